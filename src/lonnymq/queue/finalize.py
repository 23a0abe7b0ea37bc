"""Finalize dequeued messages: delete (ack), defer (unlock, maybe later, maybe with new
state), heartbeat (extend locks). Each checks the lock token, so a holder whose lock expired
and was taken over gets ``Outcome.STATE_INVALID`` instead of finalizing someone else's work."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import LiteralString

from . import _checks
from ._ops import Op, Rows, render
from .results import Outcome

_DELETE: LiteralString = "SELECT {schema}.message_delete_v1(%s::bigint, %s::uuid)"
_DEFER: LiteralString = (
    "SELECT {schema}.message_defer_v1(%s::bigint, %s::uuid, %s::bigint, %s::boolean, %s::bytea)"
)
_HEARTBEAT: LiteralString = (
    "SELECT message_id, locked_until FROM {schema}.message_heartbeat_v1("
    "%s::bigint[], %s::uuid[], %s::bigint)"
)

#: Marker for "keep the message's state as it is" in defer.
KEEP = object()


def _outcome(rows: Rows) -> Outcome:
    return Outcome(rows[0][0])


def delete_op(schema: str, message_id: int, lock_token: uuid.UUID) -> Op[Outcome]:
    return Op(schema, render(_DELETE, schema), (message_id, lock_token), _outcome)


def defer_op(
    schema: str,
    message_id: int,
    lock_token: uuid.UUID,
    *,
    delay_ms: float | None = 0,
    state: object = KEEP,
) -> Op[Outcome]:
    """Unlock a held message, due again ``delay_ms`` from now (behind the messages that are
    due before then); ``delay_ms=None`` requeues it in its old place instead."""
    delay = (
        None
        if delay_ms is None
        else _checks.milliseconds(delay_ms, "delay_ms", low=0, high=_checks.MAX_DELAY_MS)
    )
    set_state = state is not KEEP
    data = _checks.optional_bytes(state, "state") if set_state else None
    params = (message_id, lock_token, delay, set_state, data)
    return Op(schema, render(_DEFER, schema), params, _outcome)


def heartbeat_op(
    schema: str, held: Iterable[tuple[int, uuid.UUID]], *, lock_ms: float
) -> Op[set[int]]:
    lock = _checks.milliseconds(lock_ms, "lock_ms", low=1, high=_checks.MAX_LOCK_MS)
    pairs = list(held)
    ids = [p[0] for p in pairs]
    tokens = [p[1] for p in pairs]

    def parse(rows: Rows) -> set[int]:
        return {row[0] for row in rows}

    return Op(schema, render(_HEARTBEAT, schema), (ids, tokens, lock), parse)
