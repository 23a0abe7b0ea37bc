-- lonnymq migration 21.

-- =============================================================================================
-- A publish hands its message to a consumer asleep on its queue
-- (issue "A real Celery worker wakes within milliseconds")
-- =============================================================================================
--
-- A consumer asleep on a queue was woken by a NOTIFY and then dequeued what woke it: a round
-- trip after the publish's commit, on this project's machine 1.1-1.3 ms of a 3.2 ms wake-up.
-- A transport's LISTEN session now registers (table sleeper, sleep_v2) and holds a key per
-- queue it sleeps on; a publish that commits at once (message_publish_v2 with p_handoff)
-- creates a message due now locked for one such session and sends it whole in a NOTIFY on
-- that session's own channel (handoff_v1), so that it delivers without a dequeue. Only when
-- nothing else of the queue waits, for a channel without a limit, and once per transaction.
-- message_create_v1 keeps its signature; sleep_v1 and message_publish_v1 stay for clients of
-- version 20.

-- Transports that take messages handed to them by a publish (schema version 21; see
-- handoff_v1): one row per LISTEN session, written when the queues it consumes change. holder:
-- random, its own; the session holds the key 'holder' of it while it lives, and the key
-- 'asleep <holder>' of each queue it sleeps on with room. secret: signs each hand-off (any
-- role may NOTIFY; the owner and admin roles read this table).
CREATE TABLE {schema}.sleeper (
    holder bigint PRIMARY KEY,
    queues text[] COLLATE "C" NOT NULL,
    secret text NOT NULL,
    lock_ms bigint NOT NULL CHECK (lock_ms > 0),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- sleep_v1, and the hand-off's registration (schema version 21; see handoff_v1): p_holder,
-- this LISTEN session's own random id (NULL: no hand-off, as sleep_v1), whose key 'holder'
-- the session holds while it lives (taken at its first call; a call for a holder another
-- session holds fails). It holds the key 'asleep <holder>' of the queues of p_hand_take until
-- they are in p_hand_drop: those of its channels asleep with room in their prefetch window,
-- so that a publish hands a message only to a session that can take it, and to no session
-- that is gone. p_queues (NULL: unchanged): the queues it consumes, written to its sleeper
-- row with p_secret and p_lock_ms; rows of sessions that are gone are deleted then. An empty
-- p_queues (the consumer closes): its row is deleted, and the call waits for the
-- transactions handing it a message to end (their NOTIFYs are then there to be read).
CREATE FUNCTION {schema}.sleep_v2(
    p_take text[], p_drop text[], p_check text[], p_hand_take text[], p_hand_drop text[],
    p_holder bigint, p_secret text, p_lock_ms bigint, p_queues text[]
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
            INSERT INTO {schema}.sleeper (holder, queues, secret, lock_ms)
            VALUES (p_holder, p_queues, p_secret, p_lock_ms)
            ON CONFLICT (holder) DO UPDATE SET queues = excluded.queues,
                secret = excluded.secret, lock_ms = excluded.lock_ms,
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

-- Hand a message due now to a consumer asleep on its queue (schema version 21): called by
-- message_create_v1 in a publish that commits at once (message_publish_v2's p_handoff).
-- RabbitMQ pushes a message to its consumer; here the consumer used to be woken by a NOTIFY
-- and then dequeue it, a round trip after the commit. When a transport's LISTEN session
-- sleeps on the queue with room to take it (it holds the key 'asleep <holder>' of it, see
-- sleep_v2) and no other transaction is handing it a message (the key 'handoff' of its
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
-- it past its expiry. Its creation and delivery are tallied as the take's. Returns the
-- message's id, or NULL when it was not handed (then it is created as usual). Three
-- statements: what a publish's round trip pays when cold.
CREATE FUNCTION {schema}.handoff_v1(
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
          AND NOT EXISTS (SELECT 1 FROM {schema}.lane l
                          WHERE l.queue = p_queue
                            AND l.turn_at >= d.turn_from[array_position(d.queues, p_queue)]
                            AND l.turn_at <= v_now + interval '1 millisecond')
          AND NOT EXISTS (SELECT 1 FROM {schema}.message e
                          WHERE e.queue = p_queue
                            AND e.locked_until >= d.lock_from[array_position(d.queues, p_queue)]
                            AND e.locked_until <= v_now)
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
         LATERAL (SELECT concat_ws(' ', m.id, m.lock_token, p_priority,
                                   extract(epoch FROM m.created_at),
                                   extract(epoch FROM m.locked_until), length(p_queue),
                                   length(p_channel))
                         || ' ' || p_queue || p_channel
                         || translate(encode(p_content, 'base64'), E'\n', '') AS body) AS b,
         LATERAL (SELECT set_config('lonnymq.hinted', 'on', true),
                         pg_notify('lonnymq_hand_' || v_to.holder,
                                   encode(sha256(convert_to(v_to.secret, 'UTF8')
                                                 || sha256(convert_to(v_to.secret || b.body,
                                                                      'UTF8'))), 'hex')
                                   || ' ' || b.body)) AS n;
    RETURN v_id;
END;
$$;

-- Create a message. result_code: 'created', 'deduplicated' (message_id is the existing one)
-- or 'dropped' (the channel is at max_size). p_ttl_ms (NULL: none): the message is dropped
-- if not dequeued within that time after it is due. In a channel without a max_size it is
-- one INSERT: no row is locked, so no other producer waits for this transaction (one with
-- the same de-duplication name waits for it, as for any unique key).
CREATE OR REPLACE FUNCTION {schema}.message_create_v1(
    p_queue text,
    p_channel text,
    p_name text,
    p_content bytea,
    p_priority integer,
    p_delay_ms bigint,
    p_ttl_ms bigint,
    OUT result_code text,
    OUT message_id bigint
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_max_size integer;
    v_max_priority integer;
    v_at timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared({schema}.queue_key_v1('produce', p_queue));
    SELECT CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END, q.max_priority
    INTO v_max_size, v_max_priority
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
    -- a queue declared with a max_priority (x-max-priority) takes higher ones as it, as
    -- RabbitMQ does
    IF p_priority > v_max_priority THEN
        p_priority := v_max_priority;
    END IF;
    IF v_max_size IS NOT NULL THEN
        SELECT s.result_code, s.message_id INTO result_code, message_id
        FROM {schema}.message_create_sized_v1(p_queue, p_channel, p_name, p_content,
            p_priority, p_delay_ms, p_ttl_ms) AS s;
        IF result_code = 'created' THEN
            PERFORM {schema}.wake_v1(p_queue);
        END IF;
        RETURN;
    END IF;
    -- (schema version 21) in a publish that commits at once, a message due now may be handed
    -- to a consumer asleep on the queue (handoff_v1)
    IF p_name IS NULL AND coalesce(p_delay_ms, 0) <= 0
       AND current_setting('lonnymq.handoff', true) = 'on'
       -- (what fits a NOTIFY's 8,000 bytes with the rest of the payload, base64)
       AND octet_length(p_content) <= 4800
       AND octet_length(p_queue) + octet_length(p_channel) <= 1200 THEN
        message_id := {schema}.handoff_v1(p_queue, p_channel, p_content, p_priority, p_ttl_ms);
        IF message_id IS NOT NULL THEN
            result_code := 'created';
            RETURN;
        END IF;
    END IF;
    LOOP
        v_at := clock_timestamp() + p_delay_ms * interval '1 millisecond';
        INSERT INTO {schema}.message (queue, channel, priority, txid, dequeue_at, expires_at, name, content)
        VALUES (p_queue, p_channel, p_priority, pg_current_xact_id(), v_at,
                v_at + p_ttl_ms * interval '1 millisecond', p_name, p_content)
        ON CONFLICT (queue, channel, name) WHERE name IS NOT NULL AND attempts = 0 DO NOTHING
        RETURNING id INTO message_id;
        EXIT WHEN message_id IS NOT NULL;
        SELECT m.id INTO message_id FROM {schema}.message m
        WHERE m.queue = p_queue AND m.channel = p_channel AND m.name = p_name AND m.attempts = 0;
        IF message_id IS NOT NULL THEN
            result_code := 'deduplicated';
            RETURN;
        END IF;
        -- the other one was dequeued meanwhile: create after all
    END LOOP;
    result_code := 'created';
    -- (a message due now is hinted to a sleeper by its id, see wake_v2)
    PERFORM {schema}.wake_v2(p_queue, CASE WHEN coalesce(p_delay_ms, 0) <= 0 THEN message_id END);
END;
$$;

-- message_publish_v1, and p_handoff (schema version 21): the caller commits the publish at
-- once (its own transaction, not a caller's that goes on), so a message due now may be
-- handed to a consumer asleep on its queue (handoff_v1), which is then locked for it from
-- the create on. (Its body is message_publish_v1's, not a call of it: a publish's round trip
-- pays each statement cold.)
CREATE FUNCTION {schema}.message_publish_v2(
    p_exchange text,
    p_routing_key text,
    p_channel text,
    p_name text,
    p_content bytea,
    p_priority integer,
    p_delay_ms bigint,
    p_ttl_ms bigint,
    p_handoff boolean
)
RETURNS TABLE (queue_name text, result_code text, message_id bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_queue text;
    v_ttl bigint;
BEGIN
    PERFORM set_config('lonnymq.handoff', CASE WHEN p_handoff THEN 'on' ELSE '' END, true);
    FOREACH v_queue IN ARRAY {schema}.route_v1(p_exchange, p_routing_key) LOOP
        SELECT LEAST(p_ttl_ms, q.message_ttl_ms) INTO v_ttl
        FROM {schema}.queue q WHERE q.name = v_queue;
        -- (a queue gone is not re-created by a publish to its name: see message_publish_v1)
        IF NOT FOUND AND p_exchange = ''
           AND EXISTS (SELECT 1 FROM {schema}.queue_gone g WHERE g.name = v_queue) THEN
            CONTINUE;
        END IF;
        queue_name := v_queue;
        SELECT c.result_code, c.message_id INTO result_code, message_id
        FROM {schema}.message_create_v1(
            v_queue,
            coalesce(nullif(p_channel, ''), nullif(p_routing_key, ''), v_queue),
            p_name, p_content, p_priority, p_delay_ms, coalesce(v_ttl, p_ttl_ms)
        ) AS c;
        RETURN NEXT;
    END LOOP;
    PERFORM set_config('lonnymq.handoff', '', true);
END;
$$;

-- CREATE OR REPLACE resets the settings: as before, the create runs with the owner's rights
-- and a fixed search_path; so do the new entry points.
ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.sleep_v2(text[], text[], text[], text[], text[], bigint, text, bigint, text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_publish_v2(text, text, text, text, bytea, integer, bigint, bigint, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE ALL ON FUNCTION {schema}.sleep_v2(text[], text[], text[], text[], text[], bigint, text, bigint, text[])
    FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_publish_v2(text, text, text, text, bytea, integer, bigint, bigint, boolean)
    FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.key_held_v1(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.handoff_v1(text, text, bytea, integer, bigint) FROM PUBLIC;

-- Roles that may publish may publish with a hand-off, and those that may sleep may register.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT p.proname, a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname IN ('message_publish_v1', 'sleep_v1')
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            CASE r.proname
                WHEN 'message_publish_v1' THEN '{schema}.message_publish_v2(text, text, text, text, bytea, integer, bigint, bigint, boolean)'::regprocedure
                ELSE '{schema}.sleep_v2(text[], text[], text[], text[], text[], bigint, text, bigint, text[])'::regprocedure
            END, r.role);
    END LOOP;
END;
$$;
