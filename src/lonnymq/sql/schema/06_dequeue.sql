-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 6. Dequeue
-- ---------------------------------------------------------------------------------------------

-- Producers of a queue whose transactions are still open (they hold its 'produce' key)?
CREATE FUNCTION {schema}.queue_idle_v1(p_queue text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('produce', p_queue);
BEGIN
    IF pg_try_advisory_lock(v_key) THEN
        PERFORM pg_advisory_unlock(v_key);
        RETURN true;
    END IF;
    RETURN false;
END;
$$;

-- Milliseconds until something in the given queues may become available: a lane's turn (a
-- delayed message falling due) or a lock expiring (from the ingest's hint). NULL when nothing
-- is pending.
CREATE FUNCTION {schema}.queue_retry_ms_v1(p_queues text[], p_d {schema}.discovery) RETURNS bigint
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_next timestamptz;
BEGIN
    SELECT LEAST(
        (SELECT min(w.at) FROM unnest(p_queues) AS u(q) CROSS JOIN LATERAL (
            SELECT l.turn_at AS at FROM {schema}.lane l
            WHERE l.queue = u.q
              AND l.turn_at >= coalesce(p_d.turn_from[array_position(p_d.queues, u.q)], '-infinity')
            ORDER BY l.turn_at LIMIT 1) AS w),
        (SELECT min(p_d.lock_next[array_position(p_d.queues, u.q)]) FROM unnest(p_queues) AS u(q))
    ) INTO v_next;
    IF v_next IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN GREATEST(0, ceil(extract(epoch FROM v_next - v_now) * 1000))::bigint;
END;
$$;

-- The dequeue's steps that are functions of their own (message_dequeue_v3 below reads as the
-- list of its steps; each of these is one of them, or a part of one).

-- Step 0: a caller that slept (it found nothing last time, with p_listen) is awake again:
-- the 'sleep' keys its session still holds (p_keys: lonnymq.sleeping) are released.
CREATE FUNCTION {schema}.dequeue_wake_v1(p_keys text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared(k.key)
    FROM unnest(string_to_array(p_keys, ',')::bigint[]) AS k(key)
    WHERE EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks l
        WHERE l.pid = pg_backend_pid() AND l.locktype = 'advisory' AND l.objsubid = 1
          AND l.mode = 'ShareLock' AND l.granted
          AND l.classid::bigint = (k.key >> 32) & 4294967295
          AND l.objid::bigint = k.key & 4294967295);
    PERFORM set_config('lonnymq.sleeping', '', false);
END;
$$;

-- Step 2, the usual call: its lane, owned, moved to the back and its position past what the
-- call took (a lane without limits and of one priority; p_served: when it was served). One
-- statement: the next message (not locked, ingested in the latest snapshot of the ingest:
-- read after the lane's key was taken, as in step 5), and the version replaced by compare
-- and swap, as lane_put_v1 does: only over the live version, and not one that a queue-wide
-- change has locked. (lanes_served_v1 writes such a lane the same way, for any lanes: called
-- here instead, it cost the usual call over 1,000 channels 14%, 0.67 ms against 0.59 with
-- synchronous_commit off, and the lone-lane case a function call and a statement more.)
CREATE FUNCTION {schema}.lane_advance_v1(p_lane {schema}.lane, p_served timestamptz)
RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
BEGIN
    WITH next AS MATERIALIZED (
        SELECT m.dequeue_at, m.id FROM {schema}.message m
        WHERE m.queue = p_lane.queue AND m.channel = p_lane.channel
          AND m.locked_until IS NULL AND m.priority = p_lane.prios[1]
          AND (m.dequeue_at, m.id) >= (p_lane.pos_at[1], p_lane.pos_id[1])
          AND pg_visible_in_snapshot(m.txid, (
              SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1))
        ORDER BY m.priority DESC, m.dequeue_at, m.id
        LIMIT 1),
    gone AS (
        DELETE FROM {schema}.lane o
        WHERE o.queue = p_lane.queue AND o.channel = p_lane.channel AND o.id = p_lane.id
          AND o.id = (SELECT y.id FROM {schema}.lane y
                      WHERE y.queue = p_lane.queue AND y.channel = p_lane.channel
                        AND y.id = p_lane.id
                      FOR UPDATE SKIP LOCKED)
        RETURNING o.id)
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at,
                               pos_id, not_before)
    SELECT p_lane.queue, p_lane.channel,
           -- (its next message: due now, or later; none: no turn)
           CASE WHEN n.id IS NOT NULL THEN GREATEST(n.dequeue_at, p_served, p_lane.turn_at) END,
           p_served, false,
           CASE WHEN n.id IS NULL THEN '{{}}' ELSE p_lane.prios END,
           CASE WHEN n.id IS NULL THEN '{{}}' ELSE ARRAY[n.dequeue_at] END,
           CASE WHEN n.id IS NULL THEN '{{}}' ELSE ARRAY[n.id] END,
           NULL
    FROM gone o LEFT JOIN next n ON true;
END;
$$;

