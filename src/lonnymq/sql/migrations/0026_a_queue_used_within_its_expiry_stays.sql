-- lonnymq migration 26.

-- =============================================================================================
-- A queue used within its x-expires never goes, and a reply queue's declare writes nothing
-- (issue "A real Celery worker wakes within milliseconds of a publish")
-- =============================================================================================
--
-- A declare or a consumer's touch records a queue's use (used_at) only when the recorded one
-- is old enough, so that Celery's rpc:// client, which declares its reply queue before every
-- task it sends, does not write (and wait for a durable commit) at every declare. Until
-- version 25 "old enough" was a second for every queue, and the sweep took a queue for unused
-- as soon as its recorded use was its x-expires old: a queue with an x-expires under a second,
-- declared again and again, went while in use, with its messages. From version 26 the
-- recorded use may be behind by a tenth of the x-expires (at most a minute:
-- queue_use_lag_v1), and the sweep allows for that: a queue goes at most that late, never
-- while used; the reply queue of rpc:// (x-expires a day) is written once a minute at most.
-- queue_declare_v1, queue_declare_v2, queue_touch_v1 and expire_v1 are replaced (same
-- arguments and results); queue_expiring_v1 is the list of expiring queues that allows for it
-- (lonnymq status, Broker.expiring), which clients read from the table until version 25.

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
CREATE OR REPLACE FUNCTION {schema}.queue_touch_v1(p_queues text[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.queue SET used_at = clock_timestamp()
    WHERE name = ANY (p_queues) AND expires_ms IS NOT NULL
      AND used_at < clock_timestamp() - {schema}.queue_use_lag_v1(expires_ms);
$$;

-- Declare a queue with its arguments; returns (messages waiting, messages in flight).
CREATE OR REPLACE FUNCTION {schema}.queue_declare_v1(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint,
    OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = p_expires_ms,
        message_ttl_ms = p_message_ttl_ms,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.expires_ms IS DISTINCT FROM p_expires_ms
           OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
           OR (p_expires_ms IS NOT NULL
               AND q.used_at < clock_timestamp() - {schema}.queue_use_lag_v1(p_expires_ms)));
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- Declare a queue with kombu's arguments: as queue_declare_v1, and auto_delete (the queue
-- goes when its last consumer does) and max_priority (a message's priority above it is
-- stored as it). A declare brings back a queue that went (queue_gone). (One statement writes
-- the queue's row, and only when something changed or the recorded use of a queue with an
-- expiry is further behind than queue_use_lag_v1 allows: Celery's rpc:// client declares its
-- reply queue before every task it sends.)
CREATE OR REPLACE FUNCTION {schema}.queue_declare_v2(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint, p_auto_delete boolean,
    p_max_priority integer, OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = p_expires_ms,
        message_ttl_ms = p_message_ttl_ms,
        auto_delete = p_auto_delete,
        max_priority = p_max_priority,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.expires_ms IS DISTINCT FROM p_expires_ms
           OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
           OR q.auto_delete IS DISTINCT FROM p_auto_delete
           OR q.max_priority IS DISTINCT FROM p_max_priority
           OR (p_expires_ms IS NOT NULL
               AND q.used_at < clock_timestamp() - {schema}.queue_use_lag_v1(p_expires_ms)));
    DELETE FROM {schema}.queue_gone g WHERE g.name = p_queue;
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
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

-- CREATE OR REPLACE resets the settings: as before, with the owner's rights, a fixed
-- search_path and no JIT; the new entry point likewise.
ALTER FUNCTION {schema}.queue_declare_v1(text, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_touch_v1(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.expire_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_expiring_v1()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- (as every function of the schema: nobody but the owner may call the new ones directly;
-- lonnymq.grant gives queue_expiring_v1 to every kind)
REVOKE ALL ON FUNCTION {schema}.queue_use_lag_v1(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_expiring_v1() FROM PUBLIC;

-- Roles that may read the queues' status (every kind: lonnymq.grant) may list the expiring
-- queues as version 26 counts them.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace AND p.proname = 'queue_status_v1'
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.queue_expiring_v1()'::regprocedure, r.role);
    END LOOP;
END;
$$;
