-- lonnymq migration 24.

-- =============================================================================================
-- A queue-wide policy change, a purge and a queue delete in a few statements
-- (issue "The usual dequeue at the speed of Postgres, and tenants by the hundred thousand")
-- =============================================================================================
--
-- Since version 11 each of them worked on a queue of 100,000 live channels (row locks, no
-- advisory key per channel), but one channel at a time: a plpgsql call or two per channel
-- (channel_apply_v1, lane_lock_v1, lane_put_v1), 27 s for a policy change over 100,000
-- channels on this project's machine. They now run the same steps for every channel at once:
-- the lanes' live versions locked by queue_lanes_lock_v1, rewritten by lanes_put_v1; the
-- channel rows of a policy change locked, counted and pruned in slices of 1,000 channels
-- (queue_slice_apply_v1). Same signatures, same results. channel_apply_v1 (a channel's own
-- policy) is replaced too: a message acked or deferred while its count was being taken is
-- no longer counted (the condition re-checked on the row's newest version).

-- The live version of each lane of a queue (with p_defaults, only of its channels without a
-- policy of their own), locked FOR UPDATE: lane_lock_v1 for a whole queue, for a queue-wide
-- writer that holds the ingest key (a policy change, a purge, a queue delete; called once per
-- lane, lane_lock_v1 took 27 s of a policy change over 100,000 channels). One statement locks
-- them all; a version its owner replaced between the statement's snapshot and its lock (a
-- busy lane: its owner rewrites it every few milliseconds) is left out, and lane_lock_v1
-- locks the newest version of each lane left out, one by one. Lanes are made and removed only
-- under the ingest key, and an owner's write of a locked version writes nothing
-- (lane_put_v1), so what is locked stays the live version.
CREATE FUNCTION {schema}.queue_lanes_lock_v1(p_queue text, p_defaults boolean)
RETURNS {schema}.lane[]
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_locked {schema}.lane[];
    v_lane {schema}.lane;
    v_channel text;
BEGIN
    -- (the rows as a column of type lane, not a record: a record[] would be converted to
    -- lane[] through its text form, where a timestamp in a DateStyle other than ISO may not
    -- come back the same)
    SELECT coalesce(array_agg(x.l ORDER BY (x.l).channel), '{{}}') INTO v_locked FROM (
        SELECT l FROM (
            SELECT DISTINCT ON (v.channel) v.channel, v.id FROM {schema}.lane v
            WHERE v.queue = p_queue ORDER BY v.channel, v.id DESC
        ) AS live
        JOIN {schema}.lane l ON l.queue = p_queue AND l.channel = live.channel
                            AND l.id = live.id
        WHERE NOT (p_defaults AND EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = p_queue AND c.name = live.channel AND c.has_policy))
        ORDER BY l.channel
        FOR UPDATE OF l
    ) AS x;
    FOR v_channel IN
        SELECT w.channel FROM (
            SELECT DISTINCT v.channel FROM {schema}.lane v WHERE v.queue = p_queue
            EXCEPT
            SELECT d.channel FROM unnest(v_locked) AS d
        ) AS w
        WHERE NOT (p_defaults AND EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = p_queue AND c.name = w.channel AND c.has_policy))
        ORDER BY w.channel
    LOOP
        v_lane := {schema}.lane_lock_v1(p_queue, v_channel);
        IF v_lane.id IS NOT NULL THEN
            v_locked := v_locked || v_lane;
        END IF;
    END LOOP;
    RETURN v_locked;
END;
$$;

-- Replace lane versions by new ones, each p_lanes element naming by its id the version it
-- replaces: lane_put_v1 for many lanes in two statements. The caller holds each replaced
-- version's row lock (queue_lanes_lock_v1), so no other write of them can come first.
CREATE FUNCTION {schema}.lanes_put_v1(p_lanes {schema}.lane[]) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    DELETE FROM {schema}.lane l
    USING unnest(p_lanes) AS n
    WHERE l.queue = n.queue AND l.channel = n.channel AND l.id = n.id;
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at, pos_id,
                               not_before)
    SELECT n.queue, n.channel, n.turn_at, n.served_at, n.limited, n.prios, n.pos_at, n.pos_id,
           n.not_before
    FROM unnest(p_lanes) AS n
    ORDER BY n.channel;
