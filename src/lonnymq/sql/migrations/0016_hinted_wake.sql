-- lonnymq migration 16.

-- =============================================================================================
-- A woken consumer takes what woke it by its id (issue "A real Celery worker wakes within
-- milliseconds")
-- =============================================================================================
--
-- A create of a message due now that wakes sleeping consumers (wake_v2) also sends them the
-- message's id, on a second NOTIFY channel ("<schema>_hint", payload '<id> <queue>'; the
-- first such create of a transaction only); the plain notification goes too, for clients of
-- the previous version. A consumer woken by it dequeues with message_dequeue_hinted_v1,
-- which takes the hinted messages by their ids when nothing else of its queues waits (the
-- take's rules), in one statement, and otherwise hands the call to message_dequeue_v3.
-- The take itself and the leftovers of a pass read by the primary key (a held snapshot made
-- the take walk the dead entries of every consumed message). No table changes.

-- Wake consumers of a queue that sleep (they hold its 'sleep' key): NOTIFY only then, so a
-- busy queue's producers pay no NOTIFY (each costs a database-wide lock at commit). p_id
-- (schema version 16): the message a create made, due now (NULL: no hint). When it notifies,
-- the first such create of the transaction also sends the message's id (NOTIFY {{hint}},
-- '<id> <queue>'), so that a sleeper can take it by its id (message_dequeue_hinted_v1)
-- instead of looking for it; once per transaction, so that a transaction creating thousands
-- does not send as many (their dequeue finds the others as it always did). The plain
-- notification goes too: clients of the previous version listen for it only.
CREATE FUNCTION {schema}.wake_v2(p_queue text, p_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('sleep', p_queue);
BEGIN
    -- (this session's next dequeue ingests first, waiting for a running ingest: so that a
    -- session that requeues or creates and then dequeues sees what it did, in its place)
    PERFORM set_config('lonnymq.fresh', 'on', false);
    -- (a session's own sleep lock does not stop its own try: that session is told by the
    -- setting it keeps of its sleep keys)
    IF pg_try_advisory_lock(v_key) THEN
        PERFORM pg_advisory_unlock(v_key);
        IF v_key <> ALL (string_to_array(coalesce(current_setting('lonnymq.sleeping', true), ''),
                                         ',')::bigint[]) THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_notify({wake}, p_queue);
    IF p_id IS NOT NULL AND coalesce(current_setting('lonnymq.hinted', true), '') = '' THEN
        PERFORM set_config('lonnymq.hinted', 'on', true);
        PERFORM pg_notify({hint}, p_id || ' ' || p_queue);
    END IF;
END;
$$;

-- wake_v1 is wake_v2 without a hint.
CREATE OR REPLACE FUNCTION {schema}.wake_v1(p_queue text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {schema}.wake_v2(p_queue, NULL);
END;
$$;

-- message_create_v1 hints a message due now (the rest as in version 15).
CREATE OR REPLACE FUNCTION {schema}.message_create_v1(
    p_queue text,
    p_channel text,
    p_name text,
    p_content bytea,
    p_priority integer,
    p_delay_ms bigint,
    p_ttl_ms bigint,
    OUT result_code text,
    OUT message_id bigint
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_max_size integer;
    v_max_priority integer;
    v_at timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared({schema}.queue_key_v1('produce', p_queue));
    SELECT CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END, q.max_priority
    INTO v_max_size, v_max_priority
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
    -- a queue declared with a max_priority (x-max-priority) takes higher ones as it, as
    -- RabbitMQ does
    IF p_priority > v_max_priority THEN
        p_priority := v_max_priority;
    END IF;
    IF v_max_size IS NOT NULL THEN
        SELECT s.result_code, s.message_id INTO result_code, message_id
        FROM {schema}.message_create_sized_v1(p_queue, p_channel, p_name, p_content,
            p_priority, p_delay_ms, p_ttl_ms) AS s;
        IF result_code = 'created' THEN
            PERFORM {schema}.wake_v1(p_queue);
        END IF;
        RETURN;
    END IF;
    LOOP
        v_at := clock_timestamp() + p_delay_ms * interval '1 millisecond';
        INSERT INTO {schema}.message (queue, channel, priority, txid, dequeue_at, expires_at, name, content)
        VALUES (p_queue, p_channel, p_priority, pg_current_xact_id(), v_at,
                v_at + p_ttl_ms * interval '1 millisecond', p_name, p_content)
        ON CONFLICT (queue, channel, name) WHERE name IS NOT NULL AND attempts = 0 DO NOTHING
        RETURNING id INTO message_id;
        EXIT WHEN message_id IS NOT NULL;
        SELECT m.id INTO message_id FROM {schema}.message m
        WHERE m.queue = p_queue AND m.channel = p_channel AND m.name = p_name AND m.attempts = 0;
        IF message_id IS NOT NULL THEN
            result_code := 'deduplicated';
            RETURN;
        END IF;
        -- the other one was dequeued meanwhile: create after all
    END LOOP;
    result_code := 'created';
    -- (a message due now is hinted to a sleeper by its id, see wake_v2)
    PERFORM {schema}.wake_v2(p_queue, CASE WHEN coalesce(p_delay_ms, 0) <= 0 THEN message_id END);
END;
$$;
-- The wake-up take (dequeue_take_v1, as in version 15) reads the messages it takes by the
-- primary key: its test of "not locked" was `lock_token IS NULL`, the predicate of
-- message_txid_idx, and its generic plan read that index whole for the ids, every dead entry
-- that a snapshot held elsewhere keeps (a wake-up's dequeue: 76-80 buffers after 3,000
-- consumed under a held snapshot, against 22-26 by the primary key).
CREATE OR REPLACE FUNCTION {schema}.dequeue_take_v1(
    p_queue text, p_limit integer, p_lock interval, p_now timestamptz
)
RETURNS TABLE (
    message_id bigint,
    queue_name text,
    channel_name text,
    message_name text,
    message_priority smallint,
    message_attempts integer,
    message_lock_token uuid,
    message_created_at timestamptz,
    message_content bytea,
    message_state bytea,
    retry_ms bigint,
    event text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_seen integer;
    v_channels text[];
    v_ids bigint[];
    v_lock_from timestamptz;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        RETURN;
    END IF;
    -- what no ingest has seen yet (of every queue: is it little?), this queue's part of it,
    -- and the queue's lock position (none: its positions unknown, or heads of its lanes
    -- pending)
    WITH d AS MATERIALIZED (
        SELECT * FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1
    ), unseen AS (
        SELECT m.id, m.queue, m.channel
        FROM d CROSS JOIN LATERAL (
            SELECT m.* FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
            ORDER BY m.txid LIMIT 64) AS m
        UNION ALL
        SELECT m.id, m.queue, m.channel
        FROM d CROSS JOIN LATERAL pg_snapshot_xip(d.snap) AS x(txid)
        CROSS JOIN LATERAL (
            SELECT m.* FROM {schema}.message m
            WHERE m.txid = x.txid AND m.lock_token IS NULL
            LIMIT 64) AS m
    )
    SELECT count(*)::integer,
           array_agg(DISTINCT u.channel::text) FILTER (WHERE u.queue = p_queue),
           array_agg(u.id) FILTER (WHERE u.queue = p_queue),
           (SELECT d.lock_from[array_position(d.queues, p_queue)] FROM d
            WHERE p_queue <> ALL (d.pend_queue))
    INTO v_seen, v_channels, v_ids, v_lock_from
    FROM unseen u;
    IF v_seen >= 64 OR cardinality(v_channels) IS DISTINCT FROM 1 OR v_lock_from IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH picked AS MATERIALIZED (
            SELECT m.id, m.arrival
            FROM {schema}.queue q
            LEFT JOIN {schema}.channel c ON c.queue = q.name AND c.name = v_channels[1]
            JOIN {schema}.message m ON m.id = ANY (v_ids)
            WHERE q.name = p_queue
              AND CASE WHEN c.has_policy
                       THEN c.own_max_concurrency IS NULL AND c.own_rate_count IS NULL
                       ELSE q.max_concurrency IS NULL AND q.rate_count IS NULL END
              AND (SELECT e.locked_until FROM {schema}.message e
                   WHERE e.queue = p_queue AND e.locked_until >= v_lock_from
                     AND e.locked_until <= p_now
                   ORDER BY e.queue, e.locked_until LIMIT 1) IS NULL
              -- (not locked, written so that it proves no partial index's predicate: with
              -- `lock_token IS NULL` the generic plan read message_txid_idx whole for these ids,
              -- every dead entry a held snapshot keeps, instead of the primary key)
              AND coalesce(m.lock_token, '00000000-0000-0000-0000-000000000000')
                  = '00000000-0000-0000-0000-000000000000'
              AND m.dequeue_at <= p_now
              AND (m.expires_at IS NULL OR m.expires_at > p_now)
              AND m.attempts < coalesce(q.max_attempts, 2147483647)
            ORDER BY m.priority DESC, m.dequeue_at, m.id
            LIMIT p_limit
            FOR UPDATE OF m SKIP LOCKED
        ), locked AS (
            UPDATE {schema}.message m SET
                locked_until = p_now + p_lock,
                lock_token = gen_random_uuid(),
                attempts = m.attempts + 1,
                slotted = false,
                arrival = 1
            FROM picked p
            WHERE m.id = p.id
            RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts, m.lock_token,
                      m.created_at, m.content, m.state, m.dequeue_at, p.arrival AS was
        ), tallied AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, lock_until, lock_id)
            SELECT p_queue, v_channels[1], count(*) FILTER (WHERE k.was = 0), count(*),
                   p_now + p_lock, min(k.id)
            FROM locked k HAVING count(*) > 0
        )
        SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
               k.lock_token, k.created_at, k.content, k.state, NULL::bigint, 'delivered'::text
        FROM locked k ORDER BY k.priority DESC, k.dequeue_at, k.id;
    IF FOUND THEN
        PERFORM set_config('lonnymq.fresh', 'on', false);
    END IF;
END;
$$;

-- The same trap in the reads of the messages a pass could not lock (dequeue_leftovers_v1):
-- with the queue's messages all locked when the statistics were taken, its read of those not
-- locked was planned as a whole read of message_ready_idx; its delete of those past their
-- time to live could be a range of message_expires_idx.
CREATE OR REPLACE FUNCTION {schema}.dequeue_leftovers_v1(
    p_take bigint[], p_locked bigint[], p_now timestamptz
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    message_attempts integer, message_created_at timestamptz
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    r record;
    v_poison bigint[];
BEGIN
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.message m
            -- (by the primary key: `expires_at <= p_now` alone let message_expires_idx serve
            -- it as a range of every expired message, dead entries included)
            WHERE m.id = ANY (p_take) AND m.id <> ALL (p_locked)
              AND coalesce(m.expires_at, 'infinity') <= p_now
            RETURNING m.queue, m.channel, m.sized
        )
        SELECT g.queue, g.channel, count(*)::integer AS n,
               count(*) FILTER (WHERE g.sized)::integer AS sized
        FROM gone g GROUP BY g.queue, g.channel
    LOOP
        INSERT INTO {schema}.tally (queue, channel, expired) VALUES (r.queue, r.channel, r.n);
        IF r.sized > 0 THEN
            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, r.sized, 0);
        END IF;
    END LOOP;
    -- (not locked, written so that it proves no partial index's predicate: see
    -- dequeue_take_v1)
    v_poison := ARRAY(
        SELECT m.id FROM {schema}.message m
        WHERE m.id = ANY (p_take) AND m.id <> ALL (p_locked)
          AND coalesce(m.lock_token, '00000000-0000-0000-0000-000000000000')
              = '00000000-0000-0000-0000-000000000000'
        ORDER BY m.id);
    IF cardinality(v_poison) > 0 THEN
        RETURN QUERY
            WITH b AS MATERIALIZED (
                SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts')
            ), tallied AS (
                INSERT INTO {schema}.tally (queue, channel, dead)
                SELECT b.queue_name, b.channel_name, count(*)
                FROM b GROUP BY b.queue_name, b.channel_name
            )
            SELECT b.message_id, b.queue_name, b.channel_name, b.message_name,
                   b.message_attempts, b.message_created_at
            FROM b;
    END IF;
