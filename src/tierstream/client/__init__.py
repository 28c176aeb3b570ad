"""Python clients of the broker, in one place: :class:`Admin`, :class:`Producer`,
:func:`read`, :class:`Consumer` and :class:`Transaction`. All talk Arrow Flight; all raise
:mod:`tierstream.errors` types. Each lives in its own module; this one gathers them.
"""

from tierstream.client.admin import Admin
from tierstream.client.connection import BrokerClient
from tierstream.client.consumer import Consumer
from tierstream.client.producer import Message, Producer
from tierstream.client.reading import TopicReader, consume_stream, read
from tierstream.client.transaction import Transaction

__all__ = ["Admin", "BrokerClient", "Consumer", "Message", "Producer", "TopicReader",
           "Transaction", "consume_stream", "read"]
