-- lonnymq migration 6. Each section below is one change, under its own header.

-- =============================================================================================
-- Message update: reschedule or edit a waiting message (issue 15, item 9)
-- =============================================================================================
--
-- * message_update_v1 (admin): a ready or delayed message's due time, priority and content;
--   refused for a message in flight ('locked'), a dead letter or a missing id. Like a defer,
--   the message gets a new txid, so the ingest lowers its lane's position and turn to it.
-- * message_eta_v1: a Celery task's `eta` header made to agree with the due time (the worker
--   holds a task until the eta it reads in the message, whatever the database says).
-- * message_retry_v1: a delayed message made due now loses its eta header (it kept the old
--   one, and the worker waited for it).

-- A kombu payload (JSON) whose headers carry an `eta` (Celery's delayed tasks), with that
-- header made to agree with the message's due time: p_at as ISO 8601 in UTC, or JSON null
-- (what Celery writes for a task without one) when p_at is NULL, the message being due now.
-- A worker goes by the header, not by the database: a task made due now whose header kept
-- its old eta would wait in the worker until then. Any other content comes back unchanged.
CREATE OR REPLACE FUNCTION {schema}.message_eta_v1(p_content bytea, p_at timestamptz) RETURNS bytea
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_doc jsonb;
BEGIN
    IF p_content IS NULL OR position('"eta"'::bytea IN p_content) = 0 THEN
        RETURN p_content;
    END IF;
    BEGIN
        v_doc := convert_from(p_content, 'UTF8')::jsonb;
    EXCEPTION WHEN invalid_text_representation OR character_not_in_repertoire
                   OR untranslatable_character THEN
        RETURN p_content;  -- not JSON: not a kombu message
    END;
    IF jsonb_typeof(v_doc -> 'headers') IS DISTINCT FROM 'object'
       OR NOT (v_doc -> 'headers') ? 'eta' THEN
        RETURN p_content;
    END IF;
    RETURN convert_to(jsonb_set(v_doc, '{{headers,eta}}',
        CASE WHEN p_at IS NULL THEN 'null'::jsonb
             ELSE to_jsonb(to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
        END)::text, 'UTF8');
END;
$$;

-- Reschedule or edit a waiting (ready or delayed) message. Its due time: p_at, else now +
-- p_delay_ms, else kept; a time not after now means due now (a message already due keeps its
-- place, none is dated back before the others). Its priority and content: NULL keeps them.
-- A Celery task's eta header is made to agree with the new due time (message_eta_v1); a time
-- to live counts from the due time, so a message moved later keeps as long to live after it.
-- result_code: 'updated' (due_at, new_priority: what the message has now); 'locked' (in
-- flight: a consumer holds it, or its lock expired and it waits to be taken over); 'dead' (a
-- dead letter: retry it first); 'not_found'.
-- Like a defer, the update gives the message a new txid: the next ingest finds it again and
-- lowers its lane's position and turn to it (moved earlier or to a higher priority, it would
-- otherwise lie before a position that already passed it); it is delivered once ingested.
-- A dequeue locking the row at that moment is waited for (its short transaction), and the
-- message is then in flight and refused; a dequeue that comes while the update holds the row
-- passes it by (SKIP LOCKED) and finds it at its next ingest.
CREATE OR REPLACE FUNCTION {schema}.message_update_v1(
    p_id bigint, p_delay_ms bigint, p_at timestamptz, p_priority integer, p_content bytea,
    OUT result_code text, OUT due_at timestamptz, OUT new_priority integer
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_d {schema}.discovery;
    v_m record;
    v_now timestamptz;
    v_at timestamptz;
BEGIN
    -- with the ingest held, as message_retry_v1: a message never ingested still counts once
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    SELECT m.queue, m.locked_until, m.dequeue_at, m.priority INTO v_m
    FROM {schema}.message m WHERE m.id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.dead_message d WHERE d.id = p_id)
            THEN 'dead' ELSE 'not_found' END;
        RETURN;
    END IF;
    due_at := v_m.dequeue_at;
    new_priority := v_m.priority;
    IF v_m.locked_until IS NOT NULL THEN
        result_code := 'locked';
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_at := CASE WHEN p_at IS NOT NULL THEN p_at
                 WHEN p_delay_ms IS NOT NULL THEN v_now + p_delay_ms * interval '1 millisecond'
                 ELSE v_m.dequeue_at END;
    IF v_at <= v_now THEN
        v_at := LEAST(v_m.dequeue_at, v_now);
    END IF;
    UPDATE {schema}.message m SET
        dequeue_at = v_at,
        priority = coalesce(p_priority, m.priority),
        expires_at = CASE WHEN v_at > m.dequeue_at THEN m.expires_at + (v_at - m.dequeue_at)
                          ELSE m.expires_at END,
        content = CASE WHEN p_content IS NULL AND v_at = m.dequeue_at THEN m.content
            ELSE {schema}.message_eta_v1(coalesce(p_content, m.content),
                                         CASE WHEN v_at > v_now THEN v_at END) END,
        txid = pg_current_xact_id(),
        arrival = CASE WHEN m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap)
            THEN 0 ELSE 2 END
    WHERE m.id = p_id
    RETURNING m.dequeue_at, m.priority INTO due_at, new_priority;
    PERFORM {schema}.wake_v1(v_m.queue);
    result_code := 'updated';
END;
$$;

-- Retry messages by id: a dead letter goes back to its queue and channel as a new message
-- (attempts start again; 'retried', new_id), a delayed message becomes due now ('due_now',
-- its Celery eta header cleared: message_eta_v1).
-- Otherwise: 'ready' (nothing to do), 'locked' (a consumer holds it), 'channel_full' or
-- 'deduplicated' (a never-delivered message of the same name waits, new_id; the dead letter
-- stays in both cases), 'not_found'.
CREATE OR REPLACE FUNCTION {schema}.message_retry_v1(p_ids bigint[])
RETURNS TABLE (message_id bigint, result_code text, new_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_dead {schema}.dead_message;
    v_code text;
    v_new_id bigint;
    v_queue text;
    v_locked timestamptz;
    v_at timestamptz;
    v_d {schema}.discovery;
BEGIN
    -- with the ingest held: a message made due that was never ingested still counts once
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR v_id IN SELECT DISTINCT u.id FROM unnest(p_ids) AS u(id) ORDER BY u.id LOOP
        message_id := v_id;
        new_id := NULL;
        DELETE FROM {schema}.dead_message d WHERE d.id = v_id RETURNING d.* INTO v_dead;
        IF FOUND THEN
            SELECT c.result_code, c.message_id INTO v_code, v_new_id
            FROM {schema}.message_create_v1(
                v_dead.queue, v_dead.channel, v_dead.name, v_dead.content, v_dead.priority,
                0, NULL) AS c;
            IF v_code = 'dropped' THEN
                INSERT INTO {schema}.dead_message SELECT (v_dead).*;
                result_code := 'channel_full';
            ELSIF v_code = 'deduplicated' THEN
                -- a never-delivered message of that name waits: the dead letter stays
                INSERT INTO {schema}.dead_message SELECT (v_dead).*;
                result_code := 'deduplicated';
                new_id := v_new_id;
            ELSE
                IF v_code = 'created' AND v_dead.state IS NOT NULL THEN
                    UPDATE {schema}.message m SET state = v_dead.state WHERE m.id = v_new_id;
                END IF;
                result_code := 'retried';
                new_id := v_new_id;
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT m.queue, m.locked_until, m.dequeue_at INTO v_queue, v_locked, v_at
        FROM {schema}.message m WHERE m.id = v_id;
        IF NOT FOUND THEN
            result_code := 'not_found';
        ELSIF v_locked IS NOT NULL THEN
            result_code := 'locked';
        ELSIF v_at <= clock_timestamp() THEN
            result_code := 'ready';
        ELSE
            UPDATE {schema}.message m SET dequeue_at = clock_timestamp(),
                txid = pg_current_xact_id(),
                arrival = CASE WHEN m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap)
                    THEN 0 ELSE 2 END,
                content = {schema}.message_eta_v1(m.content, NULL)
            WHERE m.id = v_id AND m.locked_until IS NULL;
            IF FOUND THEN
                PERFORM {schema}.wake_v1(v_queue);
                result_code := 'due_now';
            ELSE
                result_code := 'locked';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION {schema}.message_eta_v1(bytea, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    FROM PUBLIC;
ALTER FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_retry_v1(bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- Roles that may retry messages (admins) may update them.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.oid = '{schema}.message_retry_v1(bigint[])'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)'::regprocedure,
            r.role);
    END LOOP;
END;
$$;