-- Step 1, a wake-up: the usual call found nothing, and no lane of its queue is due, because
-- what woke it is not ingested yet. When what no ingest has seen yet, of every queue, is
-- little (the first 64 rows of message_txid_idx past the ingest's snapshot, and those of the
-- transactions running in it that have committed since) and this queue's part of it is of
-- one channel, the call serves that channel as an ingest and the usual call would (its lane,
-- the only one due), without the ingest (about 20 statements): when the channel has no limit,
-- no lane of the queue has heads left pending and no lock of it is past its expiry, its
-- first messages in ready order that are due and live, up to what the call asks for. Under
-- the ingest key, tried: no ingest runs meanwhile, so none counts these messages too; the
-- statements read the ingest's state after the key was taken. The call's tally counts their
-- creation (`arrival` 1: counted), as the ingest would have; the lock's expiry reaches the
-- ingest through the tally, as any delivery's; the lane is not written (the next ingest
-- gives it what is left). The session's next call ingests first (lonnymq.fresh), so that
-- takes do not follow one another without an ingest. Returns the rows taken (none: the
-- caller goes on).
CREATE FUNCTION {schema}.dequeue_take_v1(
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

-- Steps 2 to 4: the queues of a call (those that exist, in name order), their max_attempts,
-- their positions (from the ingest's state p_d) and whether a lock is past its expiry (at
-- p_now). (Every statement's plan is set up again in each transaction, aggregates and sorts
-- most of all: one queue, the usual case, takes a statement without.)
CREATE FUNCTION {schema}.dequeue_queues_v1(
    p_queues text[], p_d {schema}.discovery, p_now timestamptz, OUT names text[],
    OUT max_attempts integer[], OUT turn_from timestamptz[], OUT lock_from timestamptz[],
    OUT expired boolean
)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_i integer;
BEGIN
    IF cardinality(p_queues) = 1 THEN
        v_i := array_position(p_d.queues, p_queues[1]);
        SELECT ARRAY[q.name::text], ARRAY[coalesce(q.max_attempts, 2147483647)],
               ARRAY[coalesce(p_d.turn_from[v_i], '-infinity')],
               ARRAY[coalesce(p_d.lock_from[v_i], '-infinity')],
               -- (the first one in lock order, from the queue's lock position: an EXISTS
               -- loses the order, and was planned as a read of the whole locked index)
               (SELECT e.locked_until FROM {schema}.message e
                WHERE e.queue = p_queues[1]
                  AND e.locked_until >= coalesce(p_d.lock_from[v_i], '-infinity')
                  AND e.locked_until <= p_now
                ORDER BY e.queue, e.locked_until LIMIT 1) IS NOT NULL
        INTO names, max_attempts, turn_from, lock_from, expired
        FROM {schema}.queue q WHERE q.name = p_queues[1];
    ELSE
        SELECT array_agg(q.name ORDER BY q.name),
               array_agg(coalesce(q.max_attempts, 2147483647) ORDER BY q.name),
               array_agg(coalesce(p_d.turn_from[array_position(p_d.queues, q.name)],
                                  '-infinity') ORDER BY q.name),
               array_agg(coalesce(p_d.lock_from[array_position(p_d.queues, q.name)],
                                  '-infinity') ORDER BY q.name),
               coalesce(bool_or(x.found), false)
        INTO names, max_attempts, turn_from, lock_from, expired
        FROM {schema}.queue q
        LEFT JOIN LATERAL (
            SELECT true AS found FROM {schema}.message e
            WHERE e.queue = q.name
              AND e.locked_until >= coalesce(p_d.lock_from[array_position(p_d.queues, q.name)],
                                             '-infinity')
              AND e.locked_until <= p_now
            ORDER BY e.locked_until LIMIT 1
        ) AS x ON true
        WHERE q.name = ANY (p_queues);
    END IF;
END;
$$;

-- Step 3: messages of p_queues whose lock expired (from each queue's lock position
-- p_lock_from), at most p_limit: they still count against their channel's concurrency and
-- are taken over (event 'redelivered') without touching any lane; one delivered
-- max_attempts times already (p_max_attempts, per queue), its holder dying each time, is a
-- poison message: dead-lettered instead (event 'dead'). Tallied here.
CREATE FUNCTION {schema}.dequeue_expired_v1(
    p_queues text[], p_lock_from timestamptz[], p_max_attempts integer[], p_limit integer,
    p_now timestamptz, p_lock interval
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    message_priority smallint, message_attempts integer, message_lock_token uuid,
    message_created_at timestamptz, message_content bytea, message_state bytea, event text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_relock bigint[];
    v_poison bigint[];
BEGIN
    v_relock := ARRAY(
        SELECT x.id FROM unnest(p_queues, p_lock_from) AS u(q, lf)
        CROSS JOIN LATERAL (
            SELECT e.id, e.locked_until FROM {schema}.message e
            WHERE e.queue = u.q AND e.locked_until >= u.lf AND e.locked_until <= p_now
            ORDER BY e.locked_until LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        ) AS x
        ORDER BY x.locked_until LIMIT p_limit);
    v_poison := ARRAY(
        SELECT m.id FROM {schema}.message m
        WHERE m.id = ANY (v_relock)
          AND m.attempts >= p_max_attempts[array_position(p_queues, m.queue)]
        ORDER BY m.id);
    IF cardinality(v_poison) > 0 THEN
        RETURN QUERY
            WITH b AS MATERIALIZED (
                SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts')
            ), tallied AS (
                INSERT INTO {schema}.tally (queue, channel, dead, dead_held)
                SELECT b.queue_name, b.channel_name, count(*), count(*)
                FROM b GROUP BY b.queue_name, b.channel_name
            )
            SELECT b.message_id, b.queue_name, b.channel_name, b.message_name, NULL::smallint,
                   b.message_attempts, NULL::uuid, b.message_created_at, NULL::bytea,
                   NULL::bytea, 'dead'::text
            FROM b;
    END IF;
    RETURN QUERY
        WITH taken AS (
            UPDATE {schema}.message m SET
                locked_until = p_now + p_lock,
                lock_token = gen_random_uuid(),
                attempts = m.attempts + 1
            WHERE m.id = ANY (v_relock) AND m.id <> ALL (v_poison)
            RETURNING m.*
        ), tallied AS (
            INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, lock_until,
                                        lock_id)
            SELECT t.queue, t.channel, count(*), count(*), min(t.locked_until), min(t.id)
            FROM taken t GROUP BY t.queue, t.channel
        )
        SELECT t.id, t.queue::text, t.channel::text, t.name, t.priority, t.attempts,
               t.lock_token, t.created_at, t.content, t.state, 'redelivered'::text
        FROM taken t ORDER BY t.locked_until, t.id;
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

-- Step 4, the lanes of a call (the first p_n of p_cands): each is owned when the call gets
-- its key; one without limits may give up to p_left (owned or not), one with limits only to
-- its owner, within its channel's headroom (channel_headroom_v2; a busy channel row: not
-- served this time, lane_postpone_v1). Per lane: owned, what it may give (cap), the slots
-- left (room), its max_concurrency, and for a rated one its emission interval, burst, tat
-- and tokens (NULL arrays when no lane is rated).
CREATE FUNCTION {schema}.lanes_claim_v1(
    p_cands {schema}.lane[], p_n integer, p_left integer, p_now timestamptz,
    OUT own boolean[], OUT cap integer[], OUT room integer[], OUT max_concurrency integer[],
    OUT rate interval[], OUT burst integer[], OUT tat timestamptz[], OUT tokens integer[]
)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    i integer;
BEGIN
    own := array_fill(false, ARRAY[p_n]);
    cap := array_fill(0, ARRAY[p_n]);
    room := array_fill(NULL::integer, ARRAY[p_n]);
    max_concurrency := array_fill(NULL::integer, ARRAY[p_n]);
    FOR i IN 1 .. p_n LOOP
        own[i] := pg_try_advisory_xact_lock(
            {schema}.lane_key_v1((p_cands[i]).queue, (p_cands[i]).channel));
        IF NOT (p_cands[i]).limited THEN
            cap[i] := p_left;
        ELSIF own[i] THEN
            SELECT h.* INTO r
            FROM {schema}.channel_headroom_v2((p_cands[i]).queue, (p_cands[i]).channel,
                                              p_now) AS h;
            IF r.headroom IS NULL THEN
                own[i] := false;
                PERFORM {schema}.lane_postpone_v1(p_cands[i]);
            ELSE
                room[i] := r.room;
                cap[i] := LEAST(r.headroom, p_left);
                max_concurrency[i] := r.max_concurrency;
                rate[i] := r.rate_interval;
                burst[i] := r.burst;
                tat[i] := r.tat;
                tokens[i] := r.tokens;
            END IF;
        END IF;
    END LOOP;
END;
$$;

-- Step 4, a pass over several lanes: each lane's heads (p_lanes: positions in p_cands, with
-- their quota) from its positions: due (p_now), ingested (p_snap), not held by anyone, one
-- more than its quota (has it more?); in rank order within the lane (priority, then due
-- time, then id).
CREATE FUNCTION {schema}.lane_heads_v1(
    p_cands {schema}.lane[], p_lanes integer[], p_quota integer[], p_snap pg_snapshot,
    p_now timestamptz, OUT ids bigint[], OUT lanes integer[], OUT ranks integer[]
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
BEGIN
    SELECT array_agg(h.id ORDER BY h.rn, h.i), array_agg(h.i ORDER BY h.rn, h.i),
           array_agg(h.rn ORDER BY h.rn, h.i)
    INTO ids, lanes, ranks
    FROM unnest(p_lanes, p_quota) AS u(i, quota)
    CROSS JOIN LATERAL (
        SELECT u.i, z.id,
               (row_number() OVER (ORDER BY z.priority DESC, z.dequeue_at, z.id))::integer AS rn
        FROM (
            SELECT m.id, m.priority, m.dequeue_at
            FROM unnest((p_cands[u.i]).prios, (p_cands[u.i]).pos_at,
                        (p_cands[u.i]).pos_id) AS p(prio, at, pid)
            CROSS JOIN LATERAL (
                SELECT m.id, m.priority, m.dequeue_at FROM {schema}.message m
                WHERE m.queue = (p_cands[u.i]).queue AND m.channel = (p_cands[u.i]).channel
                  AND m.locked_until IS NULL AND m.priority = p.prio
                  AND (m.dequeue_at, m.id) >= (p.at, p.pid) AND m.dequeue_at <= p_now
                  AND pg_visible_in_snapshot(m.txid, p_snap)
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT u.quota + 1
                FOR UPDATE SKIP LOCKED
            ) AS m
            ORDER BY m.priority DESC, m.dequeue_at, m.id
            LIMIT u.quota + 1
        ) AS z
    ) AS h;
END;
$$;

-- Step 4, a limited lane whose channel row is busy (an open transaction of a producer of a
-- channel with a max_size, or of an ack): not served this time, and its turn a little later,
-- so that it does not hold back the point from which the lanes are read (which would then
-- walk every lane version written meanwhile). The caller owns the lane (its key).
CREATE FUNCTION {schema}.lane_postpone_v1(p_lane {schema}.lane) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lane {schema}.lane := p_lane;
BEGIN
    v_lane.turn_at := GREATEST(v_lane.turn_at, clock_timestamp() + interval '10 milliseconds');
    -- (a version superseded meanwhile by its previous owner is left as it is)
    IF EXISTS (SELECT 1 FROM {schema}.lane l
               WHERE l.queue = p_lane.queue AND l.channel = p_lane.channel
                 AND l.id = p_lane.id) THEN
        PERFORM {schema}.lane_put_v1(p_lane.id, v_lane);
    END IF;
END;
$$;

-- Step 5: the lanes the call owned (p_own; p_n lanes of p_cands were served): for each, its
-- channel's counts when it has limits (p_taken more in flight, the rate's tat), then the lane
-- rewritten with the latest snapshot of the ingest (read here: after the lanes' keys were
-- taken, so an ingest that looked at a lane and left it as it was did so before): positions
-- at the first message not taken, the turn to the back (p_more: it has more due), at its next
-- due message, at its next token (a rated lane that spent them), or none (nothing left, or
-- at its max_concurrency). A lone lane (the only one due, and of the call) without limits
-- that has more, written a moment ago, is not written (its positions lag by what was taken
-- since; the next write catches up). The lanes without limits are written in one statement,
-- those with limits one by one (the lone-lane rule is not theirs).
CREATE FUNCTION {schema}.lanes_served_v1(
    p_cands {schema}.lane[], p_n integer, p_own boolean[], p_taken integer[],
    p_more boolean[], p_max integer[], p_room integer[], p_rate interval[],
    p_tat timestamptz[], p_tokens integer[], p_burst integer[], p_now timestamptz
)
RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $$
DECLARE
    v_served timestamptz := clock_timestamp();
    v_snap pg_snapshot;
    v_lane {schema}.lane;
    v_wait timestamptz;
    v_next record;
    i integer;
