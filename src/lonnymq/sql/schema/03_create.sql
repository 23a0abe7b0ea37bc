-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 3. Create
-- ---------------------------------------------------------------------------------------------

-- Create a message in a channel with a max_size in force: producers of that channel take
-- turns on its row (until their transactions end). A producer waits at most 5 s for another
-- one's open transaction, then fails with SQLSTATE LM002 (lonnymq.ChannelBusy).
CREATE FUNCTION {schema}.message_create_sized_v1(
    p_queue text, p_channel text, p_name text, p_content bytea, p_priority integer,
    p_delay_ms bigint, p_ttl_ms bigint, OUT result_code text, OUT message_id bigint
)
LANGUAGE plpgsql SET lock_timeout = '5s' SET enable_seqscan = off AS $$
DECLARE
    v_row {schema}.channel;
    v_max integer;
    v_at timestamptz;
BEGIN
    BEGIN
        LOOP
            SELECT * INTO v_row FROM {schema}.channel c
            WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
            EXIT WHEN FOUND;
            INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
            ON CONFLICT DO NOTHING;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION USING ERRCODE = 'LM002',
            MESSAGE = format('channel %L of queue %L has a max_size, and another transaction '
                             'creating in it has been open for more than 5 s', p_channel, p_queue),
            HINT = 'producers of a channel with a max_size take turns until they commit: keep '
                   'their transactions short';
    END;
    -- the limit now that the row is ours (a policy may have changed meanwhile)
    SELECT l.max_size INTO v_max FROM {schema}.channel_limits_v1(p_queue, p_channel) l;
    IF p_name IS NOT NULL THEN
        SELECT m.id INTO message_id FROM {schema}.message m
        WHERE m.queue = p_queue AND m.channel = p_channel AND m.name = p_name AND m.attempts = 0;
        IF message_id IS NOT NULL THEN
            result_code := 'deduplicated';
            RETURN;
        END IF;
    END IF;
    IF v_max IS NOT NULL AND v_row.current_size >= v_max THEN
        result_code := 'dropped';
        INSERT INTO {schema}.tally (queue, channel, dropped) VALUES (p_queue, p_channel, 1);
        -- a row created by this call and left empty must not linger
        IF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
           AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
            DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
        END IF;
        RETURN;
    END IF;
    v_at := clock_timestamp() + p_delay_ms * interval '1 millisecond';
    INSERT INTO {schema}.message
        (queue, channel, priority, sized, txid, dequeue_at, expires_at, name, content)
    VALUES (p_queue, p_channel, p_priority, v_max IS NOT NULL, pg_current_xact_id(), v_at,
            v_at + p_ttl_ms * interval '1 millisecond', p_name, p_content)
    RETURNING id INTO message_id;
    IF v_max IS NOT NULL THEN
        UPDATE {schema}.channel c SET current_size = c.current_size + 1
        WHERE c.queue = p_queue AND c.name = p_channel;
    ELSIF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
          AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
        DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
    END IF;
    result_code := 'created';
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

-- Create a message. result_code: 'created', 'deduplicated' (message_id is the existing one)
-- or 'dropped' (the channel is at max_size). p_ttl_ms (NULL: none): the message is dropped
-- if not dequeued within that time after it is due. In a channel without a max_size it is
-- one INSERT: no row is locked, so no other producer waits for this transaction (one with
-- the same de-duplication name waits for it, as for any unique key).
CREATE FUNCTION {schema}.message_create_v1(
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

-- Create many messages (a batch) in as few statements as the semantics allow. Rows of
-- channels with a max_size in force go first, one by one through message_create_sized_v1 in
-- (queue, channel, name) order (concurrent batches lock channel rows in one order); the
-- others are one INSERT, in (queue, channel, name) order too (de-duplication waits come in
-- one order), their ids drawn beforehand in input order. A later row with the name of an
-- earlier one of its channel is 'deduplicated'. One result per input row, by its position.
CREATE FUNCTION {schema}.message_create_many_v1(
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

