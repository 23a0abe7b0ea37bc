-- lonnymq migration 15.

-- =============================================================================================
-- A declare without planning (issue "A real Celery worker wakes within milliseconds")
-- =============================================================================================
--
-- queue_declare_v1 and queue_declare_v2 (same signatures and results) count the queue's
-- messages with queue_totals_v1, a plpgsql function whose plan is kept for the session,
-- instead of the sums over channel_totals_v1 (a LANGUAGE sql function inlined into a
-- statement that was planned afresh at every call); queue_declare_v2 writes the queue's row
-- in one statement, itself, instead of through queue_declare_v1 and a second UPDATE. Celery's
-- rpc:// client declares its reply queue before every task it sends. No table changes.

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

-- Declare a queue with its arguments; returns (messages waiting, messages in flight).
CREATE OR REPLACE FUNCTION {schema}.queue_declare_v1(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint,
    OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = p_expires_ms,
        message_ttl_ms = p_message_ttl_ms,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.expires_ms IS DISTINCT FROM p_expires_ms
           OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
           OR (p_expires_ms IS NOT NULL AND q.used_at < clock_timestamp() - interval '1 second'));
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- Declare a queue with kombu's arguments: as queue_declare_v1, and auto_delete (the queue
-- goes when its last consumer does) and max_priority (a message's priority above it is
-- stored as it). A declare brings back a queue that went (queue_gone). (One statement writes
-- the queue's row, and only when something changed or a queue with an expiry was last used
-- more than a second ago: Celery's rpc:// client declares its reply queue before every task
-- it sends.)
CREATE OR REPLACE FUNCTION {schema}.queue_declare_v2(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint, p_auto_delete boolean,
    p_max_priority integer, OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = p_expires_ms,
        message_ttl_ms = p_message_ttl_ms,
        auto_delete = p_auto_delete,
        max_priority = p_max_priority,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.expires_ms IS DISTINCT FROM p_expires_ms
           OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
           OR q.auto_delete IS DISTINCT FROM p_auto_delete
           OR q.max_priority IS DISTINCT FROM p_max_priority
           OR (p_expires_ms IS NOT NULL AND q.used_at < clock_timestamp() - interval '1 second'));
    DELETE FROM {schema}.queue_gone g WHERE g.name = p_queue;
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- (CREATE OR REPLACE keeps the owner and the grants; the attributes are the statement's)
REVOKE ALL ON FUNCTION {schema}.queue_totals_v1(text) FROM PUBLIC;
ALTER FUNCTION {schema}.queue_declare_v1(text, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
