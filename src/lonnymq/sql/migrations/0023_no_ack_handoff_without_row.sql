-- lonnymq migration 23.

-- =============================================================================================
-- A consumer without acks is handed a message without a row
-- (issue "A real Celery worker wakes within milliseconds")
-- =============================================================================================
--
-- A message handed to a consumer (version 21) was created locked for it; one that consumes its
-- queue without acks (Celery's rpc:// replies, its events, gossip and broadcasts) then deleted
-- it before delivering it: a round trip of the consumer's, after the publish's INSERT into
-- message and its indexes. On this project's machine an rpc:// round trip of a default
-- prefork worker spent 0.8 ms of its 9 ms in that delete. Such a consumer now registers the
-- queues it takes without acks (sleeper.no_ack, sleep_v3), and a hand-off to it writes no
-- message row: the message is in the NOTIFY, delivered at the commit, as RabbitMQ delivers to
-- a no-ack consumer at the socket write; tallied as created, delivered and acked. A consumer
-- that cannot deliver it (a queue no longer consumed, closing) creates it again.
-- sleep_v2 stays for clients of version 22 (every message handed to them has a row).

ALTER TABLE {schema}.sleeper ADD COLUMN no_ack text[] COLLATE "C" NOT NULL DEFAULT '{{}}';

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
CREATE OR REPLACE FUNCTION {schema}.sleep_v2(
    p_take text[], p_drop text[], p_check text[], p_hand_take text[], p_hand_drop text[],
    p_holder bigint, p_secret text, p_lock_ms bigint, p_queues text[]
) RETURNS text[]
LANGUAGE plpgsql AS $$
BEGIN
    RETURN {schema}.sleep_v3(p_take, p_drop, p_check, p_hand_take, p_hand_drop, p_holder,
                             p_secret, p_lock_ms, p_queues, NULL);
END;
$$;

-- A hand-off's signature with its session's secret (see handoff_v1): the hex of
-- sha256(secret || sha256(secret || body)). (A SQL function of one expression that uses its
-- body once: inlined where it is used, no call at run time; one that used it twice was not,
-- its argument being an expression, and cost 120 us a call, planned at each.)
CREATE FUNCTION {schema}.handoff_mac_v1(p_secret text, p_body text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT encode(sha256(convert_to(p_secret, 'UTF8')
                         || sha256(convert_to(p_secret || p_body, 'UTF8'))), 'hex')
$$;

-- A hand-off's body (see handoff_v1): '<id> <lock token> <priority> <created at> <until>
-- <queue length> <channel length> <queue><channel><content, base64>', times in epoch
-- seconds. (A SQL function of one expression: inlined where it is used.)
CREATE FUNCTION {schema}.handoff_body_v1(
    p_id bigint, p_token text, p_priority integer, p_created timestamptz, p_until text,
    p_queue text, p_channel text, p_content bytea
) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT concat_ws(' ', p_id, p_token, p_priority, extract(epoch FROM p_created), p_until,
                     length(p_queue), length(p_channel))
           || ' ' || p_queue || p_channel || translate(encode(p_content, 'base64'), E'\n', '')
$$;

-- Hand a message due now to a consumer asleep on its queue (schema version 21): called by
-- message_create_v1 in a publish that commits at once (message_publish_v2's p_handoff).
-- RabbitMQ pushes a message to its consumer; here the consumer used to be woken by a NOTIFY
-- and then dequeue it, a round trip after the commit. When a transport's LISTEN session
-- sleeps on the queue with room to take it (it holds the key 'asleep <holder>' of it, see
-- sleep_v3) and no other transaction is handing it a message (the key 'handoff' of its
-- holder, taken here until the commit), the message is created locked for it (as a take
-- would lock it: attempts 1, its lock_ms; the lock token starts with the holder's id) and
-- sent whole in a NOTIFY on its channel lonnymq_hand_<holder>: '<mac> <id> <lock token>
-- <priority> <created at> <locked until> <queue length> <channel length>
-- <queue><channel><content, base64>', times in epoch seconds, mac the hex of
-- sha256(secret || sha256(secret || the rest after its space)): any role may NOTIFY, and
-- may LISTEN on a channel it knows the name of, so the secret is not sent. Only the first
-- create of a transaction to hint or hand (as wake_v2's hint), when the payload fits a
-- NOTIFY, for a channel without a limit (no max_concurrency, no rate, its own or the
-- queue's), when nothing of the queue waits that the round robin would serve first (the
-- hinted take's rules, see message_dequeue_hinted_v1): nothing of it that no ingest has seen
-- (of fewer than 64 such rows, of every queue), the queue in the ingest's state without heads
-- pending, no slot of a limited channel of it freed since, no lane of it due and no lock of
-- it past its expiry. Its creation and delivery are tallied as the take's. To a session
-- that consumes the queue without acks (schema version 23: sleeper.no_ack, Celery's rpc://
-- replies, events and broadcasts) the message is sent and no row is written: delivered at
-- the commit, as RabbitMQ's delivery to a no-ack consumer is at the socket write; its id is
-- the message sequence's, its lock token '-' and in place of its lock's expiry its own time
-- to live's ('-': none), so that a consumer that cannot deliver it creates it again; it is
-- tallied as created, delivered and acked. Returns the message's id, or NULL when it was not
-- handed (then it is created as usual). Three statements: what a publish's round trip pays
-- when cold.
CREATE OR REPLACE FUNCTION {schema}.handoff_v1(
    p_queue text, p_channel text, p_content bytea, p_priority integer, p_ttl_ms bigint
) RETURNS bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('sleep', p_queue);
    v_now timestamptz := clock_timestamp();
    v_to {schema}.sleeper;
    v_id bigint;
BEGIN
    -- (nobody sleeps on the queue when its key is free: tried and given back at once)
    IF coalesce(current_setting('lonnymq.hinted', true), '') <> ''
       OR (CASE WHEN pg_try_advisory_lock(v_key) THEN pg_advisory_unlock(v_key) ELSE false END) THEN
        RETURN NULL;
    END IF;
    WITH d AS MATERIALIZED (
        SELECT d.* FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1
    ), unseen AS MATERIALIZED (
        SELECT m.queue
        FROM d CROSS JOIN LATERAL (
            SELECT m.queue FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
            ORDER BY m.txid LIMIT 64) AS m
        UNION ALL
        SELECT m.queue
        FROM d CROSS JOIN LATERAL pg_snapshot_xip(d.snap) AS x(txid)
        CROSS JOIN LATERAL (
            SELECT m.queue FROM {schema}.message m
            WHERE m.txid = x.txid AND m.lock_token IS NULL
            LIMIT 64) AS m
    ), quiet AS MATERIALIZED (
        SELECT 1
        FROM d
        LEFT JOIN {schema}.queue q ON q.name = p_queue
        LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel
        WHERE CASE WHEN c.has_policy
                   THEN c.own_max_concurrency IS NULL AND c.own_rate_count IS NULL
                   ELSE q.max_concurrency IS NULL AND q.rate_count IS NULL END
          AND (SELECT count(*) FROM unseen) < 64
          AND NOT EXISTS (SELECT 1 FROM unseen u WHERE u.queue = p_queue)
          AND p_queue = ANY (d.queues) AND NOT p_queue = ANY (d.pend_queue)
          AND NOT EXISTS (SELECT 1 FROM {schema}.channel f WHERE f.queue = p_queue AND f.freed)
          -- (the first due lane and the first expired lock, each in its index's order from
          -- the queue's position: as NOT EXISTS, the generic plan read every entry of the
          -- queue up to now, which a held snapshot keeps: schema version 22)
          AND (SELECT l.turn_at FROM {schema}.lane l
               WHERE l.queue = p_queue
                 AND l.turn_at >= d.turn_from[array_position(d.queues, p_queue)]
                 AND l.turn_at <= v_now + interval '1 millisecond'
               ORDER BY l.queue, l.turn_at LIMIT 1) IS NULL
          AND (SELECT e.locked_until FROM {schema}.message e
               WHERE e.queue = p_queue
                 AND e.locked_until >= d.lock_from[array_position(d.queues, p_queue)]
                 AND e.locked_until <= v_now
               ORDER BY e.queue, e.locked_until LIMIT 1) IS NULL
    )
    -- the sessions registered for the queue, in random order: the first asleep on it (holds
    -- the key, tried and given back at once) and not being handed a message meanwhile
    SELECT s.* INTO v_to
    FROM (SELECT s.* FROM quiet, {schema}.sleeper s WHERE p_queue = ANY (s.queues)
          ORDER BY random()) AS s
    WHERE CASE WHEN pg_try_advisory_lock({schema}.queue_key_v1('asleep ' || s.holder, p_queue))
               THEN NOT pg_advisory_unlock({schema}.queue_key_v1('asleep ' || s.holder, p_queue))
               -- (asleep: then, and only then, its 'handoff' key)
               ELSE pg_try_advisory_xact_lock({schema}.queue_key_v1('handoff', s.holder::text))
          END
    LIMIT 1;
    IF v_to.holder IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_queue = ANY (v_to.no_ack) THEN  -- (without a row: see above)
        WITH tallied AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, acked)
            VALUES (p_queue, p_channel, 1, 1, 1)
        )
        SELECT i.id INTO v_id
        FROM (SELECT nextval('{schema}.message_id_seq') AS id) AS i,
             LATERAL (SELECT {schema}.handoff_body_v1(
                                 i.id, '-', p_priority, now(),
                                 coalesce(extract(epoch FROM v_now + p_ttl_ms
                                                  * interval '1 millisecond')::text, '-'),
                                 p_queue, p_channel, p_content) AS body) AS b,
             LATERAL (SELECT set_config('lonnymq.hinted', 'on', true),
                             pg_notify('lonnymq_hand_' || v_to.holder,
                                       {schema}.handoff_mac_v1(v_to.secret, b.body)
                                       || ' ' || b.body)) AS n;
        RETURN v_id;
    END IF;
    WITH made AS (
        INSERT INTO {schema}.message (queue, channel, priority, attempts, arrival, txid,
                                      dequeue_at, locked_until, lock_token, expires_at, content)
        VALUES (p_queue, p_channel, p_priority, 1, 1, pg_current_xact_id(), v_now,
                v_now + v_to.lock_ms * interval '1 millisecond',
                (lpad(to_hex(v_to.holder), 16, '0')
                 || right(replace(gen_random_uuid()::text, '-', ''), 16))::uuid,
                v_now + p_ttl_ms * interval '1 millisecond', p_content)
        RETURNING id, lock_token, created_at, locked_until
    ), tallied AS (
        INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, lock_until, lock_id)
        SELECT p_queue, p_channel, 1, 1, m.locked_until, m.id FROM made m
    )
    SELECT m.id INTO v_id
    FROM made m,
         LATERAL (SELECT {schema}.handoff_body_v1(
                             m.id, m.lock_token::text, p_priority, m.created_at,
                             extract(epoch FROM m.locked_until)::text, p_queue, p_channel,
                             p_content) AS body) AS b,
         LATERAL (SELECT set_config('lonnymq.hinted', 'on', true),
                         pg_notify('lonnymq_hand_' || v_to.holder,
                                   {schema}.handoff_mac_v1(v_to.secret, b.body)
                                   || ' ' || b.body)) AS n;
    RETURN v_id;
END;
$$;


ALTER FUNCTION {schema}.sleep_v2(text[], text[], text[], text[], text[], bigint, text, bigint, text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.sleep_v3(text[], text[], text[], text[], text[], bigint, text, bigint, text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE ALL ON FUNCTION {schema}.sleep_v3(text[], text[], text[], text[], text[], bigint, text, bigint, text[], text[])
    FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.handoff_mac_v1(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.handoff_body_v1(bigint, text, integer, timestamptz, text, text, text, bytea)
    FROM PUBLIC;

-- Roles that may sleep with a hand-off may register what they consume without acks.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace AND p.proname = 'sleep_v2'
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.sleep_v3(text[], text[], text[], text[], text[], bigint, text, bigint, text[], text[])'::regprocedure,
            r.role);
    END LOOP;
END;
$$;
