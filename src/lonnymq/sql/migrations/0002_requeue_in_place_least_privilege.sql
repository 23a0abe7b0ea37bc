-- lonnymq migration 2: requeue in place, acks in bulk, a leaner dequeue, least privilege.
--
-- * message_defer_v1: a NULL delay requeues the message in its old place (kombu's requeue and
--   restore, as on RabbitMQ); a delay still puts it behind the messages due before then.
-- * message_delete_many_v1: one DELETE for all the rows and one update per channel (it was a
--   delete and a channel update per message); the consumer sends its acks with it.
-- * channel_release_v1: takes the number of slots released (p_count, default 1).
-- * message_dequeue_v1: re-locks expired locks only when there are some, and checks the time
--   to live in the UPDATE that locks the messages (one statement less per channel served);
--   never waits long on a channel row (SKIP LOCKED can wait for a newer row version, which
--   deadlocked with acks): lock_timeout 50ms, then look again.
-- * Least privilege: the entry points run as the schema's owner (SECURITY DEFINER, fixed
--   search_path); no function is executable by PUBLIC; lonnymq.grant gives roles what they
--   need (producer, worker, admin).

DROP FUNCTION {schema}.channel_release_v1(bigint, integer, timestamptz);

-- Release a held message's slot on its channel (after delete or defer).
CREATE FUNCTION {schema}.channel_release_v1(
    p_channel_id bigint, p_size_delta integer, p_due timestamptz, p_count integer DEFAULT 1
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old {schema}.channel;
    v_new {schema}.channel;
    v_due timestamptz;
BEGIN
    SELECT * INTO v_old FROM {schema}.channel c WHERE c.id = p_channel_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_new := v_old;
    v_new.current_size := GREATEST(0, v_old.current_size + p_size_delta);
    v_new.current_concurrency := GREATEST(0, v_old.current_concurrency - p_count);
    IF p_due IS NOT NULL THEN
        v_due := GREATEST(p_due, v_old.served_at);
        IF v_old.waiting_since IS NULL OR v_due < v_old.waiting_since THEN
            v_new.waiting_since := v_due;
        END IF;
    END IF;
    PERFORM {schema}.channel_store_v1(v_old, v_new, false);
END;
$$;


-- Dequeue up to p_limit messages from the given queues and lock them for p_lock_ms.
-- Messages whose lock expired come first (their holder is gone); then channels with a due
-- message are served round-robin, the one waiting longest first, skipping channels at
-- max_concurrency. Rows come back in delivery order. When no message is available, one row
-- comes back with message_id NULL and retry_ms: milliseconds until something may become
-- available (NULL: nothing is pending).
CREATE OR REPLACE FUNCTION {schema}.message_dequeue_v1(p_queues text[], p_limit integer, p_lock_ms bigint)
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
    retry_ms bigint
)
-- Generic plans: re-planning a dozen statements on every call (custom plans) cost more than
-- executing them; tests/test_plans.py checks the generic plans use the indexes. lock_timeout:
-- see step 2.
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET lock_timeout = '50ms' AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_queue_ids integer[];
    v_got integer := 0;
    v_left integer;
    v_n integer;
    v_channels {schema}.channel[];
    v_taken integer[];
    v_done boolean[];
    v_dropped integer[];
    v_expired bigint[];
    v_relock bigint[];
    v_locked bigint[];
    v_new {schema}.channel;
    v_batch bigint[];
    v_ids bigint[] := ARRAY[]::bigint[];
    v_ranks integer[] := ARRAY[]::integer[];
    v_orders integer[] := ARRAY[]::integer[];
    v_quota integer;
    v_open integer;
    v_cap integer;
    v_try integer := 0;
    v_wait_id bigint;
    i integer;
