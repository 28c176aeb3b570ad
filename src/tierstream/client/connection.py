"""A connection to one broker over Arrow Flight: actions, and consume/produce streams."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import pyarrow.flight as flight

from tierstream.errors import ConfigError
from tierstream.message_format import PRODUCE_SCHEMA
from tierstream.options import parse_options
from tierstream.protocol import decode, encode, translate_errors
from tierstream.security import call_headers, client_for, read_pem

__all__ = ["BrokerClient"]


class BrokerClient:
    """A connection to one broker. ``broker``/``auth_token`` default to the option table
    (``TIERSTREAM_BROKER``, ``TIERSTREAM_AUTH_TOKEN``)."""

    def __init__(self, broker: str | None = None, *, auth_token: str | None = None,
                 tls_ca: bytes | str | None = None, timeout: float = 30.0) -> None:
        opts = parse_options({"broker": broker, "authToken": auth_token,
                              "tlsCa": tls_ca if isinstance(tls_ca, str) else None},
                             scope="client")
        self.url: str = opts["broker"]
        if not self.url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise ConfigError(f"invalid broker URL {self.url!r}: expected grpc://HOST:PORT "
                              "or grpc+tls://HOST:PORT")
        self.auth_token: str | None = opts["authToken"]
        self.tls_ca = tls_ca if isinstance(tls_ca, bytes) else read_pem(opts["tlsCa"], "tlsCa")
        headers = call_headers(self.auth_token)
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._stream_options = flight.FlightCallOptions(headers=headers)
        with translate_errors(self.url):
            self._flight = client_for(self.url, tls_ca=self.tls_ca)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(broker={self.url!r})"

    def action(self, name: str, body: Mapping[str, Any] | None = None) -> Any:
        with translate_errors(self.url):
            results = list(self._flight.do_action(
                flight.Action(name, encode(dict(body or {}))), self._options))
        return decode(results[0].body.to_pybytes(), f"{name} result")["result"]

    def consume(self, ticket: Mapping[str, Any]) -> Any:
        """Open a consume stream (DoGet) for ``ticket``: a Flight reader of record batches,
        with no call timeout (a following read lasts as long as it is read)."""
        with translate_errors(self.url):
            return self._flight.do_get(flight.Ticket(encode(dict(ticket))),
                                       self._stream_options)

    def produce(self, command: Mapping[str, Any]) -> tuple[Any, Any]:
        """Open a produce stream (DoPut) for ``command``: (writer, ack reader)."""
        descriptor = flight.FlightDescriptor.for_command(encode(dict(command)))
        with translate_errors(self.url):
            writer, reader = self._flight.do_put(descriptor, PRODUCE_SCHEMA,
                                                 self._stream_options)
        return writer, reader

    def close(self) -> None:
        self._flight.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