BEGIN
    SELECT d.snap INTO v_snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    -- the lanes without limits, all in one statement: per lane and priority its next message
    -- (as lane_next_v1), then each version replaced by compare and swap (as lane_put_v1)
    WITH own AS MATERIALIZED (
        SELECT u.i, p_cands[u.i] AS l, p_more[u.i] AS more, p_taken[u.i] AS taken
        FROM generate_series(1, p_n) AS u(i)
        WHERE p_own[u.i] AND p_max[u.i] IS NULL AND p_rate[u.i] IS NULL
          AND NOT (p_n = 1 AND cardinality(p_cands) = 1 AND p_more[u.i]
                   AND NOT (p_cands[u.i]).limited AND (p_cands[u.i]).served_at > '-infinity'
                   AND (p_cands[u.i]).written_at > p_now - interval '5 milliseconds')
    ), next AS (
        SELECT o.i, min(n.dequeue_at) AS next_at,
               coalesce(array_agg(p.prio ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL),
                        '{{}}') AS prios,
               coalesce(array_agg(n.dequeue_at ORDER BY p.prio DESC)
                            FILTER (WHERE n.id IS NOT NULL), '{{}}') AS pos_at,
               coalesce(array_agg(n.id ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL),
                        '{{}}') AS pos_id
        FROM own o
        CROSS JOIN LATERAL unnest((o.l).prios, (o.l).pos_at, (o.l).pos_id) AS p(prio, at, pid)
        LEFT JOIN LATERAL (
            SELECT m.dequeue_at, m.id FROM {schema}.message m
            WHERE m.queue = (o.l).queue AND m.channel = (o.l).channel AND m.locked_until IS NULL
              AND m.priority = p.prio AND (m.dequeue_at, m.id) >= (p.at, p.pid)
              AND pg_visible_in_snapshot(m.txid, v_snap)
            ORDER BY m.priority DESC, m.dequeue_at, m.id
            LIMIT 1
        ) AS n ON true
        GROUP BY o.i
    ), gone AS (
        -- (each version locked through its whole key, one probe per lane, then deleted by
        -- its row address: a join of the lanes with the table read lane_latest_idx whole,
        -- every dead version a held snapshot keeps)
        DELETE FROM {schema}.lane x
        WHERE x.ctid = ANY (ARRAY(
            SELECT y.ctid FROM own o
            CROSS JOIN LATERAL (
                SELECT y.ctid FROM {schema}.lane y
                WHERE y.queue = (o.l).queue AND y.channel = (o.l).channel AND y.id = (o.l).id
                FOR UPDATE SKIP LOCKED
            ) AS y))
        RETURNING x.queue, x.channel
    )
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at, pos_id,
                               not_before)
    SELECT (o.l).queue, (o.l).channel,
           CASE WHEN o.more THEN GREATEST(w.served_at, (o.l).turn_at)
                WHEN n.next_at IS NOT NULL
                    THEN GREATEST(n.next_at, w.served_at, (o.l).turn_at) END,
           w.served_at, false, coalesce(n.prios, '{{}}'), coalesce(n.pos_at, '{{}}'),
           coalesce(n.pos_id, '{{}}'), NULL
    -- (a lane of no priority has no row in next)
    FROM gone g JOIN own o ON (o.l).queue = g.queue AND (o.l).channel = g.channel
    LEFT JOIN next n ON n.i = o.i
    CROSS JOIN LATERAL (
        SELECT CASE WHEN o.taken > 0 THEN v_served + o.i * interval '1 microsecond'
                    ELSE (o.l).served_at END AS served_at) AS w
    ORDER BY o.i;
    -- the lanes with limits, one by one
    FOR i IN 1 .. p_n LOOP
        CONTINUE WHEN NOT p_own[i] OR (p_max[i] IS NULL AND p_rate[i] IS NULL);
        v_lane := p_cands[i];
        IF p_taken[i] > 0 THEN
            UPDATE {schema}.channel c SET
                current_concurrency = c.current_concurrency
                    + CASE WHEN p_max[i] IS NOT NULL THEN p_taken[i] ELSE 0 END,
                rate_tat = CASE WHEN p_rate[i] IS NOT NULL THEN p_tat[i] + p_taken[i] * p_rate[i]
                                ELSE c.rate_tat END,
                rate_interval = coalesce(p_rate[i], c.rate_interval)
            WHERE c.queue = v_lane.queue AND c.name = v_lane.channel;
        END IF;
        -- a rated lane that spent its tokens: its turn not before the next one
        v_wait := CASE WHEN p_rate[i] IS NOT NULL AND p_tokens[i] - p_taken[i] <= 0
            THEN p_tat[i] + (p_taken[i] - p_burst[i] + 1) * p_rate[i] END;
        -- (what this call took is locked now; what another running dequeue holds still counts)
        SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
        v_lane.prios := v_next.prios;
        v_lane.pos_at := v_next.pos_at;
        v_lane.pos_id := v_next.pos_id;
        v_lane.limited := true;
        v_lane.not_before := v_wait;
        IF p_taken[i] > 0 THEN
            v_lane.served_at := v_served + i * interval '1 microsecond';
        END IF;
        IF p_max[i] IS NOT NULL AND p_room[i] - p_taken[i] <= 0 THEN
            v_lane.turn_at := NULL;  -- at its max_concurrency: no turn until a slot frees
        ELSIF p_more[i] THEN
            v_lane.turn_at := GREATEST(v_lane.served_at, v_lane.turn_at, v_wait);
        ELSE
            v_lane.turn_at := CASE WHEN v_next.next_at IS NOT NULL
                THEN GREATEST(v_next.next_at, v_lane.served_at, (p_cands[i]).turn_at, v_wait) END;
        END IF;
        -- (a version superseded meanwhile by its previous owner is left as it is)
        IF EXISTS (SELECT 1 FROM {schema}.lane l
                   WHERE l.queue = v_lane.queue AND l.channel = v_lane.channel
                     AND l.id = (p_cands[i]).id) THEN
            PERFORM {schema}.lane_put_v1((p_cands[i]).id, v_lane);
        END IF;
    END LOOP;
END;
$$;