BEGIN
    SELECT array_agg(q.id) INTO v_queue_ids FROM {schema}.queue q WHERE q.name = ANY (p_queues);
    IF v_queue_ids IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, NULL::bigint;
        RETURN;
    END IF;

    -- 1. Messages whose lock expired. They still count against their channel's concurrency,
    --    so they are re-locked without touching the channel row. Each queue is read in index
    --    order, stopping at p_limit: no sort of every expired lock (after a crash there may be
    --    thousands); usually there is none, and this one probe is all it costs.
    BEGIN
        v_relock := ARRAY(
            SELECT x.id FROM unnest(v_queue_ids) AS qid
            CROSS JOIN LATERAL (
                SELECT e.id, e.locked_until FROM {schema}.message e
                WHERE e.queue_id = qid AND e.locked_until <= v_now
                ORDER BY e.locked_until
                LIMIT p_limit
                FOR UPDATE SKIP LOCKED
            ) AS x
            ORDER BY x.locked_until
            LIMIT p_limit
        );
    EXCEPTION WHEN lock_not_available THEN
        v_relock := ARRAY[]::bigint[];  -- see step 2: an ack holds one; take them next time
    END;
    IF cardinality(v_relock) > 0 THEN
        RETURN QUERY
            WITH relocked AS (
                -- ids as an array, not a join: a join estimated from LIMIT's row count can
                -- turn into a hash join over the whole table under a generic plan
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1
                WHERE m.id = ANY (v_relock)
                RETURNING m.*
            )
            SELECT r.id, q.name, c.name, r.name, r.priority, r.attempts, r.lock_token,
                   r.created_at, r.content, r.state, NULL::bigint
            FROM relocked r
            JOIN {schema}.channel c ON c.id = r.channel_id
            JOIN {schema}.queue q ON q.id = r.queue_id
            ORDER BY r.id;
        GET DIAGNOSTICS v_got = ROW_COUNT;
    END IF;
    v_left := p_limit - v_got;

    -- 2. Lock the channels whose turn it is.
    WHILE v_left > 0 LOOP
        BEGIN
            SELECT array_agg(s.c ORDER BY (s.c).waiting_since, (s.c).id) INTO v_channels
            FROM (
                SELECT l.c FROM unnest(v_queue_ids) AS qid
                CROSS JOIN LATERAL (
                    SELECT c FROM {schema}.channel c
                    WHERE c.queue_id = qid AND c.waiting_since <= v_now
                    ORDER BY c.waiting_since, c.id
                    LIMIT v_left
                    FOR UPDATE SKIP LOCKED
                ) AS l
                ORDER BY (l.c).waiting_since, (l.c).id
                LIMIT v_left
            ) AS s;
        EXCEPTION WHEN lock_not_available THEN
            -- SKIP LOCKED still waits when it must lock the newer version of a row updated
            -- since our snapshot while another transaction holds it. Waiting with other
            -- channels of this statement locked can deadlock with acks (which lock channels
            -- in id order), so give up after lock_timeout (set on this function): this
            -- pass locked nothing, and the loop looks again.
            v_channels := NULL;
        END;
        EXIT WHEN v_channels IS NOT NULL OR v_got > 0 OR v_try >= 10;
        -- Nothing could be locked. If a channel is due, another transaction holds it (a
        -- create, an ack or another dequeue in flight): wait for it instead of reporting an
        -- empty queue, which would send the consumer to sleep with work waiting.
        v_try := v_try + 1;
        v_now := clock_timestamp();  -- due now, not when the call started
        SELECT w.id INTO v_wait_id FROM unnest(v_queue_ids) AS qid
        CROSS JOIN LATERAL (
            SELECT c.id, c.waiting_since FROM {schema}.channel c
            WHERE c.queue_id = qid AND c.waiting_since <= v_now
            ORDER BY c.waiting_since, c.id
            LIMIT 1
        ) AS w
        ORDER BY w.waiting_since, w.id
        LIMIT 1;
        EXIT WHEN v_wait_id IS NULL;
        -- Give the holder a moment (its transaction is one function call) and look again.
        -- Sleep, never wait on the row lock: the SKIP LOCKED pass above may have left rows
        -- locked that it did not return (a row updated since our snapshot is locked, then
        -- fails the recheck), and waiting on a lock while holding one can deadlock with a
        -- batch of creates. A dequeue never waits on a lock, so it can never deadlock.
        PERFORM pg_sleep(0.001);
        v_now := clock_timestamp();
        v_wait_id := NULL;
    END LOOP;

    IF v_channels IS NOT NULL THEN
        -- 3. Take messages in passes: each open channel gets an equal share of what is left;
        --    a channel that filled its share stays open for the next pass.
        v_taken := array_fill(0, ARRAY[cardinality(v_channels)]);
        v_done := array_fill(false, ARRAY[cardinality(v_channels)]);
        v_dropped := array_fill(0, ARRAY[cardinality(v_channels)]);
        v_open := cardinality(v_channels);
        WHILE v_left > 0 AND v_open > 0 LOOP
            v_quota := ceil(v_left::numeric / v_open)::integer;
            v_open := 0;
            FOR i IN 1 .. cardinality(v_channels) LOOP
                EXIT WHEN v_left <= 0;
                v_cap := LEAST(v_quota, v_left);
                IF v_channels[i].max_concurrency IS NOT NULL THEN
                    v_cap := LEAST(v_cap, v_channels[i].max_concurrency
                        - v_channels[i].current_concurrency - v_taken[i]);
                END IF;
                CONTINUE WHEN v_cap <= 0 OR v_done[i];
                SELECT array_agg(x.id ORDER BY x.rn) INTO v_batch
                FROM {schema}.channel_take_v1(v_channels[i].id, v_cap, v_now)
                    WITH ORDINALITY AS x(id, rn);
                -- lock them, by primary key from the array (never a join the planner could
                -- hash); messages past their time to live are left out, and dropped below
                WITH locked AS (
                    UPDATE {schema}.message m SET
                        locked_until = v_now + v_lock,
                        lock_token = gen_random_uuid(),
                        attempts = m.attempts + 1
                    WHERE m.id = ANY (v_batch) AND (m.expires_at IS NULL OR m.expires_at > v_now)
                    RETURNING m.id
                )
                SELECT array_agg(l.id) INTO v_locked FROM locked l;
                v_expired := NULL;
                IF coalesce(cardinality(v_locked), 0) < coalesce(cardinality(v_batch), 0) THEN
                    WITH gone AS (
                        DELETE FROM {schema}.message m
                        WHERE m.id = ANY (v_batch) AND m.expires_at <= v_now
                          AND m.id <> ALL (coalesce(v_locked, ARRAY[]::bigint[]))
                        RETURNING m.id
                    )
                    SELECT array_agg(gone.id) INTO v_expired FROM gone;
                    v_dropped[i] := v_dropped[i] + coalesce(cardinality(v_expired), 0);
                    SELECT array_agg(u.id ORDER BY u.ord) INTO v_batch
                    FROM unnest(v_batch) WITH ORDINALITY AS u(id, ord)
                    WHERE u.id = ANY (coalesce(v_locked, ARRAY[]::bigint[]));
                    v_done[i] := true;  -- look again on the next call
                END IF;
                v_n := coalesce(cardinality(v_batch), 0);
                IF v_n < v_cap AND v_expired IS NULL THEN
                    v_done[i] := true;  -- nothing more due in this channel
                END IF;
                CONTINUE WHEN v_n = 0;
                v_ids := v_ids || v_batch;
                v_ranks := v_ranks || ARRAY(SELECT v_taken[i] + g FROM generate_series(1, v_n) AS g);
                v_orders := v_orders || array_fill(i, ARRAY[v_n]);
                v_taken[i] := v_taken[i] + v_n;
                v_left := v_left - v_n;
                IF NOT v_done[i] THEN
                    v_open := v_open + 1;
                END IF;
            END LOOP;
        END LOOP;

        RETURN QUERY
            SELECT m.id, q.name, c.name, m.name, m.priority, m.attempts, m.lock_token,
                   m.created_at, m.content, m.state, NULL::bigint
            FROM unnest(v_ids, v_ranks, v_orders) AS s(id, rnk, ord)
            JOIN {schema}.message m ON m.id = s.id
            JOIN {schema}.channel c ON c.id = m.channel_id
            JOIN {schema}.queue q ON q.id = m.queue_id
            ORDER BY s.rnk, s.ord;

        -- 4. Move the served channels to the back of the round, in the order served.
        FOR i IN 1 .. cardinality(v_channels) LOOP
            v_new := v_channels[i];
            v_new.current_concurrency := v_new.current_concurrency + v_taken[i];
            v_new.current_size := v_new.current_size - v_dropped[i];
            IF v_taken[i] > 0 THEN
                v_new.served_at := clock_timestamp();
            END IF;
            PERFORM {schema}.channel_store_v1(v_channels[i], v_new, true);
        END LOOP;
        v_got := v_got + cardinality(v_ids);
    END IF;

    IF v_got = 0 THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
            {schema}.queue_retry_ms_v1(v_queue_ids);
    END IF;
