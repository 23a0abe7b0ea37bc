-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 8. Policies and limits
-- The channel rows (only channels with a policy of their own or a limit in force have one):
-- the limits in force, the counts a limit needs, and the policies that set them.
-- ---------------------------------------------------------------------------------------------

-- The limits in force for a channel: its own policy, else the queue's default.
CREATE FUNCTION {schema}.channel_limits_v1(
    p_queue text, p_channel text, OUT max_concurrency integer, OUT max_size integer
)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    SELECT CASE WHEN c.has_policy THEN c.own_max_concurrency ELSE q.max_concurrency END,
           CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END
    INTO max_concurrency, max_size
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
END;
$$;

-- The limits in force for a channel, with its rate (its own policy, else the queue's default):
-- at most rate_count deliveries per rate_per_ms, burst at once.
CREATE FUNCTION {schema}.channel_limits_v2(
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

-- Give back what removed (or unlocked) messages held on their channel row: p_sized messages
-- of its current_size, p_slotted of its current_concurrency. A slot freed in a channel at its
-- max_concurrency marks it `freed`: the next ingest (which the next dequeue runs, seeing it)
-- gives its lane a turn again. (Only owners and the ingest write lanes: that is what keeps
-- the queues' turn positions exact.) A row left with nothing to count and no policy goes.
CREATE FUNCTION {schema}.channel_give_back_v1(
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

-- A rate's state at p_now: the emission interval T (p_per_ms / p_count), the theoretical
-- arrival time of the next delivery (at least p_now; p_tat rescaled when it was reckoned with
-- another interval: what was owed is kept in deliveries, so a new rate applies within one of
-- its intervals), the deliveries allowed now (whole ones, at most p_burst) and, when none is,
-- when the next one is. See channel_headroom_v2.
CREATE FUNCTION {schema}.rate_state_v1(
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
CREATE FUNCTION {schema}.channel_headroom_v2(
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

-- Bring a channel in line with the limits now in force, after a policy change: a limit that
-- starts counting counts what the channel holds (max_size: its messages; max_concurrency: its
-- messages in flight), the lane is marked limited or not and gets its turn back, or loses it
-- at its max_concurrency, or waits for its next token no more. The caller holds the ingest
-- key. Returns whether the lane got a turn it did not have (or an earlier one).
CREATE FUNCTION {schema}.channel_apply_v1(p_queue text, p_channel text) RETURNS boolean
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

-- Set a channel's own policy (NULL: no limit): max_concurrency, max_size, and a rate of at
-- most p_rate_count deliveries per p_rate_per_ms, p_burst at once (all three or none).
-- Applies at once to the messages it holds.
CREATE FUNCTION {schema}.channel_policy_set_v2(
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

-- Remove a channel's own policy: it falls back to the queue default.
CREATE FUNCTION {schema}.channel_policy_clear_v1(p_queue text, p_channel text) RETURNS void
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

-- Set (or, with NULLs, clear) the queue-wide default policy, applied at once to every channel
-- of the queue that has no policy of its own: channel_apply_v1's steps for all of them, in
-- slices of 1,000 channels of a few statements each (one call per channel took 27 s over
-- 100,000 channels). Row locks only, no advisory key per channel, so the server's lock table
-- does not limit how many channels a queue may have; one transaction, so a change that fails
-- changes nothing. Each slice locks its channel rows in name order (as every writer of
-- channel rows does), then marks their messages: an ack, which locks its message and then
-- its channel row, meets the change only within one slice's moment.
CREATE FUNCTION {schema}.queue_policy_set_v2(
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
    PERFORM {schema}.channel_prune_v1(p_queue, p_channels);
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

