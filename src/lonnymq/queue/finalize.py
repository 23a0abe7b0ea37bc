"""Finalize dequeued messages: delete (ack) one or many, defer (unlock, maybe later, maybe
with new state), heartbeat (extend locks), reject (to the dead letters). Each checks the lock
token, so a holder whose lock expired and was taken over gets ``Outcome.STATE_INVALID`` instead
of finalizing someone else's work."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from .._compat import LiteralString
from ..exceptions import InvalidName
from . import _checks
from ._ops import Op, Rows, render
from .results import Outcome

_DELETE: LiteralString = "SELECT {schema}.message_delete_v1(%s::bigint, %s::uuid)"
_DELETE_MANY: LiteralString = (
    "SELECT message_id, result_code FROM {schema}.message_delete_many_v1(%s::bigint[], %s::uuid[])"
)
_DEFER: LiteralString = (
    "SELECT {schema}.message_defer_v1(%s::bigint, %s::uuid, %s::bigint, %s::boolean, %s::bytea)"
)
_HEARTBEAT: LiteralString = (
    "SELECT message_id, locked_until FROM {schema}.message_heartbeat_v1("
    "%s::bigint[], %s::uuid[], %s::bigint)"
)
_REJECT: LiteralString = "SELECT {schema}.message_reject_v1(%s::bigint, %s::uuid, %s::text)"

#: Marker for "keep the message's state as it is" in defer.
KEEP = object()


def _outcome(rows: Rows) -> Outcome:
    return Outcome(rows[0][0])


def delete_op(schema: str, message_id: int, lock_token: uuid.UUID) -> Op[Outcome]:
    pair = _checks.held_pair(message_id, lock_token)
    return Op(schema, render(_DELETE, schema), pair, _outcome)


def delete_many_op(schema: str, held: Iterable[_checks.Held]) -> Op[dict[int, Outcome]]:
    pairs = _checks.held(held)
    ids = [h[0] for h in pairs]
    tokens = [h[1] for h in pairs]

    def parse(rows: Rows) -> dict[int, Outcome]:
        return {r[0]: Outcome(r[1]) for r in rows}

    return Op(schema, render(_DELETE_MANY, schema), (ids, tokens), parse)


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
    pair = _checks.held_pair(message_id, lock_token)
    return Op(schema, render(_DEFER, schema), (*pair, delay, set_state, data), _outcome)


def heartbeat_op(schema: str, held: Iterable[_checks.Held], *, lock_ms: float) -> Op[set[int]]:
    lock = _checks.milliseconds(lock_ms, "lock_ms", low=1, high=_checks.MAX_LOCK_MS)
    pairs = _checks.held(held)
    ids = [p[0] for p in pairs]
    tokens = [p[1] for p in pairs]

    def parse(rows: Rows) -> set[int]:
        return {row[0] for row in rows}

    return Op(schema, render(_HEARTBEAT, schema), (ids, tokens, lock), parse)


def reject_op(
    schema: str, message_id: int, lock_token: uuid.UUID, *, reason: str = "rejected"
) -> Op[Outcome]:
    """Reject a held message without requeue: to the dead letters (or deleted where the
    queue keeps none)."""
    why = _checks.optional_key(reason, "reason")  # ("reason is N characters long...")
    if not why:
        raise InvalidName("reason must not be empty")
    pair = _checks.held_pair(message_id, lock_token)
    return Op(schema, render(_REJECT, schema), (*pair, why), _outcome)