-- Step 6: a listening caller that found nothing registers as sleeping on p_queues (their
-- shared 'sleep' keys, named in lonnymq.sleeping for step 0 of its next call), then checks
-- for producers still in their transactions (they may have looked for sleepers before):
-- true when there is one (the caller looks once more, and retries soon).
CREATE FUNCTION {schema}.dequeue_sleep_v1(p_queues text[]) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_keys text;
BEGIN
    v_keys := (SELECT string_agg({schema}.queue_key_v1('sleep', u.q)::text, ',')
               FROM (SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q)) AS u);
    PERFORM pg_advisory_lock_shared(k.key)
    FROM unnest(string_to_array(v_keys, ',')::bigint[]) AS k(key);
    PERFORM set_config('lonnymq.sleeping', v_keys, false);
    RETURN EXISTS (SELECT 1 FROM unnest(p_queues) AS u(q) WHERE NOT {schema}.queue_idle_v1(u.q));
END;
$$;

-- A dequeue's rows, as message_dequeue_v3 returns them: what its steps hand back to it.
-- (Created where it is missing: a repair of a half-installed schema reads this file again,
-- and there is no CREATE TYPE IF NOT EXISTS.)
DO $$
BEGIN
    CREATE TYPE {schema}.delivery AS (
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
    );
EXCEPTION WHEN duplicate_object THEN
    NULL;
END;
$$;

-- The tally of a dequeue's events (p_q, p_c, p_k: queue, channel, kind): one row per
-- channel; one channel, the usual case, without an aggregate. p_lock_until and p_lock_id go
-- with the deliveries (the ingest keeps the queue's earliest lock with them).
CREATE FUNCTION {schema}.tally_events_v1(
    p_q text[], p_c text[], p_k text[], p_lock_until timestamptz, p_lock_id bigint
)
RETURNS void
-- (plpgsql: its plan is kept for the session, where a LANGUAGE sql body is planned at each call)
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(cardinality(p_q), 0) = 0 THEN
        RETURN;
    ELSIF p_q <@ ARRAY[p_q[1]] AND p_c <@ ARRAY[p_c[1]] THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired,
                                    dead, dead_held, lock_until, lock_id)
        VALUES (p_q[1], p_c[1], cardinality(array_positions(p_k, 'delivered')),
                cardinality(array_positions(p_k, 'redelivered')),
                cardinality(array_positions(p_k, 'acked')),
                cardinality(array_positions(p_k, 'expired')),
                cardinality(array_positions(p_k, 'dead')),
                cardinality(array_positions(p_k, 'dead_held')),
                CASE WHEN p_k && ARRAY['delivered', 'redelivered'] THEN p_lock_until END,
                CASE WHEN p_k && ARRAY['delivered', 'redelivered'] THEN p_lock_id END);
        RETURN;
    END IF;
    INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired, dead,
                                dead_held, lock_until, lock_id)
    SELECT u.q, u.c, count(*) FILTER (WHERE u.k = 'delivered'),
           count(*) FILTER (WHERE u.k = 'redelivered'), count(*) FILTER (WHERE u.k = 'acked'),
           count(*) FILTER (WHERE u.k = 'expired'), count(*) FILTER (WHERE u.k = 'dead'),
           count(*) FILTER (WHERE u.k = 'dead_held'),
           CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN p_lock_until END,
           CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN p_lock_id END
    FROM unnest(p_q, p_c, p_k) AS u(q, c, k)
    GROUP BY u.q, u.c;
END;
$$;

-- Step 1: the acks (p_ack_ids, p_ack_tokens; NULL: none) deleted, in the same statement as
-- the usual call's read: the ingest's state, the lanes of p_queue whose turn it is (oldest
-- turn first; two: is the first the only one?) and, when the call is the usual one
-- (p_usual), the first lane's heads from its position. The heads are read only when the
-- ingest's state is fresh, no lock of the queue is past its expiry, the lane has no limit
-- and one priority, and it is the only one due or one message is asked for: due, ingested,
-- not held by anyone, one more than asked for (has it more?); those past their time to live
-- or their max_attempts negated (the general steps handle them). Of the acks: the messages
-- deleted, and of each its queue, channel, sized and slotted.
CREATE FUNCTION {schema}.dequeue_look_v1(
    p_queue text, p_limit integer, p_ack_ids bigint[], p_ack_tokens uuid[], p_usual boolean,
    p_now timestamptz, OUT gone_ids bigint[], OUT gone_queues text[], OUT gone_channels text[],
    OUT gone_sized boolean[], OUT gone_slotted boolean[], OUT due_lanes {schema}.lane[],
    OUT head_ids bigint[]
)
LANGUAGE plpgsql AS $$
BEGIN
    WITH gone AS (
        DELETE FROM {schema}.message m
        WHERE m.id = ANY (p_ack_ids)
          AND m.lock_token = p_ack_tokens[array_position(p_ack_ids, m.id)]
        RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
    )
    SELECT a.ids, a.queues, a.channels, a.sized, a.slotted, s.lanes, s.heads
    INTO gone_ids, gone_queues, gone_channels, gone_sized, gone_slotted, due_lanes, head_ids
    FROM (SELECT array_agg(g.id) AS ids, array_agg(g.queue) AS queues,
                 array_agg(g.channel) AS channels, array_agg(g.sized) AS sized,
                 array_agg(g.slotted) AS slotted
          FROM gone g) AS a
    LEFT JOIN LATERAL (
        SELECT x.lanes, h.heads
        FROM (SELECT * FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1) AS d
        JOIN {schema}.queue q ON q.name = p_queue
        -- the lanes whose turn it is, oldest turn first
        CROSS JOIN LATERAL (
            SELECT ARRAY(
                SELECT l FROM {schema}.lane l
                WHERE l.queue = p_queue
                  AND l.turn_at >= coalesce(
                      d.turn_from[array_position(d.queues, p_queue)], '-infinity')
                  AND l.turn_at <= p_now + interval '1 millisecond'
                ORDER BY l.turn_at, l.id LIMIT 2) AS lanes
            OFFSET 0) AS x  -- (read once, not at each use of its column)
        -- the first one's heads, when the call is the usual one
        CROSS JOIN LATERAL (
            SELECT ARRAY(
                SELECT CASE WHEN m.expires_at <= p_now
                                 OR m.attempts >= coalesce(q.max_attempts, 2147483647)
                            THEN -m.id ELSE m.id END
                FROM {schema}.message m
                WHERE p_usual AND d.taken_at >= p_now - interval '10 milliseconds'
                  AND d.folded_at >= p_now - interval '1 second'
                  AND p_queue = ANY (d.queues)
                  AND NOT (cardinality(d.pend_queue) > 0
                           AND d.taken_at < p_now - interval '5 milliseconds')
                  AND NOT (x.lanes[1]).limited AND cardinality((x.lanes[1]).prios) = 1
                  AND (p_limit = 1 OR cardinality(x.lanes) = 1)
                  -- (the first one in lock order, from the queue's lock position: an
                  -- EXISTS loses the order, and was planned as a read of the whole
                  -- locked index)
                  AND (SELECT e.locked_until FROM {schema}.message e
                       WHERE e.queue = p_queue
                         AND e.locked_until >= coalesce(
                             d.lock_from[array_position(d.queues, p_queue)], '-infinity')
                         AND e.locked_until <= p_now
                       ORDER BY e.queue, e.locked_until LIMIT 1) IS NULL
                  AND m.queue = p_queue AND m.channel = (x.lanes[1]).channel
                  AND m.locked_until IS NULL AND m.priority = ((x.lanes[1]).prios)[1]
                  AND (m.dequeue_at, m.id) >= (((x.lanes[1]).pos_at)[1],
                                               ((x.lanes[1]).pos_id)[1])
                  AND m.dequeue_at <= p_now
                  AND pg_visible_in_snapshot(m.txid, d.snap)
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT p_limit + 1
                FOR UPDATE SKIP LOCKED) AS heads) AS h
    ) AS s ON true;
END;
$$;

