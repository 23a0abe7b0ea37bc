-- lonnymq migration 27.

-- =============================================================================================
-- No CHECK constraint on message; a create's produce key taken without the executor
-- (issue "The usual dequeue at the speed of Postgres": create at 0.85 of its floor)
-- =============================================================================================
--
-- Postgres reads a table's CHECK constraints back from the catalog's text and plans them at
-- every statement that inserts or updates its rows: with the three of message (the priority's
-- range, the name's length, the lock pair) 11 us of a one-row INSERT's 78 of server CPU, paid
-- by every create and every dequeue's lock. The priority and the name are checked by the
-- functions that write them instead (message_create_v1, message_create_many_v1,
-- message_update_v1: the same SQLSTATE, 23514, and a message that says which), the lock pair
-- by the functions that lock and unlock (unchanged) and by the test suite. message_create_v1
-- also takes its produce key by an assignment rather than PERFORM (a query through the
-- executor). Same arguments and results. queue_declare_v2 is replaced too (same arguments
-- and results): a declare without arguments leaves an existing queue's as they are.

ALTER TABLE {schema}.message
    DROP CONSTRAINT message_priority_check,
    DROP CONSTRAINT message_name_check,
    DROP CONSTRAINT message_lock_pair;

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
    v_called boolean;
BEGIN
    -- (schema version 27) what the message table no longer checks itself: a CHECK constraint
    -- is read back from the catalog's text and planned at every statement that writes the
    -- table, 11 us of an INSERT's 78 (docs/design.md, "The hot path: traps measured")
    IF p_priority NOT BETWEEN 0 AND 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('a message''s priority is from 0 to 255, not %s', p_priority);
    END IF;
    IF length(p_name) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('a message''s name is 1 to 255 characters long, not %s',
                             length(p_name));
    END IF;
    -- (an assignment, not PERFORM, for a call made for its effect: PERFORM runs a query
    -- through the executor, an assignment evaluates the expression in place; schema
    -- version 27)
    v_called := pg_advisory_xact_lock_shared({schema}.queue_key_v1('produce', p_queue)) IS NULL;
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

CREATE OR REPLACE FUNCTION {schema}.message_create_many_v1(
    p_queues text[], p_channels text[], p_names text[], p_contents bytea[],
    p_priorities integer[], p_delays bigint[], p_ttls bigint[]
)
RETURNS TABLE (ord integer, result_code text, message_id bigint)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_queue text;
    v_sized_queues text[];
    v_sized_channels text[];
    v_sized integer[];
    v_codes text[];
    v_ids bigint[];
    v_n integer[];
    v_id bigint[];
    v_made boolean[];
    v_code text;
    v_id1 bigint;
    r record;
    i integer;
BEGIN
    IF coalesce(cardinality(p_queues), 0) = 0 THEN
        RETURN;
    END IF;
    -- what the message table no longer checks itself (see message_create_v1)
    SELECT u.prio, u.name INTO r FROM unnest(p_priorities, p_names) AS u(prio, name)
    WHERE u.prio NOT BETWEEN 0 AND 255 OR length(u.name) NOT BETWEEN 1 AND 255 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = CASE WHEN r.prio NOT BETWEEN 0 AND 255
                THEN format('a message''s priority is from 0 to 255, not %s', r.prio)
                ELSE format('a message''s name is 1 to 255 characters long, not %s',
                            length(r.name)) END;
    END IF;
    IF EXISTS (SELECT 1 FROM {schema}.queue q
               WHERE q.name = ANY (p_queues) AND q.max_priority IS NOT NULL) THEN
        -- priorities above a queue's max_priority are taken as it (see message_create_v1)
        p_priorities := ARRAY(
            SELECT least(i.prio, q.max_priority)
            FROM unnest(p_queues, p_priorities) WITH ORDINALITY AS i(q, prio, n)
            LEFT JOIN {schema}.queue q ON q.name = i.q
            ORDER BY i.n);
    END IF;
    v_codes := array_fill(NULL::text, ARRAY[cardinality(p_queues)]);
    v_ids := array_fill(NULL::bigint, ARRAY[cardinality(p_queues)]);
    FOR v_queue IN SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q) ORDER BY u.q LOOP
        PERFORM pg_advisory_xact_lock_shared({schema}.queue_key_v1('produce', v_queue));
    END LOOP;
    -- the channels with a max_size in force (their own policy, else the queue's, as
    -- channel_limits_v1 reads it), each looked up once, in one statement; their rows go one
    -- by one. (A lookup per row took 13 ms of a 1,000-row batch's 17; schema version 18.)
    SELECT array_agg(d.q), array_agg(d.c) INTO v_sized_queues, v_sized_channels
    FROM (SELECT DISTINCT u.q, u.c FROM unnest(p_queues, p_channels) AS u(q, c)) AS d
    LEFT JOIN {schema}.queue q ON q.name = d.q
    LEFT JOIN {schema}.channel ch ON ch.queue = d.q AND ch.name = d.c
    WHERE CASE WHEN ch.has_policy THEN ch.own_max_size ELSE q.max_size END IS NOT NULL;
    v_sized := ARRAY[]::integer[];
    IF v_sized_queues IS NOT NULL THEN
        v_sized := ARRAY(
            SELECT i.n FROM unnest(p_queues, p_channels) WITH ORDINALITY AS i(q, c, n)
            JOIN unnest(v_sized_queues, v_sized_channels) AS s(q, c) ON s.q = i.q AND s.c = i.c
        );
        FOR r IN
            SELECT i.n, i.q, i.c, i.name, i.content, i.prio, i.delay, i.ttl
            FROM unnest(p_queues, p_channels, p_names, p_contents, p_priorities, p_delays,
                p_ttls) WITH ORDINALITY AS i(q, c, name, content, prio, delay, ttl, n)
            WHERE i.n = ANY (v_sized)
            ORDER BY i.q, i.c, i.name NULLS FIRST, i.n
        LOOP
            SELECT s.result_code, s.message_id INTO v_code, v_id1
            FROM {schema}.message_create_sized_v1(r.q, r.c, r.name, r.content, r.prio,
                r.delay, r.ttl) AS s;
            v_codes[r.n] := v_code;
            v_ids[r.n] := v_id1;
        END LOOP;
    END IF;
    WITH input AS (
        SELECT i.n, i.q, i.c, i.name, i.content, i.prio,
               nextval('{schema}.message_id_seq') AS id,
               clock_timestamp() + i.delay * interval '1 millisecond' AS at, i.ttl
        FROM unnest(p_queues, p_channels, p_names, p_contents, p_priorities, p_delays, p_ttls)
            WITH ORDINALITY AS i(q, c, name, content, prio, delay, ttl, n)
        WHERE i.n <> ALL (v_sized)
    ), made AS (
        INSERT INTO {schema}.message
            (id, queue, channel, priority, txid, dequeue_at, expires_at, name, content)
        OVERRIDING SYSTEM VALUE
        SELECT x.id, x.q, x.c, x.prio, pg_current_xact_id(), x.at,
               x.at + x.ttl * interval '1 millisecond', x.name, x.content
        FROM input x ORDER BY x.q, x.c, x.name NULLS FIRST, x.n
        ON CONFLICT (queue, channel, name) WHERE name IS NOT NULL AND attempts = 0 DO NOTHING
        RETURNING id
    )
    SELECT array_agg(x.n ORDER BY x.n), array_agg(x.id ORDER BY x.n),
           array_agg(m.id IS NOT NULL ORDER BY x.n)
    INTO v_n, v_id, v_made
    FROM input x LEFT JOIN made m ON m.id = x.id;
    FOR i IN 1 .. coalesce(cardinality(v_n), 0) LOOP
        IF v_made[i] THEN
            v_codes[v_n[i]] := 'created';
            v_ids[v_n[i]] := v_id[i];
        END IF;
    END LOOP;
    -- the others were de-duplicated: by the waiting message of their name (created before,
    -- or earlier in this batch, which this statement sees)
    FOR r IN
        SELECT u.n, e.id
        FROM unnest(v_n, v_made) AS u(n, made)
        LEFT JOIN LATERAL (
            SELECT m.id FROM {schema}.message m
            WHERE m.queue = p_queues[u.n] AND m.channel = p_channels[u.n]
              AND m.name = p_names[u.n] AND m.attempts = 0
        ) AS e ON true
        WHERE NOT u.made
    LOOP
        IF r.id IS NOT NULL THEN
            v_codes[r.n] := 'deduplicated';
            v_ids[r.n] := r.id;
        ELSE
            -- the one of that name was dequeued meanwhile: create after all
            SELECT c.result_code, c.message_id INTO v_code, v_id1
            FROM {schema}.message_create_v1(p_queues[r.n], p_channels[r.n], p_names[r.n],
                p_contents[r.n], p_priorities[r.n], p_delays[r.n], p_ttls[r.n]) AS c;
            v_codes[r.n] := v_code;
            v_ids[r.n] := v_id1;
        END IF;
    END LOOP;
    FOR v_queue IN
        SELECT DISTINCT u.q FROM unnest(p_queues, v_codes) AS u(q, code)
        WHERE u.code = 'created' ORDER BY u.q
    LOOP
        PERFORM {schema}.wake_v1(v_queue);
    END LOOP;
    RETURN QUERY SELECT u.n::integer, u.code, u.id
        FROM unnest(v_codes, v_ids) WITH ORDINALITY AS u(code, id, n) ORDER BY u.n;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.message_update_v1(
    p_id bigint, p_delay_ms bigint, p_at timestamptz, p_priority integer, p_content bytea,
    OUT result_code text, OUT due_at timestamptz, OUT new_priority integer
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_d {schema}.discovery;
    v_m record;
    v_now timestamptz;
    v_at timestamptz;
BEGIN
    -- what the message table no longer checks itself (see message_create_v1)
    IF p_priority NOT BETWEEN 0 AND 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('a message''s priority is from 0 to 255, not %s', p_priority);
    END IF;
    -- with the ingest held, as message_retry_v1: a message never ingested still counts once
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    SELECT m.queue, m.locked_until, m.dequeue_at, m.priority INTO v_m
    FROM {schema}.message m WHERE m.id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.dead_message d WHERE d.id = p_id)
            THEN 'dead' ELSE 'not_found' END;
        RETURN;
    END IF;
    due_at := v_m.dequeue_at;
    new_priority := v_m.priority;
    IF v_m.locked_until IS NOT NULL THEN
        result_code := 'locked';
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_at := CASE WHEN p_at IS NOT NULL THEN p_at
                 WHEN p_delay_ms IS NOT NULL THEN v_now + p_delay_ms * interval '1 millisecond'
                 ELSE v_m.dequeue_at END;
    IF v_at <= v_now THEN
        v_at := LEAST(v_m.dequeue_at, v_now);
    END IF;
    UPDATE {schema}.message m SET
        dequeue_at = v_at,
        priority = coalesce(p_priority, m.priority),
        expires_at = CASE WHEN v_at > m.dequeue_at THEN m.expires_at + (v_at - m.dequeue_at)
                          ELSE m.expires_at END,
        content = CASE WHEN p_content IS NULL AND v_at = m.dequeue_at THEN m.content
            ELSE {schema}.message_eta_v1(coalesce(p_content, m.content),
                                         CASE WHEN v_at > v_now THEN v_at END) END,
        txid = pg_current_xact_id(),
        arrival = CASE WHEN m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap)
            THEN 0 ELSE 2 END
    WHERE m.id = p_id
    RETURNING m.dequeue_at, m.priority INTO due_at, new_priority;
    PERFORM {schema}.wake_v1(v_m.queue);
    result_code := 'updated';
