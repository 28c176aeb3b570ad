"""Who gets which message: the consumer selectors behind the four subscription types.

- ``exclusive``: one consumer per partition; a second one is refused.
- ``failover``: per partition one active consumer, the others stand by. Consumers are sorted
  by name and partition ``p`` goes to the ``p % n``-th (Pulsar's rule), so partitions spread
  over the consumers and every broker picks the same one.
- ``shared``: any consumer with permits; no order.
- ``key_shared``: each of the 65,536 key-hash slots belongs to one consumer. Without sticky
  ranges the slots are split by consistent hashing: every consumer puts
  :data:`RING_POINTS` points on a ring of the slots, and a slot belongs to the consumer of the
  first point at or after it, so a join or a leave moves about 1/n of the slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import mmh3
import numpy as np

from tierstream.model.message_format import KEY_HASH_SLOTS
from tierstream.model.positions import KeyRange

__all__ = ["RING_POINTS", "active_for_partition", "slot_owners"]

#: Points each consumer puts on the consistent-hash ring. Pulsar's default is 100; 256 keeps
#: the share of 4 consumers within about 1.3x of even for any names (fewer points spread worse).
RING_POINTS = 256


def slot_owners(names: Sequence[str], sticky: Sequence[Sequence[KeyRange] | None]
                ) -> np.ndarray:
    """For each hash slot, the index (into ``names``) of the consumer that owns it, or -1.

    Consumers with sticky ranges own exactly those (slots nobody's range covers have no
    owner); consumers without share every slot by consistent hashing. A subscription has one
    kind or the other (the dispatcher refuses a mix).
    """
    owners = np.full(KEY_HASH_SLOTS, -1, dtype=np.int32)
    auto = [i for i, r in enumerate(sticky) if r is None]
    if auto:
        points = np.array([mmh3.hash(f"{names[i]}{k}", signed=False) % KEY_HASH_SLOTS
                           for i in auto for k in range(RING_POINTS)], dtype=np.int64)
        who = np.repeat(np.array(auto, dtype=np.int32), RING_POINTS)
        order = np.lexsort((who, points))
        points, who = points[order], who[order]
        at = np.searchsorted(points, np.arange(KEY_HASH_SLOTS), side="left") % len(points)
        owners[:] = who[at]
    for i, ranges in enumerate(sticky):
        for r in ranges or ():
            owners[r.lo:r.hi] = i
    return owners


def active_for_partition(names: Sequence[str], partition: int) -> int:
    """Index (into ``names``) of the failover consumer active on ``partition``."""
    order = sorted(range(len(names)), key=lambda i: names[i])
    return order[partition % len(order)]
