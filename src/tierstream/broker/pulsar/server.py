"""The broker's listener for Pulsar's binary protocol (plain or TLS): a thread per client
connection (``connection.py``); at shutdown every producer is told to go."""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
from typing import TYPE_CHECKING, Any

from tierstream.broker.pulsar.connection import KEEPALIVE_S, Connection, Listener
from tierstream.options import DEFAULT_PULSAR_PORT
from tierstream.util.threads import Worker
from tierstream.wire.security import advertised_host

if TYPE_CHECKING:
    from tierstream.broker.stats.topic_stats import Streams
    from tierstream.broker.store import Store
    from tierstream.broker.subscriptions.registry import Subscriptions
    from tierstream.metadata.schema_registry import SchemaRegistry

__all__ = ["PulsarServer"]

log = logging.getLogger(__name__)


class PulsarServer:
    """Serves Pulsar clients on ``host:port`` (0: any free port) for ``store``; ``advertised``
    is the host name LOOKUP answers (default ``host``). With ``auth_token``, a client must
    connect with that token (Pulsar's AuthenticationToken); with ``tls_cert`` and ``tls_key``
    (PEM files) every connection is TLS (``pulsar+ssl://``)."""

    def __init__(self, store: Store, *, host: str = "127.0.0.1",
                 port: int = DEFAULT_PULSAR_PORT, advertised: str | None = None,
                 auth_token: str | None = None, auto_create: bool = True,
                 schemas: SchemaRegistry, subscriptions: Subscriptions, streams: Streams,
                 tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
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
                server.serve(sock, self.client_address)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, port), Handler)
        self.port = int(self._server.server_address[1])
        name = advertised_host(host, advertised)
        scheme = "pulsar+ssl" if context is not None else "pulsar"
        self.url = f"{scheme}://{'[' + name + ']' if ':' in name else name}:{self.port}"
        self.listener = Listener(
            store=store, schemas=schemas, subscriptions=subscriptions, streams=streams,
            url=self.url, tls=context is not None, auth_token=auth_token,
            auto_create=auto_create)
        self._thread = Worker("tierstream-pulsar-listener", self._server.serve_forever).start()

    def shutdown(self) -> None:
        """Stop accepting, tell every connected producer to go (CLOSE_PRODUCER: its client
        looks the topic up again and reconnects when a broker serves it), close."""
        self._server.shutdown()  # serve_forever returns: the thread ends
        self._server.server_close()
        self._thread.join()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.go_away()

    def serve(self, sock: socket.socket, peer: Any) -> None:
        """One connection, in the thread the listener gave it."""
        connection = Connection(self.listener, sock, peer)
        with self._lock:
            self._connections.add(connection)
        try:
            connection.serve()
        finally:
            with self._lock:
                self._connections.discard(connection)
