-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 11. Expiry and housekeeping
-- Kombu's queue arguments (x-expires, x-message-ttl), so that abandoned queues and stale
-- broadcasts go; dead letters past their retention (housekeep_v1, which also folds the
-- counts).
-- ---------------------------------------------------------------------------------------------

-- How far a queue's recorded use (used_at) may be behind its last use: a declare or a touch
-- writes used_at only when it is older than this, a tenth of the queue's x-expires and at
-- most a minute (Celery's rpc:// client declares its reply queue, x-expires a day, before
-- every task: a write, a durable commit, a minute at most). A sweep takes a queue for unused
-- only this long past its x-expires, so never one used within its x-expires; it goes at most
-- a tenth of it late. (Until version 25: one second for every queue, and the sweep did not
-- allow for it: a queue with an x-expires under a second, declared again and again, went
-- while in use.)
CREATE FUNCTION {schema}.queue_use_lag_v1(p_expires_ms bigint) RETURNS interval
LANGUAGE sql IMMUTABLE AS $$
    SELECT least(p_expires_ms / 10, 60000) * interval '1 millisecond'
$$;

-- Mark queues with an x-expires as used now (consumers call this periodically).
CREATE FUNCTION {schema}.queue_touch_v1(p_queues text[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.queue SET used_at = clock_timestamp()
    WHERE name = ANY (p_queues) AND expires_ms IS NOT NULL
      AND used_at < clock_timestamp() - {schema}.queue_use_lag_v1(expires_ms);
$$;

-- The queues with an x-expires, and how long each has been unused at least (its recorded
-- use, less what that may be behind: queue_use_lag_v1); past its x-expires, a queue goes at
-- the next sweep (expire_v1).
CREATE FUNCTION {schema}.queue_expiring_v1()
RETURNS TABLE (name text, expires_ms bigint, unused_seconds float8)
LANGUAGE sql STABLE AS $$
    SELECT q.name, q.expires_ms,
           greatest(0, extract(epoch FROM clock_timestamp() - q.used_at
                                          - {schema}.queue_use_lag_v1(q.expires_ms)))::float8
    FROM {schema}.queue q WHERE q.expires_ms IS NOT NULL ORDER BY q.name
$$;

-- A client's consumers as they are now (p_tags, with their queue, no-ack flag, prefetch and
-- last delivery): those it no longer has are removed, the others added or refreshed
-- (seen_at), and their queues marked used (x-expires). Called when a consumer starts or
-- stops, and by the client's heartbeat. Returns the auto_delete queues deleted because
-- their last consumer went ('deleted'), and the queues consumed that do not exist
-- ('missing': deleted while consumed).
CREATE FUNCTION {schema}.consumer_sync_v1(
    p_client uuid, p_host text, p_pid integer, p_node text, p_beat_ms integer,
    p_tags text[], p_queues text[], p_no_ack boolean[], p_prefetch integer[],
    p_delivered_at timestamptz[]
)
RETURNS TABLE (queue_name text, state text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_changed text[];
    v_gone text[];
BEGIN
    SELECT array_agg(DISTINCT x.q) INTO v_changed FROM (
        SELECT u.q FROM unnest(p_tags, p_queues) AS u(t, q)
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.consumer c
                          WHERE c.client = p_client AND c.tag = u.t)
        UNION ALL
        SELECT c.queue FROM {schema}.consumer c
        WHERE c.client = p_client AND c.tag <> ALL (p_tags)
    ) AS x;
    IF EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = ANY (v_changed) AND q.auto_delete)
    THEN
        -- (the ingest key first, as expire_v1 and queue_delete_v1 take it)
        PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
        PERFORM 1 FROM {schema}.queue q WHERE q.name = ANY (v_changed) AND q.auto_delete
        ORDER BY q.name FOR UPDATE;
    END IF;
    WITH gone AS (
        DELETE FROM {schema}.consumer c WHERE c.client = p_client AND c.tag <> ALL (p_tags)
        RETURNING c.queue
    )
    SELECT array_agg(DISTINCT g.queue) INTO v_gone FROM gone g;
    INSERT INTO {schema}.consumer AS c
        (client, tag, queue, host, pid, node, no_ack, prefetch, started_at, seen_at,
         delivered_at, beat_ms)
    SELECT p_client, u.t, u.q, p_host, p_pid, p_node, u.na, u.pf, v_now, v_now, u.d, p_beat_ms
    FROM unnest(p_tags, p_queues, p_no_ack, p_prefetch, p_delivered_at) AS u(t, q, na, pf, d)
    ON CONFLICT (client, tag) DO UPDATE SET
        seen_at = EXCLUDED.seen_at, node = EXCLUDED.node, prefetch = EXCLUDED.prefetch,
        beat_ms = EXCLUDED.beat_ms, delivered_at = greatest(c.delivered_at, EXCLUDED.delivered_at);
    PERFORM {schema}.queue_touch_v1(p_queues);
    RETURN QUERY
        SELECT d.q, 'deleted'::text
        FROM unnest({schema}.queue_auto_delete_v1(coalesce(v_gone, ARRAY[]::text[]))) AS d(q)
        UNION ALL
        SELECT DISTINCT u.q, 'missing'::text FROM unnest(p_queues) AS u(q)
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = u.q);
END;
$$;

