"""Who may call an endpoint, and over what: the token check and TLS of every Flight server
(the broker and the bookie endpoints) and of the clients that call them.

- A server bound to a non-loopback address needs a token, checked by middleware on every
  call before any handler runs; without TLS it also warns, because the token and the data
  then cross the network in clear text.
- TLS is pyarrow Flight's: a server takes a PEM certificate and key (``--tls-cert``,
  ``--tls-key``) and is reached as ``grpc+tls://``; a client trusts the CA of option
  ``tlsCa`` (a PEM file, or PEM text) or, without it, the system's CAs.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from tierstream.errors import AuthError, ConfigError

__all__ = ["WILDCARD_HOSTS", "TokenMiddlewareFactory", "advertised_host", "check_bind",
           "client_for", "is_loopback", "read_pem", "require_token", "server_tls", "url_host"]

log = logging.getLogger(__name__)

TLS_SCHEMES = ("grpc+tls://",)
PLAIN_SCHEMES = ("grpc://", "grpc+tcp://")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """A host as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


#: bind addresses that mean every interface: no other machine can reach one by them
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def advertised_host(host: str, advertised: str | None) -> str:
    """The host other machines are given for a listener bound to ``host``: ``advertised``
    when given; for a bind to every interface (0.0.0.0 means nothing to another machine),
    this machine's host name, as Pulsar's brokers advertise theirs; else ``host``."""
    if advertised:
        return advertised
    if host in WILDCARD_HOSTS:
        return socket.gethostname()
    return host


def require_token(host: str, *, auth_token: str | None, what: str) -> None:
    """Refuse a non-loopback bind without a token (before anything is opened)."""
    if not is_loopback(host) and not auth_token:
        raise AuthError(
            f"refusing to bind the {what} to non-loopback address {host!r} without a token: "
            "pass --auth-token or set TIERSTREAM_AUTH_TOKEN")


def check_bind(host: str, *, auth_token: str | None, tls: bool, what: str) -> None:
    """Refuse a non-loopback bind without a token; warn about one without TLS."""
    require_token(host, auth_token=auth_token, what=what)
    if not is_loopback(host) and not tls:
        log.warning("the %s listens on %s without TLS: the token and the data cross the "
                    "network in clear text (pass --tls-cert and --tls-key)", what, host)


def read_pem(value: str | bytes | None, what: str) -> bytes | None:
    """PEM bytes from a file path or from PEM text; ConfigError naming ``what`` if neither."""
    if value is None or value == "" or value == b"":
        return None
    if isinstance(value, bytes):
        return value
    if value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    try:
        data = Path(value).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {value!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"invalid {what} {value!r}: not a PEM file")
    return data


def server_tls(cert: str | None, key: str | None) -> list[tuple[bytes, bytes]] | None:
    """Flight's ``tls_certificates`` for a server, or None for plain gRPC."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    cert_pem, key_pem = read_pem(cert, "--tls-cert"), read_pem(key, "--tls-key")
    assert cert_pem is not None and key_pem is not None
    return [(cert_pem, key_pem)]


#: gRPC keepalive of every client connection while it has a call under way: a connection
#: whose peer went silent without a word (a host cut off: no reset, no FIN) is closed when a
#: ping goes unanswered, so a read waiting on it fails and reconnects. Before, a stream that
#: only receives sent nothing whose loss the kernel could notice: once the server had given
#: the connection up, the reader waited for good. The interval is the servers' floor: a gRPC
#: server answers pings more often than every 5 minutes, on a connection it sends nothing on,
#: with GOAWAY "too many pings", and pyarrow's Flight server cannot lower that
#: (apache/arrow#44916). A consumer's own keepalive (client/consumer.py) notices sooner.
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 330_000), ("grpc.keepalive_timeout_ms", 20_000),
                     ("grpc.http2.max_pings_without_data", 0)]


def client_for(url: str, *, tls_ca: bytes | None = None) -> Any:
    """A Flight client of ``url``: ``grpc+tls://`` trusts ``tls_ca`` (else the system CAs)."""
    if not url.startswith(TLS_SCHEMES + PLAIN_SCHEMES):
        raise ConfigError(f"invalid endpoint URL {url!r}: expected grpc://HOST:PORT or "
                          "grpc+tls://HOST:PORT")
    kwargs: dict[str, Any] = {"generic_options": KEEPALIVE_OPTIONS}
    if url.startswith(TLS_SCHEMES) and tls_ca is not None:
        kwargs["tls_root_certs"] = tls_ca
    try:
        return flight.FlightClient(url, **kwargs)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"cannot open a connection to {url!r}: {exc}") from None


class TokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Denies every call whose ``authorization`` header is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        values = headers.get("authorization") or headers.get("Authorization") or []
        given = values[0] if values else ""
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_b, self._expected):
            raise flight.FlightUnauthenticatedError("missing or wrong token")
        return None


def call_headers(auth_token: str | None) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {auth_token}".encode())] if auth_token else []