-- Step 1 for a call of several queues (schema version 17): as dequeue_look_v1, the acks
-- deleted in the same statement as the usual call's read; here the lanes due are those of
-- every queue of p_queues (oldest turn first across the queues, each queue named once), the
-- ingest's state must be fresh for every queue, and no lock of any of them past its expiry.
-- (dequeue_look_v1 keeps its own statement for one queue: this one sets up more plan nodes,
-- and made the usual call of one queue cost its read a quarter more.)
CREATE FUNCTION {schema}.dequeue_look_queues_v1(
    p_queues text[], p_limit integer, p_ack_ids bigint[], p_ack_tokens uuid[], p_usual boolean,
    p_now timestamptz, OUT gone_ids bigint[], OUT gone_queues text[], OUT gone_channels text[],
    OUT gone_sized boolean[], OUT gone_slotted boolean[], OUT due_lanes {schema}.lane[],
    OUT head_ids bigint[]
)
LANGUAGE plpgsql AS $$
BEGIN
    WITH gone AS (
        DELETE FROM {schema}.message m
        WHERE m.id = ANY (p_ack_ids)
          AND m.lock_token = p_ack_tokens[array_position(p_ack_ids, m.id)]
        RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
    )
    SELECT a.ids, a.queues, a.channels, a.sized, a.slotted, s.lanes, s.heads
    INTO gone_ids, gone_queues, gone_channels, gone_sized, gone_slotted, due_lanes, head_ids
    FROM (SELECT array_agg(g.id) AS ids, array_agg(g.queue) AS queues,
                 array_agg(g.channel) AS channels, array_agg(g.sized) AS sized,
                 array_agg(g.slotted) AS slotted
          FROM gone g) AS a
    LEFT JOIN LATERAL (
        SELECT x.lanes, h.heads
        FROM (SELECT * FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1) AS d
        -- the lanes whose turn it is, of every queue, oldest turn first
        CROSS JOIN LATERAL (
            SELECT ARRAY(
                SELECT y.l FROM (SELECT DISTINCT z.q FROM unnest(p_queues) AS z(q)) AS u
                CROSS JOIN LATERAL (
                    SELECT l FROM {schema}.lane l
                    WHERE l.queue = u.q
                      AND l.turn_at >= coalesce(
                          d.turn_from[array_position(d.queues, u.q)], '-infinity')
                      AND l.turn_at <= p_now + interval '1 millisecond'
                    ORDER BY l.turn_at, l.id LIMIT 2) AS y
                ORDER BY (y.l).turn_at, (y.l).id LIMIT 2) AS lanes
            OFFSET 0) AS x  -- (read once, not at each use of its column)
        -- (the first lane's queue; with none due, the first queue: none when it does not exist)
        JOIN {schema}.queue q ON q.name = coalesce((x.lanes[1]).queue, p_queues[1])
        -- the first one's heads, when the call is the usual one
        CROSS JOIN LATERAL (
            SELECT ARRAY(
                SELECT CASE WHEN m.expires_at <= p_now
                                 OR m.attempts >= coalesce(q.max_attempts, 2147483647)
                            THEN -m.id ELSE m.id END
                FROM {schema}.message m
                WHERE p_usual AND d.taken_at >= p_now - interval '10 milliseconds'
                  AND d.folded_at >= p_now - interval '1 second'
                  AND p_queues <@ d.queues
                  AND NOT (cardinality(d.pend_queue) > 0
                           AND d.taken_at < p_now - interval '5 milliseconds')
                  AND NOT (x.lanes[1]).limited AND cardinality((x.lanes[1]).prios) = 1
                  AND (p_limit = 1 OR cardinality(x.lanes) = 1)
                  -- (no lock of the queues past its expiry: of each, the first one in lock
                  -- order, from the queue's lock position: an EXISTS on the message table
                  -- loses the order, and was planned as a read of the whole locked index)
                  AND NOT EXISTS (
                      SELECT 1 FROM unnest(p_queues) AS u(q)
                      WHERE (SELECT e.locked_until FROM {schema}.message e
                             WHERE e.queue = u.q
                               AND e.locked_until >= coalesce(
                                   d.lock_from[array_position(d.queues, u.q)], '-infinity')
                               AND e.locked_until <= p_now
                             ORDER BY e.queue, e.locked_until LIMIT 1) IS NOT NULL)
                  AND m.queue = (x.lanes[1]).queue AND m.channel = (x.lanes[1]).channel
                  AND m.locked_until IS NULL AND m.priority = ((x.lanes[1]).prios)[1]
                  AND (m.dequeue_at, m.id) >= (((x.lanes[1]).pos_at)[1],
                                               ((x.lanes[1]).pos_id)[1])
                  AND m.dequeue_at <= p_now
                  AND pg_visible_in_snapshot(m.txid, d.snap)
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT p_limit + 1
                FOR UPDATE SKIP LOCKED) AS heads) AS h
    ) AS s ON true;
END;
$$;

-- Step 4, a pass's heads: of each lane of p_lanes (positions in p_cands) at most its quota
-- and one more (has it more?), in rank order (lane_heads_v1); one lane of one priority, the
-- usual pass, read without it.
CREATE FUNCTION {schema}.dequeue_pass_heads_v1(
    p_cands {schema}.lane[], p_lanes integer[], p_quota integer[], p_snap pg_snapshot,
    p_now timestamptz, OUT ids bigint[], OUT lanes integer[], OUT ranks integer[]
)
LANGUAGE plpgsql AS $$
DECLARE
    v_lane {schema}.lane := p_cands[p_lanes[1]];
BEGIN
    IF cardinality(p_lanes) = 1 AND cardinality(v_lane.prios) = 1 THEN
        ids := ARRAY(
            SELECT m.id FROM {schema}.message m
            WHERE m.queue = v_lane.queue AND m.channel = v_lane.channel
              AND m.locked_until IS NULL AND m.priority = (v_lane.prios)[1]
              AND (m.dequeue_at, m.id) >= ((v_lane.pos_at)[1], (v_lane.pos_id)[1])
              AND m.dequeue_at <= p_now
              AND pg_visible_in_snapshot(m.txid, p_snap)
            ORDER BY m.priority DESC, m.dequeue_at, m.id
            LIMIT p_quota[1] + 1
            FOR UPDATE SKIP LOCKED);
        lanes := array_fill(p_lanes[1], ARRAY[cardinality(ids)]);
        ranks := ARRAY(SELECT generate_series(1, cardinality(ids)));
        RETURN;
    END IF;
    SELECT x.ids, x.lanes, x.ranks INTO ids, lanes, ranks
    FROM {schema}.lane_heads_v1(p_cands, p_lanes, p_quota, p_snap, p_now) AS x;
END;
$$;

-- Step 4, a pass's messages locked (p_take, by primary key; p_slotted: those that take a
-- slot of their channel's max_concurrency) for p_lock: the rows to return, in rank order,
-- then lane order (p_heads, p_head_lane, p_head_rank: the pass's heads; p_taken: what each
-- lane gave before), and what each lane gave with them (taken) and their queues and channels
-- for the tally. Those past their time to live or delivered max_attempts times
-- (p_max_attempts, per queue of p_names) are left out of the lock, and expired or
-- dead-lettered (dequeue_leftovers_v1; rows 'dead', counted in dead). A message whose content
-- and state take more than 8 kB comes back without them (content NULL, which no message
-- has): an array is one value, of at most 1 GB, and its elements are copied out of TOAST;
-- the caller reads such content by id (dequeue_general_v1).
CREATE FUNCTION {schema}.dequeue_pass_lock_v1(
    p_cands {schema}.lane[], p_lanes integer[], p_heads bigint[], p_head_lane integer[],
    p_head_rank integer[], p_take bigint[], p_slotted bigint[], p_taken integer[],
    p_names text[], p_max_attempts integer[], p_lock interval, p_now timestamptz,
    OUT deliveries {schema}.delivery[], OUT locked_ids bigint[], OUT taken integer[],
    OUT ev_queue text[], OUT ev_channel text[], OUT dead integer
)
LANGUAGE plpgsql AS $$
DECLARE
    v_at integer := p_lanes[1];
    v_leftovers {schema}.delivery[];
BEGIN
    taken := p_taken;
    IF cardinality(p_lanes) = 1 THEN
        -- (one lane: its heads are in rank order already)
        WITH locked AS (
            UPDATE {schema}.message m SET
                locked_until = p_now + p_lock,
                lock_token = gen_random_uuid(),
                attempts = m.attempts + 1,
                slotted = m.id = ANY (p_slotted)
            WHERE m.id = ANY (p_take)
              AND (m.expires_at IS NULL OR m.expires_at > p_now)
              AND m.attempts < p_max_attempts[array_position(p_names, m.queue)]
            RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                      m.lock_token, m.created_at, m.content, m.state, m.dequeue_at,
                      pg_column_size(m.content) + coalesce(pg_column_size(m.state), 0)
                          <= 8192 AS small
        )
        SELECT array_agg(ROW(l.id, l.queue, l.channel, l.name, l.priority, l.attempts,
                             l.lock_token, l.created_at, CASE WHEN l.small THEN l.content END,
                             CASE WHEN l.small THEN l.state END, NULL,
                             'delivered')::{schema}.delivery
                         ORDER BY l.priority DESC, l.dequeue_at, l.id)
        INTO deliveries
        FROM locked l;
    ELSE
        -- (several lanes: in rank order, then lane order)
        WITH locked AS (
            UPDATE {schema}.message m SET
                locked_until = p_now + p_lock,
                lock_token = gen_random_uuid(),
                attempts = m.attempts + 1,
                slotted = m.id = ANY (p_slotted)
            WHERE m.id = ANY (p_take) AND (m.expires_at IS NULL OR m.expires_at > p_now)
              AND m.attempts < p_max_attempts[array_position(p_names, m.queue)]
            RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                      m.lock_token, m.created_at, m.content, m.state,
                      pg_column_size(m.content) + coalesce(pg_column_size(m.state), 0)
                          <= 8192 AS small
        )
        SELECT array_agg(ROW(l.id, l.queue, l.channel, l.name, l.priority, l.attempts,
                             l.lock_token, l.created_at, CASE WHEN l.small THEN l.content END,
                             CASE WHEN l.small THEN l.state END, NULL,
                             'delivered')::{schema}.delivery
                         ORDER BY p_taken[t.l] + t.rn, t.l)
        INTO deliveries
        FROM locked l
        JOIN unnest(p_heads, p_head_lane, p_head_rank) AS t(id, l, rn) ON t.id = l.id;
    END IF;
    deliveries := coalesce(deliveries, ARRAY[]::{schema}.delivery[]);
    locked_ids := CASE WHEN cardinality(deliveries) = cardinality(p_take) THEN p_take
                   WHEN cardinality(deliveries) = 0 THEN ARRAY[]::bigint[]
                   ELSE ARRAY(SELECT m.id FROM {schema}.message m
                              WHERE m.id = ANY (p_take) AND m.lock_token IS NOT NULL) END;
    -- what each lane gave, and the deliveries' queues and channels
    IF cardinality(p_lanes) = 1 THEN
        taken[v_at] := taken[v_at] + cardinality(locked_ids);
        ev_queue := array_fill((p_cands[v_at]).queue::text, ARRAY[cardinality(locked_ids)]);
        ev_channel := array_fill((p_cands[v_at]).channel::text, ARRAY[cardinality(locked_ids)]);
    ELSE
        SELECT array_agg(p_taken[g.i] + coalesce(c.n, 0) ORDER BY g.i) INTO taken
        FROM generate_series(1, cardinality(p_taken)) AS g(i)
        LEFT JOIN (SELECT t.l, count(*)::integer AS n
                   FROM unnest(p_heads, p_head_lane) AS t(id, l)
                   WHERE t.id = ANY (locked_ids) GROUP BY t.l) AS c ON c.l = g.i;
        SELECT coalesce(array_agg((p_cands[t.l]).queue::text), ARRAY[]::text[]),
               coalesce(array_agg((p_cands[t.l]).channel::text), ARRAY[]::text[])
        INTO ev_queue, ev_channel
        FROM unnest(p_heads, p_head_lane) AS t(id, l)
        WHERE t.id = ANY (locked_ids);
    END IF;
    dead := 0;
    IF cardinality(locked_ids) < cardinality(p_take) THEN
        v_leftovers := ARRAY(
            SELECT ROW(r.message_id, r.queue_name, r.channel_name, r.message_name, NULL,
                       r.message_attempts, NULL, r.message_created_at, NULL, NULL, NULL,
                       'dead')::{schema}.delivery
            FROM {schema}.dequeue_leftovers_v1(p_take, locked_ids, p_now) AS r);
        dead := cardinality(v_leftovers);
        deliveries := deliveries || v_leftovers;
    END IF;
END;
$$;

-- Step 4 and 5: the lanes of p_names whose turn it is (turn_at from the queue's position
-- p_turn_from, or past the lane p_after_at, p_after_id when the call looks again, to now
-- + 1 ms: a lane another consumer has just moved to the back, at its clock, is due for this
-- one too), oldest turn first, at most one per message the call still needs (p_left; one
-- more is read: does another wait?), read with the ingest's latest snapshot (a lane version
-- is never newer than the snapshot its positions are read with). Claimed (lanes_claim_v1),
-- then up to 8 passes: each gives every lane that may give more an equal share of what is
-- left (rounded up, never more than is left). Then the owned lanes are rewritten
-- (lanes_served_v1). Returns the rows (deliveries; 'dead' ones among them), what was
-- delivered (got, and the deliveries' queues and channels for the tally, with the earliest
-- lock and its message), the lanes served (served; more_due: another lane was due; last_*:
-- the last one's turn, where a call that got nothing looks again), the snapshot and the time
-- (looked_at) the lanes were read with.
CREATE FUNCTION {schema}.dequeue_lanes_v1(
    p_names text[], p_turn_from timestamptz[], p_max_attempts integer[],
    p_after_at timestamptz, p_after_id bigint, p_left integer, p_lock interval,
    OUT deliveries {schema}.delivery[], OUT got integer, OUT dead integer,
    OUT ev_queue text[], OUT ev_channel text[], OUT lock_until timestamptz,
    OUT lock_id bigint, OUT served integer, OUT more_due boolean,
    OUT last_turn_at timestamptz, OUT last_id bigint, OUT snap pg_snapshot,
    OUT looked_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_due {schema}.lane[];
    v_claim record;
    v_left integer := p_left;
    -- per lane: taken, more due, done
    v_taken integer[]; v_more boolean[]; v_done boolean[];
    v_passes integer := 0;
    v_lanes integer[];
    v_quota integer[];
    v_share integer;
    v_heads record;
    v_take bigint[];
    v_slotted bigint[];
    v_pass record;
    i integer;
BEGIN
    deliveries := ARRAY[]::{schema}.delivery[];
    got := 0; dead := 0; served := 0; more_due := false;
    ev_queue := ARRAY[]::text[]; ev_channel := ARRAY[]::text[];
    looked_at := clock_timestamp();
    IF cardinality(p_names) = 1 THEN
        SELECT ARRAY(
            SELECT l FROM {schema}.lane l
            WHERE l.queue = p_names[1]
              AND (l.turn_at, l.id) > (coalesce(p_after_at, p_turn_from[1]), p_after_id)
              AND l.turn_at <= looked_at + interval '1 millisecond'
            ORDER BY l.turn_at, l.id LIMIT v_left + 1),
            (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
        INTO v_due, snap;
    ELSE
        SELECT ARRAY(
            SELECT x.l FROM unnest(p_names, p_turn_from) AS u(q, tf)
            CROSS JOIN LATERAL (
                SELECT l FROM {schema}.lane l
                WHERE l.queue = u.q
                  AND (l.turn_at, l.id) > (GREATEST(u.tf, p_after_at),
                      CASE WHEN p_after_at >= u.tf THEN p_after_id ELSE 0 END)
                  AND l.turn_at <= looked_at + interval '1 millisecond'
                ORDER BY l.turn_at, l.id LIMIT v_left + 1
            ) AS x
            ORDER BY (x.l).turn_at, (x.l).id LIMIT v_left + 1),
            (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
        INTO v_due, snap;
    END IF;
    served := LEAST(cardinality(v_due), v_left);
    IF served = 0 THEN
        RETURN;
    END IF;
    more_due := cardinality(v_due) > served;
    last_turn_at := (v_due[served]).turn_at;
    last_id := (v_due[served]).id;
    v_claim := {schema}.lanes_claim_v1(v_due, served, v_left, looked_at);
    v_taken := array_fill(0, ARRAY[served]);
    v_more := array_fill(false, ARRAY[served]);
    v_done := array_fill(false, ARRAY[served]);
    LOOP
        v_passes := v_passes + 1;
        -- the lanes that may give more, and the share of each
        IF served = 1 THEN
            v_lanes := CASE WHEN NOT v_done[1] AND (v_claim.cap)[1] > v_taken[1]
                            THEN ARRAY[1] ELSE ARRAY[]::integer[] END;
        ELSE
            v_lanes := ARRAY(SELECT g.i FROM generate_series(1, served) AS g(i)
                             WHERE NOT v_done[g.i] AND (v_claim.cap)[g.i] > v_taken[g.i]
                             ORDER BY g.i);
        END IF;
        EXIT WHEN cardinality(v_lanes) = 0 OR v_left <= 0 OR v_passes > 8;
        v_share := ceil(v_left::numeric / cardinality(v_lanes))::integer;
        IF cardinality(v_lanes) = 1 THEN
            v_quota := ARRAY[LEAST(v_share, (v_claim.cap)[v_lanes[1]] - v_taken[v_lanes[1]])];
        ELSE
            v_quota := ARRAY(SELECT LEAST(v_share, (v_claim.cap)[u.i] - v_taken[u.i])
                             FROM unnest(v_lanes) AS u(i));
        END IF;
        v_heads := {schema}.dequeue_pass_heads_v1(v_due, v_lanes, v_quota, snap, looked_at);
        FOR i IN 1 .. cardinality(v_lanes) LOOP
            v_more[v_lanes[i]] := coalesce(array_length(
                array_positions(v_heads.lanes, v_lanes[i]), 1), 0) > v_quota[i];
            v_done[v_lanes[i]] := v_done[v_lanes[i]] OR NOT v_more[v_lanes[i]];
        END LOOP;
        -- (the quotas are rounded up: never more than the call has left, in rank order)
        IF cardinality(v_lanes) = 1 THEN
            v_take := (v_heads.ids)[1:v_quota[1]];
        ELSE
            v_take := ARRAY(
                SELECT t.id FROM unnest(v_heads.ids, v_heads.lanes, v_heads.ranks) AS t(id, l, rn)
                JOIN unnest(v_lanes, v_quota) AS u(i, quota) ON u.i = t.l
                WHERE t.rn <= u.quota
                ORDER BY t.rn, t.l LIMIT v_left);
        END IF;
        EXIT WHEN coalesce(cardinality(v_take), 0) = 0;
        IF cardinality(v_lanes) = 1 THEN
            v_slotted := CASE WHEN (v_claim.max_concurrency)[v_lanes[1]] IS NOT NULL THEN v_take
                              ELSE ARRAY[]::bigint[] END;
        ELSE
            v_slotted := ARRAY(
                SELECT t.id FROM unnest(v_heads.ids, v_heads.lanes) AS t(id, l)
                WHERE t.id = ANY (v_take) AND (v_claim.max_concurrency)[t.l] IS NOT NULL);
        END IF;
        v_pass := {schema}.dequeue_pass_lock_v1(
            v_due, v_lanes, v_heads.ids, v_heads.lanes, v_heads.ranks, v_take, v_slotted,
            v_taken, p_names, p_max_attempts, p_lock, looked_at);
        deliveries := deliveries || v_pass.deliveries;
        v_taken := v_pass.taken;
        ev_queue := ev_queue || v_pass.ev_queue;
        ev_channel := ev_channel || v_pass.ev_channel;
        dead := dead + v_pass.dead;
        got := got + cardinality(v_pass.locked_ids);
        v_left := p_left - got;
        IF cardinality(v_pass.locked_ids) > 0 AND lock_until IS NULL THEN
            lock_until := looked_at + p_lock;
            lock_id := (v_pass.locked_ids)[1];
        END IF;
    END LOOP;
    -- 5. the owned lanes: positions past what they took, the turn to the back (or at the next
    --    due message, or none)
    PERFORM {schema}.lanes_served_v1(v_due, served, v_claim.own, v_taken, v_more,
                                     v_claim.max_concurrency, v_claim.room, v_claim.rate,
                                     v_claim.tat, v_claim.tokens, v_claim.burst, looked_at);
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
CREATE FUNCTION {schema}.dequeue_ingest_v1(
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
CREATE FUNCTION {schema}.dequeue_general_v1(
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
--
-- The steps (docs/design.md, "The dequeue"): 0, the sleep keys of the caller's last call
-- released; 1, the acks and the usual call's read in one statement (dequeue_look_v1, for
-- several queues dequeue_look_queues_v1); 2, the
-- usual call served (a lane without limits, of one queue or several (schema version 17):
-- its heads locked and the call tallied in one statement), or, when no lane of its one queue
-- is due, what woke the caller taken (dequeue_take_v1),
-- or after an ingest, read once more; otherwise the general path (dequeue_general_v1: steps
-- 2 to 6). The steps are internal, called by this function only, and planned under its
-- settings (generic plans, no sequential or bitmap scans), which they do not set again.
CREATE FUNCTION {schema}.message_dequeue_v3(
    p_queues text[], p_limit integer, p_lock_ms bigint, p_ack_ids bigint[],
    p_ack_tokens uuid[], p_listen boolean
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    message_priority smallint, message_attempts integer, message_lock_token uuid,
    message_created_at timestamptz, message_content bytea, message_state bytea,
    retry_ms bigint, event text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_state {schema}.discovery;
    v_ingested boolean := false;
    v_usual boolean;
    v_look record;  -- step 1: the acks deleted, the lanes due, the heads
    v_lane {schema}.lane;
    v_take bigint[];
    v_got integer;
    v_acked integer; v_apart boolean;  -- acks tallied with the deliveries, or apart
    v_keys text;  -- the sleep keys held
    -- the acks' events for the tally: queue, channel, kind
    v_ev_queue text[] := ARRAY[]::text[]; v_ev_channel text[] := ARRAY[]::text[];
    v_ev_kind text[] := ARRAY[]::text[];
BEGIN
    -- 0. a caller that slept (it found nothing last time) is awake again
    v_keys := current_setting('lonnymq.sleeping', true);
    IF v_keys IS NOT NULL AND v_keys <> '' THEN
        PERFORM {schema}.dequeue_wake_v1(v_keys);
    END IF;
    v_usual := p_limit > 0 AND current_setting('lonnymq.fresh', true) IS DISTINCT FROM 'on';
    IF NOT v_usual AND coalesce(cardinality(p_ack_ids), 0) = 0 THEN
        SELECT * INTO v_state FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        RETURN QUERY SELECT * FROM {schema}.dequeue_general_v1(
            p_queues, p_limit, v_lock, p_listen, v_state, false, v_now, v_ev_queue,
            v_ev_channel, v_ev_kind);
        RETURN;
    END IF;
    LOOP  -- (a second round, after an ingest, for the usual call only)
        -- 1. the acks (the first round only), and the usual call's read
        v_now := clock_timestamp();
        IF cardinality(p_queues) = 1 THEN
            v_look := {schema}.dequeue_look_v1(
                p_queues[1], p_limit, CASE WHEN v_ingested THEN NULL ELSE p_ack_ids END,
                p_ack_tokens, v_usual, v_now);
        ELSE
            v_look := {schema}.dequeue_look_queues_v1(
                p_queues, p_limit, CASE WHEN v_ingested THEN NULL ELSE p_ack_ids END,
                p_ack_tokens, v_usual, v_now);
        END IF;
        IF v_look.gone_ids IS NOT NULL THEN
            v_ev_queue := v_look.gone_queues;
            v_ev_channel := v_look.gone_channels;
            v_ev_kind := array_fill('acked'::text, ARRAY[cardinality(v_look.gone_ids)]);
            IF true = ANY (v_look.gone_sized) OR true = ANY (v_look.gone_slotted) THEN
                PERFORM {schema}.ack_give_back_v1(v_look.gone_queues, v_look.gone_channels,
                                                  v_look.gone_sized, v_look.gone_slotted);
            END IF;
        END IF;
        -- (those that did not apply: a row each)
        IF NOT v_ingested
           AND coalesce(cardinality(v_look.gone_ids), 0) < coalesce(cardinality(p_ack_ids), 0) THEN
            RETURN QUERY
                SELECT o.message_id, NULL::text, NULL::text, NULL::text, NULL::smallint,
                       NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                       NULL::bigint, 'ack_' || o.result_code
                FROM {schema}.ack_outcome_v1(p_ack_ids, v_look.gone_ids) AS o
                WHERE o.result_code <> 'ok';
        END IF;

        -- 2. the usual call, served: its heads locked and returned, and the call tallied, in
        --    one statement (with the acks: on the deliveries' row when of the lane's
        --    channel, else on a row of their own when of one channel, else at the end)
        v_take := (v_look.head_ids)[1:p_limit];
        IF v_usual AND cardinality(v_take) > 0 AND NOT 0 > ANY (v_take) THEN
            v_lane := (v_look.due_lanes)[1];
            v_got := cardinality(v_take);
            v_acked := CASE WHEN v_look.gone_queues <@ ARRAY[v_lane.queue::text]
                                 AND v_look.gone_channels <@ ARRAY[v_lane.channel::text]
                            THEN cardinality(v_look.gone_ids) ELSE 0 END;
            v_apart := v_acked = 0 AND v_look.gone_queues <@ ARRAY[v_look.gone_queues[1]]
                AND v_look.gone_channels <@ ARRAY[v_look.gone_channels[1]];
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
                    SELECT v_look.gone_queues[1], v_look.gone_channels[1], 0,
                           cardinality(v_look.gone_ids), NULL, NULL
                    WHERE v_apart
                )
                SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
                       k.lock_token, k.created_at, k.content, k.state, NULL::bigint,
                       'delivered'::text
                FROM locked k ORDER BY k.dequeue_at, k.id;
            IF v_acked > 0 OR v_apart THEN  -- (tallied)
                v_ev_queue := ARRAY[]::text[];
            END IF;
            -- the lane, owned with its key: moved to the back, its position past what was
            -- taken, as in step 5 (unless it is the only one due, has more, and was written a
            -- moment ago), read with the latest snapshot of the ingest
            IF pg_try_advisory_xact_lock({schema}.lane_key_v1(v_lane.queue, v_lane.channel))
               AND NOT (cardinality(v_look.due_lanes) = 1
                        AND cardinality(v_look.head_ids) > p_limit
                        AND v_lane.served_at > '-infinity'
                        AND v_lane.written_at > v_now - interval '5 milliseconds') THEN
                PERFORM {schema}.lane_advance_v1(v_lane, clock_timestamp() + interval '1 microsecond');
            END IF;
            EXIT;
        END IF;
        -- (the usual call found nothing, as after a wake-up: with no lane due, what woke it
        -- taken without an ingest; else, when the ingest's state was old, ingested and read
        -- again, once)
        IF v_usual AND NOT v_ingested AND cardinality(v_look.due_lanes) = 0
           AND cardinality(p_queues) = 1 THEN
            RETURN QUERY SELECT * FROM {schema}.dequeue_take_v1(p_queues[1], p_limit, v_lock, v_now);
            GET DIAGNOSTICS v_got = ROW_COUNT;
            EXIT WHEN v_got > 0;
        END IF;
        SELECT * INTO v_state FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        IF v_ingested OR NOT v_usual OR coalesce(cardinality(v_look.head_ids), 0) > 0
           OR ((v_look.due_lanes)[1]).limited OR cardinality(((v_look.due_lanes)[1]).prios) > 1
           OR NOT (v_state.taken_at < v_now - interval '10 milliseconds'
                   OR v_state.folded_at < v_now - interval '1 second'
                   OR NOT (p_queues <@ v_state.queues)) THEN
            RETURN QUERY SELECT * FROM {schema}.dequeue_general_v1(
                p_queues, p_limit, v_lock, p_listen, v_state, v_ingested, v_now, v_ev_queue,
                v_ev_channel, v_ev_kind);
            RETURN;
        END IF;
        v_state := {schema}.ingest_v1(p_queues, false, false);
        v_ingested := true;
    END LOOP;
    IF cardinality(v_ev_queue) > 0 THEN  -- (served: acks not tallied with the deliveries)
        PERFORM {schema}.tally_events_v1(v_ev_queue, v_ev_channel, v_ev_kind, NULL, NULL);
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
-- in the call's tally (`arrival` 1), the lane is not written, and the session's next
-- message_dequeue_v3 call ingests first. Hinted takes follow one another without an ingest
-- (schema version 19; before, the look after a take ingested) while this session made fewer
-- than 32 takes since the newest ingest (lonnymq.taken: that ingest's id and the count;
-- schema version 20, before: while fewer than 100 transactions of the whole database began,
-- which any busy database outruns), so that what takes leave behind in message_txid_idx
-- (read from the ingest's xmax; each take is of fewer than 64 rows) stays short, and not
-- while a slot of a limited channel of the queues was freed (its lane gets its turn back at
-- the next ingest, which may come first). What this session created and no ingest has seen
-- is unseen and not hinted: no take then. When the call took all that waited, one more row
-- says so (event 'settled', with retry_ms as a call that found nothing gives it, or when
-- the locks it took expire, which no ingest has seen yet; schema version 19): nothing else
-- of these queues can be delivered now, and the caller, asleep on them (the hint came), is
-- woken by whatever is created from now on, so it need not look again. The acks, if any,
-- are deleted first (message_delete_many_v1). Otherwise, or when another consumer took
-- them first, message_dequeue_v3 does the call.
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
    v_d {schema}.discovery;
    v_mark text[] := string_to_array(current_setting('lonnymq.taken', true), ' ');
    v_taken bigint;  -- takes this session made since the newest ingest (see above)
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
       AND coalesce(current_setting('lonnymq.sleeping', true), '') = ''
       AND pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        v_taken := CASE WHEN v_mark[1] = v_d.id::text THEN v_mark[2]::bigint ELSE 0 END;
        RETURN QUERY
            WITH d AS MATERIALIZED (
                SELECT v_d.*
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
                SELECT a.queue, a.channel, a.waiting
                FROM d, (SELECT min(u.queue) AS queue, min(u.channel) AS channel,
                                count(*) AS waiting,
                                count(*) FILTER (WHERE u.id <> ALL (p_hints)) AS others,
                                count(DISTINCT (u.queue, u.channel)) AS lanes
                         FROM unseen u WHERE u.queue = ANY (p_queues)) AS a
                WHERE a.others = 0 AND a.lanes = 1 AND (SELECT count(*) FROM unseen) < 64
                  AND p_queues <@ d.queues AND NOT d.pend_queue && p_queues
                  -- (takes in a row without an ingest: see above)
                  AND (current_setting('lonnymq.fresh', true) IS DISTINCT FROM 'on'
                       OR v_taken < 32)
                  -- (no limited channel's slot freed since the last ingest: see above)
                  AND NOT EXISTS (SELECT 1 FROM {schema}.channel c
                                  WHERE c.queue = ANY (p_queues) AND c.freed)
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
            (SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
                    k.lock_token, k.created_at, k.content, k.state, NULL::bigint,
                    'delivered'::text
             FROM locked k ORDER BY k.priority DESC, k.dequeue_at, k.id)
            UNION ALL
            -- (all that waited was taken: settled, see above)
            SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
                   NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                   LEAST({schema}.queue_retry_ms_v1(p_queues, v_d), p_lock_ms), 'settled'::text
            FROM mine w
            WHERE w.waiting = (SELECT count(*) FROM locked);
        IF FOUND THEN
            PERFORM set_config('lonnymq.fresh', 'on', false),
                    set_config('lonnymq.taken', v_d.id || ' ' || (v_taken + 1), false);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, NULL,
                                                           NULL, p_listen);
END;
$$;
