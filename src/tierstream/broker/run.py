"""Running a broker process: check the addresses, open the store, serve the broker and one
endpoint per bookie until SIGTERM or SIGINT, then shut down cleanly (``tierstream broker
start``).
"""

from __future__ import annotations

import errno
import logging
import socket
from functools import partial
from typing import Any

import pyarrow.flight as flight

from tierstream.broker.config import StoreConfig
from tierstream.broker.flight.server import Broker
from tierstream.broker.store import Store
from tierstream.errors import (
    ConfigError,
    ConflictError,
    FencedError,
    StorageError,
    TierstreamError,
    UnavailableError,
)
from tierstream.metadata.bookie_registry import set_bookie_endpoint
from tierstream.options import (
    DEFAULT_ADMIN_PORT,
    DEFAULT_ADMIN_TLS_PORT,
    DEFAULT_PORT,
    DEFAULT_PULSAR_TLS_PORT,
)
from tierstream.util.signals import shut_down, stop_requested
from tierstream.wire.security import (
    WILDCARD_HOSTS,
    advertised_host,
    require_token,
    server_tls,
    url_host,
)

__all__ = ["run_broker", "serve_bookies"]

log = logging.getLogger(__name__)

#: How long a stopping broker waits for the calls under way on its servers: a client's idle
#: stream (a producer that sends nothing, a transaction staging nothing more) ends only when
#: its client closes it, and a stopped or vanished client never does. Past it, the broker
#: exits without them (its clients see the connection end), as Pulsar's brokers do after
#: ``brokerShutdownTimeoutMs``.
SHUTDOWN_GRACE_S = 10.0


