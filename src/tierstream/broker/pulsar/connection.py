"""One Pulsar client connection: its frames in order, the handshake and housekeeping
(CONNECT, PING/PONG, lookups, partitioned metadata, the topics of a namespace) and its
producers (``produce.py``).

One thread per connection reads frames in order. A bad request gets Pulsar's error answer
(``replies.py``); a frame over the advertised maximum is read past and refused; a frame that
cannot be read at all (a truncated stream, garbage that reads as a huge size) ends the
connection, logged. A request that fails in a way no check foresaw is answered
``UnknownError`` and logged with its stack, the connection kept.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierstream.broker.pulsar.consume import ConsumePath
from tierstream.broker.pulsar.produce import ProducePath
from tierstream.errors import (
    ConfigError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
)
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import (
    MAX_FRAME_SIZE,
    MAX_MESSAGE_SIZE,
    BadPayload,
    command_frame,
    parse_frame,
    read_frame_size,
)
from tierstream.pulsar_protocol.names import parse_pulsar_topic
from tierstream.pulsar_protocol.replies import error_code, request_id
from tierstream.pulsar_protocol.schemas import pulsar_schema, schema_version_bytes, version_of
from tierstream.util.version import VERSION

if TYPE_CHECKING:
    from tierstream.broker.stats.topic_stats import Streams
    from tierstream.broker.store import Store
    from tierstream.broker.subscriptions.registry import Subscriptions
    from tierstream.metadata.schema_registry import SchemaRegistry

__all__ = ["Connection", "Listener"]

log = logging.getLogger(__name__)

#: the newest protocol version whose commands this listener answers (v20: topic migration)
PROTOCOL_VERSION = 20
#: a frame over the maximum but under this is read past and refused, the connection kept;
#: a larger one (or garbage that reads as a size) closes the connection
DISCARD_LIMIT = 256 * 1024 * 1024
#: a connection that sends nothing for this long is sent a PING; twice as long, dropped
KEEPALIVE_S = 30.0

#: frames up to this size are received into the connection's own buffer (see _read)
_KEEP = 1024 * 1024
_Cmd = api.BaseCommand


@dataclass(frozen=True)
class Listener:
    """What every connection of a listener shares."""

    store: Store
    schemas: SchemaRegistry
    subscriptions: Subscriptions
    streams: Streams  # producers and consumers show in its stats
    url: str  # what LOOKUP answers: pulsar://host:port or pulsar+ssl://
    tls: bool
    auth_token: str | None
    auto_create: bool


class Connection:
    """One client connection."""

    def __init__(self, listener: Listener, sock: socket.socket, peer: Any) -> None:
        self.listener, self.sock, self.peer = listener, sock, peer
        self.store = listener.store
        self._send_lock = threading.Lock()
        self._buffer = bytearray(64 * 1024)  # what _read receives into
        self._request_ids = itertools.count(1 << 62)  # of the broker's own requests
        self.connected = False
        self.produce = ProducePath(self, listener.store, listener.schemas, listener.streams)
        self.consume = ConsumePath(self, listener.store, listener.subscriptions,
                                   listener.streams, listener.schemas)

    def drop(self, reason: str) -> None:
        """End the connection from another thread (its serve loop then closes what it
        holds); the client reconnects."""
        log.warning("pulsar client %s: connection dropped: %s", self.peer, reason)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def go_away(self) -> None:
        """The broker is going: CLOSE_PRODUCER for each producer, then the connection closed
        (its clients look their topics up again and reconnect when a broker serves them)."""
        self.produce.close_all()
        self.consume.go_away()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        self.sock.settimeout(KEEPALIVE_S)
        idle = 0
        try:
            while True:
                try:
                    header = self._read(4)
                except TimeoutError:
                    idle += 1
                    if idle >= 2:
                        log.info("pulsar client %s sent nothing for %gs: dropped", self.peer,
                                 2 * KEEPALIVE_S)
                        return
                    self.write(_Cmd(type=_Cmd.PING, ping=api.CommandPing()))
                    continue
                idle = 0
                if header is None:
                    return
                size = read_frame_size(header)
                if size > MAX_FRAME_SIZE:
                    if self._skip_oversized(size):
                        continue
                    log.warning("pulsar client %s sent a frame of %d bytes (at most %d): "
                                "connection closed", self.peer, size, MAX_FRAME_SIZE)
                    return
                body = self._read(size)
                if body is None:
                    log.warning("pulsar client %s: truncated frame", self.peer)
                    return
                try:
                    frame = parse_frame(body)
                except BadPayload as exc:  # answered where it names a producer
                    log.warning("pulsar client %s: %s", self.peer, exc)
                    self._refuse_command(exc.command, api.NotAllowedError, str(exc))
                    continue
                except ProtocolError as exc:
                    log.warning("pulsar client %s: %s", self.peer, exc)
                    continue
                try:
                    self._dispatch(frame)
                except (OSError, ssl.SSLError):
                    raise
                except Exception as exc:  # a request we did not foresee: answered, logged
                    self._unforeseen(frame.command, exc)
        except OSError as exc:
            log.debug("pulsar client %s: %s", self.peer, exc)
        finally:
            self.consume.close_all()
            self.produce.stop(timeout=KEEPALIVE_S)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _unforeseen(self, command: api.BaseCommand, exc: Exception) -> None:
        """A request that failed in a way no check foresaw: logged with its stack (a bug to
        fix), answered with Pulsar's UnknownError where it can be, the connection kept."""
        name = _command_name(command.type)
        log.warning("pulsar client %s: %s failed: %r", self.peer, name, exc, exc_info=True)
        self._refuse_command(command, api.UnknownError, f"{name} failed in the broker: {exc!r}")

    def _skip_oversized(self, size: int) -> bool:
        """Answer a frame over the advertised maximum without taking it: its command is read,
        the rest streamed past, and a SEND refused (a request answered ERROR); False if the
        frame is too large or too garbled to pass over (the connection is then closed)."""
        if size > DISCARD_LIMIT:
            return False
        head = self._read(4)
        if head is None:
            return False
        cmd_size = read_frame_size(head)
        if cmd_size > min(size - 4, 64 * 1024):
            return False
        data = self._read(cmd_size)
        command = api.BaseCommand()
        try:
            command.ParseFromString(data or b"")
        except Exception:  # protobuf's DecodeError and friends: not a frame we can answer
            return False
        left = size - 4 - cmd_size
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                return False
            left -= len(chunk)
        reason = (f"a frame of {size:,} bytes is over the {MAX_MESSAGE_SIZE:,} bytes a message "
                  "may have here (max_message_size): nothing was stored")
        log.warning("pulsar client %s: %s", self.peer, reason)
        self._refuse_command(command, api.NotAllowedError, reason)
        return True

    def _refuse_command(self, command: api.BaseCommand, error: Any, reason: str) -> None:
        """Answer a command that is not carried out: a SEND with SEND_ERROR (in turn with the
        sends before it; ChecksumError, the one code clients fail a message with), a request
        with ERROR ``error``; anything else is only logged."""
        if command.type == _Cmd.SEND and command.HasField("send"):
            self.produce.refuse(command.send, api.ChecksumError, reason)
        elif (rid := request_id(command)) is not None:
            self.error(rid, error, reason)

    def _read(self, n: int) -> memoryview | None:
        """``n`` bytes received into one buffer (no chunks joined); None if the client closed
        the connection first. Up to ``_KEEP`` bytes land in the connection's own buffer, valid
        until the next read (parse_frame copies the one part it keeps, the payload): a new
        buffer per frame was zero-filled, and its memory often faulted in, on every SEND."""
        if n > _KEEP:
            view = memoryview(bytearray(n))
        else:
            if len(self._buffer) < n:
                self._buffer = bytearray(max(n, 2 * len(self._buffer)))
            view = memoryview(self._buffer)[:n]
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                return None
            got += k
        return view

    def write_frames(self, frames: list[bytes]) -> None:
        data = b"".join(frames)
        with self._send_lock:
            self.sock.sendall(data)

    def write(self, command: api.BaseCommand) -> None:
        data = command_frame(command)
        with self._send_lock:
            self.sock.sendall(data)

    # -- commands -----------------------------------------------------------------------------

    def _dispatch(self, frame: Any) -> None:
        cmd = frame.command
        kind = cmd.type
        if kind == _Cmd.CONNECT:
            self._connect(cmd.connect)
        elif not self.connected:
            log.warning("pulsar client %s sent %s before CONNECT", self.peer,
                        _command_name(kind))
            raise OSError("command before CONNECT")
        elif kind == _Cmd.PING:
            self.write(_Cmd(type=_Cmd.PONG, pong=api.CommandPong()))
        elif kind == _Cmd.PONG:
            pass
        elif kind == _Cmd.PARTITIONED_METADATA:
            self._partitioned_metadata(cmd.partitionMetadata)
        elif kind == _Cmd.LOOKUP:
            self._lookup(cmd.lookupTopic)
        elif kind == _Cmd.GET_TOPICS_OF_NAMESPACE:
            self._topics_of_namespace(cmd.getTopicsOfNamespace)
        elif kind == _Cmd.PRODUCER:
            self.produce.create(cmd.producer)
        elif kind == _Cmd.SEND:
            self.produce.send(cmd.send, frame.metadata, frame.payload)
        elif kind == _Cmd.CLOSE_PRODUCER:
            self.produce.close(cmd.close_producer)
        elif kind == _Cmd.SUBSCRIBE:
            self.consume.subscribe(cmd.subscribe)
        elif kind == _Cmd.FLOW:
            self.consume.flow(cmd.flow)
        elif kind == _Cmd.ACK:
            self.consume.ack(cmd.ack)
        elif kind == _Cmd.REDELIVER_UNACKNOWLEDGED_MESSAGES:
            self.consume.redeliver(cmd.redeliverUnacknowledgedMessages)
        elif kind == _Cmd.CLOSE_CONSUMER:
            self.consume.close(cmd.close_consumer)
        elif kind == _Cmd.UNSUBSCRIBE:
            self.consume.unsubscribe(cmd.unsubscribe)
        elif kind == _Cmd.GET_SCHEMA:
            self._schema(cmd.getSchema)
        elif kind == _Cmd.SEEK:
            self.consume.seek(cmd.seek)
        elif kind == _Cmd.GET_LAST_MESSAGE_ID:
            self.consume.last_message_id(cmd.getLastMessageId)
        else:
            name = _command_name(kind)
            log.info("pulsar client %s: %s is not supported yet", self.peer, name)
            self._refuse_command(cmd, api.NotAllowedError,
                                 f"{name} is not supported by this tierstream broker yet")

    def _connect(self, connect: api.CommandConnect) -> None:
        token = self.listener.auth_token
        if token is not None:
            given = connect.auth_data if connect.auth_method_name == "token" else b""
            if not hmac.compare_digest(given, token.encode()):
                self.error(0, api.AuthenticationError, "a valid token is required "
                            "(AuthenticationToken)")
                raise OSError("authentication failed")
        version = min(connect.protocol_version, PROTOCOL_VERSION)
        self.connected = True
        self.write(_Cmd(type=_Cmd.CONNECTED, connected=api.CommandConnected(
            server_version=f"tierstream-{VERSION}", protocol_version=version,
            max_message_size=MAX_MESSAGE_SIZE)))

    def topic_partitions(self, name: str, *, create: bool) -> tuple[str, int, int | None]:
        """(tierstream topic, the partition count its Pulsar clients see, the partition
        named) — created with one partition if it does not exist and ``create``."""
        named = parse_pulsar_topic(name)
        try:
            record = self.store.topic(named.topic)
        except NotFoundError:
            if not (create and self.listener.auto_create and named.partition is None):
                raise
            log.info("pulsar client %s: topic %s created (auto-creation)", self.peer,
                     named.topic)
            try:
                record = self.store.create_topic(named.topic, 1)
            except TierstreamError:  # another connection made it meanwhile
                record = self.store.topic(named.topic)
        return named.topic, record.serving, named.partition

    def broker_request_id(self) -> int:
        """A request id for a command the broker sends (CLOSE_PRODUCER, CLOSE_CONSUMER): from
        one counter per connection, far above the ids a client draws."""
        return next(self._request_ids)

    def partition_of(self, name: str, *, create: bool, verb: str) -> tuple[str, int, int]:
        """(tierstream topic, its partition count, the partition) a producer or consumer
        names: a topic's base name is its partition 0 if it has one partition; a partitioned
        topic is produced to or subscribed by partition, as the clients do."""
        topic, count, partition = self.named_partition(name, create=create)
        if partition is None:
            if count > 1:
                raise ConfigError(f"{name!r} has {count} partitions: {verb} to its partitions "
                                  "(the client does so after partitioned metadata)")
            partition = 0
        # owned elsewhere (the lease's view, and the metadata where that view names another
        # broker): ServiceNotReady, and the client looks the topic up again
        self.store.open_here(topic, partition)
        return topic, count, partition

    def named_partition(self, name: str, *, create: bool) -> tuple[str, int, int | None]:
        """:meth:`topic_partitions`, and a partition named past the last one is not found
        (Pulsar's TopicNotFound)."""
        topic, count, partition = self.topic_partitions(name, create=create)
        if partition is not None and partition >= count:
            raise NotFoundError(f"{name!r}: {topic} has partitions 0..{count - 1}")
        return topic, count, partition

    def _partitioned_metadata(self, req: api.CommandPartitionedTopicMetadata) -> None:
        reply = api.CommandPartitionedTopicMetadataResponse(request_id=req.request_id)
        try:
            _, count, partition = self.named_partition(
                req.topic, create=req.metadata_auto_creation_enabled)
            # one partition is Pulsar's non-partitioned topic: the client uses the bare name;
            # so is one partition named (``...-partition-i``), as Pulsar's broker answers
            reply.partitions = count if count > 1 and partition is None else 0
            reply.response = reply.Success
        except TierstreamError as exc:
            reply.response, reply.error, reply.message = reply.Failed, error_code(exc), str(exc)
        self.write(_Cmd(type=_Cmd.PARTITIONED_METADATA_RESPONSE,
                         partitionMetadataResponse=reply))

    def _lookup(self, req: api.CommandLookupTopic) -> None:
        reply = api.CommandLookupTopicResponse(request_id=req.request_id)
        try:
            topic, _, partition = self.named_partition(req.topic, create=True)
            owner = self.store.owner_elsewhere(topic, partition or 0)
            url = owner.pulsar_url if owner is not None else None
            if url is None:
                reply.response, reply.brokerServiceUrl = reply.Connect, self.listener.url
                tls = self.listener.tls
            else:  # another broker owns the partition: the client is sent there, as Pulsar's
                reply.response, reply.brokerServiceUrl = reply.Redirect, url
                tls = url.startswith("pulsar+ssl://")
            reply.authoritative = True
            if tls:
                reply.brokerServiceUrlTls = reply.brokerServiceUrl
        except TierstreamError as exc:
            reply.response, reply.error, reply.message = reply.Failed, error_code(exc), str(exc)
        self.write(_Cmd(type=_Cmd.LOOKUP_RESPONSE, lookupTopicResponse=reply))

    def _topics_of_namespace(self, req: api.CommandGetTopicsOfNamespace) -> None:
        names = []
        for record in self.store.topics(req.namespace):
            base = f"persistent://{record.name}"
            names.extend([base] if record.serving == 1 else
                         [f"{base}-partition-{p}" for p in range(record.serving)])
        self.write(_Cmd(type=_Cmd.GET_TOPICS_OF_NAMESPACE_RESPONSE,
                         getTopicsOfNamespaceResponse=api.CommandGetTopicsOfNamespaceResponse(
                             request_id=req.request_id, topics=names)))

    def _schema(self, req: api.CommandGetSchema) -> None:
        """A version of the topic's schema (the latest without one), or TopicNotFound."""
        reply = api.CommandGetSchemaResponse(request_id=req.request_id)
        try:
            topic = parse_pulsar_topic(req.topic).topic
            version = version_of(req.schema_version) if req.schema_version else None
            info = self.listener.schemas.get(topic, version)
            reply.schema.CopyFrom(pulsar_schema(info))
            reply.schema_version = schema_version_bytes(info.version)
        except TierstreamError as exc:
            reply.error_code, reply.error_message = api.TopicNotFound, str(exc)
        self.write(_Cmd(type=_Cmd.GET_SCHEMA_RESPONSE, getSchemaResponse=reply))

    def error(self, rid: int, error: Any, message: str) -> None:
        self.write(_Cmd(type=_Cmd.ERROR, error=api.CommandError(
            request_id=rid, error=error, message=message)))


def _command_name(kind: int) -> str:
    return _Cmd.Type.Name(kind) if kind in _Cmd.Type.values() else str(kind)
