-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 4. Ingest, discovery and fold
-- The ingest position (discovery), what committed since, and the fold of the tallies.
-- ---------------------------------------------------------------------------------------------

-- The current snapshot, with the caller's own transaction among the running ones. (A
-- transaction's own snapshot leaves its xid out: what it writes after the ingest, such as
-- its tally, would pass for ingested and never be.)
CREATE FUNCTION {schema}.snapshot_v1() RETURNS pg_snapshot
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_snap pg_snapshot := pg_current_snapshot();
    v_own xid8 := pg_current_xact_id_if_assigned();
BEGIN
    IF v_own IS NULL OR NOT pg_visible_in_snapshot(v_own, v_snap) THEN
        RETURN v_snap;
    END IF;
    RETURN format('%s:%s:%s', LEAST(pg_snapshot_xmin(v_snap), v_own), pg_snapshot_xmax(v_snap),
        array_to_string(ARRAY(
            SELECT x FROM (SELECT pg_snapshot_xip(v_snap) AS x UNION SELECT v_own) AS u
            ORDER BY x), ','))::pg_snapshot;
END;
$$;

-- The ingest's first position (only when there is none: a repair of the schema must not claim
-- what is not ingested), with the installing transaction among the running ones: what it
-- creates after the install (inside a caller's transaction) is not taken as ingested, even
-- when a later transaction committed meanwhile.
INSERT INTO {schema}.discovery (snap, folded)
SELECT {schema}.snapshot_v1(), {schema}.snapshot_v1()
WHERE NOT EXISTS (SELECT 1 FROM {schema}.discovery);

-- Positions merged: per priority, the earlier of the old and the new (p_* are the new ones).
CREATE FUNCTION {schema}.positions_merge_v1(
    p_lane {schema}.lane, p_prios smallint[], p_at timestamptz[], p_id bigint[],
    OUT prios smallint[], OUT pos_at timestamptz[], OUT pos_id bigint[]
)
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    SELECT array_agg(x.prio ORDER BY x.prio DESC), array_agg(x.at ORDER BY x.prio DESC),
           array_agg(x.pid ORDER BY x.prio DESC)
    INTO prios, pos_at, pos_id
    FROM (
        SELECT DISTINCT ON (u.prio) u.prio, u.at, u.pid
        FROM (
            SELECT * FROM unnest(p_lane.prios, p_lane.pos_at, p_lane.pos_id) AS o(prio, at, pid)
            UNION ALL
            SELECT * FROM unnest(p_prios, p_at, p_id) AS n(prio, at, pid)
        ) AS u
        ORDER BY u.prio, u.at, u.pid
    ) AS x;
END;
$$;

-- Ingest what became ready in transactions that committed since the last snapshot (new
-- messages, deferred and requeued ones): give their lanes a turn, or an earlier one, and lower
-- the lanes' positions to them; count the created ones; give a turn back to lanes whose
-- channel got a slot back (`freed`); advance the scan positions of p_queues; fold the tallies
-- (at most once a second, or now with p_fold). One caller at a time (advisory lock): with
-- p_wait it waits for the current one, else it returns the latest state. Consumers deliver
-- only what is ingested. Its steps: ingest_fresh_v1 (1), ingest_freed_v1 (2),
-- ingest_positions_v1 (3 and 4), then the fold and the new state (5).
CREATE FUNCTION {schema}.ingest_v1(p_queues text[], p_wait boolean, p_fold boolean)
RETURNS {schema}.discovery
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_old {schema}.discovery;
    v_new {schema}.discovery;
    v_snap pg_snapshot;
    v_now timestamptz;
    v_committed xid8[];
    v_fresh record;
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
    -- what was in progress then and has committed since
    v_committed := ARRAY(SELECT x FROM pg_snapshot_xip(v_old.snap) AS x
                         WHERE pg_visible_in_snapshot(x, v_snap));

    -- 1. what is new: the lanes of its channels
    SELECT * INTO v_fresh FROM {schema}.ingest_fresh_v1(v_old, v_snap, v_committed, v_now);
    v_new.pend_queue := v_fresh.pend_queue;
    v_new.pend_channel := v_fresh.pend_channel;
    v_new.pend_prio := v_fresh.pend_prio;
    v_new.pend_at := v_fresh.pend_at;
    v_new.pend_id := v_fresh.pend_id;
    -- 2. channels that got a slot back while at their max_concurrency
    IF v_fresh.keys < 1000 AND EXISTS (SELECT 1 FROM {schema}.channel c WHERE c.freed) THEN
        PERFORM {schema}.ingest_freed_v1(v_old, v_snap, v_fresh.keys);
    END IF;
    -- 3 and 4. the next lock expiry of every queue; the scan positions of the caller's
    v_new := {schema}.ingest_positions_v1(v_new, p_queues, v_snap, v_committed, v_now);

    -- 5. the tallies folded (at most once a second) or the created ones counted; the state
    IF p_fold OR v_old.folded_at < v_now - interval '1 second' THEN
        PERFORM {schema}.fold_v1(v_old.folded, v_snap, v_fresh.created_queues,
                                 v_fresh.created_channels, v_fresh.created_counts);
        v_new.folded := v_snap;
        v_new.folded_at := v_now;
    ELSIF cardinality(v_fresh.created_queues) > 0 THEN
        INSERT INTO {schema}.tally (queue, channel, enqueued)
        SELECT * FROM unnest(v_fresh.created_queues, v_fresh.created_channels,
                             v_fresh.created_counts);
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

-- Ingest, step 1: what committed between the last state p_old and p_snap (p_committed: the
-- transactions in progress in p_old that have committed since), and the heads the last ingest
-- could not write, per channel: its lane gets a turn, or an earlier one, and positions no
-- later than its new heads. A channel without a lane gets one, and needs no key: no dequeue
-- can own a lane that has no version, and whoever else creates lanes holds the ingest key. A
-- lane that exists is written under its key: one its owner is serving right now waits for
-- the next ingest (no waiting: its heads are returned as pend_*), and so do those past the
-- first 1,000 keys of this ingest (each key holds a slot of the server's lock table until
-- commit, at most max_locks_per_transaction x max_connections in all, 6,400 by default:
-- 100,000 of them made every ingest fail with `out of shared memory`). Returns the messages
-- created per channel (to count) and the keys taken.
CREATE FUNCTION {schema}.ingest_fresh_v1(
    p_old {schema}.discovery, p_snap pg_snapshot, p_committed xid8[], p_now timestamptz,
    OUT created_queues text[], OUT created_channels text[], OUT created_counts integer[],
    OUT pend_queue text[], OUT pend_channel text[], OUT pend_prio smallint[],
    OUT pend_at timestamptz[], OUT pend_id bigint[], OUT keys integer
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    r record;
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_merged record;
    v_limited boolean;
    v_max integer;
    v_in_flight integer;
    v_turn_from timestamptz;
    v_at timestamptz;
    v_at_queue integer;
    v_last_queue text := '';
    v_pending integer := 0;
    v_head integer;
BEGIN
    created_queues := ARRAY[]::text[];
    created_channels := ARRAY[]::text[];
    created_counts := ARRAY[]::integer[];
    pend_queue := ARRAY[]::text[];
    pend_channel := ARRAY[]::text[];
    pend_prio := ARRAY[]::smallint[];
    pend_at := ARRAY[]::timestamptz[];
    pend_id := ARRAY[]::bigint[];
    keys := 0;
    FOR r IN
        WITH fresh AS MATERIALIZED (
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(p_old.snap) AND m.txid < pg_snapshot_xmax(p_snap)
              AND m.lock_token IS NULL AND pg_visible_in_snapshot(m.txid, p_snap)
            UNION ALL
            -- (by the txid index, one probe per transaction: another partial index of the
            -- same predicate would be read whole, dead entries and all; OFFSET 0 keeps the
            -- planner from flattening the probes into a hash join over such a read)
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM unnest(p_committed) AS x(txid)
            CROSS JOIN LATERAL (
                SELECT m.* FROM {schema}.message m
                WHERE m.txid = x.txid AND m.lock_token IS NULL
                OFFSET 0
            ) AS m
            UNION ALL
            -- the heads the last ingest could not write (counted then)
            SELECT p.q, p.c, p.prio, p.at, p.id, 1::smallint
            FROM unnest(p_old.pend_queue, p_old.pend_channel, p_old.pend_prio, p_old.pend_at,
                        p_old.pend_id) AS p(q, c, prio, at, id)
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
            v_at_queue := array_position(p_old.queues, r.queue);
            v_turn_from := CASE WHEN v_at_queue IS NULL THEN '-infinity'
                                ELSE p_old.turn_from[v_at_queue] END;
        END IF;
        IF r.created > 0 THEN
            created_queues := created_queues || r.queue;
            created_channels := created_channels || r.channel;
            created_counts := created_counts || r.created;
        END IF;
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        IF v_lane.id IS NOT NULL THEN
            IF keys >= 1000
               OR NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel)) THEN
                -- (appended in place, element by element: `||` would copy the arrays at each)
                FOR v_head IN 1 .. cardinality(r.prios) LOOP
                    v_pending := v_pending + 1;
                    pend_queue[v_pending] := r.queue;
                    pend_channel[v_pending] := r.channel;
                    pend_prio[v_pending] := r.prios[v_head];
                    pend_at[v_pending] := r.pos_at[v_head];
                    pend_id[v_pending] := r.pos_id[v_head];
                END LOOP;
                CONTINUE;
            END IF;
            keys := keys + 1;
            -- (again, under the key: its owner may have written a newer version meanwhile)
            v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        END IF;
        v_put := v_lane;
        IF v_lane.id IS NULL THEN
            SELECT l.max_concurrency IS NOT NULL OR l.rate_count IS NOT NULL INTO v_limited
            FROM {schema}.channel_limits_v2(r.queue, r.channel) l;
            v_put := ROW(NULL, r.queue, r.channel, NULL, '-infinity', p_now, v_limited,
                         '{{}}', '{{}}', '{{}}', NULL)::{schema}.lane;
        END IF;
        SELECT * INTO v_merged FROM {schema}.positions_merge_v1(v_put, r.prios, r.pos_at, r.pos_id);
        v_put.prios := v_merged.prios;
        v_put.pos_at := v_merged.pos_at;
        v_put.pos_id := v_merged.pos_id;
        -- (a rated lane out of tokens: not before its next one)
        v_at := GREATEST(r.due, v_put.served_at, v_turn_from, v_put.not_before);
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
END;
$$;

-- Ingest, step 2: channels that got a slot back while at their max_concurrency (`freed`):
-- their lanes' turn again (the lane, then the channel row: the order of the dequeue; an ack
-- locks only the row). A lane being served, a row an ack holds, and those past 1,000 lane
-- keys for the ingest (p_keys: those it took already) wait for the next ingest.
CREATE FUNCTION {schema}.ingest_freed_v1(
    p_old {schema}.discovery, p_snap pg_snapshot, p_keys integer
)
RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    r record;
    v_keys integer := p_keys;
    v_lane {schema}.lane;
    v_next record;
    v_max integer;
    v_in_flight integer;
    v_at_queue integer;