-- =============================================================================================
-- A held snapshot: finding a locked message by id stays on the primary key (issue 19)
-- =============================================================================================
--
-- Acks, defers, heartbeats and rejects found their message by id, lock token and
-- `locked_until IS NOT NULL`; that last condition let the planner serve them from a full read
-- of message_locked_idx (its predicate), cheap on a fresh table and growing with every message
-- consumed while another session holds a snapshot (18,000 buffers per ack after 60 s at
-- 1,500 msgs/s). A matching lock token now suffices: the constraint below makes a token mean
-- a lock, and the statements no longer name locked_until.

-- (first the ingest's key, as an ingest takes it before it reads the messages: the
-- constraint below locks the table)
SELECT pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));

-- Migration 5 took the ingest's first position with pg_current_snapshot(). When a transaction
-- with a later xid committed during the upgrade (any busy database), that snapshot counted the
-- upgrade's own transaction as visible, and so the messages it moved (of its txid) as
-- ingested: no lane pointed at them, and they were never handed out. (A fresh install at
-- version 5 inside a caller's transaction that then created messages, the same.) When a
-- message of that transaction (the one that recorded version 5) still waits with no lane
-- position before it, the transaction is put back among the running ones of the current
-- position, so that the next ingest probes it and takes what it holds that still waits. Only
-- then: an ingest counts what it takes as created (unless moved or requeued: arrival 1), so
-- taking again what was taken would count it twice.
WITH v5 AS (
    SELECT CASE WHEN x.x > x.cur THEN x.x - 4294967296 ELSE x.x END AS xid
    FROM (
        SELECT (c.cur & ~4294967295::bigint) | m.xmin::text::bigint AS x, c.cur
        FROM {schema}.migration m,
             (SELECT pg_current_xact_id()::text::bigint AS cur) AS c
        WHERE m.version = 5
    ) AS x
), cur AS (
    SELECT * FROM {schema}.discovery o ORDER BY o.id DESC LIMIT 1
)
UPDATE {schema}.discovery d
SET snap = (LEAST(pg_snapshot_xmin(d.snap)::text::bigint, v5.xid)::text || ':'
            || pg_snapshot_xmax(d.snap)::text || ':'
            || array_to_string(ARRAY(
                   SELECT u.x FROM (
                       SELECT pg_snapshot_xip(d.snap)::text::bigint AS x
                       UNION SELECT v5.xid
                   ) AS u ORDER BY u.x), ','))::pg_snapshot
FROM v5, cur
WHERE d.id = cur.id
  AND pg_visible_in_snapshot(v5.xid::text::xid8, d.snap)
  AND EXISTS (
      SELECT 1 FROM {schema}.message m
      WHERE m.txid = v5.xid::text::xid8 AND m.locked_until IS NULL
        AND NOT EXISTS (
            SELECT 1 FROM unnest(cur.pend_queue, cur.pend_channel) AS p(q, c)
            WHERE p.q = m.queue AND p.c = m.channel)
        AND NOT EXISTS (
            SELECT 1 FROM (
                SELECT l.* FROM {schema}.lane l
                WHERE l.queue = m.queue AND l.channel = m.channel
                ORDER BY l.id DESC LIMIT 1
            ) AS l
            CROSS JOIN LATERAL unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
            WHERE p.prio = m.priority AND (m.dequeue_at, m.id) >= (p.at, p.pid)));

ALTER TABLE {schema}.message
    ADD CONSTRAINT message_lock_pair CHECK ((locked_until IS NULL) = (lock_token IS NULL));

-- Every API function runs without JIT (the operating ones already did). Generic plans of the
-- hot ones can look costly on a table whose statistics are old (an ingest's per-transaction
-- probe was estimated at 970,000 rows): JIT then compiled a statement that ran in 0.05 ms,
-- and a dequeue took 20 ms. (The functions redefined below get it again from their ALTER.)
ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint) SET jit = off;
ALTER FUNCTION {schema}.message_create_many_v1(text[], text[], text[], bytea[], integer[], bigint[], bigint[]) SET jit = off;
ALTER FUNCTION {schema}.message_publish_v1(text, text, text, text, bytea, integer, bigint, bigint) SET jit = off;
ALTER FUNCTION {schema}.message_dequeue_v1(text[], integer, bigint) SET jit = off;
ALTER FUNCTION {schema}.message_dequeue_v2(text[], integer, bigint) SET jit = off;
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean) SET jit = off;
ALTER FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint) SET jit = off;
ALTER FUNCTION {schema}.message_delete_v1(bigint, uuid) SET jit = off;
ALTER FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[]) SET jit = off;
ALTER FUNCTION {schema}.message_defer_v1(bigint, uuid, bigint, boolean, bytea) SET jit = off;
ALTER FUNCTION {schema}.message_heartbeat_v1(bigint[], uuid[], bigint) SET jit = off;
ALTER FUNCTION {schema}.message_reject_v1(bigint, uuid, text) SET jit = off;
ALTER FUNCTION {schema}.channel_policy_set_v1(text, text, integer, integer) SET jit = off;
ALTER FUNCTION {schema}.channel_policy_clear_v1(text, text) SET jit = off;
ALTER FUNCTION {schema}.queue_policy_set_v1(text, integer, integer) SET jit = off;
ALTER FUNCTION {schema}.queue_purge_v1(text) SET jit = off;
ALTER FUNCTION {schema}.queue_delete_v1(text) SET jit = off;
ALTER FUNCTION {schema}.exchange_declare_v1(text, text, boolean, boolean) SET jit = off;
ALTER FUNCTION {schema}.exchange_delete_v1(text) SET jit = off;
ALTER FUNCTION {schema}.queue_declare_v1(text, bigint, bigint) SET jit = off;
ALTER FUNCTION {schema}.queue_bind_v1(text, text, text, text) SET jit = off;
ALTER FUNCTION {schema}.queue_unbind_v1(text, text, text) SET jit = off;
ALTER FUNCTION {schema}.queue_touch_v1(text[]) SET jit = off;
ALTER FUNCTION {schema}.expire_v1(integer) SET jit = off;
ALTER FUNCTION {schema}.dead_purge_v1(text) SET jit = off;
ALTER FUNCTION {schema}.queue_configure_v1(text, jsonb) SET jit = off;

