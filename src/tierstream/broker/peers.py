"""The other brokers of a cluster (``--cluster``), asked over tierstream's Flight wire with
the cluster's token: a partition's live figures (rates, producers, consumers, what they hold)
are in its owner's memory, so a topic's stats asked of one broker gather the others' from
their owners (``topic_stats.py``), as Pulsar's brokers answer a partitioned topic's stats.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.flight as flight

from tierstream.wire.flight import decode, encode, translate_errors
from tierstream.wire.security import call_headers, client_for

__all__ = ["PEER_TIMEOUT_S", "Peers"]

#: A broker that has not answered a question in this long is left out of the answer (its
#: partitions are listed as unanswered), so one hung broker does not hang the others' stats.
PEER_TIMEOUT_S = 5.0


class Peers:
    """Flight clients of the other brokers, one per address, made on first use
    (thread-safe). ``tls_ca``: the CA their certificates are checked against (the store's
    CA, as for its bookies; None: the system's)."""

    def __init__(self, *, auth_token: str | None, tls_ca: bytes | None,
                 timeout_s: float = PEER_TIMEOUT_S) -> None:
        self._tls_ca = tls_ca
        self._options = flight.FlightCallOptions(headers=call_headers(auth_token),
                                                 timeout=timeout_s)
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    def call(self, url: str, action: str, body: dict[str, Any]) -> Any:
        """Run ``action`` on the broker at ``url``: its result, or a tierstream error
        (UnavailableError for one down, hung or not a broker)."""
        with translate_errors(url):
            results = list(self._client(url).do_action(flight.Action(action, encode(body)),
                                                        self._options))
        return decode(results[0].body.to_pybytes(), f"{action} result of {url}")["result"]

    def call_each(self, calls: dict[str, tuple[str, dict[str, Any]]]
                  ) -> dict[str, Any | Exception]:
        """Per address, ``call(url, *calls[url])`` run side by side: its result or the
        error it raised (a late broker costs one timeout, not one per broker)."""
        if not calls:
            return {}
        with ThreadPoolExecutor(max_workers=min(8, len(calls)),
                                thread_name_prefix="peer-call") as pool:
            futures = {url: pool.submit(self.call, url, *call) for url, call in calls.items()}
            out: dict[str, Any | Exception] = {}
            for url, future in futures.items():
                exc = future.exception()
                out[url] = exc if isinstance(exc, Exception) else future.result()
            return out

    def _client(self, url: str) -> Any:
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = client_for(url, tls_ca=self._tls_ca)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
