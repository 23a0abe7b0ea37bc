"""The invariants of the schema (docs/design.md, "The hot path"), checked in one statement (one
snapshot) so that they can be asserted while work goes on, not only at rest:

* a message is locked when it has both a lock expiry and a lock token, its priority is from 0
  to 255 and its name 1 to 255 characters long (what CHECK constraints held until schema
  version 27: the functions keep it now);
* a channel row counts exactly its messages marked ``sized`` (current_size) and ``slotted``
  (current_concurrency), a slotted message is locked, and a sized message has a channel row;
* the gauges derived from the counts (size, in flight) are the channel's messages and its
  locked ones;
* a channel has at most one live lane version;
* no position skips a message: every ingested message that is not locked lies at or after its
  lane's position for its priority (the property that lets no dequeue walk what was consumed);
* a lane with an ingested message ready or delayed has a turn, unless its channel is at its
  max_concurrency (lanes the last ingest left for the next one, because their owner was
  serving them, are left out of the last two).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

Conn = psycopg.Connection[Any]

_QUERY = """
WITH d AS (SELECT * FROM {s}.discovery ORDER BY id DESC LIMIT 1),
pending AS (
    SELECT p.q, p.c FROM d, unnest(d.pend_queue, d.pend_channel) AS p(q, c)
),
live AS (
    SELECT DISTINCT ON (l.queue, l.channel) l.* FROM {s}.lane l
    WHERE NOT EXISTS (SELECT 1 FROM pending p WHERE p.q = l.queue AND p.c = l.channel)
    ORDER BY l.queue, l.channel, l.id DESC
)
SELECT 'channel row', c.queue || '/' || c.name,
       format('size %s of %s sized, in flight %s of %s slotted', c.current_size, s.sized,
              c.current_concurrency, s.slotted)
FROM {s}.channel c
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE m.sized) AS sized, count(*) FILTER (WHERE m.slotted) AS slotted
    FROM {s}.message m WHERE m.queue = c.queue AND m.channel = c.name
) AS s
WHERE c.current_size <> s.sized OR c.current_concurrency <> s.slotted
UNION ALL
SELECT 'message fields', m.queue || '/' || m.channel, m.id::text
FROM {s}.message m WHERE {fields}
UNION ALL
SELECT 'slotted and not locked', m.queue || '/' || m.channel, m.id::text
FROM {s}.message m WHERE m.slotted AND m.locked_until IS NULL
UNION ALL
SELECT 'sized without a channel row', m.queue || '/' || m.channel, m.id::text
FROM {s}.message m
WHERE m.sized AND NOT EXISTS (
    SELECT 1 FROM {s}.channel c WHERE c.queue = m.queue AND c.name = m.channel)
UNION ALL
SELECT 'gauges', coalesce(t.queue, a.queue) || '/' || coalesce(t.channel, a.channel),
       format('size %s held %s, in flight %s locked %s', coalesce(t.size, 0),
              coalesce(a.n, 0), coalesce(t.in_flight, 0), coalesce(a.locked, 0))
FROM (
    SELECT x.queue, x.channel,
           x.enqueued - x.acked - x.dead - x.expired - x.removed - x.purged AS size,
           x.delivered - x.redelivered - x.acked - x.deferred - x.dead_held - x.removed_held
               AS in_flight
    FROM {s}.channel_totals_v1(NULL) AS x
) AS t
FULL JOIN (
    SELECT m.queue, m.channel, count(*) AS n,
           count(*) FILTER (WHERE m.locked_until IS NOT NULL) AS locked
    FROM {s}.message m GROUP BY m.queue, m.channel
) AS a ON a.queue = t.queue AND a.channel = t.channel
WHERE coalesce(t.size, 0) <> coalesce(a.n, 0) OR coalesce(t.in_flight, 0) <> coalesce(a.locked, 0)
UNION ALL
SELECT 'lane versions', l.queue || '/' || l.channel, count(*)::text
FROM {s}.lane l GROUP BY l.queue, l.channel HAVING count(*) > 1
UNION ALL
SELECT 'skipped by a position', m.queue || '/' || m.channel,
       format('message %s (priority %s, due %s)', m.id, m.priority, m.dequeue_at)
FROM d, {s}.message m
WHERE m.locked_until IS NULL AND pg_visible_in_snapshot(m.txid, d.snap)
  AND NOT EXISTS (SELECT 1 FROM pending p WHERE p.q = m.queue AND p.c = m.channel)
  AND NOT EXISTS (
      SELECT 1 FROM live l
      CROSS JOIN LATERAL unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
      WHERE l.queue = m.queue AND l.channel = m.channel AND p.prio = m.priority
        AND (m.dequeue_at, m.id) >= (p.at, p.pid))
UNION ALL
SELECT 'no turn', l.queue || '/' || l.channel, n.next_at::text
FROM d, live l
CROSS JOIN LATERAL {s}.lane_next_v1(l, d.snap) AS n
LEFT JOIN LATERAL {s}.channel_limits_v1(l.queue, l.channel) AS lim ON true
LEFT JOIN {s}.channel c ON c.queue = l.queue AND c.name = l.channel
WHERE l.turn_at IS NULL AND n.next_at IS NOT NULL
  AND NOT (lim.max_concurrency IS NOT NULL
           AND coalesce(c.current_concurrency, 0) >= lim.max_concurrency)
  AND NOT coalesce(c.freed, false)
"""


#: A message's own fields: what the table's CHECK constraints held until schema version 27.
FIELDS = """(m.locked_until IS NULL) <> (m.lock_token IS NULL)
    OR m.priority NOT BETWEEN 0 AND 255 OR length(m.name) NOT BETWEEN 1 AND 255"""


def mismatches(conn: Conn, schema: str) -> list[tuple[Any, ...]]:
    """Every violation of the invariants, as (what, queue/channel, detail)."""
    query = sql.SQL(_QUERY.replace("{fields}", FIELDS)).format(s=sql.Identifier(schema))
    return conn.execute(query).fetchall()


def bad_messages(conn: Conn, schema: str) -> list[tuple[Any, ...]]:
    """Messages whose own fields break the invariants (the first violation above), if the
    schema has a message table: checked at the end of every test (tests/conftest.py)."""
    exists = "SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = %s AND tablename = 'message'"
    if conn.execute(exists, (schema,)).fetchone() is None:
        return []
    query = sql.SQL(
        "SELECT m.id, m.locked_until, m.lock_token, m.priority, m.name "
        "FROM {s}.message m WHERE " + FIELDS
    ).format(s=sql.Identifier(schema))
    return conn.execute(query).fetchall()


def assert_consistent(conn: Conn, schema: str) -> None:
    found = mismatches(conn, schema)
    assert found == [], found
