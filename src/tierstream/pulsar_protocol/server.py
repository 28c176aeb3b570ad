"""The broker's listener for Pulsar's binary protocol: connect, look topics up, produce.

One thread per connection reads frames in order. A SEND is decoded, submitted to the
partition's log at once (``PartitionLog.submit``: the store, de-duplication by producer name
and sequence id, and group commit that tierstream's own producers use) and handed to the
connection's receipt thread, which waits for each entry's quorum in order and answers
SEND_RECEIPT with tierstream's position as the message id: ledgerId = segment id, entryId =
entry id, the partition (-1 for a topic of one partition) and, per message of a batch, its
batch index. A bad request gets Pulsar's error answer (a refused message: see
:func:`_send_code`); a frame that cannot be read at all (a size over the advertised maximum,
a truncated stream) ends the connection, logged.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import queue
import socket
import socketserver
import ssl
import threading
from dataclasses import dataclass
from typing import Any

from tierstream import __version__
from tierstream.errors import (
    AuthError,
    ConfigError,
    NotFoundError,
    ProtocolError,
    StaleRoutingError,
    StorageError,
    TierstreamError,
    UnavailableError,
)
from tierstream.options import DEFAULT_PULSAR_PORT
from tierstream.pulsar_protocol import pulsar_api_pb2 as api
from tierstream.pulsar_protocol.frames import (
    MAX_FRAME_SIZE,
    MAX_MESSAGE_SIZE,
    BadPayload,
    command_frame,
    parse_frame,
    read_frame_size,
)
from tierstream.pulsar_protocol.messages import refused_feature, to_rows
from tierstream.pulsar_protocol.names import InvalidTopicName, parse_pulsar_topic
from tierstream.pulsar_protocol.schemas import (
    SchemaRefused,
    registered_version,
    schema_version_bytes,
    version_of,
)

__all__ = ["PulsarServer"]

log = logging.getLogger(__name__)

#: the newest protocol version whose commands this listener answers (v20: topic migration)
PROTOCOL_VERSION = 20
#: a frame over the maximum but under this is read past and refused, the connection kept;
#: a larger one (or garbage that reads as a size) closes the connection
DISCARD_LIMIT = 256 * 1024 * 1024
#: a connection that sends nothing for this long is sent a PING; twice as long, dropped
KEEPALIVE_S = 30.0

_Cmd = api.BaseCommand


class PulsarServer:
    """Serves Pulsar clients on ``host:port`` (0: any free port) for ``store``; ``advertised``
    is the host name LOOKUP answers (default ``host``). With ``auth_token``, a client must
    connect with that token (Pulsar's AuthenticationToken); with ``tls_cert`` and ``tls_key``
    (PEM files) every connection is TLS (``pulsar+ssl://``)."""

    def __init__(self, store: Any, *, host: str = "127.0.0.1", port: int = DEFAULT_PULSAR_PORT,
                 advertised: str | None = None, auth_token: str | None = None,
                 auto_create: bool = True, schemas: Any = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        from tierstream.metadata.schema_registry import SchemaRegistry

        self.store = store
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self.schemas = schemas if schemas is not None else SchemaRegistry(store.metadata)
        self.auth_token = auth_token
        self.auto_create = auto_create
        server = self
        context = None
        if tls_cert is not None and tls_key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls_cert, tls_key)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                if context is not None:
                    sock.settimeout(KEEPALIVE_S)  # a client that never finishes is dropped
                    try:
                        sock = context.wrap_socket(sock, server_side=True)
                    except (ssl.SSLError, OSError) as exc:
                        log.warning("pulsar client %s: TLS handshake failed: %s",
                                    self.client_address, exc)
                        return
                _Connection(server, sock, self.client_address).serve()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, port), Handler)
        self.port = int(self._server.server_address[1])
        name = advertised or host
        scheme = "pulsar+ssl" if context is not None else "pulsar"
        self.url = f"{scheme}://{'[' + name + ']' if ':' in name else name}:{self.port}"
        self.tls = context is not None
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="tierstream-pulsar-listener")
        self._thread.start()

    def shutdown(self) -> None:
        """Stop accepting, tell every connected producer to go (CLOSE_PRODUCER: its client
        looks the topic up again and reconnects when a broker serves it), close."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close_producers()


class _Connection:
    """One client connection: its frames in order, its producers, its receipts."""

    def __init__(self, server: PulsarServer, sock: socket.socket, peer: Any) -> None:
        self.server, self.sock, self.peer = server, sock, peer
        self.store = server.store
        self._send_lock = threading.Lock()
        self.connected = False
        self.producers: dict[int, _Producer] = {}
        self._receipts: queue.Queue[Any] = queue.Queue(maxsize=1000)
        self._names = itertools.count()
        self._closes = itertools.count(1 << 62)  # request ids of the broker's own requests

    # -- the loop ---------------------------------------------------------------------------

    def close_producers(self) -> None:
        """CLOSE_PRODUCER for each producer of this connection (the broker is going), then
        the connection closed."""
        for producer_id in list(self.producers):
            self._quietly(self._write, _Cmd(
                type=_Cmd.CLOSE_PRODUCER, close_producer=api.CommandCloseProducer(
                    producer_id=producer_id, request_id=next(self._closes))))
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        with self.server._lock:
            self.server._connections.add(self)
        try:
            self._serve()
        finally:
            with self.server._lock:
                self.server._connections.discard(self)

    def _serve(self) -> None:
        self.sock.settimeout(KEEPALIVE_S)
        receipts = threading.Thread(target=self._send_receipts, daemon=True,
                                    name="tierstream-pulsar-receipts")
        receipts.start()
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
                    self._write(_Cmd(type=_Cmd.PING, ping=api.CommandPing()))
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
                    if exc.command.type == _Cmd.SEND and exc.command.HasField("send"):
                        self._refuse(exc.command.send, api.ChecksumError, str(exc))
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
            self._receipts.put(None)
            receipts.join(timeout=KEEPALIVE_S)
            with contextlib.suppress(OSError):
                self.sock.close()

    def _unforeseen(self, command: api.BaseCommand, exc: Exception) -> None:
        """A request that failed in a way no check foresaw: logged with its stack (a bug to
        fix), answered with Pulsar's UnknownError where it can be, the connection kept."""
        name = _Cmd.Type.Name(command.type) if command.type in _Cmd.Type.values() \
            else str(command.type)
        log.warning("pulsar client %s: %s failed: %r", self.peer, name, exc, exc_info=True)
        reason = f"{name} failed in the broker: {exc!r}"
        if command.type == _Cmd.SEND and command.HasField("send"):
            self._refuse(command.send, api.ChecksumError, reason)
        elif (request_id := _request_id(command)) is not None:
            self._error(request_id, api.UnknownError, reason)

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
        if command.type == _Cmd.SEND and command.HasField("send"):
            self._refuse(command.send, api.ChecksumError, reason)
        elif (request_id := _request_id(command)) is not None:
            self._error(request_id, api.NotAllowedError, reason)
        return True

    def _read(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _write(self, command: api.BaseCommand) -> None:
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
                        _Cmd.Type.Name(kind) if kind in _Cmd.Type.values() else kind)
            raise OSError("command before CONNECT")
        elif kind == _Cmd.PING:
            self._write(_Cmd(type=_Cmd.PONG, pong=api.CommandPong()))
        elif kind == _Cmd.PONG:
            pass
        elif kind == _Cmd.PARTITIONED_METADATA:
            self._partitioned_metadata(cmd.partitionMetadata)
        elif kind == _Cmd.LOOKUP:
            self._lookup(cmd.lookupTopic)
        elif kind == _Cmd.GET_TOPICS_OF_NAMESPACE:
            self._topics_of_namespace(cmd.getTopicsOfNamespace)
        elif kind == _Cmd.PRODUCER:
            self._producer(cmd.producer)
        elif kind == _Cmd.SEND:
            self._send(cmd.send, frame.metadata, frame.payload)
        elif kind == _Cmd.CLOSE_PRODUCER:
            self.producers.pop(cmd.close_producer.producer_id, None)
            self._write(_Cmd(type=_Cmd.SUCCESS, success=api.CommandSuccess(
                request_id=cmd.close_producer.request_id)))
        else:
            name = _Cmd.Type.Name(kind) if kind in _Cmd.Type.values() else str(kind)
            request_id = _request_id(cmd)
            log.info("pulsar client %s: %s is not supported yet", self.peer, name)
            if request_id is not None:
                self._error(request_id, api.NotAllowedError,
                            f"{name} is not supported by this tierstream broker yet")

    def _connect(self, connect: api.CommandConnect) -> None:
        token = self.server.auth_token
        if token is not None:
            given = connect.auth_data if connect.auth_method_name == "token" else b""
            if not hmac.compare_digest(given, token.encode()):
                self._error(0, api.AuthenticationError, "a valid token is required "
                            "(AuthenticationToken)")
                raise OSError("authentication failed")
        version = min(connect.protocol_version, PROTOCOL_VERSION)
        self.connected = True
        self._write(_Cmd(type=_Cmd.CONNECTED, connected=api.CommandConnected(
            server_version=f"tierstream-{__version__}", protocol_version=version,
            max_message_size=MAX_MESSAGE_SIZE)))

    def _topic_partitions(self, name: str, *, create: bool) -> tuple[str, int, int | None]:
        """(tierstream topic, its partition count, the partition named) — created with one
        partition if it does not exist and ``create``."""
        named = parse_pulsar_topic(name)
        try:
            record = self.store.topic(named.topic)
        except NotFoundError:
            if not (create and self.server.auto_create and named.partition is None):
                raise
            log.info("pulsar client %s: topic %s created (auto-creation)", self.peer,
                     named.topic)
            try:
                record = self.store.create_topic(named.topic, 1)
            except TierstreamError:  # another connection made it meanwhile
                record = self.store.topic(named.topic)
        return named.topic, int(record.partitions), named.partition

    def _partitioned_metadata(self, req: api.CommandPartitionedTopicMetadata) -> None:
        reply = api.CommandPartitionedTopicMetadataResponse(request_id=req.request_id)
        try:
            _, count, _ = self._topic_partitions(
                req.topic, create=req.metadata_auto_creation_enabled)
            # one partition is Pulsar's non-partitioned topic: the client uses the bare name
            reply.partitions = count if count > 1 else 0
            reply.response = reply.Success
        except TierstreamError as exc:
            reply.response, reply.error, reply.message = reply.Failed, _code(exc), str(exc)
        self._write(_Cmd(type=_Cmd.PARTITIONED_METADATA_RESPONSE,
                         partitionMetadataResponse=reply))

    def _lookup(self, req: api.CommandLookupTopic) -> None:
        reply = api.CommandLookupTopicResponse(request_id=req.request_id)
        try:
            self._topic_partitions(req.topic, create=True)
            reply.response, reply.authoritative = reply.Connect, True
            reply.brokerServiceUrl = self.server.url
            if self.server.tls:
                reply.brokerServiceUrlTls = self.server.url
        except TierstreamError as exc:
            reply.response, reply.error, reply.message = reply.Failed, _code(exc), str(exc)
        self._write(_Cmd(type=_Cmd.LOOKUP_RESPONSE, lookupTopicResponse=reply))

    def _topics_of_namespace(self, req: api.CommandGetTopicsOfNamespace) -> None:
        names = []
        for record in self.store.topics(req.namespace):
            base = f"persistent://{record.name}"
            names.extend([base] if record.partitions == 1 else
                         [f"{base}-partition-{p}" for p in range(record.partitions)])
        self._write(_Cmd(type=_Cmd.GET_TOPICS_OF_NAMESPACE_RESPONSE,
                         getTopicsOfNamespaceResponse=api.CommandGetTopicsOfNamespaceResponse(
                             request_id=req.request_id, topics=names)))

    def _producer(self, req: api.CommandProducer) -> None:
        try:
            topic, count, partition = self._topic_partitions(req.topic, create=True)
            if partition is None:
                if count > 1:
                    raise ConfigError(f"{req.topic!r} has {count} partitions: produce to its "
                                      "partitions (the client does so after partitioned "
                                      "metadata)")
                partition = 0
            elif partition >= count:
                raise NotFoundError(f"{req.topic!r}: {topic} has partitions 0..{count - 1}")
            if req.encrypted:
                raise _Refused("encryption is not supported by this tierstream broker")
            if req.producer_access_mode != 0:
                raise _Refused("only the Shared producer access mode is supported")
            version = registered_version(self.server.schemas, topic, req.schema) \
                if req.HasField("schema") else None
            name = req.producer_name if req.HasField("producer_name") and req.producer_name \
                else f"pulsar-{socket.gethostname()}-{id(self):x}-{next(self._names)}"
            plog = self.store.partition(topic, partition)
            last = plog.producer_state(name)
            self.producers[req.producer_id] = _Producer(topic, partition, name, count, version)
            success = api.CommandProducerSuccess(
                request_id=req.request_id, producer_name=name,
                last_sequence_id=-1 if last is None else int(last))
            if version is not None:
                success.schema_version = schema_version_bytes(version)
            self._write(_Cmd(type=_Cmd.PRODUCER_SUCCESS, producer_success=success))
        except TierstreamError as exc:
            log.warning("pulsar client %s: producer on %s refused: %s", self.peer, req.topic,
                        exc)
            self._error(req.request_id, _code(exc), str(exc))

    def _send(self, send: api.CommandSend, metadata: Any, payload: bytes) -> None:
        producer = self.producers.get(send.producer_id)
        if producer is None:
            self._refuse(send, api.ChecksumError,
                         f"no producer {send.producer_id} on this connection")
            return
        if metadata is None:
            self._refuse(send, api.ChecksumError, "SEND without a message")
            return
        feature = refused_feature(send, metadata)
        if feature is not None:
            self._refuse(send, api.ChecksumError,
                         f"{feature} are not supported by this tierstream broker: "
                             "nothing was stored")
            return
        topic, partition, name, count = (producer.topic, producer.partition, producer.name,
                                          producer.partitions)
        try:
            version = version_of(metadata.schema_version) \
                if metadata.HasField("schema_version") else producer.schema_version
            rows = to_rows(metadata, payload, sequence_id=int(send.sequence_id),
                           schema_version=version)
            if version is not None:
                self.server.schemas.check_named_versions(topic, {str(version)})
            plog = self.store.partition(topic, partition)
            seq = send.highest_sequence_id or send.sequence_id
            for attempt in range(2):
                # each key where tierstream routes it under the topic's count now (which
                # may be more than the client routed by, if the topic grew since it looked);
                # submitted as routed by that count, so a scale event in between refuses
                # it (StaleRoutingError) and it is checked again against the new count
                now = plog.routing or count
                _check_routing(rows, topic, partition, now, count)
                try:
                    pending = plog.submit(rows, producer=name, sequence_id=int(seq),
                                          routed=now)
                    break
                except StaleRoutingError:
                    if attempt:
                        raise
        except TierstreamError as exc:
            self._refuse(send, _send_code(exc), str(exc))
            return
        self._receipts.put((send, partition if count > 1 else -1, pending))

    def _refuse(self, send: api.CommandSend, error: Any, message: str) -> None:
        """Answer SEND_ERROR in turn: after the receipts of the sends before it. A client
        fails the message at the head of its queue, so an answer that overtook an earlier
        send's receipt would fail the wrong message (the C++ core crashes on it)."""
        self._receipts.put((send, None, (error, message)))

    def _send_receipts(self) -> None:
        while (item := self._receipts.get()) is not None:
            send, partition, pending = item
            if isinstance(pending, tuple):
                error, message = pending
                self._quietly(self._send_error, send, error, message)
                continue
            try:
                ack = pending.result()
            except TierstreamError as exc:
                self._quietly(self._send_error, send, _send_code(exc), str(exc))
                continue
            message_id = api.MessageIdData(
                ledgerId=(2**64 - 1) if ack.segment_id is None else ack.segment_id,
                entryId=(2**64 - 1) if ack.entry_id is None else ack.entry_id,
                partition=partition)
            receipt = api.CommandSendReceipt(producer_id=send.producer_id,
                                             sequence_id=send.sequence_id,
                                             message_id=message_id,
                                             highest_sequence_id=send.highest_sequence_id)
            self._quietly(self._write, _Cmd(type=_Cmd.SEND_RECEIPT, send_receipt=receipt))

    def _quietly(self, write: Any, *args: Any) -> None:
        with contextlib.suppress(OSError):  # the client went away; what is stored stays
            write(*args)

    def _send_error(self, send: api.CommandSend, error: Any, message: str) -> None:
        self._write(_Cmd(type=_Cmd.SEND_ERROR, send_error=api.CommandSendError(
            producer_id=send.producer_id, sequence_id=send.sequence_id, error=error,
            message=message)))

    def _error(self, request_id: int, error: Any, message: str) -> None:
        self._write(_Cmd(type=_Cmd.ERROR, error=api.CommandError(
            request_id=request_id, error=error, message=message)))


