"""The subset of Pulsar's admin REST API (``/admin/v2``) that clients' tooling calls: create,
grow, list and delete topics, topic stats, subscriptions, delete a subscription.

Served on ``broker start --admin-port`` (Pulsar's ``webServicePort`` 8080; 8443 over HTTPS
with the broker's ``--tls-cert``), so ``curl`` scripts and other Pulsar tooling work
unchanged — the Python client cannot create a partitioned topic itself. Every operation is
the broker's own admin action (``Broker.call``): the same checks and errors as ``tierstream
topic create``. Errors are answered as Pulsar's are: an HTTP status and ``{"reason": ...}``.

Paths, all under ``/admin/v2/persistent``:

- ``GET /{tenant}/{namespace}``: the namespace's topics (a partitioned one by its partitions'
  names, as Pulsar lists them); ``GET .../partitioned``: its partitioned topics.
- ``PUT /{tenant}/{namespace}/{topic}``: create a non-partitioned topic (one partition);
  ``PUT .../{topic}/partitions`` with a count as body: create a partitioned topic;
  ``POST .../{topic}/partitions``: grow it (a scale event: per-key order is kept);
  ``GET .../{topic}/partitions``: ``{"partitions": n}`` (0 for a non-partitioned topic, as
  the binary protocol's partitioned metadata says); ``DELETE .../{topic}`` and
  ``DELETE .../{topic}/partitions``: delete it.
- ``GET .../{topic}/stats`` (a topic or one ``-partition-i``; a partitioned topic's base name
  gives its sum) and ``GET .../{topic}/partitioned-stats[?perPartition=true]``.
- ``GET .../{topic}/subscriptions``; ``DELETE .../{topic}/subscription/{name}``.

Where the JSON differs from Pulsar's: rates are the broker's last-minute rates (per topic and
partition; subscriptions and consumers have counters, not rates, so their ``msgRateOut`` is
absent); a publisher's rates are averages since it connected; ``backlogSize`` is estimated from
the topic's average stored message size. With ``--auth-token``, every call needs
``Authorization: Bearer <token>`` (Pulsar's token authentication).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import json
import logging
import socket
import ssl
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tierstream.errors import (
    AlreadyExistsError,
    AuthError,
    ConfigError,
    ConflictError,
    NotFoundError,
    ProtocolError,
    TierstreamError,
    UnavailableError,
)
from tierstream.pulsar_protocol.names import InvalidTopicName, parse_pulsar_topic
from tierstream.util.timeutil import now_ms

if TYPE_CHECKING:
    from tierstream.broker.server import Broker

__all__ = ["AdminServer", "pulsar_stats"]

log = logging.getLogger(__name__)

_PREFIX = "/admin/v2/persistent/"
_PULSAR_TYPES = {"exclusive": "Exclusive", "failover": "Failover", "shared": "Shared",
                 "key_shared": "Key_Shared"}
#: the largest request body read (a partition count is a few bytes)
_MAX_BODY = 64 * 1024


class _Answer(Exception):
    """An HTTP error answer: status and reason."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _status_of(exc: TierstreamError) -> HTTPStatus:
    if isinstance(exc, NotFoundError):
        return HTTPStatus.NOT_FOUND
    if isinstance(exc, (AlreadyExistsError, ConflictError)):
        return HTTPStatus.CONFLICT
    if isinstance(exc, AuthError):
        return HTTPStatus.UNAUTHORIZED
    if isinstance(exc, InvalidTopicName):
        return HTTPStatus.PRECONDITION_FAILED  # Pulsar's answer to an invalid topic name
    if isinstance(exc, (ConfigError, ProtocolError)):
        return HTTPStatus.BAD_REQUEST
    if isinstance(exc, UnavailableError):
        return HTTPStatus.SERVICE_UNAVAILABLE
    return HTTPStatus.INTERNAL_SERVER_ERROR


def pulsar_name(topic: str, partition: int | None = None) -> str:
    base = f"persistent://{topic}"
    return base if partition is None else f"{base}-partition-{partition}"