-- The fold replaces a channel's count row instead of updating it (found first by the newest
-- id, whatever a held snapshot keeps), and moves the counts of the channels that emptied to
-- their queue's row in one write per queue: updated in place, those rows' version chains grew
-- under a held snapshot with every fold (the queue's row by every channel that emptied), and
-- a fold of 1,000 channels took 150-800 ms after a minute.
ALTER TABLE {schema}.channel_count ADD COLUMN id bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE {schema}.channel_count DROP CONSTRAINT channel_count_pkey;
ALTER TABLE {schema}.channel_count ADD PRIMARY KEY (id);
CREATE INDEX channel_count_latest_idx ON {schema}.channel_count (queue, channel, id DESC);

-- The txid index's predicate names lock_token, the ready index's locked_until (the same rows,
-- by message_lock_pair): a statement written for one can no longer be planned on the other.
-- A lane's next position, planned generically on a small table, read the whole txid index
-- (the ready backlog and every dead entry) and sorted it: 15,000 buffers per dequeue late in
-- a held snapshot, the Kombu consumer of the churn benchmark falling behind its producer.
DROP INDEX {schema}.message_txid_idx;
CREATE INDEX message_txid_idx ON {schema}.message (txid) WHERE lock_token IS NULL;

-- The functions this section changes, as schema.sql defines them:
CREATE OR REPLACE FUNCTION {schema}.ingest_v1(p_queues text[], p_wait boolean, p_fold boolean)
RETURNS {schema}.discovery
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_old {schema}.discovery;
    v_new {schema}.discovery;
    v_snap pg_snapshot;
    v_now timestamptz;
    v_xip xid8[];
    r record;
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_merged record;
    v_max integer;
    v_in_flight integer;
    v_tf timestamptz;
    v_at timestamptz;
    v_i integer;
    v_q text;
    v_last_queue text := '';
    v_cq text[] := ARRAY[]::text[];
    v_cc text[] := ARRAY[]::text[];
    v_cn integer[] := ARRAY[]::integer[];
    v_fold boolean;
    v_next record;
    v_next_id bigint;
BEGIN
    IF p_wait THEN
        PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    ELSIF NOT pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        SELECT * INTO v_old FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        RETURN v_old;
    END IF;
    SELECT * INTO v_old FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    v_snap := {schema}.snapshot_v1();
    v_now := clock_timestamp();
    v_new := v_old;
    v_new.pend_queue := '{{}}';
    v_new.pend_channel := '{{}}';
    v_new.pend_prio := '{{}}';
    v_new.pend_at := '{{}}';
    v_new.pend_id := '{{}}';
    -- what was in progress then and has committed since
    v_xip := ARRAY(SELECT x FROM pg_snapshot_xip(v_old.snap) AS x
                   WHERE pg_visible_in_snapshot(x, v_snap));
    FOR r IN
        WITH fresh AS MATERIALIZED (
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(v_old.snap) AND m.txid < pg_snapshot_xmax(v_snap)
              AND m.lock_token IS NULL AND pg_visible_in_snapshot(m.txid, v_snap)
            UNION ALL
            -- (by the txid index, one probe per transaction: another partial index of the
            -- same predicate would be read whole, dead entries and all; OFFSET 0 keeps the
            -- planner from flattening the probes into a hash join over such a read)
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM unnest(v_xip) AS x(txid)
            CROSS JOIN LATERAL (
                SELECT m.* FROM {schema}.message m
                WHERE m.txid = x.txid AND m.lock_token IS NULL
                OFFSET 0
            ) AS m
            UNION ALL
            -- the heads the last ingest could not write (counted then)
            SELECT p.q, p.c, p.prio, p.at, p.id, 1::smallint
            FROM unnest(v_old.pend_queue, v_old.pend_channel, v_old.pend_prio, v_old.pend_at,
                        v_old.pend_id) AS p(q, c, prio, at, id)
        ), heads AS (
            SELECT DISTINCT ON (f.queue, f.channel, f.priority)
                   f.queue, f.channel, f.priority, f.dequeue_at, f.id
            FROM fresh f ORDER BY f.queue, f.channel, f.priority, f.dequeue_at, f.id
        ), counts AS (
            SELECT f.queue, f.channel,
                   count(*) FILTER (WHERE f.arrival = 0)::integer AS created,
                   min(f.dequeue_at) AS due
            FROM fresh f GROUP BY f.queue, f.channel
        )
        SELECT c.queue, c.channel, c.created, c.due,
               array_agg(h.priority ORDER BY h.priority DESC) AS prios,
               array_agg(h.dequeue_at ORDER BY h.priority DESC) AS pos_at,
               array_agg(h.id ORDER BY h.priority DESC) AS pos_id
        FROM counts c JOIN heads h ON h.queue = c.queue AND h.channel = c.channel
        GROUP BY c.queue, c.channel, c.created, c.due
        ORDER BY c.queue, c.channel
    LOOP
        IF r.queue <> v_last_queue THEN
            v_last_queue := r.queue;
            IF NOT EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = r.queue) THEN
                INSERT INTO {schema}.queue (name) VALUES (r.queue) ON CONFLICT (name) DO NOTHING;
            END IF;
            v_i := array_position(v_old.queues, r.queue);
            v_tf := CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_old.turn_from[v_i] END;
        END IF;
        IF r.created > 0 THEN
            v_cq := v_cq || r.queue;
            v_cc := v_cc || r.channel;
            v_cn := v_cn || r.created;
        END IF;
        -- a lane its owner is serving right now: for the next ingest (no waiting)
        IF NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel)) THEN
            v_new.pend_queue := v_new.pend_queue || array_fill(r.queue, ARRAY[cardinality(r.prios)]);
            v_new.pend_channel := v_new.pend_channel
                || array_fill(r.channel, ARRAY[cardinality(r.prios)]);
            v_new.pend_prio := v_new.pend_prio || r.prios;
            v_new.pend_at := v_new.pend_at || r.pos_at;
            v_new.pend_id := v_new.pend_id || r.pos_id;
            CONTINUE;
        END IF;
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        v_put := v_lane;
        IF v_lane.id IS NULL THEN
            SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.channel) l;
            v_put := ROW(NULL, r.queue, r.channel, NULL, '-infinity', v_now, v_max IS NOT NULL,
                         '{{}}', '{{}}', '{{}}')::{schema}.lane;
        END IF;
        SELECT * INTO v_merged FROM {schema}.positions_merge_v1(v_put, r.prios, r.pos_at, r.pos_id);
        v_put.prios := v_merged.prios;
        v_put.pos_at := v_merged.pos_at;
        v_put.pos_id := v_merged.pos_id;
        v_at := GREATEST(r.due, v_put.served_at, v_tf);
        IF v_put.turn_at IS NOT NULL THEN
            v_put.turn_at := LEAST(v_put.turn_at, v_at);
        ELSE
            -- no turn: nothing was ready, or the channel is at its max_concurrency
            v_in_flight := 0;
            IF v_put.limited THEN
                SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.channel) l;
                SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
                WHERE c.queue = r.queue AND c.name = r.channel;
            END IF;
            IF NOT v_put.limited OR v_max IS NULL OR coalesce(v_in_flight, 0) < v_max THEN
                v_put.turn_at := v_at;
            END IF;
        END IF;
        IF v_lane.id IS NULL OR v_put.turn_at IS DISTINCT FROM v_lane.turn_at
           OR v_put.prios IS DISTINCT FROM v_lane.prios OR v_put.pos_at IS DISTINCT FROM v_lane.pos_at
           OR v_put.pos_id IS DISTINCT FROM v_lane.pos_id THEN
            PERFORM {schema}.lane_put_v1(v_lane.id, v_put);
        END IF;
    END LOOP;

    -- channels that got a slot back while at their max_concurrency: their lanes' turn again
    -- (the lane, then the channel row: the order of the dequeue; an ack locks only the row)
    -- (a lane being served, or a row an ack holds, waits for the next ingest)
    FOR r IN SELECT c.queue, c.name FROM {schema}.channel c WHERE c.freed ORDER BY c.queue, c.name LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.name));
        SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND c.freed FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        v_lane := {schema}.lane_get_v1(r.queue, r.name);
        IF v_lane.id IS NOT NULL AND v_lane.turn_at IS NULL THEN
            SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.name) l;
            IF v_max IS NULL OR v_in_flight < v_max THEN
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
                IF v_next.next_at IS NOT NULL THEN
                    v_i := array_position(v_old.queues, r.queue);
                    v_lane.turn_at := GREATEST(v_next.next_at, v_lane.served_at,
                        CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_old.turn_from[v_i] END);
                    PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                END IF;
            END IF;
        END IF;
        UPDATE {schema}.channel c SET freed = false WHERE c.queue = r.queue AND c.name = r.name;
        DELETE FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0;
    END LOOP;

    -- the locks taken or extended since the last ingest: per queue, the earliest (and its
    -- message) lowers the queue's next expiry (every queue known, the caller's or not)
    FOR r IN
        SELECT DISTINCT ON (t.queue) t.queue, t.lock_until, t.lock_id
        FROM (
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid >= pg_snapshot_xmax(v_old.snap) AND t.txid < pg_snapshot_xmax(v_snap)
              AND pg_visible_in_snapshot(t.txid, v_snap) AND t.lock_until IS NOT NULL
            UNION ALL
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid = ANY (v_xip) AND t.lock_until IS NOT NULL
        ) AS t
        ORDER BY t.queue, t.lock_until, t.lock_id
    LOOP
        v_i := array_position(v_new.queues, r.queue);
        IF v_i IS NOT NULL AND (v_new.lock_next[v_i] IS NULL OR r.lock_until < v_new.lock_next[v_i]) THEN
            v_new.lock_next[v_i] := r.lock_until;
            v_new.lock_id[v_i] := r.lock_id;
        END IF;
    END LOOP;

    -- scan positions of the caller's queues
    FOREACH v_q IN ARRAY ARRAY(SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q) ORDER BY u.q) LOOP
        v_i := array_position(v_new.queues, v_q);
        IF v_i IS NULL THEN
            v_new.queues := v_new.queues || v_q;
            v_new.turn_from := v_new.turn_from || '-infinity'::timestamptz;
            v_new.lock_from := v_new.lock_from || '-infinity'::timestamptz;
            v_new.lock_next := v_new.lock_next || '-infinity'::timestamptz;
            v_new.lock_id := v_new.lock_id || NULL::bigint;
            v_i := cardinality(v_new.queues);
        END IF;
        -- no live turn of the queue is earlier than the first one found from the old position
        -- (every later turn is written at or after its writer's clock, or by an ingest)
        v_new.turn_from[v_i] := LEAST(v_now, coalesce((
            SELECT l.turn_at FROM {schema}.lane l
            WHERE l.queue = v_q AND l.turn_at >= v_new.turn_from[v_i]
            ORDER BY l.turn_at, l.id LIMIT 1), v_now));
        -- locks that expired and are not handled yet, else now
        v_new.lock_from[v_i] := coalesce((
            SELECT m.locked_until FROM {schema}.message m
            WHERE m.queue = v_q AND m.locked_until >= v_new.lock_from[v_i]
              AND m.locked_until <= v_now
            ORDER BY m.locked_until LIMIT 1), v_now);
        -- the next lock expiry: while the message named still has it, it is the next one;
        -- else (acked, extended, taken over) the first live lock from it on (the entries
        -- between, of acked messages, are walked about once: the bound moves on past them)
        IF v_new.lock_next[v_i] IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM {schema}.message m
            WHERE m.id = v_new.lock_id[v_i] AND m.queue = v_q
              AND m.locked_until = v_new.lock_next[v_i]) THEN
            SELECT m.locked_until, m.id INTO v_at, v_next_id FROM {schema}.message m
            WHERE m.queue = v_q AND m.locked_until >= v_new.lock_next[v_i]
            ORDER BY m.locked_until LIMIT 1;
            v_new.lock_next[v_i] := v_at;  -- (NULL: no lock)
            v_new.lock_id[v_i] := v_next_id;
        END IF;
    END LOOP;

    v_fold := p_fold OR v_old.folded_at < v_now - interval '1 second';
    IF v_fold THEN
        PERFORM {schema}.fold_v1(v_old.folded, v_snap, v_cq, v_cc, v_cn);
        v_new.folded := v_snap;
        v_new.folded_at := v_now;
    ELSIF cardinality(v_cq) > 0 THEN
        INSERT INTO {schema}.tally (queue, channel, enqueued)
        SELECT * FROM unnest(v_cq, v_cc, v_cn);
    END IF;
    v_new.snap := v_snap;
    v_new.taken_at := v_now;
    INSERT INTO {schema}.discovery
        (snap, folded, taken_at, folded_at, queues, turn_from, lock_from, lock_next, lock_id,
         expire_from, pend_queue, pend_channel, pend_prio, pend_at, pend_id)
    VALUES (v_new.snap, v_new.folded, v_new.taken_at, v_new.folded_at, v_new.queues,
            v_new.turn_from, v_new.lock_from, v_new.lock_next, v_new.lock_id, v_new.expire_from,
            v_new.pend_queue, v_new.pend_channel, v_new.pend_prio, v_new.pend_at, v_new.pend_id)
    RETURNING * INTO v_new;
    DELETE FROM {schema}.discovery d WHERE d.id = v_old.id;
    RETURN v_new;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.fold_v1(
    p_from pg_snapshot, p_snap pg_snapshot, p_q text[], p_c text[], p_n integer[]
) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_xip xid8[];
    r {schema}.channel_count;
    v_lane {schema}.lane;
    v_emptied {schema}.channel_count[] := ARRAY[]::{schema}.channel_count[];
