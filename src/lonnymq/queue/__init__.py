"""The lonnymq queue API (see :mod:`lonnymq.queue.broker`)."""

from .batch import Batch, Pending
from .broker import Broker, Channel, Queue
from .dequeue import DequeueResult, Message
from .finalize import KEEP
from .policy import ChannelInfo, Policy
from .results import Created, CreateResult, Deduplicated, Dropped, Outcome, QueueStats

__all__ = [
    "KEEP",
    "Batch",
    "Broker",
    "Channel",
    "ChannelInfo",
    "CreateResult",
    "Created",
    "Deduplicated",
    "DequeueResult",
    "Dropped",
    "Message",
    "Outcome",
    "Pending",
    "Policy",
    "Queue",
    "QueueStats",
]
