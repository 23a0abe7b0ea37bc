-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 5. Counts
-- What is folded plus what is not yet: the gauges and counters. LANGUAGE sql, read by the
-- sql bodies of groups 9 and 12, so before them; queue_totals_v1 (a declare's answer) is
-- plpgsql, for its plan (see there), and reads the same sources as channel_totals_v1.
-- ---------------------------------------------------------------------------------------------

-- The counts of every channel of p_queue (NULL: of every queue), exact as of this statement:
-- what is folded, plus the tallies not folded yet, plus the messages created and not ingested
-- yet. Gauges derive from them (see channel_count).
CREATE FUNCTION {schema}.channel_totals_v1(p_queue text)
RETURNS TABLE (
    queue text, channel text, enqueued bigint, delivered bigint, redelivered bigint,
    acked bigint, deferred bigint, dead bigint, dead_held bigint, expired bigint,
    dropped bigint, removed bigint, removed_held bigint, purged bigint
)
LANGUAGE sql STABLE AS $$
    WITH d AS (SELECT * FROM {schema}.discovery ORDER BY id DESC LIMIT 1)
    SELECT p.queue, p.channel, sum(p.enqueued)::bigint, sum(p.delivered)::bigint,
           sum(p.redelivered)::bigint, sum(p.acked)::bigint, sum(p.deferred)::bigint,
           sum(p.dead)::bigint, sum(p.dead_held)::bigint, sum(p.expired)::bigint,
           sum(p.dropped)::bigint, sum(p.removed)::bigint, sum(p.removed_held)::bigint,
           sum(p.purged)::bigint
    FROM (
        SELECT cc.queue, cc.channel, cc.enqueued, cc.delivered, cc.redelivered, cc.acked,
               cc.deferred, cc.dead, cc.dead_held, cc.expired, cc.dropped, cc.removed,
               cc.removed_held, cc.purged
        FROM {schema}.channel_count cc WHERE p_queue IS NULL OR cc.queue = p_queue
        UNION ALL
        SELECT t.queue, t.channel, t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred,
               t.dead, t.dead_held, t.expired, t.dropped, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid >= pg_snapshot_xmax(d.folded) AND (p_queue IS NULL OR t.queue = p_queue)
        UNION ALL
        SELECT t.queue, t.channel, t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred,
               t.dead, t.dead_held, t.expired, t.dropped, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.folded)))
          AND (p_queue IS NULL OR t.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.channel, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL AND m.arrival = 0
          AND (p_queue IS NULL OR m.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.channel, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snap))) AND m.lock_token IS NULL
          AND m.arrival = 0 AND (p_queue IS NULL OR m.queue = p_queue)
    ) AS p
    GROUP BY p.queue, p.channel
$$;

-- The messages waiting (ready and delayed) and in flight of one queue, as the sums of
-- channel_totals_v1(p_queue) (the same sources and arithmetic), for a declare's answer.
-- plpgsql with a generic plan kept for the session: the same read inlined from the SQL
-- function was planned afresh at every call (its `p_queue IS NULL OR` rules out a generic
-- plan), 0.6 ms of a declare's 0.75 ms after a pause; Celery's rpc:// client declares its
-- reply queue before every task it sends.
CREATE FUNCTION {schema}.queue_totals_v1(p_queue text, OUT waiting bigint, OUT in_flight bigint)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
BEGIN
    WITH d AS MATERIALIZED (
        SELECT * FROM {schema}.discovery ORDER BY id DESC LIMIT 1
    ), p AS (
        SELECT cc.enqueued, cc.delivered, cc.redelivered, cc.acked, cc.deferred, cc.dead,
               cc.dead_held, cc.expired, cc.removed, cc.removed_held, cc.purged
        FROM {schema}.channel_count cc WHERE cc.queue = p_queue
        UNION ALL
        SELECT t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred, t.dead, t.dead_held,
               t.expired, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid >= pg_snapshot_xmax(d.folded) AND t.queue = p_queue
        UNION ALL
        SELECT t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred, t.dead, t.dead_held,
               t.expired, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.folded))) AND t.queue = p_queue
        UNION ALL
        SELECT 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL AND m.arrival = 0
          AND m.queue = p_queue
        UNION ALL
        SELECT 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snap))) AND m.lock_token IS NULL
          AND m.arrival = 0 AND m.queue = p_queue
    )
    SELECT coalesce(sum(p.enqueued - p.acked - p.dead - p.expired - p.removed - p.purged
                        - (p.delivered - p.redelivered - p.acked - p.deferred - p.dead_held
                           - p.removed_held)), 0),
           coalesce(sum(p.delivered - p.redelivered - p.acked - p.deferred - p.dead_held
                        - p.removed_held), 0)
    INTO waiting, in_flight
    FROM p;
END;
$$;

-- Ready and delayed messages of p_queue (NULL: every queue) and the oldest ready one, read
-- from the lanes' positions (never from the start of an index) and from what is not ingested
-- yet. O(messages waiting).
CREATE FUNCTION {schema}.queue_waiting_v1(p_queue text)
RETURNS TABLE (queue text, ready bigint, delayed bigint, oldest_ready_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH d AS (SELECT * FROM {schema}.discovery ORDER BY id DESC LIMIT 1),
    w AS (
        SELECT m.queue, m.dequeue_at
        FROM d, {schema}.lane l
        CROSS JOIN LATERAL unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
        JOIN {schema}.message m ON m.queue = l.queue AND m.channel = l.channel
             AND m.locked_until IS NULL AND m.priority = p.prio
             AND (m.dequeue_at, m.id) >= (p.at, p.pid)
        WHERE (p_queue IS NULL OR l.queue = p_queue) AND pg_visible_in_snapshot(m.txid, d.snap)
          AND l.id = (SELECT max(l2.id) FROM {schema}.lane l2
                      WHERE l2.queue = l.queue AND l2.channel = l.channel)
        UNION ALL
        SELECT m.queue, m.dequeue_at FROM d, {schema}.message m
        WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
          AND (p_queue IS NULL OR m.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.dequeue_at FROM d, {schema}.message m
        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snap))) AND m.lock_token IS NULL
          AND (p_queue IS NULL OR m.queue = p_queue)
    )
    SELECT w.queue, count(*) FILTER (WHERE w.dequeue_at <= clock_timestamp()),
           count(*) FILTER (WHERE w.dequeue_at > clock_timestamp()),
           min(w.dequeue_at) FILTER (WHERE w.dequeue_at <= clock_timestamp())
    FROM w GROUP BY w.queue
$$;

