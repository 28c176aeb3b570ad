"""The subset of Pulsar's admin REST API (``/admin/v2``) that clients' tooling calls: create,
grow, list and delete topics, topic stats, subscriptions, delete a subscription.

Served on ``broker start --admin-port`` (Pulsar's ``webServicePort`` 8080; 8443 over HTTPS
with the broker's ``--tls-cert``), so ``curl`` scripts and other Pulsar tooling work
unchanged — the Python client cannot create a partitioned topic itself. Every operation is
the broker's own admin action (``AdminActions.call``): the same checks and errors as
``tierstream topic create``. Errors are answered as Pulsar's are: an HTTP status and
``{"reason": ...}``.

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
- ``PUT .../{topic}/compaction``: start compacting it; ``GET .../{topic}/compaction``: the
  run's ``{"status": NOT_RUN|RUNNING|SUCCESS|ERROR, "lastError": ...}``.

And Pulsar's HTTP lookup, so that a client given ``http://host:8080`` as its service URL
works: ``GET /lookup/v2/topic/persistent/{tenant}/{namespace}/{topic}`` answers the Pulsar
listener of the broker owning the partition (``metadata/ownership.py``), creating a topic
that does not exist when the listener auto-creates topics, as a binary LOOKUP does.

Where the JSON differs from Pulsar's: rates are the broker's last-minute rates (per topic and
partition; subscriptions and consumers have counters, not rates, so their ``msgRateOut`` is
absent); a publisher's rates are averages since it connected; ``backlogSize`` is estimated from
the topic's average stored message size. With ``--auth-token``, every call needs
``Authorization: Bearer <token>`` (Pulsar's token authentication).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import ssl
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tierstream.broker.pulsar.admin_stats import pulsar_stats
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
from tierstream.util.threads import Worker
from tierstream.wire.security import advertised_host

if TYPE_CHECKING:
    from tierstream.broker.admin_actions import AdminActions

__all__ = ["AdminServer"]

log = logging.getLogger(__name__)

_PREFIX = "/admin/v2/persistent/"
_LOOKUP = "/lookup/v2/topic/persistent/"
#: the largest request body read (a partition count is a few bytes)
_MAX_BODY = 64 * 1024


class _Answer(Exception):
    """An HTTP error answer: status and reason (and where to go instead, for a redirect)."""

    def __init__(self, status: HTTPStatus, reason: str, location: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.location = status, reason, location


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
    """Pulsar's admin REST subset for ``broker`` (the serving broker's admin actions) on
    ``host:port`` (0: any free port), on a thread of its own; HTTPS with ``tls_cert``/
    ``tls_key``."""

    def __init__(self, broker: AdminActions, *, host: str, port: int, auth_token: str | None = None,
                 advertised: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, pulsar_url: str | None = None,
                 auto_create: bool = False) -> None:
        context = None
        if tls_cert is not None and tls_key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls_cert, tls_key)
        expected = None if not auth_token else f"Bearer {auth_token}".encode()
        routes = _Routes(broker, pulsar_url=pulsar_url, auto_create=auto_create)

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
                    if exc.location is not None:  # the owner's, with the same request
                        where = f"{exc.location}{url.path}"
                        self._reply(status, result, where + (f"?{url.query}" if url.query
                                                             else ""))
                        return
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

            def _reply(self, status: HTTPStatus, result: Any,
                       location: str | None = None) -> None:
                data = b"" if status == HTTPStatus.NO_CONTENT else json.dumps(result).encode()
                self.send_response(status)
                if location is not None:
                    self.send_header("Location", location)
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
        name = advertised_host(host, advertised)  # not 0.0.0.0: other hosts follow it
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://{'[' + name + ']' if ':' in name else name}:{self.port}"
        self._thread = Worker("tierstream-pulsar-admin", self._server.serve_forever).start()

    def shutdown(self) -> None:
        self._server.shutdown()  # serve_forever returns: the thread ends
        self._server.server_close()
        self._thread.join()


class _Routes:
    """Paths to broker actions."""

    def __init__(self, broker: AdminActions, *, pulsar_url: str | None = None,
                 auto_create: bool = False) -> None:
        self.broker = broker
        self.pulsar_url, self.auto_create = pulsar_url, auto_create

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: bytes
               ) -> tuple[HTTPStatus, Any]:
        if path.startswith(_LOOKUP) and method == "GET":
            return HTTPStatus.OK, self._lookup(path[len(_LOOKUP):])
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
                if (query.get("checkAllowAutoCreation") or ["false"])[0].lower() == "true":
                    self._created(namespace, topic)  # as the binary protocol's metadata call
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
            case ("PUT", [topic, "compaction"]):
                name, _ = self._partition(namespace, topic)
                self.broker.call("compact", {"topic": name, "wait": False})
                return HTTPStatus.NO_CONTENT, None
            case ("GET", [topic, "compaction"]):
                name, _ = self._partition(namespace, topic)
                status = self.broker.call("compaction", {"topic": name})
                return HTTPStatus.OK, {"status": status["status"],
                                       "lastError": status.get("error") or ""}
            case ("DELETE", [topic, "subscription", subscription]):
                self._delete_subscription(namespace, topic, subscription, query)
                return HTTPStatus.NO_CONTENT, None
        raise _Answer(HTTPStatus.METHOD_NOT_ALLOWED if rest and rest[-1] in (
            "partitions", "stats", "partitioned-stats", "subscriptions", "compaction") else
            HTTPStatus.NOT_FOUND, f"{method} {path} is not part of the Pulsar admin subset "
            "tierstream serves (see docs/pulsar.md)")

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

    def _created(self, namespace: str, topic: str) -> None:
        """A topic a client names that does not exist is created with one partition when
        this broker's Pulsar listener auto-creates topics (``--pulsar-auto-create``)."""
        name, partition = self._name(namespace, topic)
        if not self.auto_create or partition is not None:
            return
        with contextlib.suppress(NotFoundError):
            self._record(name)
            return
        with contextlib.suppress(AlreadyExistsError):  # another client made it meanwhile
            self.broker.call("create-topic", {"topic": name, "partitions": 1})
            log.info("pulsar admin: topic %s created (auto-creation, HTTP lookup)", name)

    def _lookup(self, path: str) -> dict[str, Any]:
        """Pulsar's HTTP lookup: the Pulsar listener of the broker owning the partition."""
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if len(parts) != 3 or not all(parts):
            raise _Answer(HTTPStatus.NOT_FOUND, f"no such path {_LOOKUP}{path}: expected "
                          f"{_LOOKUP}{{tenant}}/{{namespace}}/{{topic}}")
        namespace, topic = "/".join(parts[:2]), parts[2]
        self._created(namespace, topic)
        name, partition = self._partition(namespace, topic)
        owner = self.broker.store.owner_elsewhere(name, partition or 0)
        url = owner.pulsar_url if owner is not None else self.pulsar_url
        if url is None:
            raise _Answer(HTTPStatus.SERVICE_UNAVAILABLE, "this broker serves no Pulsar "
                          "clients: start it with --pulsar-port")
        tls = url.startswith("pulsar+ssl://")
        return {"brokerUrl": "" if tls else url, "brokerUrlTls": url if tls else "",
                "nativeUrl": url}

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
        if partition is not None:
            self._redirect_to_owner(name, partition)
        raw = self.broker.call("topic-stats", {"topic": name, "per_partition": True})
        if partition is None:
            return pulsar_stats(raw)
        count = raw["announced"] or raw["partition_count"]
        if partition >= count:
            raise _Answer(HTTPStatus.NOT_FOUND, f"Topic not found: {name} has partitions "
                          f"0..{count - 1}")
        ours = [p for p in raw["partitions"] if p["partition"] == partition]
        if not ours:  # moved away since the redirect was decided
            raise _Answer(HTTPStatus.SERVICE_UNAVAILABLE, f"{name} partition {partition} is "
                          "moving to another broker: ask again")
        return pulsar_stats(ours[0])

    def _redirect_to_owner(self, name: str, partition: int) -> None:
        """A partition another broker owns (by the lease's last renewal) is answered there,
        as Pulsar's brokers answer: 307 to the owner's admin REST, which admin clients
        follow."""
        owner = self.broker.store.owners.elsewhere(name, partition)
        if owner is None:
            return
        if owner.admin_url is None:
            raise _Answer(HTTPStatus.SERVICE_UNAVAILABLE, f"{name} partition {partition} is "
                          f"served by {owner.describe()}, which serves no Pulsar admin (start "
                          "it with --admin-port)")
        raise _Answer(HTTPStatus.TEMPORARY_REDIRECT, f"{name} partition {partition} is served "
                      f"by {owner.describe()}", location=owner.admin_url)

    def _partitioned_stats(self, namespace: str, topic: str, per_partition: bool
                           ) -> dict[str, Any]:
        name = self._whole(namespace, topic)
        raw = self.broker.call("topic-stats", {"topic": name, "per_partition": True})
        out = pulsar_stats(raw)
        # what its clients see; on a cluster, the other owners' partitions too
        out["metadata"] = {"partitions": raw["announced"] or raw["partition_count"]}
        out["partitions"] = {} if not per_partition else {
            pulsar_name(name, part["partition"]): pulsar_stats(part)
            for part in raw["partitions"]}
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


def _serving(record: dict[str, Any]) -> int:
    """The partitions a topic's Pulsar clients see (``TopicRecord.serving``)."""
    return int(record.get("announced") or record["partitions"])
