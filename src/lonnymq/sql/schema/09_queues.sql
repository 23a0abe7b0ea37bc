-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 9. Queues: declare, purge, delete, stats
-- ---------------------------------------------------------------------------------------------

-- Declare a queue with its arguments; returns (messages waiting, messages in flight).
CREATE FUNCTION {schema}.queue_declare_v1(
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
           OR (p_expires_ms IS NOT NULL
               AND q.used_at < clock_timestamp() - {schema}.queue_use_lag_v1(p_expires_ms)));
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- Declare a queue with kombu's arguments: as queue_declare_v1, and auto_delete (the queue
-- goes when its last consumer does) and max_priority (a message's priority above it is
-- stored as it). A declare brings back a queue that went (queue_gone). A declare with
-- arguments sets them all (the last such declare wins); one without any (kombu's plain
-- Queue(name), a SimpleQueue: no x-expires, x-message-ttl, x-max-priority) leaves an
-- existing queue's as they are (schema version 27: until then it cleared them, so that
-- another process's plain declare turned off the expiry, the time to live and the priority
-- cap for everyone). auto_delete is what the declare says, always (kombu always says it; a
-- plain declare never leaves a queue that goes with its last consumer, and its messages). (One statement writes the queue's row,
-- and only when something changed or the recorded use of a queue with an expiry is further
-- behind than queue_use_lag_v1 allows: Celery's rpc:// client declares its reply queue before
-- every task it sends.)
CREATE FUNCTION {schema}.queue_declare_v2(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint, p_auto_delete boolean,
    p_max_priority integer, OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_plain boolean := p_expires_ms IS NULL AND p_message_ttl_ms IS NULL
                       AND p_max_priority IS NULL;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END,
        message_ttl_ms = CASE WHEN v_plain THEN q.message_ttl_ms ELSE p_message_ttl_ms END,
        auto_delete = p_auto_delete,
        max_priority = CASE WHEN v_plain THEN q.max_priority ELSE p_max_priority END,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.auto_delete IS DISTINCT FROM p_auto_delete
           OR NOT v_plain AND (q.expires_ms IS DISTINCT FROM p_expires_ms
                               OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
                               OR q.max_priority IS DISTINCT FROM p_max_priority)
           OR (CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END IS NOT NULL
               AND q.used_at < clock_timestamp() - {schema}.queue_use_lag_v1(
                   CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END)));
    DELETE FROM {schema}.queue_gone g WHERE g.name = p_queue;
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- Delete every message of a queue that is not held by a consumer (ready and delayed ones).
-- Returns how many were deleted. Held messages stay until acked or their lock expires. A
-- few statements whatever the number of channels (row locks only: no advisory key per
-- channel, which the server's lock table limits).
CREATE FUNCTION {schema}.queue_purge_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_d {schema}.discovery;
    v_total bigint;
    v_sized text[];
    v_sizes integer[];
    v_lanes {schema}.lane[];
BEGIN
    -- with the ingest held, a message not ingested yet is counted as enqueued here
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    WITH gone AS (
        DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NULL
        RETURNING m.channel, m.sized,
                  m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap) AS fresh
    ), per AS (
        SELECT g.channel, count(*)::integer AS n, count(*) FILTER (WHERE g.sized)::integer AS s,
               count(*) FILTER (WHERE g.fresh)::integer AS f
        FROM gone g GROUP BY g.channel
    ), counted AS (
        INSERT INTO {schema}.tally (queue, channel, enqueued, purged)
        SELECT p_queue, p.channel, p.f, p.n FROM per p
    )
    SELECT coalesce(sum(p.n), 0),
           coalesce(array_agg(p.channel ORDER BY p.channel) FILTER (WHERE p.s > 0), '{{}}'),
           coalesce(array_agg(p.s ORDER BY p.channel) FILTER (WHERE p.s > 0), '{{}}')
    INTO v_total, v_sized, v_sizes
    FROM per p;
    -- what the sized ones held on their channel rows, given back (channel_give_back_v1),
    -- the rows locked in name order first, as every writer of channel rows locks them
    PERFORM 1 FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = ANY (v_sized) ORDER BY c.name FOR UPDATE;
    UPDATE {schema}.channel c SET current_size = GREATEST(0, c.current_size - u.s)
    FROM unnest(v_sized, v_sizes) AS u(name, s)
    WHERE c.queue = p_queue AND c.name = u.name;
    -- a row left with nothing to count goes
    PERFORM {schema}.channel_prune_v1(p_queue, v_sized);
    -- the lanes have nothing left to give
    v_lanes := {schema}.queue_lanes_lock_v1(p_queue, false);
    SELECT coalesce(array_agg(
               ROW(o.id, o.queue, o.channel, NULL, o.served_at, o.written_at, o.limited,
                   '{{}}', '{{}}', '{{}}', o.not_before)::{schema}.lane ORDER BY o.channel), '{{}}')
    INTO v_lanes
    FROM unnest(v_lanes) AS o
    WHERE o.turn_at IS NOT NULL OR cardinality(o.prios) > 0;
    PERFORM {schema}.lanes_put_v1(v_lanes);
    RETURN v_total;