END;
$$;

-- A slice of queue_policy_set_v2's channels (p_channels, in name order) brought in line with
-- the queue's new default, channel_apply_v1's row steps: with a limit in force each has a row
-- (inserted if missing), every row is locked in name order; a limit that starts counting
-- counts what the channel holds (max_size its messages, max_concurrency its messages in
-- flight); a row left with nothing to count goes.
CREATE FUNCTION {schema}.queue_slice_apply_v1(
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
    DELETE FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = ANY (p_channels) AND NOT c.has_policy
      AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
      AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
END;
$$;

-- The lanes of a queue's channels without a policy of their own brought in line with its new
-- default (channel_apply_v1's lane step for all of them): marked limited or not, waiting for
-- a next token no more, without a turn at p_max_concurrency, else with one from their next
-- message when they had none (or one set by a token). The caller holds the ingest key, and
-- their channel rows. Returns whether a lane got a turn it did not have, or an earlier one.
CREATE FUNCTION {schema}.queue_lanes_apply_v1(
    p_queue text, p_max_concurrency integer, p_limited boolean
) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lanes {schema}.lane[] := {schema}.queue_lanes_lock_v1(p_queue, true);
    v_d {schema}.discovery;
    v_turn_from timestamptz;
    v_new {schema}.lane[];
    v_woken boolean;
BEGIN
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    v_turn_from := coalesce(v_d.turn_from[array_position(v_d.queues, p_queue)], '-infinity');
    WITH put AS (
        SELECT o.id, o.queue, o.channel,
               CASE WHEN p_max_concurrency IS NOT NULL
                         AND coalesce(c.current_concurrency, 0) >= p_max_concurrency THEN NULL
                    WHEN n.next_at IS NOT NULL
                         THEN GREATEST(n.next_at, o.served_at, v_turn_from)
                    ELSE o.turn_at END AS turn_at,
               o.served_at, o.written_at, p_limited AS limited,
               CASE WHEN n.done THEN n.prios ELSE o.prios END AS prios,
               CASE WHEN n.done THEN n.pos_at ELSE o.pos_at END AS pos_at,
               CASE WHEN n.done THEN n.pos_id ELSE o.pos_id END AS pos_id,
               NULL::timestamptz AS not_before,
               o.turn_at AS old_turn_at,
               (o.limited, o.turn_at, o.not_before, o.prios, o.pos_at, o.pos_id) AS old_state
        FROM unnest(v_lanes) AS o
        LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = o.channel
        -- (its positions and next message, for a lane without a turn or waiting for a token,
        -- not at its max_concurrency; a lane without positions has neither. OFFSET 0 keeps
        -- the conditions a filter before the call: pulled up into the join, they were tested
        -- after it, and lane_next_v1 ran for every lane)
        LEFT JOIN LATERAL (
            SELECT true AS done, x.next_at, x.prios, x.pos_at, x.pos_id
            FROM {schema}.lane_next_v1(o, v_d.snap) AS x
            WHERE (o.turn_at IS NULL OR o.not_before IS NOT NULL) AND cardinality(o.prios) > 0
              AND NOT (p_max_concurrency IS NOT NULL
                       AND coalesce(c.current_concurrency, 0) >= p_max_concurrency)
            OFFSET 0
        ) AS n ON true
    )
    SELECT coalesce(array_agg(
               ROW(p.id, p.queue, p.channel, p.turn_at, p.served_at, p.written_at, p.limited,
                   p.prios, p.pos_at, p.pos_id, p.not_before)::{schema}.lane
               ORDER BY p.channel)
               FILTER (WHERE (p.limited, p.turn_at, p.not_before, p.prios, p.pos_at, p.pos_id)
                             IS DISTINCT FROM p.old_state), '{{}}'),
           coalesce(bool_or(p.turn_at IS NOT NULL
                            AND (p.old_turn_at IS NULL
                                 OR (p.turn_at < p.old_turn_at
                                     AND p.old_turn_at > clock_timestamp()))), false)
    INTO v_new, v_woken
    FROM put p;
    PERFORM {schema}.lanes_put_v1(v_new);
    RETURN v_woken;
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
                  AND NOT m.sized
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
                  AND m.locked_until IS NOT NULL AND NOT m.slotted
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

-- Set (or, with NULLs, clear) the queue-wide default policy, applied at once to every channel
-- of the queue that has no policy of its own: channel_apply_v1's steps for all of them, in
-- slices of 1,000 channels of a few statements each (one call per channel took 27 s over
-- 100,000 channels). Row locks only, no advisory key per channel, so the server's lock table
-- does not limit how many channels a queue may have; one transaction, so a change that fails
-- changes nothing. Each slice locks its channel rows in name order (as every writer of
-- channel rows does), then marks their messages: an ack, which locks its message and then
-- its channel row, meets the change only within one slice's moment.
CREATE OR REPLACE FUNCTION {schema}.queue_policy_set_v2(
    p_queue text, p_max_concurrency integer, p_max_size integer, p_rate_count integer,
    p_rate_per_ms bigint, p_burst integer
) RETURNS void
-- (each slice read in name order from where the last one stopped, by index: not the queue's
-- every lane hashed or sorted again)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashagg = off
AS $$
DECLARE
    v_after text COLLATE "C" := '';
    v_lanes text[];
    v_rows text[];
    v_next text[];
    v_slice text[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    PERFORM {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue SET max_concurrency = p_max_concurrency, max_size = p_max_size,
        rate_count = p_rate_count, rate_per_ms = p_rate_per_ms, burst = p_burst
    WHERE name = p_queue;
    LOOP
        -- the next 1,000 channels in name order that have a lane or a row (a row's range
        -- bounded by the lanes', so that no slice reads to the end of the queue's rows)
        v_lanes := ARRAY(SELECT DISTINCT l.channel FROM {schema}.lane l
                         WHERE l.queue = p_queue AND l.channel > v_after ORDER BY 1 LIMIT 1000);
        IF cardinality(v_lanes) = 1000 THEN
            v_rows := ARRAY(SELECT c.name FROM {schema}.channel c
                            WHERE c.queue = p_queue AND c.name > v_after
                              AND c.name <= v_lanes[1000]
                            ORDER BY c.name);
        ELSE
            v_rows := ARRAY(SELECT c.name FROM {schema}.channel c
                            WHERE c.queue = p_queue AND c.name > v_after
                            ORDER BY c.name LIMIT 1000);
        END IF;
        v_next := ARRAY(SELECT DISTINCT u.name FROM unnest(v_lanes || v_rows) AS u(name)
                        ORDER BY 1 LIMIT 1000);
        EXIT WHEN cardinality(v_next) = 0;
        v_after := v_next[cardinality(v_next)];
        -- (those without a policy of their own: one lookup each)
        v_slice := ARRAY(SELECT u.name FROM unnest(v_next) AS u(name)
                         WHERE NOT coalesce((SELECT c.has_policy FROM {schema}.channel c
                                             WHERE c.queue = p_queue AND c.name = u.name), false)
                         ORDER BY u.name);
        IF cardinality(v_slice) > 0 THEN
            PERFORM {schema}.queue_slice_apply_v1(p_queue, v_slice, p_max_concurrency,
                p_max_size,
                p_max_concurrency IS NOT NULL OR p_max_size IS NOT NULL OR p_rate_count IS NOT NULL);
        END IF;
    END LOOP;
    -- the lanes (sleepers may be waiting for a turn one of them gets)
    IF {schema}.queue_lanes_apply_v1(p_queue, p_max_concurrency,
                                      p_max_concurrency IS NOT NULL OR p_rate_count IS NOT NULL) THEN
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
    DELETE FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = ANY (v_sized) AND NOT c.has_policy
      AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
      AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
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
CREATE OR REPLACE FUNCTION {schema}.queue_delete_v1(p_queue text) RETURNS bigint
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

-- CREATE OR REPLACE resets the settings: as before, with the owner's rights, a fixed
-- search_path and no JIT.
ALTER FUNCTION {schema}.queue_policy_set_v2(text, integer, integer, integer, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- (as every function of the schema: nobody but the owner may call the new ones directly)
REVOKE ALL ON FUNCTION {schema}.queue_lanes_lock_v1(text, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.lanes_put_v1({schema}.lane[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_slice_apply_v1(text, text[], integer, integer, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_lanes_apply_v1(text, integer, boolean) FROM PUBLIC;