def _check_routing(rows: Any, topic: str, partition: int, count: int, client: int) -> None:
    """Refuse keyed messages that tierstream routes to another partition than this one under
    the topic's ``count`` (each key in one partition is what keeps its order for every
    reader); ``client`` is the count the client routed by."""
    from tierstream.message_format import key_hashes

    keys = rows.column("key")
    if keys.null_count == len(keys):
        return
    slots = key_hashes(keys).to_numpy()
    wrong = [i for i, (k, s) in enumerate(zip(keys.to_pylist(), slots.tolist(), strict=True))
             if k is not None and s % count != partition]
    if not wrong:
        return
    key, home = keys[wrong[0]].as_py(), int(slots[wrong[0]]) % count
    if client != count:
        raise _Refused(
            f"{topic} grew from {client} to {count} partitions: key {key!r} now belongs to "
            f"partition {home}, not {partition}; nothing was stored. The client routes it "
            "there once it refreshes the topic's partitions (Java autoUpdatePartitionsInterval"
            ", Go PartitionsAutoDiscoveryInterval, C++ partitionsUpdateInterval: 60 s by "
            "default), or when the producer is made again")
    raise _Refused(
        f"key {key!r} belongs to partition {home} of {topic} ({count} partitions), not "
        f"{partition}: tierstream routes a key by murmur3_32 % 65536 % partitions: give the "
        "producer that routing (Python: message_router=tierstream.pulsar_protocol.key_router"
        "; Java: hashingScheme Murmur3_32Hash, which agrees when the partition count divides "
        "65,536); nothing was stored")


