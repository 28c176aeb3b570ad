"""The source framework's runtime, without Spark: the local runner (``local.py``: ``plan``,
``scan``, ``read``, ``tail``), following a topic's partitions as it grows (``follow.py``)
and windows on event time (``event_time.py``). It runs the splits the enumerator plans with
the readers of ``tierstream.readers``, as ``spark_adapter`` runs them on Spark; the fan-in
of reader threads into one iterator is ``util/fanin.py``, as the client library fans its
streams in with it too.
"""
