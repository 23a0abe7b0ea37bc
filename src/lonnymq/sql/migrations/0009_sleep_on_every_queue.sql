-- lonnymq migration 9.

-- =============================================================================================
-- A consumer of several queues sleeps on all of them (issue 25)
-- =============================================================================================
--
-- A producer NOTIFYs only while a consumer holds its queue's `sleep` key (wake_v1). Until
-- now the keys were taken by message_dequeue_v3 itself (with p_listen), and each call first
-- released every key its session held: a Kombu connection runs one dequeue per consuming
-- channel on one session, so a Celery worker (task queues, pidbox, gossip) slept on the last
-- channel's queues only, and a task published to it while idle waited for the fallback poll
-- (up to 5 s).
--
-- sleep_v1 lets a client hold the keys on a session of its choice, queue by queue: the
-- transport holds them on its LISTEN session (the session that receives the NOTIFYs, so that
-- both go together when it is lost, and one that a transaction-mode pooler cannot hand to
-- someone else), for the union of the queues its idle channels consume, and dequeues with
-- p_listen = false. The protocol is that of the dequeue's step 6: take the keys, see whether
-- a producer transaction of those queues is still open (it may have looked for sleepers
-- before), then look again. message_dequeue_v3 with p_listen is unchanged, for the queue API
-- and clients of earlier versions.

-- The session takes the shared `sleep` keys of p_take and releases those of p_drop (keys it
-- holds: a session lock each, released at the latest when the session ends); returns the
-- queues of p_check with a producer transaction open (their `produce` key is held), in name
-- order. A client that takes a key looks for messages again afterwards, and again each time
-- a queue it checked has no producer transaction open any more.
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

REVOKE ALL ON FUNCTION {schema}.sleep_v1(text[], text[], text[]) FROM PUBLIC;
ALTER FUNCTION {schema}.sleep_v1(text[], text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- Roles granted the worker's rights before this migration (they may dequeue) get it.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname = 'message_dequeue_v3'
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.sleep_v1(text[], text[], text[])'::regprocedure, r.role);
    END LOOP;
END;
$$;