BEGIN
    FOR r IN SELECT c.queue, c.name FROM {schema}.channel c WHERE c.freed ORDER BY c.queue, c.name LOOP
        EXIT WHEN v_keys >= 1000;
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.name));
        v_keys := v_keys + 1;
        SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND c.freed FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        v_lane := {schema}.lane_get_v1(r.queue, r.name);
        IF v_lane.id IS NOT NULL AND v_lane.turn_at IS NULL THEN
            SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.name) l;
            IF v_max IS NULL OR v_in_flight < v_max THEN
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, p_snap);
                IF v_next.next_at IS NOT NULL THEN
                    v_at_queue := array_position(p_old.queues, r.queue);
                    v_lane.turn_at := GREATEST(v_next.next_at, v_lane.served_at, v_lane.not_before,
                        CASE WHEN v_at_queue IS NULL THEN '-infinity'
                             ELSE p_old.turn_from[v_at_queue] END);
                    PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                END IF;
            END IF;
        END IF;
        UPDATE {schema}.channel c SET freed = false WHERE c.queue = r.queue AND c.name = r.name;
        DELETE FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0
          AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
    END LOOP;
END;
$$;

-- Ingest, steps 3 and 4, on the new state p_new (returned): 3. the locks taken or extended
-- since the last state (p_new.snap: the tallies of the calls that took them, committed in
-- p_snap; p_committed: as for ingest_fresh_v1): per queue, the earliest (and its message)
-- lowers the queue's next expiry (every queue known, the caller's or not); 4. the scan
-- positions of the queues of p_queues (a queue not known yet is added).
CREATE FUNCTION {schema}.ingest_positions_v1(
    p_new {schema}.discovery, p_queues text[], p_snap pg_snapshot, p_committed xid8[],
    p_now timestamptz
)
RETURNS {schema}.discovery
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    r record;
    v_new {schema}.discovery := p_new;
    v_queue text;
    v_at_queue integer;
    v_at timestamptz;
    v_next_id bigint;
