"""Who answers at a network bookie's address, as the broker's client of it
(``remote.py``) checks it: the bookie it expects, taking writes, on the disk its registration
names (``bookie/cookie.py``). A disk that replaced a lost one (``bookie serve --replace``) is
adopted once the registration names it; a bookie restarted at another address (a new port,
a host's new IP) is followed there. A mixin over the client's state, declared below."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from tierstream.bookie.wire import not_this_bookie
from tierstream.wire.security import client_for

__all__ = ["BookieIdentity"]

log = logging.getLogger(__name__)


class BookieIdentity:
    """The identity checks of :class:`~tierstream.managed_ledger.bookies.remote.RemoteBookie`
    (a mixin)."""

    # The client's state, owned and kept by RemoteBookie (remote.py).
    bookie_id: str
    address: str
    instance: str | None
    _registration: Callable[[], tuple[str, str | None] | None] | None
    _tls_ca: bytes | None
    _client: Any
    _lock: threading.Condition

    def _someone_else(self, answer: dict[str, Any]) -> str | None:
        """Why a ping's ``answer`` is not this bookie taking writes (None: it is). Another
        instance of it is asked of the registration: a replacing disk is the bookie now."""
        other = not_this_bookie(answer, self.bookie_id, self.address)
        if other is not None:
            return other
        found = answer.get("instance")
        if self.instance is None or found is None or found == self.instance:
            return None
        registration = self._registration() if self._registration else None
        if registration is not None and registration[1] == found:
            log.warning("bookie %s at %s is a new disk now (instance %s, registered in place "
                        "of %s)", self.bookie_id, self.address, found, self.instance)
            self.instance = found
            return None
        return f"the endpoint at {self.address} is another disk of bookie " \
            f"{self.bookie_id} (instance {found}, not {self.instance})"

    def _moved(self) -> bool:
        """Whether the bookie registered another address than the one that did not answer."""
        try:
            registration = self._registration() if self._registration else None
        except Exception:  # the metadata store unreachable too: the address stays
            return False
        if registration is None or registration[0] == self.address:
            return False
        old = self._client
        with self._lock:
            log.warning("bookie %s registered a new address, %s (was %s): it is written there "
                        "from now on", self.bookie_id, registration[0], self.address)
            self.address = registration[0]
            self._client = client_for(self.address, tls_ca=self._tls_ca)
        with contextlib.suppress(Exception):
            old.close()
        return True
