-- lonnymq migration 25.

-- =============================================================================================
-- A look again beside a long ingest is not lost
-- (issue "A real Celery worker wakes within milliseconds of a publish")
-- =============================================================================================
--
-- A consumer that found nothing takes its queues' sleep keys, then looks once more: a producer
-- that committed before the keys were taken sent no NOTIFY, and the look must see its message.
-- The look ingests, waiting at most 50 ms for an ingest another session runs (a sweep's, a
-- busy consumer's); past that, until version 24, it answered "nothing" from the state before
-- that ingest, and the consumer slept until its fallback poll although the message waited
-- (seen in CI's full suite, where the machine is loaded). From version 25 the answer is then
-- "look again in 20 ms". ingest_wait_v2 is ingest_wait_v1 that says whether it waited in
-- vain; dequeue_ingest_v1 and dequeue_general_v1 are replaced to use it (internal, same
-- arguments and results), and ingest_wait_v1, which nothing calls then, is dropped.

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

-- Step 2: ingest what committed since the ingest's state p_state (read at p_now) when it
-- is old: every 10 ms (which also moves the points from which lanes are read past the
-- versions consumers superseded meanwhile: dead rows that a snapshot held elsewhere keeps
-- from being vacuumed), when the last fold is a second old, when a queue of p_queues is not
-- in it yet, or when heads an ingest could not write wait (after 5 ms: soon, not at once, or
-- a busy lane would have every call ingest); and, waiting for an ingest another consumer is
-- running, when this session created or requeued something (lonnymq.fresh: its next call
-- sees what it did, in its place). Not at every call: an ingest costs several times a
-- delivery, and with messages waiting a consumer has no need of the newest ones. The new
-- state, and when it was taken (ingested_at; NULL: no ingest). waited: the ingest waited
-- for any other, so a caller that sleeps on its own (p_listen false) is not ingested for
-- again in step 6; one that sleeps here is, after it registers as sleeping.
CREATE OR REPLACE FUNCTION {schema}.dequeue_ingest_v1(
    p_queues text[], p_listen boolean, p_state {schema}.discovery, p_now timestamptz,
    OUT state {schema}.discovery, OUT waited boolean, OUT ingested_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_wait record;
BEGIN
    state := p_state;
    waited := false;
    IF current_setting('lonnymq.fresh', true) = 'on' THEN
        PERFORM set_config('lonnymq.fresh', '', false);
        SELECT * INTO v_wait FROM {schema}.ingest_wait_v2(p_queues);
        state := v_wait.state;
        -- (the other's ingest outlasted the wait: step 6 waits once more, see there)
        waited := NOT p_listen AND NOT v_wait.in_vain;
        ingested_at := clock_timestamp();
    ELSIF p_state.taken_at < p_now - interval '10 milliseconds'
          OR p_state.folded_at < p_now - interval '1 second'
          OR NOT (p_queues <@ p_state.queues)
          OR (cardinality(p_state.pend_queue) > 0
              AND p_state.taken_at < p_now - interval '5 milliseconds') THEN
        state := {schema}.ingest_v1(p_queues, false, false);
        ingested_at := clock_timestamp();
    END IF;
END;
$$;

-- The dequeue's general path, for what the usual call (message_dequeue_v3's steps 1 and 2)
-- did not serve: p_state, the ingest's state the call read (p_ingested: it ingested), p_now
-- its time, p_ev_*: the events of its acks, tallied here with the deliveries. Steps 2 to 6
-- (docs/design.md, "The dequeue"): an ingest when the state is old; the messages whose lock
-- expired; the lanes whose turn it is; and when nothing was found, the sleep (p_listen) and
-- one more look after an ingest. Returns the rows, or the one that says nothing was found
-- (message_id NULL, retry_ms).
CREATE OR REPLACE FUNCTION {schema}.dequeue_general_v1(
    p_queues text[], p_limit integer, p_lock interval, p_listen boolean,
    p_state {schema}.discovery, p_ingested boolean, p_now timestamptz, p_ev_queue text[],
    p_ev_channel text[], p_ev_kind text[]
)
RETURNS SETOF {schema}.delivery
LANGUAGE plpgsql AS $$
DECLARE
    v_state {schema}.discovery := p_state;
    v_ingested boolean := p_ingested;
    v_now timestamptz := p_now;
    v_slept boolean := false;
    v_waited boolean := false;
    v_wait record;
    v_busy boolean := false;
    v_got integer := 0;
    v_dead integer := 0;
    v_ingest record;
    v_queues record;
    v_lanes record;
    r record;
    -- where a call that got nothing from the lanes it read looks again, and how often it did
    v_after_at timestamptz;
    v_after_id bigint := 0;
    v_passed integer := 0;
    -- events for the tally: queue, channel, kind; the earliest lock and its message
    v_ev_queue text[] := p_ev_queue;
    v_ev_channel text[] := p_ev_channel;
    v_ev_kind text[] := p_ev_kind;
    v_lock_until timestamptz;
    v_lock_id bigint;
    v_retry bigint;
BEGIN
    LOOP
        -- 2. ingest what committed since the snapshot, when it is old (dequeue_ingest_v1)
        IF NOT v_ingested THEN
            v_ingest := {schema}.dequeue_ingest_v1(p_queues, p_listen, v_state, v_now);
            IF v_ingest.ingested_at IS NOT NULL THEN
                v_state := v_ingest.state;
                v_ingested := true;
                v_waited := v_waited OR v_ingest.waited;
                v_now := v_ingest.ingested_at;
            END IF;
        END IF;

        -- the queues, their settings and positions; is there a lock past its expiry?
        v_queues := {schema}.dequeue_queues_v1(p_queues, v_state, v_now);

        -- 3. messages whose lock expired: taken over first (or dead-lettered)
        IF v_queues.expired AND p_limit > v_got THEN
            FOR r IN SELECT * FROM {schema}.dequeue_expired_v1(
                         v_queues.names, v_queues.lock_from, v_queues.max_attempts,
                         p_limit - v_got, v_now, p_lock) AS x LOOP
                v_dead := v_dead + (r.event = 'dead')::integer;
                v_got := v_got + (r.event = 'redelivered')::integer;
                RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name, r.message_name,
                    r.message_priority, r.message_attempts, r.message_lock_token,
                    r.message_created_at, r.message_content, r.message_state, NULL::bigint,
                    r.event;
            END LOOP;
        END IF;

        -- 4. and 5. lanes whose turn it is (dequeue_lanes_v1)
        IF p_limit > v_got AND v_queues.names IS NOT NULL THEN
            v_lanes := {schema}.dequeue_lanes_v1(
                v_queues.names, v_queues.turn_from, v_queues.max_attempts, v_after_at,
                v_after_id, p_limit - v_got, p_lock);
            v_now := v_lanes.looked_at;
            v_state.snap := coalesce(v_lanes.snap, v_state.snap);
            IF cardinality(v_lanes.deliveries) > 0 THEN
                -- (in their order; the content of large messages read by id, here)
                RETURN QUERY
                    SELECT d.message_id, d.queue_name, d.channel_name, d.message_name,
                           d.message_priority, d.message_attempts, d.message_lock_token,
                           d.message_created_at,
                           CASE WHEN d.event = 'delivered' AND d.message_content IS NULL
                                THEN (SELECT m.content FROM {schema}.message m
                                      WHERE m.id = d.message_id)
                                ELSE d.message_content END,
                           CASE WHEN d.event = 'delivered' AND d.message_content IS NULL
                                THEN (SELECT m.state FROM {schema}.message m
                                      WHERE m.id = d.message_id)
                                ELSE d.message_state END,
                           d.retry_ms, d.event
                    FROM unnest(v_lanes.deliveries) AS d;
            END IF;
            v_got := v_got + v_lanes.got;
            v_dead := v_dead + v_lanes.dead;
            v_ev_queue := v_ev_queue || v_lanes.ev_queue;
            v_ev_channel := v_ev_channel || v_lanes.ev_channel;
            v_ev_kind := v_ev_kind || array_fill('delivered'::text, ARRAY[v_lanes.got]);
            IF v_lanes.lock_until IS NOT NULL
               AND (v_lock_until IS NULL OR v_lanes.lock_until < v_lock_until) THEN
                v_lock_until := v_lanes.lock_until;
                v_lock_id := v_lanes.lock_id;
            END IF;
            -- (nothing from these lanes, their heads held by other calls, say: the next look
            -- starts after them, at once when another lane is due, up to 8 times)
            IF v_lanes.served > 0 AND v_got = 0 THEN
                v_after_at := v_lanes.last_turn_at;
                v_after_id := v_lanes.last_id;
                v_passed := v_passed + 1;
                CONTINUE WHEN v_lanes.more_due AND v_passed <= 8;
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
        --    When that ingest outlasts the wait, what it brings in is not seen and nothing
        --    tells this caller when it commits (a producer that committed before the caller
        --    slept sent no NOTIFY): the answer is then "look again in 20 ms" (v_busy).
        EXIT WHEN v_waited;
        v_waited := true;
        SELECT * INTO v_wait FROM {schema}.ingest_wait_v2(p_queues);
        v_state := v_wait.state;
        v_busy := v_busy OR v_wait.in_vain;
        v_ingested := true;
        v_now := clock_timestamp();
    END LOOP;

    IF cardinality(v_ev_queue) > 0 THEN
        PERFORM {schema}.tally_events_v1(v_ev_queue, v_ev_channel, v_ev_kind, v_lock_until,
                                         v_lock_id);
    END IF;
    IF v_got = 0 THEN
        -- (after dead-lettering, look again at once: what comes next may be deliverable)
        v_retry := CASE WHEN v_dead > 0 THEN 0
                        ELSE {schema}.queue_retry_ms_v1(p_queues, v_state) END;
        IF v_busy THEN
            v_retry := LEAST(coalesce(v_retry, 20), 20);
        END IF;
        RETURN NEXT ROW(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, v_retry,
                        NULL)::{schema}.delivery;
    END IF;
END;
$$;

DROP FUNCTION {schema}.ingest_wait_v1(text[]);

-- =============================================================================================
-- A channel row's steps written once
-- (issue "The usual dequeue at the speed of Postgres, and tenants by the hundred thousand")
-- =============================================================================================
--
-- channel_apply_v1 (a channel's own policy) counted its messages with its own copy of
-- queue_slice_apply_v1's steps, and four functions deleted a row left with nothing to count
-- with the same statement: channel_apply_v1 now runs queue_slice_apply_v1 for its channel, and
-- channel_prune_v1 is that statement. Same results.

-- The rows of p_channels (of p_queue) left with nothing to count (no policy of their own, no
-- message sized or slotted, not freed, no rate debt) go: a channel without limits has no row.
CREATE FUNCTION {schema}.channel_prune_v1(p_queue text, p_channels text[]) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = ANY (p_channels) AND NOT c.has_policy
      AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
      AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
$$;

-- A slice of queue_policy_set_v2's channels (p_channels, in name order) brought in line with
-- the queue's new default, channel_apply_v1's row steps: with a limit in force each has a row
-- (inserted if missing), every row is locked in name order; a limit that starts counting
-- counts what the channel holds (max_size its messages, max_concurrency its messages in
-- flight); a row left with nothing to count goes.
CREATE OR REPLACE FUNCTION {schema}.queue_slice_apply_v1(
    p_queue text, p_channels text[], p_max_concurrency integer, p_max_size integer,
    p_limited boolean
) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    IF p_limited THEN
        -- (a conflicting row is locked, not updated: WHERE false)
        INSERT INTO {schema}.channel AS c (queue, name)
        SELECT p_queue, u.name FROM unnest(p_channels) AS u(name) ORDER BY u.name
        ON CONFLICT (queue, name) DO UPDATE SET name = EXCLUDED.name WHERE false;
    ELSE
        PERFORM 1 FROM {schema}.channel c
        WHERE c.queue = p_queue AND c.name = ANY (p_channels) ORDER BY c.name FOR UPDATE;
    END IF;
    -- (the conditions on the updated row itself are checked again on its newest version: a
    -- message deferred or acked meanwhile is not counted)
    IF p_max_size IS NOT NULL THEN
        WITH marked AS (
            UPDATE {schema}.message m SET sized = true
            WHERE m.id IN (
                SELECT x.id FROM {schema}.message x
                WHERE x.queue = p_queue AND x.channel = ANY (p_channels)
                  AND x.locked_until IS NULL AND NOT x.sized
                UNION ALL
                SELECT x.id FROM {schema}.message x
                WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                  AND x.channel = ANY (p_channels) AND NOT x.sized)
              AND NOT m.sized
            RETURNING m.channel
        ), per AS (
            SELECT k.channel, count(*)::integer AS n FROM marked k GROUP BY k.channel
        )
        UPDATE {schema}.channel c SET current_size = c.current_size + per.n
        FROM per WHERE c.queue = p_queue AND c.name = per.channel;
    END IF;
    IF p_max_concurrency IS NOT NULL THEN
        WITH marked AS (
            UPDATE {schema}.message m SET slotted = true
            WHERE m.id IN (
                SELECT x.id FROM {schema}.message x
                WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                  AND x.channel = ANY (p_channels) AND NOT x.slotted)
              AND m.locked_until IS NOT NULL AND NOT m.slotted
            RETURNING m.channel
        ), per AS (
            SELECT k.channel, count(*)::integer AS n FROM marked k GROUP BY k.channel
        )
        UPDATE {schema}.channel c SET current_concurrency = c.current_concurrency + per.n
        FROM per WHERE c.queue = p_queue AND c.name = per.channel;
    END IF;
    PERFORM {schema}.channel_prune_v1(p_queue, p_channels);
END;
$$;

-- Bring a channel in line with the limits now in force, after a policy change: a limit that
-- starts counting counts what the channel holds (max_size: its messages; max_concurrency: its
-- messages in flight), the lane is marked limited or not and gets its turn back, or loses it
-- at its max_concurrency, or waits for its next token no more. The caller holds the ingest
-- key. Returns whether the lane got a turn it did not have (or an earlier one).
CREATE OR REPLACE FUNCTION {schema}.channel_apply_v1(p_queue text, p_channel text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lim record;
    v_in_flight integer;  -- (counted on the channel's row)
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_d {schema}.discovery;
    v_next record;
    v_i integer;
BEGIN
    SELECT * INTO v_lim FROM {schema}.channel_limits_v2(p_queue, p_channel);
    -- the channel's row (queue_slice_apply_v1's steps, for this one channel)
    PERFORM {schema}.queue_slice_apply_v1(p_queue, ARRAY[p_channel], v_lim.max_concurrency,
        v_lim.max_size, v_lim.max_size IS NOT NULL OR v_lim.max_concurrency IS NOT NULL
                        OR v_lim.rate_count IS NOT NULL);
    SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel;
    v_lane := {schema}.lane_lock_v1(p_queue, p_channel);
    IF v_lane.id IS NULL THEN
        RETURN false;
    END IF;
    v_put := v_lane;
    v_put.limited := v_lim.max_concurrency IS NOT NULL OR v_lim.rate_count IS NOT NULL;
    -- (a lane waiting for its next token under the old rate: its turn is recomputed, and its
    -- owner reckons the tokens under the new one)
    v_put.not_before := NULL;
    IF v_lim.max_concurrency IS NOT NULL
       AND coalesce(v_in_flight, 0) >= v_lim.max_concurrency THEN
        v_put.turn_at := NULL;
    ELSIF v_put.turn_at IS NULL OR v_lane.not_before IS NOT NULL THEN
        SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        SELECT * INTO v_next FROM {schema}.lane_next_v1(v_put, v_d.snap);
        v_put.prios := v_next.prios;
        v_put.pos_at := v_next.pos_at;
        v_put.pos_id := v_next.pos_id;
        IF v_next.next_at IS NOT NULL THEN
            v_i := array_position(v_d.queues, p_queue);
            v_put.turn_at := GREATEST(v_next.next_at, v_put.served_at,
                CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_d.turn_from[v_i] END);
        END IF;
    END IF;
    IF v_put.limited IS DISTINCT FROM v_lane.limited OR v_put.turn_at IS DISTINCT FROM v_lane.turn_at
       OR v_put.not_before IS DISTINCT FROM v_lane.not_before
       OR v_put.prios IS DISTINCT FROM v_lane.prios OR v_put.pos_at IS DISTINCT FROM v_lane.pos_at
       OR v_put.pos_id IS DISTINCT FROM v_lane.pos_id THEN
        PERFORM {schema}.lane_put_v1(v_lane.id, v_put);
    END IF;
    -- (a turn it did not have, or an earlier one: sleepers may be waiting for the later one)
    RETURN v_put.turn_at IS NOT NULL
        AND (v_lane.turn_at IS NULL
             OR (v_put.turn_at < v_lane.turn_at AND v_lane.turn_at > clock_timestamp()));
END;
$$;

-- Remove a channel's own policy: it falls back to the queue default.
CREATE OR REPLACE FUNCTION {schema}.channel_policy_clear_v1(p_queue text, p_channel text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    UPDATE {schema}.channel c SET has_policy = false, own_max_concurrency = NULL,
        own_max_size = NULL, own_rate_count = NULL, own_rate_per_ms = NULL, own_burst = NULL
    WHERE c.queue = p_queue AND c.name = p_channel;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- (its row, left with nothing to count, goes there)
    IF {schema}.channel_apply_v1(p_queue, p_channel) THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
END;
$$;

-- Delete every message of a queue that is not held by a consumer (ready and delayed ones).
-- Returns how many were deleted. Held messages stay until acked or their lock expires. A
-- few statements whatever the number of channels (row locks only: no advisory key per
-- channel, which the server's lock table limits).
CREATE OR REPLACE FUNCTION {schema}.queue_purge_v1(p_queue text) RETURNS bigint
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

-- CREATE OR REPLACE resets the settings: as before, with the owner's rights, a fixed
-- search_path and no JIT.
ALTER FUNCTION {schema}.channel_policy_clear_v1(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- (as every function of the schema: nobody but the owner may call the new ones directly)
REVOKE ALL ON FUNCTION {schema}.channel_prune_v1(text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.ingest_wait_v2(text[]) FROM PUBLIC;