BEGIN
    v_xip := ARRAY(SELECT x FROM pg_snapshot_xip(p_from) AS x WHERE pg_visible_in_snapshot(x, p_snap));
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.tally t
            WHERE t.txid >= pg_snapshot_xmax(p_from) AND t.txid < pg_snapshot_xmax(p_snap)
              AND pg_visible_in_snapshot(t.txid, p_snap)
            RETURNING t.*
        ), gone_late AS (
            DELETE FROM {schema}.tally t WHERE t.txid = ANY (v_xip)
            RETURNING t.*
        ), delta AS (
            SELECT g.queue, g.channel, sum(g.enqueued) AS enqueued, sum(g.delivered) AS delivered,
                   sum(g.redelivered) AS redelivered, sum(g.acked) AS acked,
                   sum(g.deferred) AS deferred, sum(g.dead) AS dead, sum(g.dead_held) AS dead_held,
                   sum(g.expired) AS expired, sum(g.dropped) AS dropped, sum(g.removed) AS removed,
                   sum(g.removed_held) AS removed_held, sum(g.purged) AS purged
            FROM (
                SELECT * FROM gone
                UNION ALL SELECT * FROM gone_late
                UNION ALL
                SELECT NULL::xid8, u.q, u.c, u.n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                       NULL::timestamptz, NULL::bigint
                FROM unnest(p_q, p_c, p_n) AS u(q, c, n)
            ) AS g
            WHERE EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = g.queue)
            GROUP BY g.queue, g.channel
        ), old AS (
            -- (each channel's row is replaced, not updated: its newest version is found first
            -- by channel_count_latest_idx, whatever dead versions a held snapshot keeps; an
            -- update in place would make every fold walk the row's chain of versions, and a
            -- delete and insert of the same key every dead entry of that key)
            SELECT d.*, o.id AS old_id, o.enqueued AS o_enqueued, o.delivered AS o_delivered,
                   o.redelivered AS o_redelivered, o.acked AS o_acked, o.deferred AS o_deferred,
                   o.dead AS o_dead, o.dead_held AS o_dead_held, o.expired AS o_expired,
                   o.dropped AS o_dropped, o.removed AS o_removed,
                   o.removed_held AS o_removed_held, o.purged AS o_purged
            FROM delta d
            LEFT JOIN LATERAL (
                SELECT * FROM {schema}.channel_count c
                WHERE c.queue = d.queue AND c.channel = d.channel
                ORDER BY c.id DESC LIMIT 1
            ) AS o ON true
        ), replaced AS (
            DELETE FROM {schema}.channel_count c USING old o WHERE c.id = o.old_id
        ), merged AS (
            INSERT INTO {schema}.channel_count AS cc (queue, channel, enqueued, delivered,
                redelivered, acked, deferred, dead, dead_held, expired, dropped, removed,
                removed_held, purged)
            SELECT o.queue, o.channel,
                   coalesce(o.o_enqueued, 0) + o.enqueued,
                   coalesce(o.o_delivered, 0) + o.delivered,
                   coalesce(o.o_redelivered, 0) + o.redelivered,
                   coalesce(o.o_acked, 0) + o.acked,
                   coalesce(o.o_deferred, 0) + o.deferred,
                   coalesce(o.o_dead, 0) + o.dead,
                   coalesce(o.o_dead_held, 0) + o.dead_held,
                   coalesce(o.o_expired, 0) + o.expired,
                   coalesce(o.o_dropped, 0) + o.dropped,
                   coalesce(o.o_removed, 0) + o.removed,
                   coalesce(o.o_removed_held, 0) + o.removed_held,
                   coalesce(o.o_purged, 0) + o.purged
            FROM old o ORDER BY o.queue, o.channel
            RETURNING cc.*
        )
        SELECT m.* FROM merged m
        WHERE m.enqueued - m.acked - m.dead - m.expired - m.removed - m.purged <= 0
        ORDER BY m.queue, m.channel
    LOOP
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = r.queue AND c.name = r.channel AND c.has_policy);
        -- (a lane being served goes at a later fold)
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel));
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        CONTINUE WHEN v_lane.id IS NOT NULL AND v_lane.turn_at IS NOT NULL;
        -- (by id: a lane has one live version, and a scan of the channel's versions would walk
        -- the dead ones a held snapshot keeps)
        IF v_lane.id IS NOT NULL THEN
            DELETE FROM {schema}.lane l WHERE l.id = v_lane.id;
        END IF;
        DELETE FROM {schema}.channel_count cc WHERE cc.id = r.id;
        v_emptied := v_emptied || r;
    END LOOP;
    -- the emptied channels' counts go to their queue's row in one write per queue: a write per
    -- channel made that row's version chain grow by the number of channels that emptied each
    -- second under a held snapshot, and every write walk it (a fold of 1,000 channels took
    -- 150-800 ms after a minute)
    IF cardinality(v_emptied) > 0 THEN
        INSERT INTO {schema}.queue_count AS qc (queue, enqueued, delivered, redelivered, acked,
            deferred, dead, dead_held, expired, dropped, removed, removed_held, purged)
        SELECT g.queue, sum(g.enqueued), sum(g.delivered), sum(g.redelivered), sum(g.acked),
               sum(g.deferred), sum(g.dead), sum(g.dead_held), sum(g.expired), sum(g.dropped),
               sum(g.removed), sum(g.removed_held), sum(g.purged)
        FROM unnest(v_emptied) AS g
        GROUP BY g.queue ORDER BY g.queue
        ON CONFLICT (queue) DO UPDATE SET
            enqueued = qc.enqueued + EXCLUDED.enqueued,
            delivered = qc.delivered + EXCLUDED.delivered,
            redelivered = qc.redelivered + EXCLUDED.redelivered,
            acked = qc.acked + EXCLUDED.acked,
            deferred = qc.deferred + EXCLUDED.deferred,
            dead = qc.dead + EXCLUDED.dead,
            dead_held = qc.dead_held + EXCLUDED.dead_held,
            expired = qc.expired + EXCLUDED.expired,
            dropped = qc.dropped + EXCLUDED.dropped,
            removed = qc.removed + EXCLUDED.removed,
            removed_held = qc.removed_held + EXCLUDED.removed_held,
            purged = qc.purged + EXCLUDED.purged;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.channel_totals_v1(p_queue text)
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

CREATE OR REPLACE FUNCTION {schema}.queue_waiting_v1(p_queue text)
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

