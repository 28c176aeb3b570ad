"""A connection to one broker over Arrow Flight: actions, and consume/produce streams."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self
from urllib.parse import urlsplit

import pyarrow.flight as flight

from tierstream.errors import ConfigError, NotOwnerError, UnavailableError
from tierstream.model import arguments
from tierstream.model.message_format import PRODUCE_SCHEMA
from tierstream.options import DEFAULT_BROKER_URL, parse_options
from tierstream.wire.flight import decode, encode, translate_errors
from tierstream.wire.security import call_headers, client_for, read_pem

__all__ = ["FAILOVER_WAIT_S", "FENCED_PASS_S", "BrokerClient"]

log = logging.getLogger(__name__)

#: how long a client that names several brokers waits for one of them to answer when none
#: does — a standby taking over needs its --takeover-after and its recovery — as Pulsar's
#: clients wait out their operation timeout (30 s)
FAILOVER_WAIT_S = 30.0
#: how long a broker that refused as fenced is passed over when another is named: it no
#: longer serves the store, and opening a stream there succeeds without a word from it, so
#: falling back to it while the new one does not answer yet went round in a busy loop; a
#: broker restarted at that address is tried again after this
FENCED_PASS_S = 5.0
#: how many brokers in a row a partition's call follows to its owner before giving up (each
#: names the next: a move under way)
_FOLLOWS = 4


class BrokerClient:
    """A connection to a broker. ``broker``/``auth_token`` default to the option table
    (``TIERSTREAM_BROKER``, ``TIERSTREAM_AUTH_TOKEN``). ``broker`` may name several
    brokers, ``grpc://a:6651,grpc://b:6651`` (or a list): a broker that cannot be reached,
    or no longer serves the store (another took it over), is left for the next; calls and
    new streams go to the first that answers (Pulsar's multi-host service URL)."""

    def __init__(self, broker: str | Sequence[str] | None = None, *,
                 auth_token: str | None = None, tls_ca: bytes | str | None = None,
                 timeout: float = 30.0) -> None:
        if broker is not None and not isinstance(broker, str):
            broker = ",".join(broker)
        opts = parse_options({"broker": broker, "authToken": auth_token,
                              "tlsCa": tls_ca if isinstance(tls_ca, str) else None},
                             scope="client")
        #: every broker named, as given (what other clients of this one are given)
        self.broker: str = opts["broker"]
        for url in [u.strip() for u in self.broker.split(",") if u.strip()] or [self.broker]:
            if not url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
                raise ConfigError(f"invalid broker URL {url!r}: expected grpc://HOST:PORT "
                                  "or grpc+tls://HOST:PORT (several: separated by commas)")
        self.urls = [_with_port(u.strip()) for u in self.broker.split(",") if u.strip()]
        self.url: str = self.urls[0]  # the one in use
        self.auth_token: str | None = opts["authToken"]
        self.tls_ca = tls_ca if isinstance(tls_ca, bytes) else read_pem(opts["tlsCa"], "tlsCa")
        headers = self._headers = call_headers(self.auth_token)
        self._options = flight.FlightCallOptions(
            headers=headers, timeout=arguments.seconds(timeout, "timeout", zero_ok=False))
        self._stream_options = flight.FlightCallOptions(headers=headers)
        self._clients: dict[str, Any] = {}
        self._passed_over: dict[str, float] = {}  # url -> until when (fenced())
        #: (topic, partition) -> the URL of the broker that said it owns it (follow())
        self._owners: dict[tuple[str, int], str] = {}
        self._clients_lock = threading.Lock()
        with translate_errors(self.url):
            self._client_of(self.url)

    def _client_of(self, url: str) -> Any:
        with self._clients_lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = client_for(url, tls_ca=self.tls_ca)
            return client

    def _call(self, work: Callable[[Any], Any], used: list[str] | None = None) -> Any:
        """``work(flight client)`` on the broker in use; if it cannot be reached (or was
        fenced), on the next ones named. The brokers are tried in a local order (threads of
        one producer share this client), and the one that answers is kept. One broker named:
        its error at once. Several: while none answers (a standby taking over), round after
        round with backoff for up to :data:`FAILOVER_WAIT_S`, then one error naming them."""
        deadline: float | None = None
        pause = 0.1
        while True:
            start = self.urls.index(self.url) if self.url in self.urls else 0
            for turn in range(len(self.urls)):
                url = self.urls[(start + turn) % len(self.urls)]
                if self._passed_over.get(url, 0.0) > time.monotonic():
                    last = UnavailableError(f"broker {url} no longer serves the store "
                                            "(fenced)")
                    continue
                try:
                    with translate_errors(url):
                        result = work(self._client_of(url))
                except NotOwnerError:
                    raise  # it answered: another broker owns the partition (followed)
                except UnavailableError as exc:
                    last = exc
                    continue
                self.url = url
                if used is not None:  # where it went (a stream's broker)
                    used.append(url)
                return result
            if len(self.urls) < 2:
                raise last
            now = time.monotonic()
            if deadline is None:
                deadline = now + FAILOVER_WAIT_S
                log.warning("no broker of %s answers (%s); waiting up to %g s for one",
                            ", ".join(self.urls), last, FAILOVER_WAIT_S)
            if now >= deadline:
                raise UnavailableError(f"no broker of {', '.join(self.urls)} answered in "
                                       f"{FAILOVER_WAIT_S:g} s; the last said: {last}")
            time.sleep(min(pause, deadline - now))  # backoff between rounds of tries
            pause = min(2 * pause, 1.0)

    def fenced(self, url: str) -> None:
        """``url`` refused a call as fenced: when other brokers are named, it is passed over
        for :data:`FENCED_PASS_S`, even while none of them answers yet."""
        if len(self.urls) > 1:
            self._passed_over[url] = time.monotonic() + FENCED_PASS_S

    def follow(self, topic: str, partition: int, url: str) -> None:
        """A broker said ``url`` owns the partition: its streams go there from now on, until
        that broker cannot be reached (then to the brokers named again, which say where it
        went)."""
        if not url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise UnavailableError(f"{topic} partition {partition} is owned by a broker at "
                                   f"{url!r}, which is not a broker URL")
        if self._owners.get((topic, partition)) != url:
            log.info("%s partition %d is served by %s; following it", topic, partition, url)
            self._owners[(topic, partition)] = url

    def unfollow(self, topic: str, partition: int, url: str | None) -> bool:
        """The owner followed for the partition, at ``url``, hangs (connected, but no
        answer in time): its streams go to the brokers named again, which say where it
        went. Whether it was followed."""
        if url is None or self._owners.get((topic, partition)) != url:
            return False
        log.info("%s partition %d: its owner at %s does not answer; asking %s", topic,
                 partition, url, self.broker)
        del self._owners[(topic, partition)]
        return True

    def url_for(self, command: Mapping[str, Any]) -> str:
        """The broker a stream of ``command``'s partition goes to."""
        return self._owners.get(_partition_of(command), self.url)

    def _partition_call(self, command: Mapping[str, Any], work: Callable[[Any], Any],
                        used: list[str] | None = None) -> Any:
        """``work`` on the broker that owns the partition ``command`` names, once one said
        so (:meth:`follow`); else, or when it cannot be reached, as :meth:`_call` does. A
        call refused there as not owned (an action: a stream's refusal comes with its first
        read) goes to the owner the refusal names."""
        key = _partition_of(command)
        for _ in range(_FOLLOWS):
            url = self._owners.get(key)
            try:
                if url is None:
                    return self._call(work, used)
                with translate_errors(url):
                    result = work(self._client_of(url))
                if used is not None:
                    used.append(url)
                return result
            except NotOwnerError as exc:
                if not exc.owner_url or exc.owner_url == url:
                    raise
                self.follow(*key, exc.owner_url)
            except UnavailableError as exc:
                if url is None:
                    raise
                log.info("the owner of %s partition %d at %s: %s; asking %s", *key, url, exc,
                         self.broker)
                self._owners.pop(key, None)
        raise UnavailableError(f"{key[0]} partition {key[1]}: sent from broker to broker "
                               f"{_FOLLOWS} times without finding its owner")

    def next_broker(self) -> str:
        """Use the next broker named (one that answers, but not in time, is left too)."""
        self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}(broker={self.url!r})"

    def action(self, name: str, body: Mapping[str, Any] | None = None, *,
               timeout: float | None = None) -> Any:
        """Run action ``name`` (within ``timeout`` if given, else the client's); one that
        names a partition (a consumer's ack, flow, nack) goes to the partition's owner
        (:meth:`_partition_call`)."""
        body = dict(body or {})
        options = self._options if timeout is None else flight.FlightCallOptions(
            headers=self._headers, timeout=timeout)

        def work(f: Any) -> Any:
            return list(f.do_action(flight.Action(name, encode(body)), options))

        routed = "topic" in body and isinstance(body.get("partition"), int)
        results = self._partition_call(body, work) if routed else self._call(work)
        return decode(results[0].body.to_pybytes(), f"{name} result")["result"]

    def consume(self, ticket: Mapping[str, Any]) -> Any:
        """Open a consume stream (DoGet) for ``ticket``: a Flight reader of record batches,
        with no call timeout (a following read lasts as long as it is read). It returns once
        the broker answered the stream's schema, so its refusal (an attach error, offsets it
        cannot resolve, a partition it does not own) is raised here."""
        def work(f: Any) -> Any:
            reader = f.do_get(flight.Ticket(encode(dict(ticket))), self._stream_options)
            try:
                reader.schema  # noqa: B018 - the broker's refusal (not the owner) comes now
            except BaseException:
                reader.cancel()
                raise
            return reader

        return self._partition_call(ticket, work)

    def produce(self, command: Mapping[str, Any]) -> tuple[Any, Any, str]:
        """Open a produce stream (DoPut) for ``command``: (writer, ack reader, the URL of
        the broker it went to)."""
        descriptor = flight.FlightDescriptor.for_command(encode(dict(command)))
        used: list[str] = []
        writer, reader = self._partition_call(command, lambda f: f.do_put(
            descriptor, PRODUCE_SCHEMA, self._stream_options), used)
        return writer, reader, used[-1]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BROKER_PORT = urlsplit(DEFAULT_BROKER_URL).port


def _with_port(url: str) -> str:
    """``url`` with the broker's port when it names none (gRPC would dial 443)."""
    try:
        port = urlsplit(url).port
    except ValueError:
        raise ConfigError(f"invalid broker URL {url!r}: its port is not a number in "
                          "1-65535") from None
    return url if port is not None else f"{url.rstrip('/')}:{BROKER_PORT}"


def _partition_of(command: Mapping[str, Any]) -> tuple[str, int]:
    return str(command.get("topic")), int(command.get("partition") or 0)