BEGIN
    FOR r IN
        SELECT DISTINCT ON (t.queue) t.queue, t.lock_until, t.lock_id
        FROM (
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid >= pg_snapshot_xmax(p_new.snap) AND t.txid < pg_snapshot_xmax(p_snap)
              AND pg_visible_in_snapshot(t.txid, p_snap) AND t.lock_until IS NOT NULL
            UNION ALL
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid = ANY (p_committed) AND t.lock_until IS NOT NULL
        ) AS t
        ORDER BY t.queue, t.lock_until, t.lock_id
    LOOP
        v_at_queue := array_position(v_new.queues, r.queue);
        IF v_at_queue IS NOT NULL AND (v_new.lock_next[v_at_queue] IS NULL
                                       OR r.lock_until < v_new.lock_next[v_at_queue]) THEN
            v_new.lock_next[v_at_queue] := r.lock_until;
            v_new.lock_id[v_at_queue] := r.lock_id;
        END IF;
    END LOOP;

    FOREACH v_queue IN ARRAY ARRAY(SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q) ORDER BY u.q) LOOP
        v_at_queue := array_position(v_new.queues, v_queue);
        IF v_at_queue IS NULL THEN
            v_new.queues := v_new.queues || v_queue;
            v_new.turn_from := v_new.turn_from || '-infinity'::timestamptz;
            v_new.lock_from := v_new.lock_from || '-infinity'::timestamptz;
            v_new.lock_next := v_new.lock_next || '-infinity'::timestamptz;
            v_new.lock_id := v_new.lock_id || NULL::bigint;
            v_at_queue := cardinality(v_new.queues);
        END IF;
        -- no live turn of the queue is earlier than the first one found from the old position
        -- (every later turn is written at or after its writer's clock, or by an ingest)
        v_new.turn_from[v_at_queue] := LEAST(p_now, coalesce((
            SELECT l.turn_at FROM {schema}.lane l
            WHERE l.queue = v_queue AND l.turn_at >= v_new.turn_from[v_at_queue]
            ORDER BY l.turn_at, l.id LIMIT 1), p_now));
        -- locks that expired and are not handled yet, else now
        v_new.lock_from[v_at_queue] := coalesce((
            SELECT m.locked_until FROM {schema}.message m
            WHERE m.queue = v_queue AND m.locked_until >= v_new.lock_from[v_at_queue]
              AND m.locked_until <= p_now
            ORDER BY m.locked_until LIMIT 1), p_now);
        -- the next lock expiry: while the message named still has it, it is the next one;
        -- else (acked, extended, taken over) the first live lock from it on (the entries
        -- between, of acked messages, are walked about once: the bound moves on past them)
        IF v_new.lock_next[v_at_queue] IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM {schema}.message m
            WHERE m.id = v_new.lock_id[v_at_queue] AND m.queue = v_queue
              AND m.locked_until = v_new.lock_next[v_at_queue]) THEN
            SELECT m.locked_until, m.id INTO v_at, v_next_id FROM {schema}.message m
            WHERE m.queue = v_queue AND m.locked_until >= v_new.lock_next[v_at_queue]
            ORDER BY m.locked_until LIMIT 1;
            v_new.lock_next[v_at_queue] := v_at;  -- (NULL: no lock)
            v_new.lock_id[v_at_queue] := v_next_id;
        END IF;
    END LOOP;
    RETURN v_new;