@dataclass(frozen=True)
class _Producer:
    topic: str
    partition: int
    name: str
    partitions: int  # the topic's count when the producer was made: how the client routes
    schema_version: int | None  # of the producer's schema; None: bytes


class _Refused(TierstreamError):
    """A request for a feature this listener does not offer (Pulsar's NotAllowedError)."""


def _code(exc: BaseException) -> Any:  # an api.ServerError value
    if isinstance(exc, SchemaRefused):
        return api.IncompatibleSchema
    if isinstance(exc, NotFoundError):
        return api.TopicNotFound
    if isinstance(exc, AuthError):
        return api.AuthorizationError
    if isinstance(exc, InvalidTopicName):
        return api.InvalidTopicName
    if isinstance(exc, (ConfigError, _Refused)):
        return api.NotAllowedError
    return api.PersistenceError


def _send_code(exc: BaseException) -> Any:
    """SEND_ERROR's code: the C++ core of most Pulsar clients fails the message it names only
    for ChecksumError; for any other code it drops the connection and sends the message again,
    forever. So a message refused for good (bad input, a refused feature, a key routed
    elsewhere) is answered ChecksumError, with the reason in the text; a store that cannot
    take it now (unavailable, out of space) PersistenceError, which the client retries."""
    if isinstance(exc, (UnavailableError, StorageError)):
        return api.PersistenceError
    return api.ChecksumError


def _request_id(cmd: api.BaseCommand) -> int | None:
    for field, _ in cmd.ListFields():
        if field.name == "type":
            continue
        inner = getattr(cmd, field.name)
        if hasattr(inner, "request_id"):
            return int(inner.request_id)
    return None