-- Every consumer of p_queue (of every queue when NULL), oldest first: who (host, pid,
-- Celery node), since when, when last heard of and its last delivery; `alive` false for one
-- not heard of for three beats since the server started (the next sweep removes it).
CREATE FUNCTION {schema}.consumer_list_v1(p_queue text)
RETURNS TABLE (
    queue_name text, client uuid, tag text, host text, pid integer, node text,
    no_ack boolean, prefetch integer, started_at timestamptz, seen_at timestamptz,
    delivered_at timestamptz, alive boolean
)
LANGUAGE sql STABLE AS $$
    SELECT c.queue::text, c.client, c.tag, c.host, c.pid, c.node, c.no_ack, c.prefetch,
           c.started_at, c.seen_at, c.delivered_at,
           greatest(c.seen_at, pg_postmaster_start_time())
               >= clock_timestamp() - 3 * c.beat_ms * interval '1 millisecond'
    FROM {schema}.consumer c
    WHERE p_queue IS NULL OR c.queue = p_queue
    ORDER BY c.queue, c.started_at, c.client, c.tag
    LIMIT 10000;
$$;

-- Delete expired messages (not held by a consumer) and queues unused for longer than their
-- x-expires, at most p_limit messages a call. Returns (messages, queues) deleted. Reads the
-- expiry index from the position where the last sweep stopped.
CREATE FUNCTION {schema}.expire_v1(p_limit integer, OUT messages bigint, OUT queues bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_d {schema}.discovery;
    v_from timestamptz;
    v_stale text[];
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
    -- consumers not heard of for three of their beats: their process is gone (killed, or
    -- cut off); an auto_delete queue goes with its last one (see consumer_sync_v1). (Since
    -- the server started, at the earliest: after a restart, every client is given that long
    -- to come back.)
    SELECT array_agg(DISTINCT c.queue) INTO v_stale FROM {schema}.consumer c
    WHERE greatest(c.seen_at, pg_postmaster_start_time())
          < v_now - 3 * c.beat_ms * interval '1 millisecond';
    IF v_stale IS NOT NULL THEN
        PERFORM 1 FROM {schema}.queue q WHERE q.name = ANY (v_stale) AND q.auto_delete
        ORDER BY q.name FOR UPDATE;
        DELETE FROM {schema}.consumer c
        WHERE greatest(c.seen_at, pg_postmaster_start_time())
              < v_now - 3 * c.beat_ms * interval '1 millisecond';
        queues := queues + cardinality({schema}.queue_auto_delete_v1(v_stale));
    END IF;
    FOR r IN
        SELECT q.name, q.expires_ms FROM {schema}.queue q
        WHERE q.expires_ms IS NOT NULL
          AND q.used_at < v_now - q.expires_ms * interval '1 millisecond'
                          - {schema}.queue_use_lag_v1(q.expires_ms)
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(r.name);
        PERFORM {schema}.queue_forget_v1(r.name, r.expires_ms, 'expired');
        queues := queues + 1;
    END LOOP;
END;
$$;

-- Housekeeping, run by consumers every expire_interval: prune dead letters older than their
-- queue's retention (at most p_limit), ingest and fold the counts, and remove the lanes of
-- channels empty for 5 minutes (at most p_limit). The ingest moves the positions of the queues
-- a transport sleeps on (schema version 22): a consumer that is handed every message runs no
-- dequeue, and each hand-off's checks read the locked index from its queue's lock position
-- (handoff_v1), past the entries of what was handed and acked since, which a held snapshot
-- keeps.
CREATE FUNCTION {schema}.housekeep_v1(p_limit integer, OUT dead_pruned bigint)
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
    -- queues that went a day ago: a publish to their name creates them again
    DELETE FROM {schema}.queue_gone g WHERE g.name = ANY (ARRAY(
        SELECT o.name FROM {schema}.queue_gone o
        WHERE o.gone_at < v_now - interval '1 day' ORDER BY o.gone_at LIMIT p_limit));
    PERFORM {schema}.ingest_v1(
        ARRAY(SELECT DISTINCT u.q FROM {schema}.sleeper s CROSS JOIN LATERAL unnest(s.queues) AS u(q)
              ORDER BY u.q),
        true, true);
    -- channels empty for 5 minutes: their lanes and counts go
    -- (at most 1,000 a call: each takes a lane key, a slot of the server's lock table)
    PERFORM {schema}.lane_prune_v1(LEAST(p_limit, 1000), interval '5 minutes');
END;
$$;