END;
$$;

-- Ingest, waiting (at most 50 ms) for an ingest another consumer is running: what it brings
-- in is not deliverable before it commits. Past the 50 ms, the latest state as it is, and
-- in_vain: what that ingest brings in is not in the state, and no NOTIFY will tell the caller
-- when it commits (schema version 25).
CREATE FUNCTION {schema}.ingest_wait_v2(
    p_queues text[], OUT state {schema}.discovery, OUT in_vain boolean
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_timeout text := current_setting('lock_timeout');
BEGIN
    in_vain := false;
    BEGIN
        PERFORM set_config('lock_timeout', '50ms', true);
        state := {schema}.ingest_v1(p_queues, true, false);
    EXCEPTION WHEN lock_not_available THEN
        SELECT * INTO state FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        in_vain := true;
    END;
    PERFORM set_config('lock_timeout', v_timeout, true);
END;
$$;

-- Fold the tallies of the transactions visible in p_snap and not in p_from (with p_q/p_c/p_n
-- enqueued counts of the caller) into channel_count; a channel left empty, without a policy,
-- is noted in lane_idle (its lane and counts go when it has stayed empty for a while:
-- lane_prune_v1). Run by the ingest.
CREATE FUNCTION {schema}.fold_v1(
    p_from pg_snapshot, p_snap pg_snapshot, p_q text[], p_c text[], p_n integer[]
) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_xip xid8[];
    r {schema}.channel_count;
    v_idle_q text[] := ARRAY[]::text[];
    v_idle_c text[] := ARRAY[]::text[];
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
            -- (the newest row from (queue, channel) on, in channel_count_latest_idx order: a
            -- range no other index gives, so the primary key is never read backwards instead)
            LEFT JOIN LATERAL (
                SELECT x.* FROM (
                    SELECT * FROM {schema}.channel_count c
                    WHERE (c.queue, c.channel) >= (d.queue, d.channel)
                    ORDER BY c.queue, c.channel, c.id DESC LIMIT 1
                ) AS x
                WHERE x.queue = d.queue AND x.channel = d.channel
            ) AS o ON true
        ), replaced AS (
            DELETE FROM {schema}.channel_count c USING old o
            WHERE c.queue = o.queue AND c.channel = o.channel AND c.id = o.old_id
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
        -- (its lane stays: deleted now and needed again a moment later, it would be looked up
        -- through every dead version a held snapshot keeps of it)
        v_idle_q := v_idle_q || r.queue;
        v_idle_c := v_idle_c || r.channel;
    END LOOP;
    IF cardinality(v_idle_q) > 0 THEN
        INSERT INTO {schema}.lane_idle (queue, channel, since)
        SELECT u.q, u.c, clock_timestamp() FROM unnest(v_idle_q, v_idle_c) AS u(q, c)
        ORDER BY u.q, u.c
        ON CONFLICT (queue, channel) DO NOTHING;
    END IF;
END;
$$;

-- Remove the lanes and counts of channels that have stayed empty since a fold found them so,
-- p_idle ago or more (at most p_limit, oldest first): each channel's folded counts go to its
-- queue's row (one write per queue), its channel row too when nothing holds it (no policy, no
-- count, no rate owed). A channel whose lane was written after it emptied (a message came) is
-- left alone; the next fold that finds it empty notes it again. Run by housekeeping, after an
-- ingest (so every committed message has written its lane). Returns the channels removed.
CREATE FUNCTION {schema}.lane_prune_v1(p_limit integer, p_idle interval) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_d {schema}.discovery;
    r record;
    v_lane {schema}.lane;
    v_count {schema}.channel_count;
    v_gone {schema}.channel_count[] := ARRAY[]::{schema}.channel_count[];
    v_n integer := 0;
