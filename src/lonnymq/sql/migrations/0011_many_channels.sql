-- lonnymq migration 11.

-- =============================================================================================
-- A queue of 100,000 live channels: a queue-wide policy change, a purge, a delete (issue 26)
-- =============================================================================================
--
-- A queue-wide policy change, a purge and a queue delete took each channel's lane key (an
-- advisory lock, a slot of the server's lock table until commit: max_locks_per_transaction x
-- max_connections for every session together, 6,400 by default) and failed with `out of
-- shared memory` past a few thousand live channels, changing nothing. They hold the ingest
-- key; now they lock each lane's live version (a row lock, no slot: lane_lock_v1) instead of
-- its key, in the same one transaction (all or nothing), and a lane write is a compare and
-- swap (lane_put_v1): a dequeue that owns a lane meanwhile and rewrites it after serving finds
-- the version locked and writes nothing (no dequeue waits for them), where before it did not
-- get the lane at all.

CREATE OR REPLACE FUNCTION {schema}.lane_put_v1(p_old_id bigint, p_new {schema}.lane) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    IF p_old_id IS NOT NULL THEN
        -- (compare and swap: only over the live version, and not one that a writer holding
        -- the ingest key has locked, lane_lock_v1: that one's write wins; a dequeue never
        -- waits for it)
        DELETE FROM {schema}.lane l
        WHERE l.queue = p_new.queue AND l.channel = p_new.channel AND l.id = p_old_id
          AND l.id = (SELECT x.id FROM {schema}.lane x
                      WHERE x.queue = p_new.queue AND x.channel = p_new.channel
                        AND x.id = p_old_id
                      FOR UPDATE SKIP LOCKED);
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at, pos_id,
                               not_before)
    VALUES (p_new.queue, p_new.channel, p_new.turn_at, p_new.served_at, p_new.limited,
            p_new.prios, p_new.pos_at, p_new.pos_id, p_new.not_before);
END;
$$;

-- Lock a lane's live version (FOR UPDATE) and return it (NULL: the channel has no lane), for
-- a writer that holds the ingest key (a policy change, a purge, a queue delete), in place of
-- the lane's advisory key: such a key is a slot of the server's lock table until commit, and
-- a queue-wide change over 100,000 channels ran out of them. A dequeue that owns the lane
-- meanwhile may still serve the version it read; its rewrite (lane_put_v1) then finds the
-- version locked and writes nothing. A version its owner is replacing right now is waited
-- for (a dequeue: a short transaction), and its successor locked instead.
CREATE FUNCTION {schema}.lane_lock_v1(p_queue text, p_channel text) RETURNS {schema}.lane
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lane {schema}.lane;
BEGIN
    LOOP
        v_lane := {schema}.lane_get_v1(p_queue, p_channel);
        IF v_lane.id IS NULL THEN
            RETURN NULL;
        END IF;
        PERFORM 1 FROM {schema}.lane l
        WHERE l.queue = p_queue AND l.channel = p_channel AND l.id = v_lane.id
        FOR UPDATE;
        IF FOUND THEN
            RETURN v_lane;
        END IF;
    END LOOP;
END;
$$;

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

CREATE OR REPLACE FUNCTION {schema}.queue_purge_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_d {schema}.discovery;
    v_total bigint := 0;
    r record;
    v_lane {schema}.lane;
BEGIN
    -- with the ingest held, a message not ingested yet is counted as enqueued here
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
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
        SELECT * FROM per ORDER BY channel
    LOOP
        v_total := v_total + r.n;
        IF r.s > 0 THEN
            PERFORM {schema}.channel_give_back_v1(p_queue, r.channel, r.s, 0);
        END IF;
    END LOOP;
    FOR r IN SELECT DISTINCT l.channel FROM {schema}.lane l WHERE l.queue = p_queue ORDER BY 1 LOOP
        v_lane := {schema}.lane_lock_v1(p_queue, r.channel);
        IF v_lane.turn_at IS NOT NULL OR cardinality(v_lane.prios) > 0 THEN
            v_lane.turn_at := NULL;
            v_lane.prios := '{{}}';
            v_lane.pos_at := '{{}}';
            v_lane.pos_id := '{{}}';
            PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
        END IF;
    END LOOP;
    RETURN v_total;
END;
$$;

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
    PERFORM {schema}.lane_lock_v1(p_queue, l.channel)
    FROM (SELECT DISTINCT l.channel FROM {schema}.lane l WHERE l.queue = p_queue ORDER BY 1) AS l;
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

-- (CREATE OR REPLACE keeps the owner and the grants; the attributes are the statement's)
REVOKE ALL ON FUNCTION {schema}.lane_lock_v1(text, text) FROM PUBLIC;
ALTER FUNCTION {schema}.queue_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.queue_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
