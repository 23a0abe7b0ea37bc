"""Structured logs: lonnymq's log events as one JSON object per line.

The transport logs what happens to messages on the ``lonnymq.events`` logger (enqueued,
dequeued, acked and deferred at DEBUG; redelivered after a lock expired, dead-lettered and
channel full at WARNING), with the fields as attributes of the log record: ``event``,
``message_id``, ``queue``, ``channel`` and, where they apply, ``attempts`` and ``reason``.
Other lonnymq loggers (``lonnymq.transport``...) log plain messages.

    import logging
    from lonnymq.logs import JsonFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.getLogger("lonnymq").addHandler(handler)
    logging.getLogger("lonnymq.events").setLevel(logging.DEBUG)  # the steady flow too
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

#: Attributes of a log record that carry a lonnymq event's fields.
FIELDS = ("event", "message_id", "queue", "channel", "attempts", "reason")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the event
    fields present on the record, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                data[name] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
