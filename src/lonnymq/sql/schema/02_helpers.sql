-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 2. Keys, wake-up and small helpers
-- Advisory lock keys, the NOTIFY of sleeping consumers, queue ids, lane versions.
-- ---------------------------------------------------------------------------------------------

-- The advisory lock key of a lane: held (transaction lock) by the dequeue that owns the lane
-- for its call, and by the ingest and the policy changes that rewrite it.
CREATE FUNCTION {schema}.lane_key_v1(p_queue text, p_channel text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended({lock_prefix} || 'lane:' || p_queue || chr(31) || p_channel, 0)
$$;

-- Keys of a queue: 'produce' is held shared by every producer transaction of the queue until
-- it ends; 'sleep' is held shared (session lock) by consumers that found nothing and wait for
-- a NOTIFY. Neither is ever waited for by a producer.
CREATE FUNCTION {schema}.queue_key_v1(p_kind text, p_queue text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended({lock_prefix} || p_kind || ':' || p_queue, 0)
$$;

-- wake_v2 without a hint.
CREATE FUNCTION {schema}.wake_v1(p_queue text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {schema}.wake_v2(p_queue, NULL);
END;
$$;

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

-- Hold and release the shared `sleep` keys of queues on this session, queue by queue (the
-- transport holds them on its LISTEN session, for the queues of its idle channels; see
-- docs/design.md, "Wake-ups"): takes those of p_take, releases those of p_drop (keys the
-- session holds), and returns the queues of p_check with a producer transaction open (their
-- `produce` key is held), in name order. A client that takes a key looks for messages again
-- afterwards, and again each time a queue it checked has no producer transaction open any
-- more: the protocol of the dequeue's step 6.
CREATE FUNCTION {schema}.sleep_v1(p_take text[], p_drop text[], p_check text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared({schema}.queue_key_v1('sleep', d.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_drop) AS u(q) ORDER BY u.q) AS d;
    PERFORM pg_advisory_lock_shared({schema}.queue_key_v1('sleep', t.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_take) AS u(q) ORDER BY u.q) AS t;
    RETURN ARRAY(SELECT DISTINCT c.q FROM unnest(p_check) AS c(q)
                 WHERE NOT {schema}.queue_idle_v1(c.q) ORDER BY c.q);
END;
$$;

-- The hand-off's registration (schema version 21; see handoff_v1), and sleep_v1: p_holder,
-- this LISTEN session's own random id (NULL: no hand-off, as sleep_v1), whose key 'holder'
-- the session holds while it lives (taken at its first call; a call for a holder another
-- session holds fails). It holds the key 'asleep <holder>' of the queues of p_hand_take until
-- they are in p_hand_drop: those of its channels asleep with room in their prefetch window,
-- so that a publish hands a message only to a session that can take it, and to no session
-- that is gone. p_queues (NULL: unchanged): the queues it consumes, written to its sleeper
-- row with p_secret, p_lock_ms and p_no_ack (schema version 23: those of them it consumes
-- without acks, whose messages are handed to it without a row); rows of sessions that are
-- gone are deleted then. An empty p_queues (the consumer closes): its row is deleted, and the
-- call waits for the transactions handing it a message to end (their NOTIFYs are then there
-- to be read).
CREATE FUNCTION {schema}.sleep_v3(
    p_take text[], p_drop text[], p_check text[], p_hand_take text[], p_hand_drop text[],
    p_holder bigint, p_secret text, p_lock_ms bigint, p_queues text[], p_no_ack text[]
) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint;
BEGIN
    IF p_holder IS NOT NULL THEN
        v_key := {schema}.queue_key_v1('holder', p_holder::text);
        IF NOT pg_try_advisory_lock(v_key) THEN
            RAISE EXCEPTION 'hand-off holder % is another session''s', p_holder
                USING ERRCODE = 'lock_not_available';
        END IF;
        IF current_setting('lonnymq.holder', true) IS NOT DISTINCT FROM p_holder::text THEN
            PERFORM pg_advisory_unlock(v_key);  -- (held once, since its first call)
        END IF;
        PERFORM set_config('lonnymq.holder', p_holder::text, false);
        PERFORM pg_advisory_unlock({schema}.queue_key_v1('asleep ' || p_holder, d.q))
        FROM (SELECT DISTINCT u.q FROM unnest(p_hand_drop) AS u(q) ORDER BY u.q) AS d;
        IF cardinality(p_queues) = 0 THEN
            DELETE FROM {schema}.sleeper s WHERE s.holder = p_holder;
            PERFORM pg_advisory_xact_lock({schema}.queue_key_v1('handoff', p_holder::text));
        ELSIF p_queues IS NOT NULL THEN
            INSERT INTO {schema}.sleeper (holder, queues, secret, lock_ms, no_ack)
            VALUES (p_holder, p_queues, p_secret, p_lock_ms, coalesce(p_no_ack, '{{}}'))
            ON CONFLICT (holder) DO UPDATE SET queues = excluded.queues,
                secret = excluded.secret, lock_ms = excluded.lock_ms, no_ack = excluded.no_ack,
                updated_at = clock_timestamp();
            DELETE FROM {schema}.sleeper s
            WHERE s.holder IN (
                SELECT g.holder FROM {schema}.sleeper g
                WHERE g.holder <> p_holder
                  AND NOT {schema}.key_held_v1({schema}.queue_key_v1('holder', g.holder::text))
                FOR UPDATE SKIP LOCKED);
        END IF;
    END IF;
    PERFORM pg_advisory_unlock_shared({schema}.queue_key_v1('sleep', d.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_drop) AS u(q) ORDER BY u.q) AS d;
    PERFORM pg_advisory_lock_shared({schema}.queue_key_v1('sleep', t.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_take) AS u(q) ORDER BY u.q) AS t;
    IF p_holder IS NOT NULL THEN
        PERFORM pg_advisory_lock({schema}.queue_key_v1('asleep ' || p_holder, t.q))
        FROM (SELECT DISTINCT u.q FROM unnest(p_hand_take) AS u(q) ORDER BY u.q) AS t;
    END IF;
    RETURN ARRAY(SELECT DISTINCT c.q FROM unnest(p_check) AS c(q)
                 WHERE NOT {schema}.queue_idle_v1(c.q) ORDER BY c.q);
END;
$$;

-- sleep_v3 without p_no_ack (schema version 21; for clients of version 22): every message
-- handed to a session registered with it has a row.
CREATE FUNCTION {schema}.sleep_v2(
    p_take text[], p_drop text[], p_check text[], p_hand_take text[], p_hand_drop text[],
    p_holder bigint, p_secret text, p_lock_ms bigint, p_queues text[]
) RETURNS text[]
LANGUAGE plpgsql AS $$
BEGIN
    RETURN {schema}.sleep_v3(p_take, p_drop, p_check, p_hand_take, p_hand_drop, p_holder,
                             p_secret, p_lock_ms, p_queues, NULL);
END;
$$;

-- Whether another session holds the advisory key p_key (session or transaction lock): tried
-- and, when got, released at once.
CREATE FUNCTION {schema}.key_held_v1(p_key bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_try_advisory_lock(p_key) THEN
        PERFORM pg_advisory_unlock(p_key);
        RETURN false;
    END IF;
    RETURN true;
END;
$$;

-- The id of a queue, created on first use.
CREATE FUNCTION {schema}.queue_ensure_v1(p_queue text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_id integer;
BEGIN
    SELECT q.id INTO v_id FROM {schema}.queue q WHERE q.name = p_queue;
    IF v_id IS NULL THEN
        INSERT INTO {schema}.queue (name) VALUES (p_queue)
        ON CONFLICT (name) DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NULL THEN
            SELECT q.id INTO v_id FROM {schema}.queue q WHERE q.name = p_queue;
        END IF;
    END IF;
    RETURN v_id;
END;
$$;

-- A lane's live version (NULL when the channel has none): the first entry of lane_latest_idx
-- from (p_queue, p_channel) on, newest first. (Written as a range in that index's order, which
-- no other index gives: with `queue = $1 AND channel = $2 ORDER BY id DESC` the planner may read
-- the primary key backwards and filter, every lane version of every channel written since,
-- live or dead: 8,000 buffers per ingest three minutes into a held snapshot.)
CREATE FUNCTION {schema}.lane_get_v1(p_queue text, p_channel text) RETURNS {schema}.lane
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
-- read of the latest version never walks superseded ones). The caller holds the lane's key,
-- or the live version's row lock (lane_lock_v1). Nothing is written when the old version is
-- no longer the live one, or is locked by another transaction (lane_lock_v1).
-- (Rows of lane and channel_count are found by their whole key, (queue, channel, id), never by
-- id alone: after a VACUUM the planner may serve `id = $1` from lane_latest_idx, whose last
-- column is the id, read whole: 3,300 buffers per delete late in a held snapshot. With the
-- whole key, either index finds the row at once.)
CREATE FUNCTION {schema}.lane_put_v1(p_old_id bigint, p_new {schema}.lane) RETURNS void
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

-- A lane's positions tightened to its first message per priority (ready or delayed, ingested,
-- not locked by a committed dequeue; one locked by a dequeue still running counts, so that no
-- position passes a message that such a dequeue may still give back), the priorities that
-- still have one, and when the first of them falls due (NULL: none).
-- (Bitmap scans off, here and in the dequeue: a bitmap heap scan reads and sorts every row from
-- the position on, where an index scan stops after the first; see migration 7.)
CREATE FUNCTION {schema}.lane_next_v1(
    p_lane {schema}.lane, p_snap pg_snapshot, OUT next_at timestamptz, OUT prios smallint[],
    OUT pos_at timestamptz[], OUT pos_id bigint[]
)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
BEGIN
    SELECT min(n.dequeue_at),
           coalesce(array_agg(p.prio ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}'),
           coalesce(array_agg(n.dequeue_at ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}'),
           coalesce(array_agg(n.id ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}')
    INTO next_at, prios, pos_at, pos_id
    FROM unnest(p_lane.prios, p_lane.pos_at, p_lane.pos_id) AS p(prio, at, pid)
    LEFT JOIN LATERAL (
        SELECT m.dequeue_at, m.id FROM {schema}.message m
        WHERE m.queue = p_lane.queue AND m.channel = p_lane.channel AND m.locked_until IS NULL
          AND m.priority = p.prio AND (m.dequeue_at, m.id) >= (p.at, p.pid)
          AND pg_visible_in_snapshot(m.txid, p_snap)
        ORDER BY m.priority DESC, m.dequeue_at, m.id
        LIMIT 1
    ) AS n ON true;
END;
$$;

