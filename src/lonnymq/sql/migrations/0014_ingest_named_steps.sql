-- lonnymq migration 14.

-- =============================================================================================
-- The ingest and the dequeue as named steps (issue 26)
-- =============================================================================================
--
-- ingest_v1 (same signature and result) reads as its steps, each a function of its own:
-- ingest_fresh_v1 (1: what committed since, to the lanes of its channels), ingest_freed_v1
-- (2: channels that got a slot back; called only when there is one), ingest_positions_v1 (3
-- and 4: the next lock expiry of every queue, the scan positions of the caller's), then the
-- fold and the new state (5). message_dequeue_v3 (same signature and results): what a pass
-- of step 4 could not lock (expired, or delivered max_attempts times) is handled by
-- dequeue_leftovers_v1, which tallies it; a call with p_listen false that ingested first
-- (its session created, requeued or took without an ingest) does not ingest again before it
-- answers "nothing" (its caller sleeps on its own and looks again once registered), and one
-- that finds no lane due tries the take (dequeue_take_v1) before it reads the ingest's
-- state. No table changes.

-- Ingest what became ready in transactions that committed since the last snapshot (new
-- messages, deferred and requeued ones): give their lanes a turn, or an earlier one, and lower
-- the lanes' positions to them; count the created ones; give a turn back to lanes whose
-- channel got a slot back (`freed`); advance the scan positions of p_queues; fold the tallies
-- (at most once a second, or now with p_fold). One caller at a time (advisory lock): with
-- p_wait it waits for the current one, else it returns the latest state. Consumers deliver
-- only what is ingested. Its steps: ingest_fresh_v1 (1), ingest_freed_v1 (2),
-- ingest_positions_v1 (3 and 4), then the fold and the new state (5).
CREATE OR REPLACE FUNCTION {schema}.ingest_v1(p_queues text[], p_wait boolean, p_fold boolean)
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

-- Step 4, what a pass took (p_take) and could not lock (not in p_locked): those past their
-- time to live deleted (event 'expired'), those delivered max_attempts times dead-lettered;
-- returns the latter (their dead letters' rows). Tallied here.
CREATE FUNCTION {schema}.dequeue_leftovers_v1(
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
            WHERE m.id = ANY (p_take) AND m.id <> ALL (p_locked) AND m.expires_at <= p_now
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
    v_poison := ARRAY(
        SELECT m.id FROM {schema}.message m
        WHERE m.id = ANY (p_take) AND m.id <> ALL (p_locked) AND m.locked_until IS NULL
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

-- Dequeue up to p_limit messages from the given queues and lock them for p_lock_ms; with
-- p_ack_ids/p_ack_tokens, delete those held messages first (a consumer's acks travel with
-- its next dequeue: rows 'ack_state_invalid' / 'ack_not_found' for those that did not
-- apply). Messages whose lock expired come first (their holder is gone); then lanes whose
-- turn it is are served round-robin, the one waiting longest first, an equal share each,
-- within a channel's max_concurrency; within a lane, highest priority, then earliest due,
-- then oldest. Rows come back in delivery order. When nothing is available, one row comes
-- back with message_id NULL and retry_ms: milliseconds until something may become available
-- (NULL: nothing is pending). With p_listen, a caller that gets nothing is registered as
-- sleeping on its queues until its next call: their producers then send a NOTIFY. A message
-- delivered max_attempts times already (of its queue) goes to the dead letters instead and
-- comes back as a row with event 'dead'; a delivered message's event is 'delivered', or
-- 'redelivered' when its previous lock had expired.
--
-- Nothing here waits for another transaction: a consumer owns a lane for its call when it
-- gets the lane's advisory key (it then moves the lane to the back and its positions past
-- what it took); a lane owned by another consumer is served too, without being written,
-- unless it has a max_concurrency (whose count is under the channel row, locked by its owner).
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
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_lock_until timestamptz;
    v_lock_id bigint;
    v_state {schema}.discovery;
    v_ingested boolean := false;
    v_slept boolean := false;
    v_waited boolean := false;
    v_rows integer;
    v_busy boolean := false;
    v_got integer := 0;
    v_left integer;
    v_count integer;  -- the lanes of this look
    v_at integer;  -- a lane, as its place in v_due
    r record;
    v_keys text;  -- the sleep keys held
    -- events for the tally: queue, channel, kind
    v_ev_queue text[] := ARRAY[]::text[];
    v_ev_channel text[] := ARRAY[]::text[];
    v_ev_kind text[] := ARRAY[]::text[];
    -- acks: the messages deleted, and of each its queue, channel, sized and slotted
    v_gone bigint[]; v_ack_queue text[]; v_ack_channel text[];
    v_ack_sized boolean[]; v_ack_slotted boolean[];
    -- queues: names, and of each its max_attempts and positions (turns, locks)
    v_names text[]; v_max_attempts integer[]; v_turn_from timestamptz[]; v_lock_from timestamptz[];
    v_expired boolean;
    -- lanes, and per lane: owned, cap, room, max_concurrency, taken, more due, done
    v_due {schema}.lane[];
    v_owned boolean[]; v_cap integer[]; v_room integer[]; v_max integer[];
    v_taken integer[]; v_more boolean[]; v_done boolean[];
    -- rated lanes: emission interval, burst, tat (at least now) and tokens when the call began
    v_interval interval[]; v_burst integer[]; v_tat timestamptz[]; v_tokens integer[];
    v_opened integer;
    v_share integer;
    v_passes integer;
    v_lanes integer[];
    v_quota integer[];
    -- a pass's heads: id, lane, rank in lane
    v_heads bigint[]; v_head_lane integer[]; v_head_rank integer[];
    v_take bigint[];
    v_slotted bigint[];
    v_locked bigint[];
    v_lane {schema}.lane;
    v_retry bigint;
    v_snap pg_snapshot;
    v_dead integer := 0;
    -- the usual call (step 2): taken without steps 3 to 6; its acks tallied with it
    v_served boolean := false;
    v_acked integer;
    v_after_at timestamptz;
    v_after_id bigint := 0;
    v_passed integer := 0;
    v_apart boolean;  -- (acks of another channel, tallied apart)
    v_usual boolean;
    i integer;
BEGIN
    -- 0. a caller that slept (it found nothing last time) is awake again
    v_keys := current_setting('lonnymq.sleeping', true);
    IF v_keys IS NOT NULL AND v_keys <> '' THEN
        PERFORM {schema}.dequeue_wake_v1(v_keys);
    END IF;

    -- 1. acks, in the same statement as the usual call's read (2): the ingest's state, the
    --    lanes whose turn it is and, when the call is the usual one, the first one's heads
    v_usual := cardinality(p_queues) = 1 AND p_limit > 0
        AND current_setting('lonnymq.fresh', true) IS DISTINCT FROM 'on';
    LOOP
        IF v_usual OR coalesce(cardinality(p_ack_ids), 0) > 0 THEN  -- (a 2nd round: usual)
            v_now := clock_timestamp();
            WITH gone AS (
                DELETE FROM {schema}.message m
                WHERE NOT v_ingested AND m.id = ANY (p_ack_ids)
                  AND m.lock_token = p_ack_tokens[array_position(p_ack_ids, m.id)]
                RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
            )
            SELECT a.ids, a.queues, a.channels, a.sized, a.slotted, s.lanes, s.heads
            INTO v_gone, v_ack_queue, v_ack_channel, v_ack_sized, v_ack_slotted, v_due, v_heads
            FROM (SELECT array_agg(g.id) AS ids, array_agg(g.queue) AS queues,
                         array_agg(g.channel) AS channels, array_agg(g.sized) AS sized,
                         array_agg(g.slotted) AS slotted
                  FROM gone g) AS a
            LEFT JOIN LATERAL (
                SELECT x.lanes, h.heads
                FROM (SELECT * FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1) AS d
                JOIN {schema}.queue q ON q.name = p_queues[1]
                -- the lanes whose turn it is, oldest turn first (two: is it the only one?)
                CROSS JOIN LATERAL (
                    SELECT ARRAY(
                        SELECT l FROM {schema}.lane l
                        WHERE l.queue = p_queues[1]
                          AND l.turn_at >= coalesce(
                              d.turn_from[array_position(d.queues, p_queues[1])], '-infinity')
                          AND l.turn_at <= v_now + interval '1 millisecond'
                        ORDER BY l.turn_at, l.id LIMIT 2) AS lanes
                    OFFSET 0) AS x  -- (read once, not at each use of its column)
                -- the first one's heads from its position when the call is the usual one (the
                -- ingest's state is fresh, no lock is past its expiry, the lane has no limit and
                -- one priority, and is the only one due or one message is asked for): due,
                -- ingested, not held by anyone, one more than asked for (has it more?); those
                -- past their time to live or their max_attempts negated (steps 3 and 4 handle
                -- them)
                CROSS JOIN LATERAL (
                    SELECT ARRAY(
                        SELECT CASE WHEN m.expires_at <= v_now
                                         OR m.attempts >= coalesce(q.max_attempts, 2147483647)
                                    THEN -m.id ELSE m.id END
                        FROM {schema}.message m
                        WHERE v_usual AND d.taken_at >= v_now - interval '10 milliseconds'
                          AND d.folded_at >= v_now - interval '1 second'
                          AND p_queues[1] = ANY (d.queues)
                          AND NOT (cardinality(d.pend_queue) > 0
                                   AND d.taken_at < v_now - interval '5 milliseconds')
                          AND NOT (x.lanes[1]).limited AND cardinality((x.lanes[1]).prios) = 1
                          AND (p_limit = 1 OR cardinality(x.lanes) = 1)
                          -- (the first one in lock order, from the queue's lock position: an
                          -- EXISTS loses the order, and was planned as a read of the whole
                          -- locked index)
                          AND (SELECT e.locked_until FROM {schema}.message e
                               WHERE e.queue = p_queues[1]
                                 AND e.locked_until >= coalesce(
                                     d.lock_from[array_position(d.queues, p_queues[1])], '-infinity')
                                 AND e.locked_until <= v_now
                               ORDER BY e.queue, e.locked_until LIMIT 1) IS NULL
                          AND m.queue = p_queues[1] AND m.channel = (x.lanes[1]).channel
                          AND m.locked_until IS NULL AND m.priority = ((x.lanes[1]).prios)[1]
                          AND (m.dequeue_at, m.id) >= (((x.lanes[1]).pos_at)[1],
                                                       ((x.lanes[1]).pos_id)[1])
                          AND m.dequeue_at <= v_now
                          AND pg_visible_in_snapshot(m.txid, d.snap)
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT p_limit + 1
                        FOR UPDATE SKIP LOCKED) AS heads) AS h
            ) AS s ON true;
        END IF;
        IF v_gone IS NOT NULL THEN
            v_ev_queue := v_ack_queue;
            v_ev_channel := v_ack_channel;
            v_ev_kind := array_fill('acked'::text, ARRAY[cardinality(v_gone)]);
            IF true = ANY (v_ack_sized) OR true = ANY (v_ack_slotted) THEN
                PERFORM {schema}.ack_give_back_v1(v_ack_queue, v_ack_channel, v_ack_sized,
                                                  v_ack_slotted);
            END IF;
        END IF;
        -- (those that did not apply: a row each)
        IF NOT v_ingested AND coalesce(cardinality(v_gone), 0) < coalesce(cardinality(p_ack_ids), 0) THEN
            RETURN QUERY
                SELECT o.message_id, NULL::text, NULL::text, NULL::text, NULL::smallint,
                       NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                       NULL::bigint, 'ack_' || o.result_code
                FROM {schema}.ack_outcome_v1(p_ack_ids, v_gone) AS o WHERE o.result_code <> 'ok';
        END IF;

        -- 2. the usual call, served: its heads locked and returned, and the call tallied, in one
        --    statement. Otherwise steps 2 to 6 run; the heads the read locked, if any, are its own.
        v_take := v_heads[1:p_limit];
        IF v_usual AND cardinality(v_take) > 0 AND NOT 0 > ANY (v_take) THEN
            v_served := true;
            v_lane := v_due[1];
            v_got := cardinality(v_take);
            -- (tallied in the same statement, with the acks: on the deliveries' row when of the
            -- lane's channel, else on a row of their own when of one channel, else below)
            v_acked := CASE WHEN v_ack_queue <@ ARRAY[v_lane.queue::text]
                                 AND v_ack_channel <@ ARRAY[v_lane.channel::text]
                            THEN cardinality(v_gone) ELSE 0 END;
            v_apart := v_acked = 0 AND v_ack_queue <@ ARRAY[v_ack_queue[1]]
                AND v_ack_channel <@ ARRAY[v_ack_channel[1]];
            RETURN QUERY
                WITH locked AS (
                    UPDATE {schema}.message m SET
                        locked_until = v_now + v_lock,
                        lock_token = gen_random_uuid(),
                        attempts = m.attempts + 1,
                        slotted = false
                    WHERE m.id = ANY (v_take)
                    RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                              m.lock_token, m.created_at, m.content, m.state, m.dequeue_at
                ), tallied AS (
                    INSERT INTO {schema}.tally (queue, channel, delivered, acked, lock_until, lock_id)
                    SELECT v_lane.queue, v_lane.channel, v_got, v_acked, v_now + v_lock, v_take[1]
                    UNION ALL
                    SELECT v_ack_queue[1], v_ack_channel[1], 0, cardinality(v_gone), NULL, NULL
                    WHERE v_apart
                )
                SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
                       k.lock_token, k.created_at, k.content, k.state, NULL::bigint,
                       'delivered'::text
                FROM locked k ORDER BY k.dequeue_at, k.id;
            -- (tallied)
            v_ev_queue := CASE WHEN v_acked > 0 OR v_apart THEN ARRAY[]::text[] ELSE v_ev_queue END;
            -- the lane, owned with its key: moved to the back, its position past what was
            -- taken, as in step 5 (unless it is the only one due, has more, and was written a
            -- moment ago), read with the latest snapshot of the ingest
            IF pg_try_advisory_xact_lock({schema}.lane_key_v1(v_lane.queue, v_lane.channel))
               AND NOT (cardinality(v_due) = 1 AND cardinality(v_heads) > p_limit
                        AND v_lane.served_at > '-infinity'
                        AND v_lane.written_at > v_now - interval '5 milliseconds') THEN
                PERFORM {schema}.lane_advance_v1(v_lane, clock_timestamp() + interval '1 microsecond');
            END IF;
        END IF;
        EXIT WHEN v_served;
        -- (the usual call found nothing, as after a wake-up: with no lane due, what woke it
        -- taken without an ingest; else, when the ingest's state was old, ingested and read
        -- again, once; its acks are in, the tally below has them)
        IF v_usual AND NOT v_ingested AND cardinality(v_due) = 0 THEN
            RETURN QUERY SELECT * FROM {schema}.dequeue_take_v1(p_queues[1], p_limit, v_lock, v_now);
            GET DIAGNOSTICS v_got = ROW_COUNT;
            v_served := v_got > 0;
            EXIT WHEN v_served;
        END IF;
        SELECT * INTO v_state FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        EXIT WHEN v_ingested OR NOT v_usual OR coalesce(cardinality(v_heads), 0) > 0;
        EXIT WHEN (v_due[1]).limited OR cardinality((v_due[1]).prios) > 1
            OR NOT (v_state.taken_at < v_now - interval '10 milliseconds'
                    OR v_state.folded_at < v_now - interval '1 second'
                    OR NOT (p_queues <@ v_state.queues));
        v_state := {schema}.ingest_v1(p_queues, false, false);
        v_ingested := true;
        v_now := clock_timestamp();
    END LOOP;

    LOOP
        EXIT WHEN v_served;
        -- 2. ingest what committed since the snapshot: every 10 ms (which also moves the
        --    points from which lanes are read past the versions consumers superseded
        --    meanwhile: dead rows that a snapshot held elsewhere keeps from being vacuumed),
        --    and below when this call finds nothing in what is ingested. Not at every call:
        --    an ingest costs several times a delivery, and with messages waiting a consumer
        --    has no need of the newest ones.
        IF NOT v_ingested AND current_setting('lonnymq.fresh', true) = 'on' THEN
            PERFORM set_config('lonnymq.fresh', '', false);
            v_state := {schema}.ingest_wait_v1(p_queues);
            v_ingested := true;
            -- (a caller that sleeps on its own, p_listen false, is not ingested for again in
            -- step 6: this ingest waited for any other already; one that sleeps here is, after
            -- it registers as sleeping)
            v_waited := NOT p_listen;
            v_now := clock_timestamp();
        ELSIF NOT v_ingested
           AND (v_state.taken_at < v_now - interval '10 milliseconds'
                OR v_state.folded_at < v_now - interval '1 second'
                OR NOT (p_queues <@ v_state.queues)
                -- (heads an ingest could not write, their lane being served: soon, not at
                -- once, or a busy lane would have every call ingest)
                OR (cardinality(v_state.pend_queue) > 0
                    AND v_state.taken_at < v_now - interval '5 milliseconds')) THEN
            v_state := {schema}.ingest_v1(p_queues, false, false);
            v_ingested := true;
            v_now := clock_timestamp();
        END IF;

        -- the queues, their settings and positions; is there a lock past its expiry?
        SELECT x.names, x.max_attempts, x.turn_from, x.lock_from, x.expired
        INTO v_names, v_max_attempts, v_turn_from, v_lock_from, v_expired
        FROM {schema}.dequeue_queues_v1(p_queues, v_state, v_now) AS x;
        v_left := p_limit - v_got;

        -- 3. messages whose lock expired: taken over first (or dead-lettered)
        IF v_expired AND v_left > 0 THEN
            FOR r IN SELECT * FROM {schema}.dequeue_expired_v1(v_names, v_lock_from, v_max_attempts,
                                                               v_left, v_now, v_lock) AS x LOOP
                v_dead := v_dead + (r.event = 'dead')::integer;
                v_got := v_got + (r.event = 'redelivered')::integer;
                RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name, r.message_name,
                    r.message_priority, r.message_attempts, r.message_lock_token,
                    r.message_created_at, r.message_content, r.message_state, NULL::bigint,
                    r.event;
            END LOOP;
            v_left := p_limit - v_got;
        END IF;

        -- 4. lanes whose turn it is, oldest turn first (one more than needed, to know
        --    whether another one waits)
        v_count := 0;
        IF v_left > 0 AND v_names IS NOT NULL THEN
            -- (the ingest's state is read again in the same statement: a lane version is
            -- never newer than the snapshot its positions are read with)
            -- (due: at most a millisecond from now, so that a lane another consumer has
            -- just moved to the back, at its clock, is due for this one too)
            v_now := clock_timestamp();
            IF cardinality(v_names) = 1 THEN
                SELECT ARRAY(
                    SELECT l FROM {schema}.lane l
                    WHERE l.queue = v_names[1]
                      AND (l.turn_at, l.id) > (coalesce(v_after_at, v_turn_from[1]), v_after_id)
                      AND l.turn_at <= v_now + interval '1 millisecond'
                    ORDER BY l.turn_at, l.id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_due, v_snap;
            ELSE
                SELECT ARRAY(
                    SELECT x.l FROM unnest(v_names, v_turn_from) AS u(q, tf)
                    CROSS JOIN LATERAL (
                        SELECT l FROM {schema}.lane l
                        WHERE l.queue = u.q
                          AND (l.turn_at, l.id) > (GREATEST(u.tf, v_after_at),
                              CASE WHEN v_after_at >= u.tf THEN v_after_id ELSE 0 END)
                          AND l.turn_at <= v_now + interval '1 millisecond'
                        ORDER BY l.turn_at, l.id LIMIT v_left + 1
                    ) AS x
                    ORDER BY (x.l).turn_at, (x.l).id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_due, v_snap;
            END IF;
            v_state.snap := v_snap;
            v_count := LEAST(cardinality(v_due), v_left);
        END IF;
        IF v_count > 0 THEN
            SELECT c.own, c.cap, c.room, c.max_concurrency, c.rate, c.burst, c.tat, c.tokens
            INTO v_owned, v_cap, v_room, v_max, v_interval, v_burst, v_tat, v_tokens
            FROM {schema}.lanes_claim_v1(v_due, v_count, v_left, v_now) AS c;
            v_taken := array_fill(0, ARRAY[v_count]);
            v_more := array_fill(false, ARRAY[v_count]);
            v_done := array_fill(false, ARRAY[v_count]);
            -- passes: an equal share of what is left to each lane that may give more
            v_passes := 0;
            LOOP
                v_passes := v_passes + 1;
                IF v_count = 1 THEN
                    v_lanes := CASE WHEN NOT v_done[1] AND v_cap[1] > v_taken[1]
                                    THEN ARRAY[1] ELSE ARRAY[]::integer[] END;
                ELSE
                    v_lanes := ARRAY(SELECT g.i FROM generate_series(1, v_count) AS g(i)
                                     WHERE NOT v_done[g.i] AND v_cap[g.i] > v_taken[g.i] ORDER BY g.i);
                END IF;
                v_opened := cardinality(v_lanes);
                EXIT WHEN v_opened = 0 OR v_left <= 0 OR v_passes > 8;
                v_share := ceil(v_left::numeric / v_opened)::integer;
                IF v_opened = 1 THEN
                    v_quota := ARRAY[LEAST(v_share, v_cap[v_lanes[1]] - v_taken[v_lanes[1]])];
                ELSE
                    v_quota := ARRAY(SELECT LEAST(v_share, v_cap[u.i] - v_taken[u.i])
                                     FROM unnest(v_lanes) AS u(i));
                END IF;
                -- each lane's head from its positions: due, ingested, not held by anyone; one
                -- more than its quota tells whether it has more
                IF v_opened = 1 AND cardinality((v_due[v_lanes[1]]).prios) = 1 THEN
                    v_at := v_lanes[1];
                    v_heads := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.queue = (v_due[v_at]).queue AND m.channel = (v_due[v_at]).channel
                          AND m.locked_until IS NULL AND m.priority = ((v_due[v_at]).prios)[1]
                          AND (m.dequeue_at, m.id) >= (((v_due[v_at]).pos_at)[1],
                                                       ((v_due[v_at]).pos_id)[1])
                          AND m.dequeue_at <= v_now
                          AND pg_visible_in_snapshot(m.txid, v_state.snap)
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT v_quota[1] + 1
                        FOR UPDATE SKIP LOCKED);
                    v_head_lane := array_fill(v_at, ARRAY[cardinality(v_heads)]);
                    v_head_rank := ARRAY(SELECT generate_series(1, cardinality(v_heads)));
                ELSE
                SELECT x.ids, x.lanes, x.ranks INTO v_heads, v_head_lane, v_head_rank
                FROM {schema}.lane_heads_v1(v_due, v_lanes, v_quota, v_state.snap, v_now) AS x;
                END IF;
                FOR i IN 1 .. v_opened LOOP
                    v_at := v_lanes[i];
                    v_more[v_at] :=
                        coalesce(array_length(array_positions(v_head_lane, v_at), 1), 0) > v_quota[i];
                    IF NOT v_more[v_at] THEN
                        v_done[v_at] := true;
                    END IF;
                END LOOP;
                -- (the quotas are rounded up: never more than the call has left, in rank order)
                IF v_opened = 1 THEN
                    v_take := v_heads[1:v_quota[1]];
                ELSE
                    v_take := ARRAY(
                        SELECT t.id FROM unnest(v_heads, v_head_lane, v_head_rank) AS t(id, l, rn)
                        JOIN unnest(v_lanes, v_quota) AS u(i, quota) ON u.i = t.l
                        WHERE t.rn <= u.quota
                        ORDER BY t.rn, t.l LIMIT v_left);
                END IF;
                EXIT WHEN coalesce(cardinality(v_take), 0) = 0;
                IF v_opened = 1 THEN
                    v_slotted := CASE WHEN v_max[v_lanes[1]] IS NOT NULL THEN v_take
                                      ELSE ARRAY[]::bigint[] END;
                ELSE
                    v_slotted := ARRAY(
                        SELECT t.id FROM unnest(v_heads, v_head_lane) AS t(id, l)
                        WHERE t.id = ANY (v_take) AND v_max[t.l] IS NOT NULL);
                END IF;
                -- lock them (by primary key from the array); those past their time to live or
                -- delivered max_attempts times are left out, and handled below
                v_locked := ARRAY[]::bigint[];
                IF v_opened = 1 THEN
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
                              AND m.attempts < v_max_attempts[array_position(v_names, m.queue)]
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
                    v_at := v_lanes[1];
                    v_taken[v_at] := v_taken[v_at] + cardinality(v_locked);
                    IF cardinality(v_locked) > 0 THEN
                        v_ev_queue := v_ev_queue || array_fill((v_due[v_at]).queue::text,
                                                 ARRAY[cardinality(v_locked)]);
                        v_ev_channel := v_ev_channel || array_fill((v_due[v_at]).channel::text,
                                                 ARRAY[cardinality(v_locked)]);
                        v_ev_kind := v_ev_kind
                            || array_fill('delivered'::text, ARRAY[cardinality(v_locked)]);
                    END IF;
                ELSE
                -- (several lanes: in rank order, then lane order; what each gave, in one
                -- statement each, not row by row)
                RETURN QUERY
                    WITH locked AS (
                        UPDATE {schema}.message m SET
                            locked_until = v_now + v_lock,
                            lock_token = gen_random_uuid(),
                            attempts = m.attempts + 1,
                            slotted = m.id = ANY (v_slotted)
                        WHERE m.id = ANY (v_take) AND (m.expires_at IS NULL OR m.expires_at > v_now)
                          AND m.attempts < v_max_attempts[array_position(v_names, m.queue)]
                        RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                                  m.lock_token, m.created_at, m.content, m.state
                    )
                    SELECT l.id, l.queue::text, l.channel::text, l.name, l.priority, l.attempts,
                           l.lock_token, l.created_at, l.content, l.state, NULL::bigint,
                           'delivered'::text
                    FROM locked l
                    JOIN unnest(v_heads, v_head_lane, v_head_rank) AS t(id, l, rn) ON t.id = l.id
                    ORDER BY v_taken[t.l] + t.rn, t.l;
                GET DIAGNOSTICS v_rows = ROW_COUNT;
                v_locked := CASE WHEN v_rows = cardinality(v_take) THEN v_take
                    ELSE ARRAY(SELECT m.id FROM {schema}.message m
                               WHERE m.id = ANY (v_take) AND m.lock_token IS NOT NULL) END;
                SELECT array_agg(v_taken[g.i] + coalesce(c.n, 0) ORDER BY g.i) INTO v_taken
                FROM generate_series(1, v_count) AS g(i)
                LEFT JOIN (SELECT t.l, count(*)::integer AS n
                           FROM unnest(v_heads, v_head_lane) AS t(id, l)
                           WHERE t.id = ANY (v_locked) GROUP BY t.l) AS c ON c.l = g.i;
                v_ev_queue := v_ev_queue || ARRAY(SELECT (v_due[t.l]).queue::text
                                    FROM unnest(v_heads, v_head_lane) AS t(id, l)
                                    WHERE t.id = ANY (v_locked));
                v_ev_channel := v_ev_channel || ARRAY(SELECT (v_due[t.l]).channel::text
                                    FROM unnest(v_heads, v_head_lane) AS t(id, l)
                                    WHERE t.id = ANY (v_locked));
                v_ev_kind := v_ev_kind || array_fill('delivered'::text, ARRAY[cardinality(v_locked)]);
                END IF;
                v_got := v_got + cardinality(v_locked);
                v_left := p_limit - v_got;
                IF cardinality(v_locked) > 0
                   AND (v_lock_until IS NULL OR v_now + v_lock < v_lock_until) THEN
                    v_lock_until := v_now + v_lock;
                    v_lock_id := v_locked[1];
                END IF;
                IF cardinality(v_locked) < cardinality(v_take) THEN
                    FOR r IN SELECT * FROM {schema}.dequeue_leftovers_v1(v_take, v_locked, v_now) LOOP
                        v_dead := v_dead + 1;
                        RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name,
                            r.message_name, NULL::smallint, r.message_attempts, NULL::uuid,
                            r.message_created_at, NULL::bytea, NULL::bytea, NULL::bigint, 'dead';
                    END LOOP;
                END IF;
            END LOOP;

            -- 5. the owned lanes: positions past what they took, the turn to the back (or at
            --    the next due message, or none)
            PERFORM {schema}.lanes_served_v1(v_due, v_count, v_owned, v_taken, v_more, v_max,
                                             v_room, v_interval, v_tat, v_tokens, v_burst, v_now);
            -- (nothing from these lanes, their heads held by other calls, say: the next look
            -- starts after them (v_after_*), at once when another lane is due, up to 8 times)
            IF v_got = 0 THEN
                v_after_at := (v_due[v_count]).turn_at;
                v_after_id := (v_due[v_count]).id;
                v_passed := v_passed + 1;
                CONTINUE WHEN cardinality(v_due) > v_count AND v_passed <= 8;
            END IF;
        END IF;
        EXIT WHEN v_got > 0;

        -- 6. nothing. A listening caller registers as sleeping, checks for producers still
        --    in their transactions (they may have looked for sleepers before), then looks
        --    once more: a producer that commits after that sees it sleeping and notifies.
        IF p_listen AND NOT v_slept THEN
            v_slept := true;
            v_busy := {schema}.dequeue_sleep_v1(p_queues);
            v_ingested := false;
            v_now := clock_timestamp();
            CONTINUE;
        END IF;
        -- (then ingest, waiting a little for an ingest another consumer is running: what it
        -- brings in is not deliverable before it commits, and answering "nothing" meanwhile
        -- would send this caller to sleep while messages wait)
        EXIT WHEN v_waited;
        v_waited := true;
        v_state := {schema}.ingest_wait_v1(p_queues);
        v_ingested := true;
        v_now := clock_timestamp();
    END LOOP;

    -- the tally of this call: one row per channel (one channel, the usual case, without an
    -- aggregate)
    IF cardinality(v_ev_queue) > 0 AND v_ev_queue <@ ARRAY[v_ev_queue[1]]
       AND v_ev_channel <@ ARRAY[v_ev_channel[1]] THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, acked, lock_until, lock_id)
        VALUES (v_ev_queue[1], v_ev_channel[1], cardinality(array_positions(v_ev_kind, 'delivered')),
                cardinality(array_positions(v_ev_kind, 'acked')),
                CASE WHEN 'delivered' = ANY (v_ev_kind) THEN v_lock_until END,
                CASE WHEN 'delivered' = ANY (v_ev_kind) THEN v_lock_id END);
    ELSIF cardinality(v_ev_queue) > 0 THEN
        PERFORM {schema}.tally_events_v1(v_ev_queue, v_ev_channel, v_ev_kind, v_lock_until, v_lock_id);
    END IF;

    IF v_got = 0 THEN
        -- (after dead-lettering, look again at once: what comes next may be deliverable)
        v_retry := CASE WHEN v_dead > 0 THEN 0 ELSE {schema}.queue_retry_ms_v1(p_queues, v_state) END;
        IF v_busy THEN
            v_retry := LEAST(coalesce(v_retry, 20), 20);
        END IF;
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, v_retry,
            NULL::text;
    END IF;
END;
$$;

-- (CREATE OR REPLACE keeps the owner and the grants; the attributes are the statement's)
REVOKE ALL ON FUNCTION {schema}.ingest_fresh_v1({schema}.discovery, pg_snapshot, xid8[], timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.ingest_freed_v1({schema}.discovery, pg_snapshot, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.ingest_positions_v1({schema}.discovery, text[], pg_snapshot, xid8[], timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.dequeue_leftovers_v1(bigint[], bigint[], timestamptz) FROM PUBLIC;
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
