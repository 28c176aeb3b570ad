"""What every layer may use and that knows nothing of any of them: long-lived worker threads
with an owner (``threads.py``)."""
