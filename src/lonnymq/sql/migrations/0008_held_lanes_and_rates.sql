-- lonnymq migration 8.

-- =============================================================================================
-- A held snapshot: lanes found by their own index, kept while their channel empties (issue 19)
-- =============================================================================================
--
-- Measured in a 12-minute churn (1 Kombu producer at half the maximum rate, 1 prefetch-1
-- consumer, a REPEATABLE READ snapshot held for minutes 3-9), on version 7: the consumer fell
-- 38 s behind by the end of the hold. `auto_explain` named three statements:
--
-- * A lane's live version (lane_get_v1: `queue = $1 AND channel = $2 ORDER BY id DESC LIMIT
--   1`) was read as a backward scan of the lane's primary key, filtering every lane version of
--   every channel written since, live or dead, until one of the channel's: 8,000 buffers per
--   ingest three minutes into the hold. At half load the churn's channel empties every
--   second, each fold deleted its lane, and the next ingest looked it up that way, under the
--   `ingest` key that consumers wait for. It is now a range in lane_latest_idx order (no
--   other index gives that order), and a fold no longer deletes the lane of a channel that
--   empties: it notes the channel in lane_idle, and housekeeping removes the lane and counts
--   of channels still empty five minutes later (lane_prune_v1). A lane's newest version is
--   then live, and found first, whatever dead versions the snapshot keeps.
-- * The fold's read of a channel's newest count row: the same, by range.
-- * The TTL sweep (expire_v1: `DELETE ... WHERE id IN (subquery)`) was planned as a semi join
--   over a full read of the message primary key: 28,000 buffers and 150 ms per sweep two
--   minutes into the hold, every sweep, holding the `ingest` key. It deletes by primary key
--   from an array now; so does the dead-letter pruning.
--
-- Also: an ingest takes at most 1,000 lane keys (each holds a slot of the server's lock table
-- until commit; a batch across 100,000 new channels made every ingest fail with `out of shared
-- memory`); the lanes past them wait in the pending arrays for the next ingest.

-- =============================================================================================
-- Rate limits per channel (issue 16)
-- =============================================================================================
--
-- A channel policy `rate`: at most rate_count deliveries per rate_per_ms, `burst` at once,
-- with a queue-wide default. Enforced by the owner of the channel's lane in the dequeue, as a
-- GCRA under the channel row (channel_headroom_v2, rate_state_v1); a lane that spent its tokens
-- gets its turn at the next one (lane.not_before), so retry_ms wakes idle consumers then.

ALTER TABLE {schema}.queue
    ADD COLUMN rate_count integer CHECK (rate_count > 0),
    ADD COLUMN rate_per_ms bigint CHECK (rate_per_ms > 0),
    ADD COLUMN burst integer CHECK (burst > 0),
    ADD CONSTRAINT queue_rate_whole CHECK (
        (rate_count IS NULL) = (rate_per_ms IS NULL) AND (rate_count IS NULL) = (burst IS NULL));

ALTER TABLE {schema}.channel
    ADD COLUMN own_rate_count integer CHECK (own_rate_count > 0),
    ADD COLUMN own_rate_per_ms bigint CHECK (own_rate_per_ms > 0),
    ADD COLUMN own_burst integer CHECK (own_burst > 0),
    ADD COLUMN rate_tat timestamptz,
    ADD COLUMN rate_interval interval,
    ADD CONSTRAINT channel_rate_whole CHECK (
        (own_rate_count IS NULL) = (own_rate_per_ms IS NULL)
        AND (own_rate_count IS NULL) = (own_burst IS NULL));

ALTER TABLE {schema}.lane ADD COLUMN not_before timestamptz;

CREATE TABLE {schema}.lane_idle (
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    since timestamptz NOT NULL,
    PRIMARY KEY (queue, channel)
);

CREATE INDEX lane_idle_since_idx ON {schema}.lane_idle (since);

-- The channels whose lanes version 7 deleted when they emptied are unaffected; the lanes
-- of channels empty now are noted, so that housekeeping removes them as it would have.
INSERT INTO {schema}.lane_idle (queue, channel, since)
SELECT DISTINCT ON (l.queue, l.channel) l.queue, l.channel, clock_timestamp()
FROM {schema}.lane l
WHERE NOT EXISTS (SELECT 1 FROM {schema}.message m
                  WHERE m.queue = l.queue AND m.channel = l.channel)
ORDER BY l.queue, l.channel, l.id DESC;

-- A lane's live version (NULL when the channel has none): the first entry of lane_latest_idx
-- from (p_queue, p_channel) on, newest first. (Written as a range in that index's order, which
-- no other index gives: with `queue = $1 AND channel = $2 ORDER BY id DESC` the planner may read
-- the primary key backwards and filter, every lane version of every channel written since,
-- live or dead: 8,000 buffers per ingest three minutes into a held snapshot.)
CREATE OR REPLACE FUNCTION {schema}.lane_get_v1(p_queue text, p_channel text) RETURNS {schema}.lane
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    v_lane {schema}.lane;
BEGIN
    SELECT * INTO v_lane FROM {schema}.lane l WHERE (l.queue, l.channel) >= (p_queue, p_channel)
    ORDER BY l.queue, l.channel, l.id DESC LIMIT 1;
    IF v_lane.queue IS DISTINCT FROM p_queue OR v_lane.channel IS DISTINCT FROM p_channel THEN
        RETURN NULL;
    END IF;
    RETURN v_lane;
END;
$$;

-- Replace a lane's version by a new one: the old row is deleted, the new one inserted (so a
-- read of the latest version never walks superseded ones). The caller holds the lane's key.
-- (Rows of lane and channel_count are found by their whole key, (queue, channel, id), never by
-- id alone: after a VACUUM the planner may serve `id = $1` from lane_latest_idx, whose last
-- column is the id, read whole: 3,300 buffers per delete late in a held snapshot. With the
-- whole key, either index finds the row at once.)
CREATE OR REPLACE FUNCTION {schema}.lane_put_v1(p_old_id bigint, p_new {schema}.lane) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    IF p_old_id IS NOT NULL THEN
        DELETE FROM {schema}.lane l
        WHERE l.queue = p_new.queue AND l.channel = p_new.channel AND l.id = p_old_id;
    END IF;
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at, pos_id,
                               not_before)
    VALUES (p_new.queue, p_new.channel, p_new.turn_at, p_new.served_at, p_new.limited,
            p_new.prios, p_new.pos_at, p_new.pos_id, p_new.not_before);
END;
$$;

-- The limits in force for a channel, with its rate (its own policy, else the queue's default):
-- at most rate_count deliveries per rate_per_ms, burst at once.
CREATE OR REPLACE FUNCTION {schema}.channel_limits_v2(
    p_queue text, p_channel text, OUT max_concurrency integer, OUT max_size integer,
    OUT rate_count integer, OUT rate_per_ms bigint, OUT burst integer
)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    SELECT CASE WHEN c.has_policy THEN c.own_max_concurrency ELSE q.max_concurrency END,
           CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END,
           CASE WHEN c.has_policy THEN c.own_rate_count ELSE q.rate_count END,
           CASE WHEN c.has_policy THEN c.own_rate_per_ms ELSE q.rate_per_ms END,
           CASE WHEN c.has_policy THEN c.own_burst ELSE q.burst END
    INTO max_concurrency, max_size, rate_count, rate_per_ms, burst
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
END;
$$;

-- A rate's state at p_now: the emission interval T (p_per_ms / p_count), the theoretical
-- arrival time of the next delivery (at least p_now; p_tat rescaled when it was reckoned with
-- another interval: what was owed is kept in deliveries, so a new rate applies within one of
-- its intervals), the deliveries allowed now (whole ones, at most p_burst) and, when none is,
-- when the next one is. See channel_headroom_v2.
CREATE OR REPLACE FUNCTION {schema}.rate_state_v1(
    p_tat timestamptz, p_tat_interval interval, p_count integer, p_per_ms bigint, p_burst integer,
    p_now timestamptz, OUT rate_interval interval, OUT tat timestamptz, OUT tokens integer,
    OUT next_at timestamptz
)
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_count IS NULL THEN
        RETURN;
    END IF;
    rate_interval := (p_per_ms::double precision / p_count) * interval '1 millisecond';
    tat := p_tat;
    IF tat > p_now AND p_tat_interval IS DISTINCT FROM rate_interval AND p_tat_interval > '0' THEN
        tat := p_now + (extract(epoch FROM tat - p_now) / extract(epoch FROM p_tat_interval))
                       * rate_interval;
    END IF;
    tat := GREATEST(coalesce(tat, p_now), p_now);
    -- (the 1e-6 absorbs the rounding of timestamps to microseconds: at the time a delivery is
    -- due, it is allowed)
    tokens := LEAST(p_burst, GREATEST(0, floor(p_burst - extract(epoch FROM tat - p_now)
                                                / extract(epoch FROM rate_interval) + 1e-6)))::integer;
    IF tokens = 0 THEN
        next_at := tat - (p_burst - 1) * rate_interval;
    END IF;
END;
$$;

-- What the owner of a limited lane may take now (p_now), its channel row locked for the
-- caller (created when missing): `room`, the free slots under its max_concurrency (NULL: none
-- applies); `tokens`, the deliveries its rate allows now (NULL: no rate); `headroom`, the
-- lesser of the two. All NULL when another transaction holds the row (a producer of a channel
-- with a max_size, or an ack): the lane waits for a later dequeue rather than this one waiting
-- for it.
--
-- The rate is a GCRA (generic cell rate algorithm): with T = rate_per_ms / rate_count (the
-- emission interval), the row keeps `rate_tat`, the theoretical arrival time of the next
-- delivery; n deliveries are allowed at time t when max(tat, t) + n T <= t + burst T, and
-- taking them moves tat to max(tat, t) + n T. So no window of length w holds more than
-- burst + w / T deliveries. `tat` comes back as max(tat, t) (rate_state_v1).
CREATE OR REPLACE FUNCTION {schema}.channel_headroom_v2(
    p_queue text, p_channel text, p_now timestamptz, OUT headroom integer,
    OUT max_concurrency integer, OUT room integer, OUT tokens integer, OUT rate_interval interval,
    OUT burst integer, OUT tat timestamptz
)
LANGUAGE plpgsql SET lock_timeout = '10ms' SET enable_seqscan = off AS $$
DECLARE
    v_lim record;
    v_row {schema}.channel;
BEGIN
    SELECT * INTO v_lim FROM {schema}.channel_limits_v2(p_queue, p_channel);
    max_concurrency := v_lim.max_concurrency;
    IF v_lim.max_concurrency IS NULL AND v_lim.rate_count IS NULL THEN
        headroom := 2147483647;
        RETURN;
    END IF;
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel) THEN
            max_concurrency := NULL;
            RETURN;  -- busy
        END IF;
        BEGIN
            INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
            ON CONFLICT DO NOTHING
            RETURNING * INTO v_row;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        IF v_row.name IS NULL THEN
            max_concurrency := NULL;
            RETURN;  -- another transaction is creating it
        END IF;
    END IF;
    IF v_lim.max_concurrency IS NOT NULL THEN
        room := GREATEST(0, v_lim.max_concurrency - v_row.current_concurrency);
    END IF;
    IF v_lim.rate_count IS NOT NULL THEN
        burst := v_lim.burst;
        SELECT r.rate_interval, r.tat, r.tokens INTO rate_interval, tat, tokens
        FROM {schema}.rate_state_v1(v_row.rate_tat, v_row.rate_interval, v_lim.rate_count,
                                    v_lim.rate_per_ms, v_lim.burst, p_now) AS r;
        -- (a rate changed since the row's tat was reckoned: what is owed, rescaled, is kept,
        -- whether or not this call takes anything)
        IF v_row.rate_tat > p_now AND v_row.rate_interval IS DISTINCT FROM rate_interval THEN
            UPDATE {schema}.channel c SET rate_tat = tat, rate_interval = channel_headroom_v2.rate_interval
            WHERE c.queue = p_queue AND c.name = p_channel;
        END IF;
    END IF;
    headroom := LEAST(coalesce(room, 2147483647), coalesce(tokens, 2147483647));
END;
$$;

-- Create a message in a channel with a max_size in force: producers of that channel take
-- turns on its row (until their transactions end). A producer waits at most 5 s for another
-- one's open transaction, then fails with SQLSTATE LM002 (lonnymq.ChannelBusy).
CREATE OR REPLACE FUNCTION {schema}.message_create_sized_v1(
    p_queue text, p_channel text, p_name text, p_content bytea, p_priority integer,
    p_delay_ms bigint, p_ttl_ms bigint, OUT result_code text, OUT message_id bigint
)
LANGUAGE plpgsql SET lock_timeout = '5s' SET enable_seqscan = off AS $$
DECLARE
    v_row {schema}.channel;
    v_max integer;
    v_at timestamptz;
BEGIN
    BEGIN
        LOOP
            SELECT * INTO v_row FROM {schema}.channel c
            WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
            EXIT WHEN FOUND;
            INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
            ON CONFLICT DO NOTHING;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION USING ERRCODE = 'LM002',
            MESSAGE = format('channel %L of queue %L has a max_size, and another transaction '
                             'creating in it has been open for more than 5 s', p_channel, p_queue),
            HINT = 'producers of a channel with a max_size take turns until they commit: keep '
                   'their transactions short';
    END;
    -- the limit now that the row is ours (a policy may have changed meanwhile)
    SELECT l.max_size INTO v_max FROM {schema}.channel_limits_v1(p_queue, p_channel) l;
    IF p_name IS NOT NULL THEN
        SELECT m.id INTO message_id FROM {schema}.message m
        WHERE m.queue = p_queue AND m.channel = p_channel AND m.name = p_name AND m.attempts = 0;
        IF message_id IS NOT NULL THEN
            result_code := 'deduplicated';
            RETURN;
        END IF;
    END IF;
    IF v_max IS NOT NULL AND v_row.current_size >= v_max THEN
        result_code := 'dropped';
        INSERT INTO {schema}.tally (queue, channel, dropped) VALUES (p_queue, p_channel, 1);
        -- a row created by this call and left empty must not linger
        IF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
           AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
            DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
        END IF;
        RETURN;
    END IF;
    v_at := clock_timestamp() + p_delay_ms * interval '1 millisecond';
    INSERT INTO {schema}.message
        (queue, channel, priority, sized, txid, dequeue_at, expires_at, name, content)
    VALUES (p_queue, p_channel, p_priority, v_max IS NOT NULL, pg_current_xact_id(), v_at,
            v_at + p_ttl_ms * interval '1 millisecond', p_name, p_content)
    RETURNING id INTO message_id;
    IF v_max IS NOT NULL THEN
        UPDATE {schema}.channel c SET current_size = c.current_size + 1
        WHERE c.queue = p_queue AND c.name = p_channel;
    ELSIF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
          AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
        DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
    END IF;
    result_code := 'created';
END;
$$;

-- Ingest what became ready in transactions that committed since the last snapshot (new
-- messages, deferred and requeued ones): give their lanes a turn, or an earlier one, and lower
-- the lanes' positions to them; count the created ones; give a turn back to lanes whose
-- channel got a slot back (`freed`); advance the scan positions of p_queues; fold the tallies
-- (at most once a second, or now with p_fold). One caller at a time (advisory lock): with
-- p_wait it waits for the current one, else it returns the latest state. Consumers deliver
-- only what is ingested.
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
    v_limited boolean;
    v_next record;
    v_next_id bigint;
    -- lane keys taken (each holds a slot of the server's lock table until commit: at most
    -- max_locks_per_transaction x max_connections in all, 6,400 by default)
    v_keys integer := 0;
    -- heads of the lanes left for the next ingest (pend_*), and how many
    v_pq text[] := ARRAY[]::text[];
    v_pc text[] := ARRAY[]::text[];
    v_pp smallint[] := ARRAY[]::smallint[];
    v_pa timestamptz[] := ARRAY[]::timestamptz[];
    v_pi bigint[] := ARRAY[]::bigint[];
    v_np integer := 0;
    v_k integer;
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
        -- A channel without a lane gets one, and needs no key: no dequeue can own a lane that
        -- has no version, and whoever else creates lanes holds the ingest key. A lane that
        -- exists is written under its key: one its owner is serving right now waits for the
        -- next ingest (no waiting), and so do those past the first 1,000 keys of this ingest
        -- (each key holds a slot of the lock table until commit: 100,000 of them made every
        -- ingest fail with `out of shared memory`).
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        IF v_lane.id IS NOT NULL THEN
            IF v_keys >= 1000
               OR NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel)) THEN
                -- (appended in place, element by element: `||` would copy the arrays at each)
                FOR v_k IN 1 .. cardinality(r.prios) LOOP
                    v_np := v_np + 1;
                    v_pq[v_np] := r.queue;
                    v_pc[v_np] := r.channel;
                    v_pp[v_np] := r.prios[v_k];
                    v_pa[v_np] := r.pos_at[v_k];
                    v_pi[v_np] := r.pos_id[v_k];
                END LOOP;
                CONTINUE;
            END IF;
            v_keys := v_keys + 1;
            -- (again, under the key: its owner may have written a newer version meanwhile)
            v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        END IF;
        v_put := v_lane;
        IF v_lane.id IS NULL THEN
            SELECT l.max_concurrency IS NOT NULL OR l.rate_count IS NOT NULL INTO v_limited
            FROM {schema}.channel_limits_v2(r.queue, r.channel) l;
            v_put := ROW(NULL, r.queue, r.channel, NULL, '-infinity', v_now, v_limited,
                         '{{}}', '{{}}', '{{}}', NULL)::{schema}.lane;
        END IF;
        SELECT * INTO v_merged FROM {schema}.positions_merge_v1(v_put, r.prios, r.pos_at, r.pos_id);
        v_put.prios := v_merged.prios;
        v_put.pos_at := v_merged.pos_at;
        v_put.pos_id := v_merged.pos_id;
        -- (a rated lane out of tokens: not before its next one)
        v_at := GREATEST(r.due, v_put.served_at, v_tf, v_put.not_before);
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

    v_new.pend_queue := v_pq;
    v_new.pend_channel := v_pc;
    v_new.pend_prio := v_pp;
    v_new.pend_at := v_pa;
    v_new.pend_id := v_pi;

    -- channels that got a slot back while at their max_concurrency: their lanes' turn again
    -- (the lane, then the channel row: the order of the dequeue; an ack locks only the row)
    -- (a lane being served, or a row an ack holds, waits for the next ingest)
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
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
                IF v_next.next_at IS NOT NULL THEN
                    v_i := array_position(v_old.queues, r.queue);
                    v_lane.turn_at := GREATEST(v_next.next_at, v_lane.served_at, v_lane.not_before,
                        CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_old.turn_from[v_i] END);
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

-- Fold the tallies of the transactions visible in p_snap and not in p_from (with p_q/p_c/p_n
-- enqueued counts of the caller) into channel_count; a channel left empty, without a policy,
-- is noted in lane_idle (its lane and counts go when it has stayed empty for a while:
-- lane_prune_v1). Run by the ingest.
CREATE OR REPLACE FUNCTION {schema}.fold_v1(
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
CREATE OR REPLACE FUNCTION {schema}.lane_prune_v1(p_limit integer, p_idle interval) RETURNS integer
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
    -- rated lanes: emission interval, burst, tat (at least now) and tokens when the call began
    v_rt interval[];
    v_burst integer[];
    v_tat timestamptz[];
    v_tok integer[];
    v_wait timestamptz;
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
            -- (rated lanes only: filled as they are met, NULL elsewhere)
            v_rt := NULL;
            v_burst := NULL;
            v_tat := NULL;
            v_tok := NULL;
            v_taken := array_fill(0, ARRAY[v_n]);
            v_more := array_fill(false, ARRAY[v_n]);
            v_done := array_fill(false, ARRAY[v_n]);
            FOR i IN 1 .. v_n LOOP
                v_own[i] := pg_try_advisory_xact_lock(
                    {schema}.lane_key_v1((v_cands[i]).queue, (v_cands[i]).channel));
                IF NOT (v_cands[i]).limited THEN
                    v_cap[i] := v_left;
                ELSIF v_own[i] THEN
                    SELECT h.* INTO r
                    FROM {schema}.channel_headroom_v2((v_cands[i]).queue, (v_cands[i]).channel,
                                                      v_now) AS h;
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
                        IF EXISTS (SELECT 1 FROM {schema}.lane l
                                   WHERE l.queue = v_lane.queue AND l.channel = v_lane.channel
                                     AND l.id = v_lane.id) THEN
                            PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                        END IF;
                    ELSE
                        v_room[i] := r.room;
                        v_cap[i] := LEAST(r.headroom, v_left);
                        v_max[i] := r.max_concurrency;
                        v_rt[i] := r.rate_interval;
                        v_burst[i] := r.burst;
                        v_tat[i] := r.tat;
                        v_tok[i] := r.tokens;
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
                IF (v_max[i] IS NOT NULL OR v_rt[i] IS NOT NULL) AND v_taken[i] > 0 THEN
                    UPDATE {schema}.channel c SET
                        current_concurrency = c.current_concurrency
                            + CASE WHEN v_max[i] IS NOT NULL THEN v_taken[i] ELSE 0 END,
                        rate_tat = CASE WHEN v_rt[i] IS NOT NULL
                                        THEN v_tat[i] + v_taken[i] * v_rt[i] ELSE c.rate_tat END,
                        rate_interval = coalesce(v_rt[i], c.rate_interval)
                    WHERE c.queue = v_lane.queue AND c.name = v_lane.channel;
                END IF;
                -- a rated lane that spent its tokens: its turn not before the next one
                v_wait := CASE WHEN v_rt[i] IS NOT NULL AND v_tok[i] - v_taken[i] <= 0
                    THEN v_tat[i] + (v_taken[i] - v_burst[i] + 1) * v_rt[i] END;
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
                v_lane.limited := v_max[i] IS NOT NULL OR v_rt[i] IS NOT NULL;
                v_lane.not_before := v_wait;
                IF v_taken[i] > 0 THEN
                    v_lane.served_at := v_served + i * interval '1 microsecond';
                END IF;
                IF v_max[i] IS NOT NULL AND v_room[i] - v_taken[i] <= 0 THEN
                    v_lane.turn_at := NULL;  -- at its max_concurrency: no turn until a slot frees
                ELSIF v_more[i] THEN
                    v_lane.turn_at := GREATEST(v_lane.served_at, v_lane.turn_at, v_wait);
                ELSE
                    v_lane.turn_at := CASE WHEN v_next.next_at IS NOT NULL
                        THEN GREATEST(v_next.next_at, v_lane.served_at, (v_cands[i]).turn_at,
                                      v_wait) END;
                END IF;
                -- (a version superseded meanwhile by its previous owner is left as it is)
                IF EXISTS (SELECT 1 FROM {schema}.lane l
                           WHERE l.queue = v_lane.queue AND l.channel = v_lane.channel
                             AND l.id = (v_cands[i]).id) THEN
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

-- Give back what removed (or unlocked) messages held on their channel row: p_sized messages
-- of its current_size, p_slotted of its current_concurrency. A slot freed in a channel at its
-- max_concurrency marks it `freed`: the next ingest (which the next dequeue runs, seeing it)
-- gives its lane a turn again. (Only owners and the ingest write lanes: that is what keeps
-- the queues' turn positions exact.) A row left with nothing to count and no policy goes.
CREATE OR REPLACE FUNCTION {schema}.channel_give_back_v1(
    p_queue text, p_channel text, p_sized integer, p_slotted integer
) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_row {schema}.channel;
    v_max integer;
BEGIN
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_row.current_size := GREATEST(0, v_row.current_size - p_sized);
    IF p_slotted > 0 THEN
        SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(p_queue, p_channel) l;
        IF v_max IS NOT NULL AND v_row.current_concurrency >= v_max
           AND v_row.current_concurrency - p_slotted < v_max THEN
            v_row.freed := true;
            PERFORM {schema}.wake_v1(p_queue);
        END IF;
        v_row.current_concurrency := GREATEST(0, v_row.current_concurrency - p_slotted);
    END IF;
    IF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
       AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
        DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
    ELSE
        UPDATE {schema}.channel c SET
            current_size = v_row.current_size,
            current_concurrency = v_row.current_concurrency,
            freed = v_row.freed
        WHERE c.queue = p_queue AND c.name = p_channel;
    END IF;
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
    v_row {schema}.channel;
    v_n integer;
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_d {schema}.discovery;
    v_next record;
    v_i integer;
BEGIN
    SELECT * INTO v_lim FROM {schema}.channel_limits_v2(p_queue, p_channel);
    IF v_lim.max_size IS NOT NULL OR v_lim.max_concurrency IS NOT NULL
       OR v_lim.rate_count IS NOT NULL THEN
        INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
        ON CONFLICT DO NOTHING;
    END IF;
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
    IF FOUND THEN
        IF v_lim.max_size IS NOT NULL THEN
            WITH marked AS (
                UPDATE {schema}.message m SET sized = true
                WHERE m.id IN (
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.channel = p_channel AND x.locked_until IS NULL
                      AND NOT x.sized
                    UNION ALL
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                      AND x.channel = p_channel AND NOT x.sized)
                RETURNING 1
            )
            SELECT count(*) INTO v_n FROM marked;
            v_row.current_size := v_row.current_size + v_n;
        END IF;
        IF v_lim.max_concurrency IS NOT NULL THEN
            WITH marked AS (
                UPDATE {schema}.message m SET slotted = true
                WHERE m.id IN (
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                      AND x.channel = p_channel AND NOT x.slotted)
                RETURNING 1
            )
            SELECT count(*) INTO v_n FROM marked;
            v_row.current_concurrency := v_row.current_concurrency + v_n;
        END IF;
        UPDATE {schema}.channel c SET
            current_size = v_row.current_size, current_concurrency = v_row.current_concurrency
        WHERE c.queue = p_queue AND c.name = p_channel;
        DELETE FROM {schema}.channel c
        WHERE c.queue = p_queue AND c.name = p_channel AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
          AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
    END IF;
    PERFORM pg_advisory_xact_lock({schema}.lane_key_v1(p_queue, p_channel));
    v_lane := {schema}.lane_get_v1(p_queue, p_channel);
    IF v_lane.id IS NULL THEN
        RETURN false;
    END IF;
    v_put := v_lane;
    v_put.limited := v_lim.max_concurrency IS NOT NULL OR v_lim.rate_count IS NOT NULL;
    -- (a lane waiting for its next token under the old rate: its turn is recomputed, and its
    -- owner reckons the tokens under the new one)
    v_put.not_before := NULL;
    IF v_lim.max_concurrency IS NOT NULL
       AND coalesce(v_row.current_concurrency, 0) >= v_lim.max_concurrency THEN
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

-- Set a channel's own policy (NULL: no limit): max_concurrency, max_size, and a rate of at
-- most p_rate_count deliveries per p_rate_per_ms, p_burst at once (all three or none).
-- Applies at once to the messages it holds.
CREATE OR REPLACE FUNCTION {schema}.channel_policy_set_v2(
    p_queue text, p_channel text, p_max_concurrency integer, p_max_size integer,
    p_rate_count integer, p_rate_per_ms bigint, p_burst integer
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    PERFORM {schema}.queue_ensure_v1(p_queue);
    INSERT INTO {schema}.channel AS c (queue, name, has_policy, own_max_concurrency, own_max_size,
                                       own_rate_count, own_rate_per_ms, own_burst)
    VALUES (p_queue, p_channel, true, p_max_concurrency, p_max_size, p_rate_count, p_rate_per_ms,
            p_burst)
    ON CONFLICT (queue, name) DO UPDATE SET
        has_policy = true, own_max_concurrency = EXCLUDED.own_max_concurrency,
        own_max_size = EXCLUDED.own_max_size, own_rate_count = EXCLUDED.own_rate_count,
        own_rate_per_ms = EXCLUDED.own_rate_per_ms, own_burst = EXCLUDED.own_burst;
    IF {schema}.channel_apply_v1(p_queue, p_channel) THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
END;
$$;

-- Version 1 (clients of schema version 7 and before): the limits, keeping the channel's rate.
CREATE OR REPLACE FUNCTION {schema}.channel_policy_set_v1(
    p_queue text, p_channel text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT c.own_rate_count, c.own_rate_per_ms, c.own_burst INTO r FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel AND c.has_policy;
    PERFORM {schema}.channel_policy_set_v2(p_queue, p_channel, p_max_concurrency, p_max_size,
                                           r.own_rate_count, r.own_rate_per_ms, r.own_burst);
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
    IF {schema}.channel_apply_v1(p_queue, p_channel) THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
    DELETE FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel AND NOT c.has_policy
      AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
      AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
END;
$$;

-- Set (or, with NULLs, clear) the queue-wide default policy, applied at once to every channel
-- of the queue that has no policy of its own.
CREATE OR REPLACE FUNCTION {schema}.queue_policy_set_v2(
    p_queue text, p_max_concurrency integer, p_max_size integer, p_rate_count integer,
    p_rate_per_ms bigint, p_burst integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_channel text;
    v_woken boolean := false;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    PERFORM {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue SET max_concurrency = p_max_concurrency, max_size = p_max_size,
        rate_count = p_rate_count, rate_per_ms = p_rate_per_ms, burst = p_burst
    WHERE name = p_queue;
    FOR v_channel IN
        SELECT x.channel FROM (
            SELECT l.channel FROM {schema}.lane l WHERE l.queue = p_queue
            UNION
            SELECT c.name FROM {schema}.channel c WHERE c.queue = p_queue
        ) AS x
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.channel c
                          WHERE c.queue = p_queue AND c.name = x.channel AND c.has_policy)
        ORDER BY x.channel
    LOOP
        IF {schema}.channel_apply_v1(p_queue, v_channel) THEN
            v_woken := true;
        END IF;
    END LOOP;
    IF v_woken THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
END;
$$;

-- Version 1 (clients of schema version 7 and before): the limits, keeping the queue's rate.
CREATE OR REPLACE FUNCTION {schema}.queue_policy_set_v1(
    p_queue text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT q.rate_count, q.rate_per_ms, q.burst INTO r FROM {schema}.queue q
    WHERE q.name = p_queue;
    PERFORM {schema}.queue_policy_set_v2(p_queue, p_max_concurrency, p_max_size, r.rate_count,
                                         r.rate_per_ms, r.burst);
END;
$$;

-- Delete expired messages (not held by a consumer) and queues unused for longer than their
-- x-expires, at most p_limit messages a call. Returns (messages, queues) deleted. Reads the
-- expiry index from the position where the last sweep stopped.
CREATE OR REPLACE FUNCTION {schema}.expire_v1(p_limit integer, OUT messages bigint, OUT queues bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_d {schema}.discovery;
    v_from timestamptz;
    v_queue text;
    r record;
BEGIN
    messages := 0;
    queues := 0;
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        -- (by primary key from an array: `id IN (subquery)` was planned as a semi join that
        -- read the whole primary key, every message and dead version, at each sweep: 28,000
        -- buffers and 150 ms two minutes into a held snapshot, under the ingest key)
        WITH gone AS (
            DELETE FROM {schema}.message m
            WHERE m.id = ANY (ARRAY(
                SELECT x.id FROM {schema}.message x
                WHERE x.expires_at >= v_d.expire_from AND x.expires_at <= v_now
                  AND x.locked_until IS NULL
                ORDER BY x.expires_at LIMIT p_limit
                FOR UPDATE SKIP LOCKED))
            RETURNING m.queue, m.channel, m.sized,
                      m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap) AS fresh
        ), per AS (
            SELECT g.queue, g.channel, count(*)::integer AS n,
                   count(*) FILTER (WHERE g.sized)::integer AS s,
                   count(*) FILTER (WHERE g.fresh)::integer AS f
            FROM gone g GROUP BY g.queue, g.channel
        ), counted AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, expired)
            SELECT p.queue, p.channel, p.f, p.n FROM per p
        )
        SELECT * FROM per ORDER BY queue, channel
    LOOP
        messages := messages + r.n;
        IF r.s > 0 THEN
            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, r.s, 0);
        END IF;
    END LOOP;
    -- the next sweep starts at the first message with a time to live still here and past it
    -- (held by a consumer), else now
    IF messages < p_limit THEN
        v_from := coalesce((
            SELECT x.expires_at FROM {schema}.message x
            WHERE x.expires_at >= v_d.expire_from AND x.expires_at <= v_now
            ORDER BY x.expires_at LIMIT 1), v_now);
        IF v_from > v_d.expire_from THEN
            INSERT INTO {schema}.discovery
                (snap, folded, taken_at, folded_at, queues, turn_from, lock_from, lock_next, lock_id,
                 expire_from, pend_queue, pend_channel, pend_prio, pend_at, pend_id)
            VALUES (v_d.snap, v_d.folded, v_d.taken_at, v_d.folded_at, v_d.queues,
                    v_d.turn_from, v_d.lock_from, v_d.lock_next, v_d.lock_id, v_from, v_d.pend_queue,
                    v_d.pend_channel, v_d.pend_prio, v_d.pend_at, v_d.pend_id);
            DELETE FROM {schema}.discovery d WHERE d.id = v_d.id;
        END IF;
    END IF;
    FOR v_queue IN
        SELECT q.name FROM {schema}.queue q
        WHERE q.expires_ms IS NOT NULL
          AND q.used_at < v_now - q.expires_ms * interval '1 millisecond'
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(v_queue);
        queues := queues + 1;
    END LOOP;
END;
$$;

-- Housekeeping, run by consumers every expire_interval: prune dead letters older than their
-- queue's retention (at most p_limit), ingest and fold the counts, and remove the lanes of
-- channels empty for 5 minutes (at most p_limit).
CREATE OR REPLACE FUNCTION {schema}.housekeep_v1(p_limit integer, OUT dead_pruned bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_shortest bigint;
BEGIN
    SELECT least(min(q.dead_retention_ms), 1209600000) INTO v_shortest FROM {schema}.queue q;
    WITH old AS (
        SELECT d.id FROM {schema}.dead_message d
        LEFT JOIN {schema}.queue q ON q.name = d.queue
        WHERE d.dead_at < v_now - coalesce(v_shortest, 1209600000) * interval '1 millisecond'
          AND d.dead_at < v_now - coalesce(q.dead_retention_ms, 1209600000)
              * interval '1 millisecond'
        ORDER BY d.dead_at
        LIMIT p_limit
    ), gone AS (
        DELETE FROM {schema}.dead_message d WHERE d.id = ANY (ARRAY(SELECT o.id FROM old o))
        RETURNING 1
    )
    SELECT count(*) INTO dead_pruned FROM gone;
    PERFORM {schema}.ingest_v1(ARRAY[]::text[], true, true);
    -- channels empty for 5 minutes: their lanes and counts go
    -- (at most 1,000 a call: each takes a lane key, a slot of the server's lock table)
    PERFORM {schema}.lane_prune_v1(LEAST(p_limit, 1000), interval '5 minutes');
END;
$$;

-- The channels of a queue, largest first, with their policies and counters (version 1, for
-- clients of schema version 7 and before: channel_list_v2 without the rates).
CREATE OR REPLACE FUNCTION {schema}.channel_list_v1(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT c.channel_name, c.size, c.in_flight, c.max_concurrency, c.max_size, c.has_policy,
           c.waiting_since, c.served_at, c.enqueued, c.delivered, c.acked, c.deferred, c.dead,
           c.expired, c.dropped
    FROM {schema}.channel_list_v2(p_queue, p_limit) AS c;
END;
$$;

-- The channels of a queue, largest first, with their policies (rates too), counters, the
-- state of their rate: deliveries allowed now (`tokens`) and, when none is, when the next one
-- is (`next_token_at`); and since when their oldest ready message has been due.
CREATE OR REPLACE FUNCTION {schema}.channel_list_v2(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint, rate_count integer, rate_per_ms bigint, burst integer,
    tokens integer, next_token_at timestamptz, oldest_ready_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    -- what committed since the ingest's snapshot (a lane's turn after a freed slot, say)
    PERFORM {schema}.ingest_v1(ARRAY[p_queue], false, false);
    RETURN QUERY
    WITH t AS MATERIALIZED (SELECT * FROM {schema}.channel_totals_v1(p_queue)),
    c AS (
        SELECT coalesce(t.channel, ch.name) AS channel,
               coalesce(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged, 0) AS size,
               coalesce(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held, 0) AS in_flight,
               t.enqueued, t.delivered, t.acked, t.deferred, t.dead, t.expired, t.dropped,
               coalesce(ch.has_policy, false) AS has_policy
        FROM t FULL JOIN (SELECT * FROM {schema}.channel x WHERE x.queue = p_queue AND x.has_policy) AS ch
            ON ch.name = t.channel
    ),
    -- (the largest first, limited before the per-channel lookups: with them first, the top 50
    -- of 100,000 channels took 1,892 ms, limited first 326 ms)
    top AS MATERIALIZED (
        SELECT * FROM c WHERE c.size > 0 OR c.has_policy
        ORDER BY c.size DESC, c.in_flight DESC, c.channel
        LIMIT p_limit
    )
    SELECT top.channel, top.size::integer, top.in_flight::integer, lim.max_concurrency,
           lim.max_size, top.has_policy, l.turn_at, nullif(l.served_at, '-infinity'),
           coalesce(top.enqueued, 0), coalesce(top.delivered, 0), coalesce(top.acked, 0),
           coalesce(top.deferred, 0), coalesce(top.dead, 0), coalesce(top.expired, 0),
           coalesce(top.dropped, 0), lim.rate_count, lim.rate_per_ms, lim.burst, st.tokens,
           GREATEST(st.next_at, l.not_before),
           -- (its lane's positions: the due time of its first ready message per priority; at
           -- most that old, as a position may lag behind what was just taken)
           (SELECT min(p.at) FROM unnest(l.pos_at) AS p(at) WHERE p.at <= v_now)
    FROM top
    CROSS JOIN LATERAL {schema}.channel_limits_v2(p_queue, top.channel) AS lim
    LEFT JOIN LATERAL {schema}.lane_get_v1(p_queue, top.channel) AS l ON true
    LEFT JOIN {schema}.channel ch ON ch.queue = p_queue AND ch.name = top.channel
    LEFT JOIN LATERAL {schema}.rate_state_v1(ch.rate_tat, ch.rate_interval, lim.rate_count,
                                             lim.rate_per_ms, lim.burst, v_now) AS st ON true
    ORDER BY top.size DESC, top.in_flight DESC, top.channel;
END;
$$;

-- A channel's own policy, the queue default (rates too), its gauges (messages held, in flight)
-- and the state of its rate.
CREATE OR REPLACE FUNCTION {schema}.channel_get_v2(p_queue text, p_channel text)
RETURNS TABLE (
    has_policy boolean, own_max_concurrency integer, own_max_size integer,
    max_concurrency integer, max_size integer, size bigint, in_flight bigint,
    own_rate_count integer, own_rate_per_ms bigint, own_burst integer, rate_count integer,
    rate_per_ms bigint, burst integer, tokens integer, next_token_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT g.*, c.own_rate_count, c.own_rate_per_ms, c.own_burst, q.rate_count, q.rate_per_ms,
           q.burst, st.tokens, GREATEST(st.next_at, l.not_before)
    FROM {schema}.channel_get_v1(p_queue, p_channel) AS g
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel AND c.has_policy
    CROSS JOIN LATERAL {schema}.channel_limits_v2(p_queue, p_channel) AS lim
    LEFT JOIN {schema}.channel ch ON ch.queue = p_queue AND ch.name = p_channel
    LEFT JOIN LATERAL {schema}.rate_state_v1(ch.rate_tat, ch.rate_interval, lim.rate_count,
                                             lim.rate_per_ms, lim.burst, v_now) AS st ON true
    LEFT JOIN LATERAL {schema}.lane_get_v1(p_queue, p_channel) AS l ON true;
END;
$$;

-- Per queue, the channels whose rate holds back messages that are due now (their lane waits
-- for its next token), and how many such messages they hold ready (read from the lanes'
-- positions: O(messages they hold)).
CREATE OR REPLACE FUNCTION {schema}.rate_held_v1()
RETURNS TABLE (queue_name text, channels bigint, messages bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT l.queue::text, count(*), coalesce(sum(n.ready), 0)::bigint
    FROM (
        SELECT DISTINCT ON (x.queue, x.channel) x.*
        FROM {schema}.lane x WHERE x.limited
        ORDER BY x.queue, x.channel, x.id DESC
    ) AS l
    CROSS JOIN LATERAL (
        SELECT count(*) AS ready
        FROM unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
        CROSS JOIN LATERAL (
            SELECT 1 FROM {schema}.message m
            WHERE m.queue = l.queue AND m.channel = l.channel AND m.locked_until IS NULL
              AND m.priority = p.prio AND (m.dequeue_at, m.id) >= (p.at, p.pid)
              AND m.dequeue_at <= v_now
        ) AS m
    ) AS n
    WHERE l.not_before > v_now AND n.ready > 0
    GROUP BY l.queue;
END;
$$;


-- Rights: the new functions are not executable by PUBLIC (lonnymq.grant gives them to the
-- roles of their kind); the entry points run as the schema's owner. (CREATE OR REPLACE reset
-- what the definition does not say: the entry points replaced above get their settings again,
-- in the order a fresh install gives them.)
REVOKE ALL ON FUNCTION {schema}.channel_limits_v2(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.rate_state_v1(timestamptz, interval, integer, bigint, integer, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.channel_headroom_v2(text, text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.lane_prune_v1(integer, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.channel_policy_set_v2(text, text, integer, integer, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_policy_set_v2(text, integer, integer, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.channel_list_v2(text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.channel_get_v2(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.rate_held_v1() FROM PUBLIC;

ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_policy_set_v1(text, text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_policy_clear_v1(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.queue_policy_set_v1(text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.expire_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.housekeep_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_list_v1(text, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_policy_set_v2(text, text, integer, integer, integer, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_get_v2(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.queue_policy_set_v2(text, integer, integer, integer, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_list_v2(text, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.rate_held_v1()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- Roles granted a kind of rights before this migration get the new functions of their kind
-- (see lonnymq.roles): whoever may read the status may read what rates hold back; an admin
-- may set rates, list and read channels with them, and read lane_idle (as every table).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role, p.proname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname IN ('queue_status_v1', 'channel_policy_set_v1')
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        IF r.proname = 'queue_status_v1' THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
                '{schema}.rate_held_v1()'::regprocedure, r.role);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s, %s, %s, %s TO %s',
                '{schema}.channel_policy_set_v2(text, text, integer, integer, integer, bigint, integer)'::regprocedure,
                '{schema}.queue_policy_set_v2(text, integer, integer, integer, bigint, integer)'::regprocedure,
                '{schema}.channel_get_v2(text, text)'::regprocedure,
                '{schema}.channel_list_v2(text, integer)'::regprocedure, r.role);
            EXECUTE format('GRANT SELECT ON %s TO %s', '{schema}.lane_idle'::regclass, r.role);
        END IF;
    END LOOP;
END;
$$;