class AdminServer:
    """Pulsar's admin REST subset for ``broker`` (a ``Broker``) on ``host:port`` (0: any free
    port), on a thread of its own; HTTPS with ``tls_cert``/``tls_key``."""

    def __init__(self, broker: Broker, *, host: str, port: int, auth_token: str | None = None,
                 advertised: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        context = None
        if tls_cert is not None and tls_key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls_cert, tls_key)
        expected = None if not auth_token else f"Bearer {auth_token}".encode()
        routes = _Routes(broker)

        class Handler(BaseHTTPRequestHandler):
            server_version = "tierstream-pulsar-admin"
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("pulsar admin %s: " + format, self.client_address[0], *args)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_PUT(self) -> None:
                self._answer("PUT")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_DELETE(self) -> None:
                self._answer("DELETE")

            def _answer(self, method: str) -> None:
                try:
                    body = self._body()
                    if expected is not None:
                        given = (self.headers.get("Authorization") or "").encode()
                        if not hmac.compare_digest(given, expected):
                            raise _Answer(HTTPStatus.UNAUTHORIZED, "authentication required: "
                                          "send 'Authorization: Bearer <token>'")
                    url = urllib.parse.urlsplit(self.path)
                    query = urllib.parse.parse_qs(url.query)
                    status, result = routes.handle(method, url.path, query, body)
                except _Answer as exc:
                    status, result = exc.status, {"reason": exc.reason}
                except TierstreamError as exc:
                    status, result = _status_of(exc), {"reason": str(exc)}
                except Exception as exc:  # answered, logged with its stack; the server lives
                    log.exception("pulsar admin %s %s failed", method, self.path)
                    status, result = HTTPStatus.INTERNAL_SERVER_ERROR, {
                        "reason": f"{type(exc).__name__}: {exc}"}
                self._reply(status, result)

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_BODY:
                    self.close_connection = True
                    raise _Answer(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                  f"request body of {length} bytes: at most {_MAX_BODY}")
                return self.rfile.read(length) if length > 0 else b""

            def _reply(self, status: HTTPStatus, result: Any) -> None:
                data = b"" if status == HTTPStatus.NO_CONTENT else json.dumps(result).encode()
                self.send_response(status)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if data:
                    self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def get_request(self) -> tuple[socket.socket, Any]:
                sock, peer = super().get_request()
                if context is not None:
                    sock.settimeout(30.0)  # a client that never finishes its handshake
                    sock = context.wrap_socket(sock, server_side=True)
                    sock.settimeout(None)
                return sock, peer

            def handle_error(self, request: Any, client_address: Any) -> None:
                log.warning("pulsar admin: a request from %s failed", client_address)

        try:
            self._server = Server((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve Pulsar admin on {host}:{port}: "
                              f"{exc.strerror or exc}") from None
        self.port = int(self._server.server_address[1])
        name = advertised or host
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://{'[' + name + ']' if ':' in name else name}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="tierstream-pulsar-admin")
        self._thread.start()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Routes:
    """Paths to broker actions."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: bytes
               ) -> tuple[HTTPStatus, Any]:
        if path.startswith("/admin/v2/non-persistent/"):
            raise _Answer(HTTPStatus.NOT_IMPLEMENTED, "non-persistent topics are not "
                          "supported: tierstream stores every message; use persistent")
        if not path.startswith(_PREFIX):
            raise _Answer(HTTPStatus.NOT_FOUND, f"no such path {path!r}: the Pulsar admin "
                          f"subset is served under {_PREFIX}")
        parts = [urllib.parse.unquote(p) for p in path[len(_PREFIX):].strip("/").split("/")]
        if len(parts) < 2 or not all(parts):
            raise _Answer(HTTPStatus.NOT_FOUND, f"no such path {path!r}: expected "
                          f"{_PREFIX}{{tenant}}/{{namespace}}[/{{topic}}/...]")
        namespace = "/".join(parts[:2])
        rest = parts[2:]
        flag = (query.get("perPartition") or ["false"])[0].lower() == "true"
        match (method, rest):
            case ("GET", []):
                return HTTPStatus.OK, self._topics(namespace, expand=True)
            case ("GET", ["partitioned"]):
                return HTTPStatus.OK, self._topics(namespace, expand=False, partitioned=True)
            case ("PUT", [topic]):
                self._create(namespace, topic, 1)
                return HTTPStatus.NO_CONTENT, None
            case ("PUT", [topic, "partitions"]):
                self._create(namespace, topic, _count(body))
                return HTTPStatus.NO_CONTENT, None
            case ("POST", [topic, "partitions"]):
                self.broker.call("set-partitions", {"topic": self._whole(namespace, topic),
                                                    "partitions": _count(body)})
                return HTTPStatus.NO_CONTENT, None
            case ("GET", [topic, "partitions"]):
                name, partition = self._partition(namespace, topic)
                count = _serving(self._record(name))
                # one partition, or one partition named: Pulsar's non-partitioned answer
                return HTTPStatus.OK, {"partitions": count if count > 1 and partition is None
                                       else 0}
            case ("DELETE", [topic]) | ("DELETE", [topic, "partitions"]):
                self._delete_topic(namespace, topic, query)
                return HTTPStatus.NO_CONTENT, None
            case ("GET", [topic, "stats"]):
                return HTTPStatus.OK, self._stats(namespace, topic)
            case ("GET", [topic, "partitioned-stats"]):
                return HTTPStatus.OK, self._partitioned_stats(namespace, topic, flag)
            case ("GET", [topic, "subscriptions"]):
                name, _ = self._partition(namespace, topic)  # every partition has them all
                rows = self.broker.call("subscriptions", {"topic": name})
                return HTTPStatus.OK, sorted({r["subscription"] for r in rows})
            case ("DELETE", [topic, "subscription", subscription]):
                self._delete_subscription(namespace, topic, subscription, query)
                return HTTPStatus.NO_CONTENT, None
        raise _Answer(HTTPStatus.METHOD_NOT_ALLOWED if rest and rest[-1] in (
            "partitions", "stats", "partitioned-stats", "subscriptions") else
            HTTPStatus.NOT_FOUND, f"{method} {path} is not part of the Pulsar admin subset "
            "tierstream serves (see README, 'Pulsar clients')")

    # -- topics -------------------------------------------------------------------------------

    def _name(self, namespace: str, topic: str) -> tuple[str, int | None]:
        parsed = parse_pulsar_topic(f"persistent://{namespace}/{topic}")
        return parsed.topic, parsed.partition

    def _partition(self, namespace: str, topic: str) -> tuple[str, int | None]:
        """The topic and the partition a name means; a partition past the last one is
        404, as Pulsar's "Topic not found"."""
        name, partition = self._name(namespace, topic)
        if partition is not None:
            count = _serving(self._record(name))
            if partition >= count:
                raise _Answer(HTTPStatus.NOT_FOUND, f"Topic not found: {name} has partitions "
                              f"0..{count - 1}")
        return name, partition

    def _whole(self, namespace: str, topic: str) -> str:
        name, partition = self._name(namespace, topic)
        if partition is not None:
            raise _Answer(HTTPStatus.PRECONDITION_FAILED, f"{topic!r} names one partition; "
                          "this call takes the topic's name")
        return name

    def _record(self, name: str) -> dict[str, Any]:
        record: dict[str, Any] = self.broker.call("get-topic", {"topic": name})
        return record

    def _create(self, namespace: str, topic: str, partitions: int) -> None:
        name = self._whole(namespace, topic)
        with contextlib.suppress(NotFoundError):
            self._record(name)
            raise _Answer(HTTPStatus.CONFLICT, f"This topic already exists: {name}")
        self.broker.call("create-topic", {"topic": name, "partitions": partitions})

    def _topics(self, namespace: str, *, expand: bool, partitioned: bool = False) -> list[str]:
        out: list[str] = []
        for record in self.broker.call("list-topics", {"namespace": namespace}):
            n = _serving(record)
            if partitioned and n < 2:
                continue
            if expand and n > 1:
                out.extend(pulsar_name(record["name"], p) for p in range(n))
            else:
                out.append(pulsar_name(record["name"]))
        return out

    def _delete_topic(self, namespace: str, topic: str, query: dict[str, list[str]]
                      ) -> None:
        """Delete a topic that no client is attached to (Pulsar's 412 otherwise)."""
        name = self._whole(namespace, topic)
        if (query.get("force") or ["false"])[0].lower() == "true":
            raise _Answer(HTTPStatus.NOT_IMPLEMENTED, "force=true is not supported: close the "
                          "topic's producers and consumers, then delete it")
        attached = self.broker.streams.current(name)
        if attached:
            kinds = sorted({e["kind"] for e in attached})
            raise _Answer(HTTPStatus.PRECONDITION_FAILED, "Topic has active producers/"
                          f"subscriptions: {len(attached)} {'/'.join(kinds)} stream(s) "
                          f"attached to {name}; close them, then delete it")
        self.broker.call("delete-topic", {"topic": name})

    # -- stats --------------------------------------------------------------------------------

    def _stats(self, namespace: str, topic: str) -> dict[str, Any]:
        name, partition = self._name(namespace, topic)
        raw = self.broker.call("topic-stats", {"topic": name, "per_partition": True})
        plogs = self.broker.store.partitions(name, serving=True)
        rows = self.broker.call("subscriptions", {"topic": name})
        if partition is None:
            return pulsar_stats(raw, plogs, rows)
        if partition >= len(raw["partitions"]):
            raise _Answer(HTTPStatus.NOT_FOUND, f"Topic not found: {name} has partitions "
                          f"0..{len(raw['partitions']) - 1}")
        return pulsar_stats(raw["partitions"][partition], [plogs[partition]],
                            [r for r in rows if r["partition"] == partition])

    def _partitioned_stats(self, namespace: str, topic: str, per_partition: bool
                           ) -> dict[str, Any]:
        name = self._whole(namespace, topic)
        raw = self.broker.call("topic-stats", {"topic": name, "per_partition": True})
        plogs = self.broker.store.partitions(name, serving=True)
        rows = self.broker.call("subscriptions", {"topic": name})
        out = pulsar_stats(raw, plogs, rows)
        out["metadata"] = {"partitions": len(raw["partitions"])}  # what its clients see
        out["partitions"] = {} if not per_partition else {
            pulsar_name(name, p): pulsar_stats(part, [plogs[p]],
                                               [r for r in rows if r["partition"] == p])
            for part in raw["partitions"] for p in [part["partition"]]}
        return out

    # -- subscriptions ------------------------------------------------------------------------

    def _delete_subscription(self, namespace: str, topic: str, subscription: str,
                             query: dict[str, list[str]]) -> None:
        if (query.get("force") or ["false"])[0].lower() == "true":
            raise _Answer(HTTPStatus.NOT_IMPLEMENTED, "force=true is not supported: close the "
                          "subscription's consumers, then delete it")
        name = self._whole(namespace, topic)
        try:
            self.broker.call("delete-subscription", {"topic": name,
                                                     "subscription": subscription})
        except ConflictError as exc:
            raise _Answer(HTTPStatus.PRECONDITION_FAILED,
                          f"Subscription has active connected consumers: {exc}") from None
        except NotFoundError:
            raise _Answer(HTTPStatus.NOT_FOUND, f"Subscription not found: {subscription!r} "
                          f"on {name}") from None


def _count(body: bytes) -> int:
    """A partition count sent as the request body (a JSON number)."""
    try:
        value = json.loads(body or b"null")
    except ValueError:
        value = None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Answer(HTTPStatus.NOT_ACCEPTABLE, f"invalid partition count "
                      f"{body.decode(errors='replace')!r}: expected a number of partitions "
                      "of at least 1 as the body")
    return value


def _consumers(shares: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ConsumerStats per consumer name, over its shares of the partitions."""
    out: dict[str, dict[str, Any]] = {}
    for c in shares:
        entry = out.setdefault(c["name"], {"consumerName": c["name"], "unackedMessages": 0,
                                           "availablePermits": 0, "msgOutCounter": 0,
                                           "redeliveredMessages": 0})
        entry["unackedMessages"] += c["unacked"]
        entry["availablePermits"] += c["permits"]
        entry["msgOutCounter"] += c["delivered"]
        entry["redeliveredMessages"] += c["redelivered"]
    return [out[k] for k in sorted(out)]


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat()


def pulsar_stats(raw: dict[str, Any], plogs: list[Any], rows: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """Pulsar's TopicStats JSON from tierstream's topic stats (``topic_stats.py``) of a topic or
    one partition: ``plogs`` are its partitions (for the counters since the broker started),
    ``rows`` its subscriptions' rows (``Subscriptions.listing``, for each consumer's share)."""
    storage = raw["storage"]
    stored_bytes = sum(loc["bytes"] for loc in storage.values())
    stored_messages = sum(loc["messages"] for loc in storage.values())
    per_message = stored_bytes / stored_messages if stored_messages else 0.0
    rate_in = raw["msg_rate_in"]
    now = now_ms()
    publishers = []
    # a producer waiting for an exclusive hold is counted, not listed, as Pulsar does
    waiting = sum(1 for p in raw["producers"] if p["waiting"])
    for i, p in enumerate(p for p in raw["producers"] if not p["waiting"]):
        seconds = max(0.001, (now - p["since"]) / 1000)
        publishers.append({
            "producerId": i, "producerName": p["name"], "accessMode": p["mode"],
            "msgRateIn": p["messages"] / seconds, "msgThroughputIn": p["bytes"] / seconds,
            "averageMsgSize": p["bytes"] / p["messages"] if p["messages"] else 0.0,
            "connectedSince": _iso(p["since"]), "metadata": {}})
    subscriptions = {}
    for name, sub in raw["subscriptions"].items():
        subscriptions[name] = {
            "type": _PULSAR_TYPES.get(sub["type"], sub["type"]),
            "msgBacklog": sub["backlog"], "backlogSize": int(sub["backlog"] * per_message),
            "unackedMessages": sub["unacked"], "msgDelayed": sub.get("delayed", 0),
            "msgRateExpired": 0.0,
            "isReplicated": False, "consumers": _consumers(
                [c for r in rows if r["subscription"] == name for c in r["consumers"]]),
        }
    backlog = max((s["msgBacklog"] for s in subscriptions.values()), default=0)
    return {
        "msgRateIn": rate_in, "msgThroughputIn": raw["byte_rate_in"],
        "msgRateOut": raw["msg_rate_out"], "msgThroughputOut": raw["byte_rate_out"],
        "msgInCounter": sum(p.rate_in.messages_total for p in plogs),
        "bytesInCounter": sum(p.rate_in.bytes_total for p in plogs),
        "msgOutCounter": sum(p.rate_out.messages_total for p in plogs),
        "bytesOutCounter": sum(p.rate_out.bytes_total for p in plogs),
        "averageMsgSize": raw["byte_rate_in"] / rate_in if rate_in else 0.0,
        "msgChunkPublished": False,
        "storageSize": stored_bytes, "offloadedStorageSize": storage["tier"]["bytes"],
        "backlogSize": int(backlog * per_message),
        "publishers": publishers, "waitingPublishers": waiting,
        "subscriptions": subscriptions, "replication": {},
        "deduplicationStatus": "Enabled",
    }


def _serving(record: dict[str, Any]) -> int:
    """The partitions a topic's Pulsar clients see (``TopicRecord.serving``)."""
    return int(record.get("announced") or record["partitions"])