END;
$$;


-- Defer a held message: unlock it, due again after p_delay_ms, with new state when
-- p_set_state. Attempts are kept. result_code as for delete.
CREATE OR REPLACE FUNCTION {schema}.message_defer_v1(
    p_id bigint, p_lock_token uuid, p_delay_ms bigint, p_set_state boolean, p_state bytea,
    OUT result_code text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_channel_id bigint;
    v_at timestamptz;
BEGIN
    UPDATE {schema}.message m SET
        locked_until = NULL,
        lock_token = NULL,
        -- a NULL delay requeues: the message keeps its place (as RabbitMQ's requeue does)
        dequeue_at = CASE WHEN p_delay_ms IS NULL THEN m.dequeue_at
            ELSE clock_timestamp() + p_delay_ms * interval '1 millisecond' END,
        state = CASE WHEN p_set_state THEN p_state ELSE m.state END
    WHERE m.id = p_id AND m.lock_token = p_lock_token AND m.locked_until IS NOT NULL
    RETURNING m.channel_id, m.dequeue_at INTO v_channel_id, v_at;
    IF v_channel_id IS NULL THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    PERFORM {schema}.channel_release_v1(v_channel_id, 0, v_at);
    result_code := 'ok';
END;
$$;


DROP FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[]);

-- Delete (ack) many held messages. One outcome per id, as message_delete_v1.
CREATE FUNCTION {schema}.message_delete_many_v1(p_ids bigint[], p_lock_tokens uuid[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_gone bigint[];
    v_channels bigint[];
    r record;
BEGIN
    -- by primary key from the array (never a join the planner could hash), each row with
    -- the token given for it
    WITH gone AS (
        DELETE FROM {schema}.message m
        WHERE m.id = ANY (p_ids)
          AND m.lock_token = p_lock_tokens[array_position(p_ids, m.id)]
          AND m.locked_until IS NOT NULL
        RETURNING m.id, m.channel_id
    )
    SELECT array_agg(g.id), array_agg(g.channel_id) INTO v_gone, v_channels FROM gone g;
    -- one update per channel, in id order (the same order for every caller)
    FOR r IN
        SELECT x.channel_id, count(*)::integer AS n FROM unnest(v_channels) AS x(channel_id)
        GROUP BY x.channel_id ORDER BY x.channel_id
    LOOP
        PERFORM {schema}.channel_release_v1(r.channel_id, -r.n, NULL, r.n);
    END LOOP;
    RETURN QUERY
        SELECT h.id,
            CASE WHEN h.id = ANY (coalesce(v_gone, ARRAY[]::bigint[])) THEN 'ok'
                 WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                     THEN 'state_invalid'
                 ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
END;
$$;


-- Security: callers run the entry points below with the rights of the schema's owner
-- (SECURITY DEFINER, with a fixed search_path) and need no rights on the tables; nobody may
-- execute a function unless granted (lonnymq.grant / `lonnymq grant`: producer, worker,
-- admin). The internal functions are only called by the entry points.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM PUBLIC;
ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_publish_v1(text, text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_dequeue_v1(text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_delete_v1(bigint, uuid)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_defer_v1(bigint, uuid, bigint, boolean, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_heartbeat_v1(bigint[], uuid[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.channel_policy_set_v1(text, text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.channel_policy_clear_v1(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_policy_set_v1(text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_stats_v1(text, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.exchange_declare_v1(text, text, boolean, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.exchange_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_declare_v1(text, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_bind_v1(text, text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_unbind_v1(text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_touch_v1(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.expire_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
