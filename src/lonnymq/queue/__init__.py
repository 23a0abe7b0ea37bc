"""The lonnymq queue API (see :mod:`lonnymq.queue.broker`)."""

from .batch import Batch, Pending
from .broker import Broker, Channel, Queue
from .consumers import ConsumerInfo
from .dequeue import DeadLettered, DequeueResult, Message
from .expiry import QueueExpiry
from .finalize import KEEP
from .listing import MessageInfo
from .operate import (
    ChannelStatus,
    Counters,
    HorizonHolder,
    MessageDetail,
    QueueSettings,
    QueueStatus,
    RateHeld,
    RetryResult,
    UpdateResult,
)
from .policy import ChannelInfo, Policy
from .rate import Rate
from .results import Created, CreateResult, Deduplicated, Dropped, Outcome, QueueStats

__all__ = [
    "KEEP",
    "Batch",
    "Broker",
    "Channel",
    "ChannelInfo",
    "ChannelStatus",
    "ConsumerInfo",
    "Counters",
    "CreateResult",
    "Created",
    "DeadLettered",
    "Deduplicated",
    "DequeueResult",
    "Dropped",
    "HorizonHolder",
    "Message",
    "MessageDetail",
    "MessageInfo",
    "Outcome",
    "Pending",
    "Policy",
    "Queue",
    "Rate",
    "RateHeld",
    "QueueExpiry",
    "QueueSettings",
    "QueueStats",
    "QueueStatus",
    "RetryResult",
    "UpdateResult",
]
