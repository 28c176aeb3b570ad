"""What a user writes for ``--from``/``--to``, turned into bounds, and end bounds into cuts.

A bound is ``earliest``, ``latest``, a time (ISO-8601, or epoch ms), a position
``p:s:e[:b]``, or a **stream cut** (JSON as ``read``/``backfill`` print it, or ``@FILE`` as
``--cut-out FILE`` writes it). A bounded read's end is resolved to a cut before it runs, so
the command can print it and a later ``tail --from`` can start exactly there: backfill, then
tail, is exactly the log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tierstream.errors import ConfigError
from tierstream.model.positions import Offset, OffsetKind
from tierstream.splits.split import StreamCut, check_window
from tierstream.util.timeutil import format_ms

if TYPE_CHECKING:
    from tierstream.client.admin import Admin

__all__ = ["end_cut", "parse_bound", "spark_bound", "write_cut"]


def parse_bound(text: str, flag: str, topic: str) -> Offset | StreamCut:
    """``text`` as an Offset, or a StreamCut of ``topic`` (``{...}`` or ``@FILE``)."""
    raw = text.strip()
    if raw.startswith("@"):
        path = Path(raw[1:])
        try:
            raw = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{flag} {text!r}: cannot read the cut file: "
                              f"{exc.strerror or exc}") from None
    if raw.lstrip().startswith("{"):
        try:
            cut = StreamCut.from_json(raw)
        except ConfigError as exc:
            raise ConfigError(f"invalid {flag} {text[:80]!r}: {exc}") from None
        if cut.topic != topic:
            raise ConfigError(f"invalid {flag}: the cut is of topic {cut.topic!r}, not {topic!r}")
        return cut
    return Offset.parse(text, what=flag)


def end_cut(admin: Admin, topic: str, bound: Offset | StreamCut, *,
            start: Offset | StreamCut | None = None) -> StreamCut | None:
    """The cut a bounded read up to ``bound`` ends at (None for a single position); a
    ConfigError if it is before ``start`` (a time start is resolved as the end is, to
    compare them exactly).

    ``latest`` is the broker's last confirmed positions now; a time ``t`` is, per partition,
    the first position published at or after ``t``. publish_time never decreases within a
    partition, so reading up to that cut is reading up to ``t``.
    """
    check_window(start, bound)
    cut = _cut_at(admin, topic, bound)
    begins = None if start is None or cut is None else _cut_at(admin, topic, start)
    for p, end in [] if begins is None or cut is None else cut.positions:
        first = None if begins is None else begins.get(p)
        # two positions may name one point (a segment's end, the next one's start): the
        # end is before the start only if messages lie between them
        if first is not None and end < first and admin.advance(topic, end, 1, first)[1]:
            raise ConfigError(f"the read ends at {end} in partition {p}, before it starts "
                              f"there at {first}" + (
                                  f" (where {format_ms(start.time_ms)} begins)"
                                  if isinstance(start, Offset) and start.time_ms is not None
                                  else "") + ": give an end after the start")
    return cut


def _cut_at(admin: Admin, topic: str, bound: Offset | StreamCut) -> StreamCut | None:
    if isinstance(bound, StreamCut):
        return bound
    if bound.kind is OffsetKind.LATEST:
        return admin.latest_cut(topic)
    if bound.kind is OffsetKind.TIME:
        assert bound.time_ms is not None
        partitions = admin.get_topic(topic).partitions
        return StreamCut.of(topic, {p: admin.position_at_time(topic, p, bound.time_ms)
                                    for p in range(partitions)})
    return None


def write_cut(cut: StreamCut, path: str | os.PathLike[str]) -> None:
    """Write ``cut`` as JSON to ``path`` (atomically: a reader never sees half a cut)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.partial")
    try:
        tmp.write_text(json.dumps(cut.to_dict(), sort_keys=True) + "\n")
        tmp.replace(target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the cut to {str(path)!r}: {exc.strerror or exc}") \
            from None


def spark_bound(bound: Offset | StreamCut, flag: str, side: str, command: str
                ) -> dict[str, str]:
    """A bound as the Spark source's ``<side>Time`` or ``<side>Position`` option."""
    if isinstance(bound, StreamCut):
        return {f"{side}Position": bound.to_json()}
    if bound.kind is OffsetKind.TIME:
        return {f"{side}Time": str(bound.time_ms)}
    if bound.kind is OffsetKind.POSITION:
        raise ConfigError(f"{flag} {bound}: {command} takes a time, earliest, latest or a "
                          "stream cut (JSON or @FILE)")
    return {f"{side}Position": bound.kind.value}
