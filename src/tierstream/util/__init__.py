"""What every layer may use and that knows nothing of any of them: long-lived worker threads
with an owner (``threads.py``), reader threads fanned into one iterator with a stop that
interrupts them (``fanin.py``), durable file writes (``durable.py``), crash and fault points for
tests (``faults.py``), stopping a foreground command (``signals.py``), times and durations as
people write them (``timeutil.py``) and sizes as people read them (``units.py``)."""
