"""Python clients of the broker, in one place: :class:`Admin`, :class:`Producer`,
:func:`read` and :class:`Consumer`. All talk Arrow Flight; all raise
:mod:`tierstream.errors` types. Each lives in its own module; this one gathers them.
"""

from tierstream.store.admin import Admin
from tierstream.store.connection import BrokerClient
from tierstream.store.consumer import Consumer
from tierstream.store.producer import Message, Producer
from tierstream.store.reading import TopicReader, consume_stream, read

__all__ = ["Admin", "BrokerClient", "Consumer", "Message", "Producer", "TopicReader",
           "consume_stream", "read"]
