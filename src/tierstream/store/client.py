"""Python clients of the broker, in one place: :class:`Admin`, :class:`Producer`,
:func:`read`, :class:`Consumer` and :class:`Transaction`. All talk Arrow Flight; all raise
:mod:`tierstream.errors` types. Each lives in its own module; this one gathers them.
"""

from tierstream.store.admin import Admin
from tierstream.store.connection import BrokerClient
from tierstream.store.consumer import Consumer
from tierstream.store.producer import Message, Producer
from tierstream.store.reading import TopicReader, consume_stream, read
from tierstream.store.transaction import Transaction

__all__ = ["Admin", "BrokerClient", "Consumer", "Message", "Producer", "TopicReader",
           "Transaction", "consume_stream", "read"]