def run_broker(config: StoreConfig, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
               auth_token: str | None = None, ready: Any = None, tls_cert: str | None = None,
               tls_key: str | None = None, bookie_endpoints: bool = True,
               advertised_address: str | None = None, bookie_port_base: int = 0,
               metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
               pulsar_port: int = 0, pulsar_tls_port: int | None = None,
               pulsar_auto_create: bool = True, admin_port: int | None = None) -> None:
    """Open the store, serve until SIGTERM/SIGINT, then shut down cleanly (main thread only).

    With ``bookie_endpoints`` (the default) every bookie also serves its sealed ledgers on an
    endpoint of its own (port ``bookie_port_base + i`` for bookie i, or any free port when it
    is 0; same host, token and TLS), registered in metadata under ``advertised_address`` (the
    host readers on other machines use) or ``host``. With ``metrics_port``, Prometheus
    metrics are served there (``broker/stats/metrics.py``; 0: any free port). With ``pulsar_port``
    (0: off), Pulsar clients are served there (``broker/pulsar/server.py``); with TLS
    (``tls_cert``), on ``pulsar_tls_port`` instead (None: 6652; 0: off), as pulsar+ssl, and
    the plain port stays closed, as Flight has no plain port then; ``pulsar_auto_create``:
    a topic a Pulsar client names is created if missing. With ``admin_port`` (None: 8080, or
    8443 as HTTPS with TLS; 0: off), Pulsar's admin REST subset is served there
    (``broker/pulsar/admin_http.py``). ``ready`` is called with the broker URL and
    ``{what: URL}`` of the other listeners (metrics, pulsar clients, pulsar admin) once it
    accepts calls.
    """
    # checked before anything opens; the servers check (and warn) again as they bind
    server_tls(tls_cert, tls_key)  # both or neither, readable
    require_token(host, auth_token=auth_token, what="broker")
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"invalid port {port!r}: expected 0..65535 (0: any free port)")
    # every listener's port, checked together: all the ports taken are said in one line
    wanted: list[tuple[str, int, str, str]] = [(host, port, "--port", "the broker")]
    option = "--pulsar-port"
    if tls_cert is not None:
        option = "--pulsar-tls-port"
        pulsar_port = DEFAULT_PULSAR_TLS_PORT if pulsar_tls_port is None else pulsar_tls_port
    elif pulsar_tls_port:
        raise ConfigError(f"--pulsar-tls-port {pulsar_tls_port} needs --tls-cert and "
                          "--tls-key (pulsar+ssl is served with the broker's certificate)")
    _check_range(pulsar_port, option)
    wanted.append((host, pulsar_port, option, "the Pulsar listener; 0: off"))
    if admin_port is None:
        admin_port = DEFAULT_ADMIN_PORT if tls_cert is None else DEFAULT_ADMIN_TLS_PORT
    _check_range(admin_port, "--admin-port")
    wanted.append((host, admin_port, "--admin-port", "the Pulsar admin listener; 0: off"))
    if config.network_bookies:
        bookie_endpoints = False  # each network bookie is its own endpoint
    bookie_ports = [bookie_port_base + i if bookie_port_base else 0
                    for i in range(config.bookies)] if bookie_endpoints else []
    if bookie_ports and bookie_port_base and not (bookie_port_base > 0
                                                  and bookie_ports[-1] <= 65535):
        raise ConfigError(f"invalid --bookie-port-base {bookie_port_base}: its {config.bookies} "
                          "bookie port(s) must lie in 1..65535")
    wanted += [(host, p, "--bookie-port-base", f"bookie {i}'s endpoint")
               for i, p in enumerate(bookie_ports)]
    if metrics_port is not None:
        if isinstance(metrics_port, bool) or not 0 <= metrics_port <= 65535:
            raise ConfigError(f"invalid --metrics-port {metrics_port!r}: expected 0..65535 "
                              "(0: any free port)")
        wanted.append((metrics_host, metrics_port, "--metrics-port", "Prometheus metrics"))
    _check_ports_free(wanted)
    _raise_file_limit()
    store = Store(config)
    endpoints: list[Any] = []
    metrics = pulsar = admin = None
    try:
        broker = Broker(store, host=host, port=port, auth_token=auth_token,
                        tls_cert=tls_cert, tls_key=tls_key)
        if bookie_endpoints:
            endpoints = serve_bookies(store, host, auth_token, tls_cert, tls_key,
                                       advertised_address, bookie_ports)
        if metrics_port is not None:
            from tierstream.broker.stats.metrics import MetricsServer

            metrics = MetricsServer(store, broker.subscriptions, broker.streams, broker.lags,
                                    host=metrics_host, port=metrics_port, tls_cert=tls_cert,
                                    tls_key=tls_key)
        if pulsar_port:
            from tierstream.broker.pulsar.server import PulsarServer

            pulsar = PulsarServer(store, host=host, port=pulsar_port,
                                  advertised=advertised_address, auth_token=auth_token,
                                  schemas=broker.schemas, subscriptions=broker.subscriptions,
                                  streams=broker.streams,
                                  tls_cert=tls_cert,
                                  tls_key=tls_key, auto_create=pulsar_auto_create)
        if admin_port:
            from tierstream.broker.pulsar.admin_http import AdminServer

            admin = AdminServer(broker, host=host, port=admin_port, auth_token=auth_token,
                                advertised=advertised_address, tls_cert=tls_cert,
                                tls_key=tls_key, pulsar_url=pulsar.url if pulsar else None,
                                auto_create=pulsar_auto_create)
    except BaseException:
        if pulsar is not None:
            pulsar.shutdown()
        if metrics is not None:
            metrics.shutdown()
        for endpoint in endpoints:
            endpoint.shutdown()
        store.close()
        raise
    lost = store.metadata.backend.lost
    with stop_requested() as stop:
        try:
            where = url_host(advertised_host(host, advertised_address))
            if not advertised_address and host in WILDCARD_HOSTS:
                log.warning("bound to every interface (%s): other machines are given this "
                            "one's host name, %s (--advertised-address names another)", host,
                            where)
            store.owners.advertise(f"{broker.scheme}://{where}:{broker.port}",
                                   pulsar.url if pulsar else None, admin.url if admin else None)
            if ready is not None:
                served = {"metrics": metrics and metrics.url,
                          "pulsar clients": pulsar and pulsar.url,
                          "pulsar admin": admin and admin.url}
                ready(broker.url, {k: v for k, v in served.items() if v})
            while not stop.wait(0.5):
                if lost.is_set():  # the metadata's server stayed away: stop, cleanly
                    log.error("%s: the broker stops", store.metadata.backend.lost_reason)
                    break
                if store.fenced.is_set():  # a newer broker took the store over
                    break
                if store.failed.is_set():  # a thread it cannot serve without died
                    log.error("%s: the broker stops", store.failed_reason)
                    break
        finally:
            log.info("broker shutting down")
            store.closing.set()  # ends tail streams so that shutdown does not wait on them
            # a broker that cannot serve on (fenced, its metadata lost) waits for no client
            grace = 0.0 if lost.is_set() or store.fenced.is_set() else SHUTDOWN_GRACE_S
            servers = [("Pulsar admin server", admin), ("Pulsar protocol server", pulsar),
                       ("broker's Flight server", broker), ("metrics server", metrics),
                       *((f"bookie endpoint {i}", e) for i, e in enumerate(endpoints))]
            # the Flight server's own shutdown for the broker: its subscriptions close after
            left = shut_down([(name, partial(flight.FlightServerBase.shutdown, server)
                               if server is broker else server.shutdown)
                              for name, server in servers if server is not None], grace)
            if left:
                log.warning("the %s still had calls under way %g s after the shutdown began "
                            "(clients' streams left open): the broker exits without them",
                            ", ".join(left), grace)
            broker.subscriptions.close()  # every subscription's last acks
            try:
                store.close()
            except TierstreamError as exc:
                if not (lost.is_set() or store.fenced.is_set() or store.failed.is_set()):
                    raise
                # with the metadata lost, the store fenced or a thread it needs dead, what
                # close could not record is recovered at the next start, as after a crash
                log.warning("closing the store: %s (the next start recovers it)", exc)
    if lost.is_set():
        raise UnavailableError(f"{store.metadata.backend.lost_reason}: the broker stopped")
    if store.fenced.is_set():
        raise FencedError(f"{store.fenced_reason}: the broker stopped (other brokers "
                          "serve its partitions now)")
    if store.failed.is_set():
        raise StorageError(f"{store.failed_reason}: the broker stopped")


