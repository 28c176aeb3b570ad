"""One partition's log, as Pulsar's managed ledger: an ordered run of segments.

``partition_log.py`` appends entries to the open segment's bookies (write quorum, ack
quorum) and rolls segments; ``partition_reads.py`` reads any segment from wherever it lives;
``partition_positions.py`` turns times and counts into positions from the entry indexes;
``open_segment.py`` is the segment being written; ``dedup.py`` the producers' sequence ids.
"""