END;
$$;
-- A dequeue that knows what woke it (schema version 16): p_hints, ids of messages that
-- creates of the call's queues hinted (wake_v2) to this sleeping consumer. When they are all
-- that no ingest has seen yet of these queues, and all of one channel, the call takes them by
-- their ids, as the take (dequeue_take_v1) would have taken them, in one statement instead of
-- message_dequeue_v3's usual read and the take's two (what a woken consumer paid: measured
-- 1.0 ms against 0.6 on this project's machine). The same rules as the take: under the ingest
-- key, tried; what no ingest has seen yet is little (fewer than 64 rows, of every queue); the
-- channel has no limit (no max_concurrency, no rate, its own or the queue's); the queues are
-- in the ingest's state and none has heads pending; no lane of the call's queues is due and
-- no lock of theirs is past its expiry, so that nothing waits that the round robin would
-- serve first; the messages are due, live and under max_attempts. Their creation is counted
-- in the call's tally (`arrival` 1), the lane is not written, and the session's next call
-- ingests first. The acks, if any, are deleted first (message_delete_many_v1). Otherwise,
-- or when another consumer took them first, message_dequeue_v3 does the call.
CREATE FUNCTION {schema}.message_dequeue_hinted_v1(
    p_queues text[], p_hints bigint[], p_limit integer, p_lock_ms bigint, p_ack_ids bigint[],
    p_ack_tokens uuid[], p_listen boolean
)
RETURNS TABLE (
    message_id bigint,
    queue_name text,
    channel_name text,
    message_name text,
    message_priority smallint,
    message_attempts integer,
    message_lock_token uuid,
    message_created_at timestamptz,
    message_content bytea,
    message_state bytea,
    retry_ms bigint,
    event text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
BEGIN
    IF cardinality(p_ack_ids) > 0 THEN
        RETURN QUERY
            SELECT d.message_id, NULL::text, NULL::text, NULL::text, NULL::smallint,
                   NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                   NULL::bigint, 'ack_' || d.result_code
            FROM {schema}.message_delete_many_v1(p_ack_ids, p_ack_tokens) AS d
            WHERE d.result_code <> 'ok';
    END IF;
    IF cardinality(p_hints) > 0 AND p_limit > 0
       AND current_setting('lonnymq.fresh', true) IS DISTINCT FROM 'on'
       AND coalesce(current_setting('lonnymq.sleeping', true), '') = ''
       AND pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        RETURN QUERY
            WITH d AS MATERIALIZED (
                SELECT * FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1
            ), unseen AS MATERIALIZED (
                -- what no ingest has seen yet, of every queue (as in dequeue_take_v1)
                SELECT m.id, m.queue, m.channel
                FROM d CROSS JOIN LATERAL (
                    SELECT m.* FROM {schema}.message m
                    WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
                    ORDER BY m.txid LIMIT 64) AS m
                UNION ALL
                SELECT m.id, m.queue, m.channel
                FROM d CROSS JOIN LATERAL pg_snapshot_xip(d.snap) AS x(txid)
                CROSS JOIN LATERAL (
                    SELECT m.* FROM {schema}.message m
                    WHERE m.txid = x.txid AND m.lock_token IS NULL
                    LIMIT 64) AS m
            ), mine AS MATERIALIZED (
                -- this call's part of it: all hinted, of one channel; nothing else waiting
                SELECT a.queue, a.channel
                FROM d, (SELECT min(u.queue) AS queue, min(u.channel) AS channel,
                                count(*) FILTER (WHERE u.id <> ALL (p_hints)) AS others,
                                count(DISTINCT (u.queue, u.channel)) AS lanes
                         FROM unseen u WHERE u.queue = ANY (p_queues)) AS a
                WHERE a.others = 0 AND a.lanes = 1 AND (SELECT count(*) FROM unseen) < 64
                  AND p_queues <@ d.queues AND NOT d.pend_queue && p_queues
                  AND NOT EXISTS (
                      SELECT 1 FROM unnest(p_queues) AS w(q) CROSS JOIN LATERAL (
                          SELECT (SELECT l.turn_at FROM {schema}.lane l
                                  WHERE l.queue = w.q
                                    AND l.turn_at >= d.turn_from[array_position(d.queues, w.q)]
                                    AND l.turn_at <= v_now + interval '1 millisecond'
                                  ORDER BY l.turn_at LIMIT 1) AS due,
                                 (SELECT e.locked_until FROM {schema}.message e
                                  WHERE e.queue = w.q
                                    AND e.locked_until >= d.lock_from[array_position(d.queues, w.q)]
                                    AND e.locked_until <= v_now
                                  ORDER BY e.queue, e.locked_until LIMIT 1) AS expired) AS x
                      WHERE x.due IS NOT NULL OR x.expired IS NOT NULL)
            ), picked AS MATERIALIZED (
                SELECT m.id, m.arrival
                FROM mine w
                JOIN {schema}.queue q ON q.name = w.queue
                LEFT JOIN {schema}.channel c ON c.queue = w.queue AND c.name = w.channel
                JOIN {schema}.message m ON m.id = ANY (p_hints)
                -- (what no ingest has seen: one the ingest counted is the dequeue's)
                WHERE m.id IN (SELECT u.id FROM unseen u)
                  AND m.queue = w.queue AND m.channel = w.channel
                  AND CASE WHEN c.has_policy
                           THEN c.own_max_concurrency IS NULL AND c.own_rate_count IS NULL
                           ELSE q.max_concurrency IS NULL AND q.rate_count IS NULL END
                  -- (not locked, written so that the ids are read by the primary key: see
                  -- dequeue_take_v1)
                  AND coalesce(m.lock_token, '00000000-0000-0000-0000-000000000000')
                      = '00000000-0000-0000-0000-000000000000'
                  AND m.dequeue_at <= v_now
                  AND (m.expires_at IS NULL OR m.expires_at > v_now)
                  AND m.attempts < coalesce(q.max_attempts, 2147483647)
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT p_limit
                FOR UPDATE OF m SKIP LOCKED
            ), locked AS (
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1,
                    slotted = false,
                    arrival = 1
                FROM picked p
                WHERE m.id = p.id
                RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                          m.lock_token, m.created_at, m.content, m.state, m.dequeue_at,
                          p.arrival AS was
            ), tallied AS (
                INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, lock_until, lock_id)
                SELECT min(k.queue), min(k.channel), count(*) FILTER (WHERE k.was = 0), count(*),
                       v_now + v_lock, min(k.id)
                FROM locked k HAVING count(*) > 0
            )
            SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
                   k.lock_token, k.created_at, k.content, k.state, NULL::bigint,
                   'delivered'::text
            FROM locked k ORDER BY k.priority DESC, k.dequeue_at, k.id;
        IF FOUND THEN
            PERFORM set_config('lonnymq.fresh', 'on', false);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, NULL,
                                                           NULL, p_listen);
END;
$$;
-- CREATE OR REPLACE keeps the grants but resets the settings: as before, the create runs
-- with the owner's rights and a fixed search_path; so does the new dequeue.
ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_dequeue_hinted_v1(text[], bigint[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE ALL ON FUNCTION {schema}.message_dequeue_hinted_v1(text[], bigint[], integer, bigint, bigint[], uuid[], boolean)
    FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.wake_v2(text, bigint) FROM PUBLIC;

-- Roles that may dequeue (lonnymq.grant worker or admin) may dequeue with a hint.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname = 'message_dequeue_v3'
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.message_dequeue_hinted_v1(text[], bigint[], integer, bigint, bigint[], uuid[], boolean)'::regprocedure,
            r.role);
    END LOOP;
END;
$$;