CREATE OR REPLACE FUNCTION {schema}.message_dequeue_v3(
    p_queues text[], p_limit integer, p_lock_ms bigint, p_ack_ids bigint[],
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
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_lock_until timestamptz;
    v_lock_id bigint;
    v_d {schema}.discovery;
    v_ingested boolean := false;
    v_slept boolean := false;
    v_waited boolean := false;
    v_qi integer;
    v_rows integer;
    v_busy boolean := false;
    v_got integer := 0;
    v_left integer;
    v_n integer;
    v_k integer;
    r record;
    v_keys text;
    -- events for the tally: queue, channel, kind
    e_q text[] := ARRAY[]::text[];
    e_c text[] := ARRAY[]::text[];
    e_k text[] := ARRAY[]::text[];
    -- acks
    v_gone bigint[];
    v_gq text[];
    v_gc text[];
    v_gs boolean[];
    v_gl boolean[];
    -- queues
    v_qn text[];
    v_qmax integer[];
    v_qtf timestamptz[];
    v_qlf timestamptz[];
    v_expired boolean;
    v_relock bigint[];
    v_poison bigint[];
    -- lanes, and per lane: owned, cap, max_concurrency, taken, more due, done
    v_cands {schema}.lane[];
    v_own boolean[];
    v_cap integer[];
    v_room integer[];
    v_max integer[];
    v_taken integer[];
    v_more boolean[];
    v_done boolean[];
    v_open integer;
    v_share integer;
    v_passes integer;
    v_lanes integer[];
    v_quota integer[];
    -- a pass's heads: id, lane, rank in lane
    h_id bigint[];
    h_lane integer[];
    h_rn integer[];
    v_take bigint[];
    v_slotted bigint[];
    v_locked bigint[];
    v_served timestamptz;
    v_lane {schema}.lane;
    v_next record;
    v_retry bigint;
    v_snap pg_snapshot;
    v_dead integer := 0;
    i integer;
BEGIN
    -- 0. a caller that slept (it found nothing last time) is awake again
    v_keys := current_setting('lonnymq.sleeping', true);
    IF v_keys IS NOT NULL AND v_keys <> '' THEN
        PERFORM pg_advisory_unlock_shared(k.key)
        FROM unnest(string_to_array(v_keys, ',')::bigint[]) AS k(key)
        WHERE EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks l
            WHERE l.pid = pg_backend_pid() AND l.locktype = 'advisory' AND l.objsubid = 1
              AND l.mode = 'ShareLock' AND l.granted
              AND l.classid::bigint = (k.key >> 32) & 4294967295
              AND l.objid::bigint = k.key & 4294967295);
        PERFORM set_config('lonnymq.sleeping', '', false);
    END IF;

    -- 1. acks
    IF coalesce(cardinality(p_ack_ids), 0) > 0 THEN
        WITH gone AS (
            DELETE FROM {schema}.message m
            WHERE m.id = ANY (p_ack_ids)
              AND m.lock_token = p_ack_tokens[array_position(p_ack_ids, m.id)]
            RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
        )
        SELECT array_agg(g.id), array_agg(g.queue), array_agg(g.channel), array_agg(g.sized),
               array_agg(g.slotted)
        INTO v_gone, v_gq, v_gc, v_gs, v_gl FROM gone g;
        IF v_gone IS NOT NULL THEN
            e_q := v_gq;
            e_c := v_gc;
            e_k := array_fill('acked'::text, ARRAY[cardinality(v_gone)]);
            IF true = ANY (v_gs) OR true = ANY (v_gl) THEN
                FOR r IN
                    SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
                           count(*) FILTER (WHERE u.l)::integer AS l
                    FROM unnest(v_gq, v_gc, v_gs, v_gl) AS u(q, c, s, l)
                    WHERE u.s OR u.l GROUP BY u.q, u.c ORDER BY u.q, u.c
                LOOP
                    PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
                END LOOP;
            END IF;
        END IF;
        IF coalesce(cardinality(v_gone), 0) < cardinality(p_ack_ids) THEN
            RETURN QUERY
                SELECT h.id, NULL::text, NULL::text, NULL::text, NULL::smallint, NULL::integer,
                       NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, NULL::bigint,
                       CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                            THEN 'ack_state_invalid' ELSE 'ack_not_found' END
                FROM unnest(p_ack_ids) AS h(id)
                WHERE h.id <> ALL (coalesce(v_gone, ARRAY[]::bigint[]));
        END IF;
    END IF;

    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    LOOP
        -- 2. ingest what committed since the snapshot: every 10 ms (which also moves the
        --    points from which lanes are read past the versions consumers superseded
        --    meanwhile: dead rows that a snapshot held elsewhere keeps from being vacuumed),
        --    and below when this call finds nothing in what is ingested. Not at every call:
        --    an ingest costs several times a delivery, and with messages waiting a consumer
        --    has no need of the newest ones.
        IF NOT v_ingested AND current_setting('lonnymq.fresh', true) = 'on' THEN
            PERFORM set_config('lonnymq.fresh', '', false);
            v_d := {schema}.ingest_wait_v1(p_queues);
            v_ingested := true;
            v_now := clock_timestamp();
        ELSIF NOT v_ingested
           AND (v_d.taken_at < v_now - interval '10 milliseconds'
                OR v_d.folded_at < v_now - interval '1 second'
                OR NOT (p_queues <@ v_d.queues)
                -- (heads an ingest could not write, their lane being served: soon, not at
                -- once, or a busy lane would have every call ingest)
                OR (cardinality(v_d.pend_queue) > 0
                    AND v_d.taken_at < v_now - interval '5 milliseconds')) THEN
            v_d := {schema}.ingest_v1(p_queues, false, false);
            v_ingested := true;
            v_now := clock_timestamp();
        END IF;

        -- the queues, their settings and positions; is there a lock past its expiry?
        -- (Every statement's plan is set up again in each transaction, aggregates and sorts
        -- most of all: the usual cases, one queue and one lane, take statements without.)
        IF cardinality(p_queues) = 1 THEN
            v_qi := array_position(v_d.queues, p_queues[1]);
            SELECT ARRAY[q.name::text], ARRAY[coalesce(q.max_attempts, 2147483647)],
                   ARRAY[coalesce(v_d.turn_from[v_qi], '-infinity')],
                   ARRAY[coalesce(v_d.lock_from[v_qi], '-infinity')],
                   -- (the first one in lock order, from the queue's lock position: an EXISTS
                   -- loses the order, and was planned as a read of the whole locked index)
                   (SELECT e.locked_until FROM {schema}.message e
                    WHERE e.queue = p_queues[1]
                      AND e.locked_until >= coalesce(v_d.lock_from[v_qi], '-infinity')
                      AND e.locked_until <= v_now
                    ORDER BY e.queue, e.locked_until LIMIT 1) IS NOT NULL
            INTO v_qn, v_qmax, v_qtf, v_qlf, v_expired
            FROM {schema}.queue q WHERE q.name = p_queues[1];
        ELSE
            SELECT array_agg(q.name ORDER BY q.name),
                   array_agg(coalesce(q.max_attempts, 2147483647) ORDER BY q.name),
                   array_agg(coalesce(v_d.turn_from[array_position(v_d.queues, q.name)],
                                      '-infinity') ORDER BY q.name),
                   array_agg(coalesce(v_d.lock_from[array_position(v_d.queues, q.name)],
                                      '-infinity') ORDER BY q.name),
                   coalesce(bool_or(x.found), false)
            INTO v_qn, v_qmax, v_qtf, v_qlf, v_expired
            FROM {schema}.queue q
            LEFT JOIN LATERAL (
                SELECT true AS found FROM {schema}.message e
                WHERE e.queue = q.name
                  AND e.locked_until >= coalesce(v_d.lock_from[array_position(v_d.queues, q.name)],
                                                 '-infinity')
                  AND e.locked_until <= v_now
                ORDER BY e.locked_until LIMIT 1
            ) AS x ON true
            WHERE q.name = ANY (p_queues);
        END IF;
        v_left := p_limit - v_got;

        -- 3. messages whose lock expired: they still count against their channel's
        --    concurrency and are taken over without touching any lane
        IF v_expired AND v_left > 0 THEN
            v_relock := ARRAY(
                SELECT x.id FROM unnest(v_qn, v_qlf) AS u(q, lf)
                CROSS JOIN LATERAL (
                    SELECT e.id, e.locked_until FROM {schema}.message e
                    WHERE e.queue = u.q AND e.locked_until >= u.lf AND e.locked_until <= v_now
                    ORDER BY e.locked_until LIMIT v_left
                    FOR UPDATE SKIP LOCKED
                ) AS x
                ORDER BY x.locked_until LIMIT v_left);
            -- delivered max_attempts times already, its holder dying each time: a poison
            -- message, dead-lettered instead
            v_poison := ARRAY(
                SELECT m.id FROM {schema}.message m
                WHERE m.id = ANY (v_relock) AND m.attempts >= v_qmax[array_position(v_qn, m.queue)]
                ORDER BY m.id);
            IF cardinality(v_poison) > 0 THEN
                FOR r IN SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b LOOP
                    v_dead := v_dead + 1;
                    e_q := e_q || r.queue_name || r.queue_name;
                    e_c := e_c || r.channel_name || r.channel_name;
                    e_k := e_k || 'dead'::text || 'dead_held'::text;
                    RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name, r.message_name,
                        NULL::smallint, r.message_attempts, NULL::uuid, r.message_created_at,
                        NULL::bytea, NULL::bytea, NULL::bigint, 'dead'::text;
                END LOOP;
            END IF;
            FOR r IN
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1
                WHERE m.id = ANY (v_relock) AND m.id <> ALL (v_poison)
                RETURNING m.*
            LOOP
                e_q := e_q || r.queue || r.queue;
                e_c := e_c || r.channel || r.channel;
                e_k := e_k || 'delivered'::text || 'redelivered'::text;
                v_got := v_got + 1;
                IF v_lock_until IS NULL OR r.locked_until < v_lock_until THEN
                    v_lock_until := r.locked_until;
                    v_lock_id := r.id;
                END IF;
                RETURN QUERY SELECT r.id, r.queue::text, r.channel::text, r.name, r.priority,
                    r.attempts, r.lock_token, r.created_at, r.content, r.state, NULL::bigint,
                    'redelivered'::text;
            END LOOP;
            v_left := p_limit - v_got;
        END IF;

        -- 4. lanes whose turn it is, oldest turn first (one more than needed, to know
        --    whether another one waits)
        v_n := 0;
        IF v_left > 0 AND v_qn IS NOT NULL THEN
            -- (the ingest's state is read again in the same statement: a lane version is
            -- never newer than the snapshot its positions are read with)
            -- (due: at most a millisecond from now, so that a lane another consumer has
            -- just moved to the back, at its clock, is due for this one too)
            v_now := clock_timestamp();
            IF cardinality(v_qn) = 1 THEN
                SELECT ARRAY(
                    SELECT l FROM {schema}.lane l
                    WHERE l.queue = v_qn[1] AND l.turn_at >= v_qtf[1]
                      AND l.turn_at <= v_now + interval '1 millisecond'
                    ORDER BY l.turn_at, l.id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_cands, v_snap;
            ELSE
                SELECT ARRAY(
                    SELECT x.l FROM unnest(v_qn, v_qtf) AS u(q, tf)
                    CROSS JOIN LATERAL (
                        SELECT l FROM {schema}.lane l
                        WHERE l.queue = u.q AND l.turn_at >= u.tf
                          AND l.turn_at <= v_now + interval '1 millisecond'
                        ORDER BY l.turn_at, l.id LIMIT v_left + 1
                    ) AS x
                    ORDER BY (x.l).turn_at, (x.l).id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_cands, v_snap;
            END IF;
            v_d.snap := v_snap;
            v_n := LEAST(cardinality(v_cands), v_left);
        END IF;
        IF v_n > 0 THEN
            v_own := array_fill(false, ARRAY[v_n]);
            v_cap := array_fill(0, ARRAY[v_n]);
            v_room := array_fill(NULL::integer, ARRAY[v_n]);
            v_max := array_fill(NULL::integer, ARRAY[v_n]);
            v_taken := array_fill(0, ARRAY[v_n]);
            v_more := array_fill(false, ARRAY[v_n]);
            v_done := array_fill(false, ARRAY[v_n]);
            FOR i IN 1 .. v_n LOOP
                v_own[i] := pg_try_advisory_xact_lock(
                    {schema}.lane_key_v1((v_cands[i]).queue, (v_cands[i]).channel));
                IF NOT (v_cands[i]).limited THEN
                    v_cap[i] := v_left;
                ELSIF v_own[i] THEN
                    SELECT h.headroom, h.max_concurrency INTO r
                    FROM {schema}.channel_headroom_v1((v_cands[i]).queue, (v_cands[i]).channel) AS h;
                    IF r.headroom IS NULL THEN
                        -- its channel row is busy (an open transaction of a producer of a
                        -- channel with a max_size, or of an ack): not served this time, and
                        -- its turn a little later, so that it does not hold back the point
                        -- from which the lanes are read (which would then walk every lane
                        -- version written meanwhile)
                        v_own[i] := false;
                        v_lane := v_cands[i];
                        v_lane.turn_at := GREATEST(v_lane.turn_at,
                                                   clock_timestamp() + interval '10 milliseconds');
                        IF EXISTS (SELECT 1 FROM {schema}.lane l WHERE l.id = v_lane.id) THEN
                            PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                        END IF;
                    ELSE
                        v_room[i] := r.headroom;
                        v_cap[i] := LEAST(r.headroom, v_left);
                        v_max[i] := r.max_concurrency;
                    END IF;
                END IF;
            END LOOP;
            -- passes: an equal share of what is left to each lane that may give more
            v_passes := 0;
            LOOP
                v_passes := v_passes + 1;
                IF v_n = 1 THEN
                    v_lanes := CASE WHEN NOT v_done[1] AND v_cap[1] > v_taken[1]
                                    THEN ARRAY[1] ELSE ARRAY[]::integer[] END;
                ELSE
                    v_lanes := ARRAY(SELECT g.i FROM generate_series(1, v_n) AS g(i)
                                     WHERE NOT v_done[g.i] AND v_cap[g.i] > v_taken[g.i] ORDER BY g.i);
                END IF;
                v_open := cardinality(v_lanes);
                EXIT WHEN v_open = 0 OR v_left <= 0 OR v_passes > 8;
                v_share := ceil(v_left::numeric / v_open)::integer;
                IF v_open = 1 THEN
                    v_quota := ARRAY[LEAST(v_share, v_cap[v_lanes[1]] - v_taken[v_lanes[1]])];
                ELSE
                    v_quota := ARRAY(SELECT LEAST(v_share, v_cap[u.i] - v_taken[u.i])
                                     FROM unnest(v_lanes) AS u(i));
                END IF;
                -- each lane's head from its positions: due, ingested, not held by anyone; one
                -- more than its quota tells whether it has more
                IF v_open = 1 AND cardinality((v_cands[v_lanes[1]]).prios) = 1 THEN
                    v_k := v_lanes[1];
                    h_id := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.queue = (v_cands[v_k]).queue AND m.channel = (v_cands[v_k]).channel
                          AND m.locked_until IS NULL AND m.priority = ((v_cands[v_k]).prios)[1]
                          AND (m.dequeue_at, m.id) >= (((v_cands[v_k]).pos_at)[1],
                                                       ((v_cands[v_k]).pos_id)[1])
                          AND m.dequeue_at <= v_now
                          AND pg_visible_in_snapshot(m.txid, v_d.snap)
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT v_quota[1] + 1
                        FOR UPDATE SKIP LOCKED);
                    h_lane := array_fill(v_k, ARRAY[cardinality(h_id)]);
                    h_rn := ARRAY(SELECT generate_series(1, cardinality(h_id)));
                ELSE
                SELECT array_agg(h.id ORDER BY h.rn, h.i), array_agg(h.i ORDER BY h.rn, h.i),
                       array_agg(h.rn ORDER BY h.rn, h.i)
                INTO h_id, h_lane, h_rn
                FROM unnest(v_lanes, v_quota) AS u(i, quota)
                CROSS JOIN LATERAL (
                    SELECT u.i, z.id, z.priority, z.dequeue_at,
                           (row_number() OVER (ORDER BY z.priority DESC, z.dequeue_at, z.id))::integer AS rn
                    FROM (
                        SELECT m.id, m.priority, m.dequeue_at
                        FROM unnest((v_cands[u.i]).prios, (v_cands[u.i]).pos_at,
                                    (v_cands[u.i]).pos_id) AS p(prio, at, pid)
                        CROSS JOIN LATERAL (
                            SELECT m.id, m.priority, m.dequeue_at FROM {schema}.message m
                            WHERE m.queue = (v_cands[u.i]).queue
                              AND m.channel = (v_cands[u.i]).channel
                              AND m.locked_until IS NULL AND m.priority = p.prio
                              AND (m.dequeue_at, m.id) >= (p.at, p.pid) AND m.dequeue_at <= v_now
                              AND pg_visible_in_snapshot(m.txid, v_d.snap)
                            ORDER BY m.priority DESC, m.dequeue_at, m.id
                            LIMIT u.quota + 1
                            FOR UPDATE SKIP LOCKED
                        ) AS m
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT u.quota + 1
                    ) AS z
                ) AS h;
                END IF;
                FOR i IN 1 .. v_open LOOP
                    v_k := v_lanes[i];
                    v_more[v_k] := coalesce(array_length(array_positions(h_lane, v_k), 1), 0) > v_quota[i];
                    IF NOT v_more[v_k] THEN
                        v_done[v_k] := true;
                    END IF;
                END LOOP;
                -- (the quotas are rounded up: never more than the call has left, in rank order)
                IF v_open = 1 THEN
                    v_take := h_id[1:v_quota[1]];
                ELSE
                    v_take := ARRAY(
                        SELECT t.id FROM unnest(h_id, h_lane, h_rn) AS t(id, l, rn)
                        JOIN unnest(v_lanes, v_quota) AS u(i, quota) ON u.i = t.l
                        WHERE t.rn <= u.quota
                        ORDER BY t.rn, t.l LIMIT v_left);
                END IF;
                EXIT WHEN coalesce(cardinality(v_take), 0) = 0;
                IF v_open = 1 THEN
                    v_slotted := CASE WHEN v_max[v_lanes[1]] IS NOT NULL THEN v_take
                                      ELSE ARRAY[]::bigint[] END;
                ELSE
                    v_slotted := ARRAY(
                        SELECT t.id FROM unnest(h_id, h_lane) AS t(id, l)
                        WHERE t.id = ANY (v_take) AND v_max[t.l] IS NOT NULL);
                END IF;
                -- lock them (by primary key from the array); those past their time to live or
                -- delivered max_attempts times are left out, and handled below
                v_locked := ARRAY[]::bigint[];
                IF v_open = 1 THEN
                    -- (one lane: its heads are in rank order already)
                    RETURN QUERY
                        WITH locked AS (
                            UPDATE {schema}.message m SET
                                locked_until = v_now + v_lock,
                                lock_token = gen_random_uuid(),
                                attempts = m.attempts + 1,
                                slotted = m.id = ANY (v_slotted)
                            WHERE m.id = ANY (v_take)
                              AND (m.expires_at IS NULL OR m.expires_at > v_now)
                              AND m.attempts < v_qmax[array_position(v_qn, m.queue)]
                            RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                                      m.lock_token, m.created_at, m.content, m.state, m.dequeue_at
                        )
                        SELECT l.id, l.queue::text, l.channel::text, l.name, l.priority, l.attempts,
                               l.lock_token, l.created_at, l.content, l.state, NULL::bigint,
                               'delivered'::text
                        FROM locked l ORDER BY l.priority DESC, l.dequeue_at, l.id;
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    IF v_rows = cardinality(v_take) THEN
                        v_locked := v_take;
                    ELSIF v_rows > 0 THEN
                        v_locked := ARRAY(SELECT m.id FROM {schema}.message m
                                          WHERE m.id = ANY (v_take) AND m.lock_token IS NOT NULL);
                    END IF;
                    v_k := v_lanes[1];
                    v_taken[v_k] := v_taken[v_k] + cardinality(v_locked);
                    IF cardinality(v_locked) > 0 THEN
                        e_q := e_q || array_fill((v_cands[v_k]).queue::text,
                                                 ARRAY[cardinality(v_locked)]);
                        e_c := e_c || array_fill((v_cands[v_k]).channel::text,
                                                 ARRAY[cardinality(v_locked)]);
                        e_k := e_k || array_fill('delivered'::text, ARRAY[cardinality(v_locked)]);
                    END IF;
                ELSE
                FOR r IN
                    WITH locked AS (
                        UPDATE {schema}.message m SET
                            locked_until = v_now + v_lock,
                            lock_token = gen_random_uuid(),
                            attempts = m.attempts + 1,
                            slotted = m.id = ANY (v_slotted)
                        WHERE m.id = ANY (v_take) AND (m.expires_at IS NULL OR m.expires_at > v_now)
                          AND m.attempts < v_qmax[array_position(v_qn, m.queue)]
                        RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                                  m.lock_token, m.created_at, m.content, m.state
                    )
                    SELECT l.*, t.l AS lane, v_taken[t.l] + t.rn AS rnk
                    FROM locked l
                    JOIN unnest(h_id, h_lane, h_rn) AS t(id, l, rn) ON t.id = l.id
                    ORDER BY rnk, lane
                LOOP
                    v_locked := v_locked || r.id;
                    message_id := r.id;
                    queue_name := r.queue;
                    channel_name := r.channel;
                    message_name := r.name;
                    message_priority := r.priority;
                    message_attempts := r.attempts;
                    message_lock_token := r.lock_token;
                    message_created_at := r.created_at;
                    message_content := r.content;
                    message_state := r.state;
                    retry_ms := NULL;
                    event := 'delivered';
                    RETURN NEXT;
                END LOOP;
                FOR i IN 1 .. cardinality(h_id) LOOP
                    IF h_id[i] = ANY (v_locked) THEN
                        v_taken[h_lane[i]] := v_taken[h_lane[i]] + 1;
                        e_q := e_q || (v_cands[h_lane[i]]).queue;
                        e_c := e_c || (v_cands[h_lane[i]]).channel;
                        e_k := e_k || 'delivered'::text;
                    END IF;
                END LOOP;
                END IF;
                v_got := v_got + cardinality(v_locked);
                v_left := p_limit - v_got;
                IF cardinality(v_locked) > 0
                   AND (v_lock_until IS NULL OR v_now + v_lock < v_lock_until) THEN
                    v_lock_until := v_now + v_lock;
                    v_lock_id := v_locked[1];
                END IF;
                IF cardinality(v_locked) < cardinality(v_take) THEN
                    -- past their time to live: deleted
                    FOR r IN
                        DELETE FROM {schema}.message m
                        WHERE m.id = ANY (v_take) AND m.id <> ALL (v_locked) AND m.expires_at <= v_now
                        RETURNING m.id, m.queue, m.channel, m.sized
                    LOOP
                        e_q := e_q || r.queue;
                        e_c := e_c || r.channel;
                        e_k := e_k || 'expired'::text;
                        IF r.sized THEN
                            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, 1, 0);
                        END IF;
                    END LOOP;
                    -- delivered max_attempts times: dead-lettered
                    v_poison := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.id = ANY (v_take) AND m.id <> ALL (v_locked) AND m.locked_until IS NULL
                        ORDER BY m.id);
                    IF cardinality(v_poison) > 0 THEN
                        FOR r IN SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b LOOP
                            v_dead := v_dead + 1;
                            e_q := e_q || r.queue_name;
                            e_c := e_c || r.channel_name;
                            e_k := e_k || 'dead'::text;
                            RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name,
                                r.message_name, NULL::smallint, r.message_attempts, NULL::uuid,
                                r.message_created_at, NULL::bytea, NULL::bytea, NULL::bigint,
                                'dead'::text;
                        END LOOP;
                    END IF;
                END IF;
            END LOOP;

            -- 5. the owned lanes: positions past what they took, the turn to the back (or at
            --    the next due message, or none). Positions are read with the latest snapshot of
            --    the ingest: one that looked at a lane and left it as it was (its positions
            --    covered what it found) did so before this call took the lane's key.
            v_served := clock_timestamp();
            SELECT d.snap INTO v_snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
            FOR i IN 1 .. v_n LOOP
                CONTINUE WHEN NOT v_own[i];
                v_lane := v_cands[i];
                IF v_max[i] IS NOT NULL AND v_taken[i] > 0 THEN
                    UPDATE {schema}.channel c SET current_concurrency = c.current_concurrency + v_taken[i]
                    WHERE c.queue = v_lane.queue AND c.name = v_lane.channel;
                END IF;
                -- a lone lane with more to give, written a moment ago: not written now (its
                -- positions lag by what was taken since; the next write catches up)
                CONTINUE WHEN v_n = 1 AND cardinality(v_cands) = 1 AND v_more[i]
                    AND NOT v_lane.limited AND v_lane.served_at > '-infinity'
                    AND v_lane.written_at > v_now - interval '5 milliseconds';
                -- positions at the first message not taken (what this call took is locked
                -- now; what another running dequeue holds still counts)
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
                v_lane.prios := v_next.prios;
                v_lane.pos_at := v_next.pos_at;
                v_lane.pos_id := v_next.pos_id;
                v_lane.limited := v_max[i] IS NOT NULL;
                IF v_taken[i] > 0 THEN
                    v_lane.served_at := v_served + i * interval '1 microsecond';
                END IF;
                IF v_max[i] IS NOT NULL AND v_room[i] - v_taken[i] <= 0 THEN
                    v_lane.turn_at := NULL;  -- at its max_concurrency: no turn until a slot frees
                ELSIF v_more[i] THEN
                    v_lane.turn_at := GREATEST(v_lane.served_at, v_lane.turn_at);
                ELSE
                    v_lane.turn_at := CASE WHEN v_next.next_at IS NOT NULL
                        THEN GREATEST(v_next.next_at, v_lane.served_at, (v_cands[i]).turn_at) END;
                END IF;
                -- (a version superseded meanwhile by its previous owner is left as it is)
                IF EXISTS (SELECT 1 FROM {schema}.lane l WHERE l.id = (v_cands[i]).id) THEN
                    PERFORM {schema}.lane_put_v1((v_cands[i]).id, v_lane);
                END IF;
            END LOOP;
        END IF;
        EXIT WHEN v_got > 0;

        -- 6. nothing. A listening caller registers as sleeping, checks for producers still
        --    in their transactions (they may have looked for sleepers before), then looks
        --    once more: a producer that commits after that sees it sleeping and notifies.
        IF p_listen AND NOT v_slept THEN
            v_slept := true;
            v_keys := (SELECT string_agg({schema}.queue_key_v1('sleep', u.q)::text, ',')
                       FROM (SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q)) AS u);
            PERFORM pg_advisory_lock_shared(k.key)
            FROM unnest(string_to_array(v_keys, ',')::bigint[]) AS k(key);
            PERFORM set_config('lonnymq.sleeping', v_keys, false);
            v_busy := EXISTS (SELECT 1 FROM unnest(p_queues) AS u(q)
                              WHERE NOT {schema}.queue_idle_v1(u.q));
            v_ingested := false;
            v_now := clock_timestamp();
            CONTINUE;
        END IF;
        -- (then ingest, waiting a little for an ingest another consumer is running: what it
        -- brings in is not deliverable before it commits, and answering "nothing" meanwhile
        -- would send this caller to sleep while messages wait)
        EXIT WHEN v_waited;
        v_waited := true;
        v_d := {schema}.ingest_wait_v1(p_queues);
        v_ingested := true;
        v_now := clock_timestamp();
    END LOOP;

    -- the tally of this call: one row per channel (one channel, the usual case, without an
    -- aggregate)
    IF cardinality(e_q) > 0 AND e_q <@ ARRAY[e_q[1]] AND e_c <@ ARRAY[e_c[1]] THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired, dead,
                                    dead_held, lock_until, lock_id)
        VALUES (e_q[1], e_c[1], cardinality(array_positions(e_k, 'delivered')),
                cardinality(array_positions(e_k, 'redelivered')),
                cardinality(array_positions(e_k, 'acked')),
                cardinality(array_positions(e_k, 'expired')),
                cardinality(array_positions(e_k, 'dead')),
                cardinality(array_positions(e_k, 'dead_held')),
                CASE WHEN 'delivered' = ANY (e_k) OR 'redelivered' = ANY (e_k) THEN v_lock_until END,
                CASE WHEN 'delivered' = ANY (e_k) OR 'redelivered' = ANY (e_k) THEN v_lock_id END);
    ELSIF cardinality(e_q) > 0 THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired, dead,
                                    dead_held, lock_until, lock_id)
        SELECT u.q, u.c, count(*) FILTER (WHERE u.k = 'delivered'),
               count(*) FILTER (WHERE u.k = 'redelivered'), count(*) FILTER (WHERE u.k = 'acked'),
               count(*) FILTER (WHERE u.k = 'expired'), count(*) FILTER (WHERE u.k = 'dead'),
               count(*) FILTER (WHERE u.k = 'dead_held'),
               CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN v_lock_until END,
               CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN v_lock_id END
        FROM unnest(e_q, e_c, e_k) AS u(q, c, k)
        GROUP BY u.q, u.c;
    END IF;

    IF v_got = 0 THEN
        -- (after dead-lettering, look again at once: what comes next may be deliverable)
        v_retry := CASE WHEN v_dead > 0 THEN 0 ELSE {schema}.queue_retry_ms_v1(p_queues, v_d) END;
        IF v_busy THEN
            v_retry := LEAST(coalesce(v_retry, 20), 20);
        END IF;
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, v_retry,
            NULL::text;
    END IF;