BEGIN
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        SELECT i.queue, i.channel, i.since FROM {schema}.lane_idle i
        WHERE i.since < v_now - p_idle
        ORDER BY i.since LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    LOOP
        -- (a lane being served is busy, not idle)
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel));
        DELETE FROM {schema}.lane_idle i WHERE i.queue = r.queue AND i.channel = r.channel;
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        CONTINUE WHEN v_lane.id IS NOT NULL
            AND (v_lane.written_at > r.since OR v_lane.turn_at IS NOT NULL);
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM unnest(v_d.pend_queue, v_d.pend_channel) AS p(q, c)
            WHERE p.q = r.queue AND p.c = r.channel);
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = r.queue AND c.name = r.channel AND c.has_policy);
        IF v_lane.id IS NOT NULL THEN
            DELETE FROM {schema}.lane l
            WHERE l.queue = r.queue AND l.channel = r.channel AND l.id = v_lane.id;
        END IF;
        SELECT x.* INTO v_count FROM (
            SELECT * FROM {schema}.channel_count c
            WHERE (c.queue, c.channel) >= (r.queue, r.channel)
            ORDER BY c.queue, c.channel, c.id DESC LIMIT 1
        ) AS x
        WHERE x.queue = r.queue AND x.channel = r.channel;
        IF v_count.id IS NOT NULL THEN
            DELETE FROM {schema}.channel_count cc
            WHERE cc.queue = r.queue AND cc.channel = r.channel AND cc.id = v_count.id;
            v_gone := v_gone || v_count;
        END IF;
        DELETE FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.channel AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
          AND (c.rate_tat IS NULL OR c.rate_tat <= v_now);
        v_n := v_n + 1;
    END LOOP;
    -- the removed channels' counts go to their queue's row in one write per queue (a write per
    -- channel would grow that row's chain of versions by every channel removed)
    IF cardinality(v_gone) > 0 THEN
        INSERT INTO {schema}.queue_count AS qc (queue, enqueued, delivered, redelivered, acked,
            deferred, dead, dead_held, expired, dropped, removed, removed_held, purged)
        SELECT g.queue, sum(g.enqueued), sum(g.delivered), sum(g.redelivered), sum(g.acked),
               sum(g.deferred), sum(g.dead), sum(g.dead_held), sum(g.expired), sum(g.dropped),
               sum(g.removed), sum(g.removed_held), sum(g.purged)
        FROM unnest(v_gone) AS g
        WHERE EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = g.queue)
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
    RETURN v_n;
END;
$$;