def serve_bookies(store: Store, host: str, auth_token: str | None, tls_cert: str | None,
                   tls_key: str | None, advertised: str | None,
                   ports: list[int] | None = None) -> list[Any]:
    """An endpoint per bookie of the store (``ports[i]``, 0: any free), each registered in
    metadata."""
    from tierstream.bookie.server import BookieServer, advertised_url

    servers = []
    try:
        for i, (bookie_id, bookie) in enumerate(store.bookies.items()):
            if bookie.root is None:
                continue  # a network bookie serves itself
            port = ports[i] if ports else 0
            server = BookieServer(bookie.root, bookie_id=bookie_id, host=host, port=port,
                                  auth_token=auth_token, tls_cert=tls_cert, tls_key=tls_key)
            servers.append(server)
            address = advertised_url(server, advertised)
            set_bookie_endpoint(store.metadata, bookie_id, address)
            log.info("bookie %s serves its ledgers at %s", bookie_id, address)
    except BaseException:
        for server in servers:
            server.shutdown()
        raise
    return servers


def _raise_file_limit() -> None:
    """Take the hard limit of open files as the soft one: connections, followers and ledger
    files all need descriptors, and the default soft limit (often 1024) is low for a server."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %s to %s", soft, hard)


def _check_range(port: int, option: str) -> None:
    """A listener that ``0`` turns off: its port in range."""
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"invalid {option} {port!r}: expected 0..65535 (0: off)")


def _check_ports_free(wanted: list[tuple[str, int, str, str]]) -> None:
    """Every ``(host, port, option, what)`` with a port free, or one error naming each one
    taken and the option that sets it (0: off, or any free port)."""
    taken: list[str] = []
    for host, port, option, what in wanted:
        if not port:
            continue
        try:
            _check_port_free(host, port)
        except ConflictError:
            taken.append(f"{port} ({option}: {what})")
        except ConfigError as exc:  # an address that cannot be bound here: bad input
            raise ConfigError(f"{exc} ({option}: {what})") from None
    if taken:
        raise ConflictError(f"port{'s' if len(taken) > 1 else ''} already in use on this "
                            f"host: {', '.join(taken)}; give {'them' if len(taken) > 1 else 'it'}"
                            " another port, or stop what listens there")


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            # a port in use is the machine's state (exit 1); an address that cannot be bound
            # here is bad input (exit 2)
            cls = ConflictError if exc.errno == errno.EADDRINUSE else ConfigError
            raise cls(f"cannot listen on {host}:{port}: {exc.strerror}") from None