END;
$$;

-- Delete a queue: all its messages (held ones too), lanes, policies and counts. Its dead
-- letters stay until their retention ends. Returns how many messages were deleted.
CREATE FUNCTION {schema}.queue_delete_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    DELETE FROM {schema}.binding WHERE queue = p_queue;
    PERFORM 1 FROM {schema}.queue q WHERE q.name = p_queue FOR UPDATE;
    IF NOT FOUND AND NOT EXISTS (SELECT 1 FROM {schema}.message m WHERE m.queue = p_queue
                                 AND m.locked_until IS NULL) THEN
        RETURN 0;
    END IF;
    PERFORM {schema}.queue_lanes_lock_v1(p_queue, false);
    WITH gone AS (
        DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NULL
        RETURNING 1
    ), gone_held AS (
        DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NOT NULL
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM gone_held) INTO v_n;
    DELETE FROM {schema}.lane l WHERE l.queue = p_queue;
    DELETE FROM {schema}.channel c WHERE c.queue = p_queue;
    DELETE FROM {schema}.channel_count cc WHERE cc.queue = p_queue;
    DELETE FROM {schema}.queue_count qc WHERE qc.queue = p_queue;
    DELETE FROM {schema}.tally t WHERE t.queue = p_queue;
    DELETE FROM {schema}.queue q WHERE q.name = p_queue;
    RETURN v_n;
END;
$$;

-- Remember a queue as gone (see queue_gone): its x-expires, and why.
CREATE FUNCTION {schema}.queue_forget_v1(p_queue text, p_expires_ms bigint, p_reason text)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {schema}.queue_gone (name, expires_ms, reason) VALUES (p_queue, p_expires_ms, p_reason)
    ON CONFLICT (name) DO UPDATE
        SET expires_ms = EXCLUDED.expires_ms, reason = EXCLUDED.reason, gone_at = EXCLUDED.gone_at;
$$;

-- Delete the auto_delete queues among p_queues that no consumer consumes any more (with
-- their messages and bindings, as queue_delete_v1 does), and remember them as gone. The
-- caller holds the ingest key and has locked these queue rows (FOR UPDATE, in name order)
-- before removing their consumers, so that a last consumer going and a new one coming are
-- never both unseen. Returns the queues deleted.
CREATE FUNCTION {schema}.queue_auto_delete_v1(p_queues text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_gone text[] := ARRAY[]::text[];
    r record;
BEGIN
    FOR r IN
        SELECT q.name, q.expires_ms FROM {schema}.queue q
        WHERE q.name = ANY (p_queues) AND q.auto_delete
          AND NOT EXISTS (SELECT 1 FROM {schema}.consumer c WHERE c.queue = q.name)
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(r.name);
        PERFORM {schema}.queue_forget_v1(r.name, r.expires_ms, 'auto_delete');
        v_gone := v_gone || r.name::text;
    END LOOP;
    RETURN v_gone;
END;
$$;

-- Counters of a queue, exact (ready and delayed are counted from the messages: O(messages
-- not held)).
CREATE FUNCTION {schema}.queue_stats_v1(p_queue text, p_count_ready boolean)
RETURNS TABLE (
    total bigint, in_flight bigint, ready bigint, delayed bigint, channels bigint,
    max_concurrency integer, max_size integer
)
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged), 0)::bigint,
           coalesce(sum(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held), 0)::bigint,
           CASE WHEN p_count_ready THEN coalesce((SELECT w.ready FROM {schema}.queue_waiting_v1(p_queue) w), 0) END,
           CASE WHEN p_count_ready THEN coalesce((SELECT w.delayed FROM {schema}.queue_waiting_v1(p_queue) w), 0) END,
           count(*) FILTER (WHERE t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged > 0),
           (SELECT q.max_concurrency FROM {schema}.queue q WHERE q.name = p_queue),
           (SELECT q.max_size FROM {schema}.queue q WHERE q.name = p_queue)
    FROM {schema}.channel_totals_v1(p_queue) AS t
$$;