END;
$$;

-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

CREATE OR REPLACE FUNCTION {schema}.message_delete_many_v1(p_ids bigint[], p_lock_tokens uuid[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_gone bigint[];
    v_q text[];
    v_c text[];
    v_s boolean[];
    v_l boolean[];
    r record;
BEGIN
    WITH gone AS (
        DELETE FROM {schema}.message m
        WHERE m.id = ANY (p_ids)
          AND m.lock_token = p_lock_tokens[array_position(p_ids, m.id)]
        RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
    )
    SELECT array_agg(g.id), array_agg(g.queue), array_agg(g.channel), array_agg(g.sized),
           array_agg(g.slotted)
    INTO v_gone, v_q, v_c, v_s, v_l FROM gone g;
    IF v_gone IS NOT NULL THEN
        INSERT INTO {schema}.tally (queue, channel, acked)
        SELECT u.q, u.c, count(*) FROM unnest(v_q, v_c) AS u(q, c) GROUP BY u.q, u.c;
        IF true = ANY (v_s) OR true = ANY (v_l) THEN
            FOR r IN
                SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
                       count(*) FILTER (WHERE u.l)::integer AS l
                FROM unnest(v_q, v_c, v_s, v_l) AS u(q, c, s, l)
                WHERE u.s OR u.l GROUP BY u.q, u.c ORDER BY u.q, u.c
            LOOP
                PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
            END LOOP;
        END IF;
    END IF;
    IF coalesce(cardinality(v_gone), 0) = cardinality(p_ids) THEN
        RETURN QUERY SELECT h.id, 'ok'::text FROM unnest(p_ids) AS h(id);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT h.id,
            CASE WHEN h.id = ANY (coalesce(v_gone, ARRAY[]::bigint[])) THEN 'ok'
                 WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                     THEN 'state_invalid'
                 ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
END;
$$;

-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

CREATE OR REPLACE FUNCTION {schema}.message_defer_v1(
    p_id bigint, p_lock_token uuid, p_delay_ms bigint, p_set_state boolean, p_state bytea,
    OUT result_code text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    r record;
BEGIN
    UPDATE {schema}.message m SET
        locked_until = NULL,
        lock_token = NULL,
        slotted = false,
        txid = pg_current_xact_id(),
        arrival = 1,
        dequeue_at = CASE WHEN p_delay_ms IS NULL THEN m.dequeue_at
            ELSE clock_timestamp() + p_delay_ms * interval '1 millisecond' END,
        state = CASE WHEN p_set_state THEN p_state ELSE m.state END
    FROM (SELECT o.id, o.slotted FROM {schema}.message o
          WHERE o.id = p_id AND o.lock_token = p_lock_token
          FOR UPDATE) AS old
    WHERE m.id = old.id
    RETURNING m.queue, m.channel, old.slotted INTO r;
    IF r.queue IS NULL THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    INSERT INTO {schema}.tally (queue, channel, deferred) VALUES (r.queue, r.channel, 1);
    IF r.slotted THEN
        PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, 0, 1);
    END IF;
    PERFORM {schema}.wake_v1(r.queue);
    result_code := 'ok';
END;
$$;

-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_defer_v1(bigint, uuid, bigint, boolean, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

CREATE OR REPLACE FUNCTION {schema}.message_heartbeat_v1(p_ids bigint[], p_lock_tokens uuid[], p_lock_ms bigint)
RETURNS TABLE (message_id bigint, locked_until timestamptz)
LANGUAGE sql AS $$
    WITH extended AS (
        UPDATE {schema}.message m SET locked_until = clock_timestamp() + p_lock_ms * interval '1 millisecond'
        FROM unnest(p_ids, p_lock_tokens) AS h(id, lock_token)
        WHERE m.id = h.id AND m.lock_token = h.lock_token
        RETURNING m.id, m.queue, m.channel, m.locked_until
    ), tallied AS (
        -- (a lock extended for less than it had: the ingest's hint of the next expiry)
        INSERT INTO {schema}.tally (queue, channel, lock_until, lock_id)
        SELECT DISTINCT ON (e.queue, e.channel) e.queue, e.channel, e.locked_until, e.id
        FROM extended e ORDER BY e.queue, e.channel, e.locked_until
    )
    SELECT e.id, e.locked_until FROM extended e;
$$;

-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_heartbeat_v1(bigint[], uuid[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

CREATE OR REPLACE FUNCTION {schema}.message_reject_v1(
    p_id bigint, p_lock_token uuid, p_reason text, OUT result_code text
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    r record;
BEGIN
    PERFORM 1 FROM {schema}.message m
    WHERE m.id = p_id AND m.lock_token = p_lock_token
    FOR UPDATE;
    IF NOT FOUND THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    FOR r IN SELECT * FROM {schema}.message_bury_v1(ARRAY[p_id], coalesce(p_reason, 'rejected')) LOOP
        INSERT INTO {schema}.tally (queue, channel, dead, dead_held)
        VALUES (r.queue_name, r.channel_name, 1, 1);
    END LOOP;
    result_code := 'ok';
END;
$$;

-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_reject_v1(bigint, uuid, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
