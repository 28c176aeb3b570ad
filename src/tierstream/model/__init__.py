"""The data model every side shares: a message's schema and key hash
(``message_format.py``), positions, offsets and key ranges (``positions.py``), topic names
(``names.py``), elastic topics' scale events (``lineage.py``), the data-loss rule
(``data_loss.py``), subscription types (``subscription_type.py``) and a data directory's
layout (``layout.py``).
"""