END;
$$;

-- A declare without arguments leaves an existing queue's as they are (see the fresh schema's
-- comment on queue_declare_v2).
CREATE OR REPLACE FUNCTION {schema}.queue_declare_v2(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint, p_auto_delete boolean,
    p_max_priority integer, OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_plain boolean := p_expires_ms IS NULL AND p_message_ttl_ms IS NULL
                       AND p_max_priority IS NULL;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END,
        message_ttl_ms = CASE WHEN v_plain THEN q.message_ttl_ms ELSE p_message_ttl_ms END,
        auto_delete = p_auto_delete,
        max_priority = CASE WHEN v_plain THEN q.max_priority ELSE p_max_priority END,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.auto_delete IS DISTINCT FROM p_auto_delete
           OR NOT v_plain AND (q.expires_ms IS DISTINCT FROM p_expires_ms
                               OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
                               OR q.max_priority IS DISTINCT FROM p_max_priority)
           OR (CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END IS NOT NULL
               AND q.used_at < clock_timestamp() - {schema}.queue_use_lag_v1(
                   CASE WHEN v_plain THEN q.expires_ms ELSE p_expires_ms END)));
    DELETE FROM {schema}.queue_gone g WHERE g.name = p_queue;
    SELECT t.waiting, t.in_flight INTO waiting, in_flight FROM {schema}.queue_totals_v1(p_queue) AS t;
END;
$$;

-- CREATE OR REPLACE resets the settings: as before, with the owner's rights, a fixed
-- search_path and no JIT.
ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_create_many_v1(text[], text[], text[], bytea[], integer[], bigint[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
