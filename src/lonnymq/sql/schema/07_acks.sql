-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 7. Acks and finalize: delete (ack), defer, heartbeat, bury (dead-letter), reject
-- ---------------------------------------------------------------------------------------------

-- The ack block of message_delete_many_v1 and of the dequeue (its acks): what the acked
-- messages (p_queues, p_channels: of each; p_sized, p_slotted: counted in their channel's
-- current_size / current_concurrency) held on limited channels is given back, channel by
-- channel in (queue, channel) order (the order every writer of channel rows keeps).
CREATE FUNCTION {schema}.ack_give_back_v1(
    p_queues text[], p_channels text[], p_sized boolean[], p_slotted boolean[]
)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
               count(*) FILTER (WHERE u.l)::integer AS l
        FROM unnest(p_queues, p_channels, p_sized, p_slotted) AS u(q, c, s, l)
        WHERE u.s OR u.l GROUP BY u.q, u.c ORDER BY u.q, u.c
    LOOP
        PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
    END LOOP;
END;
$$;

-- The outcome of each ack of p_ids, p_gone being those deleted: 'ok', 'state_invalid' (held
-- under another lock token, or not held) or 'not_found'.
CREATE FUNCTION {schema}.ack_outcome_v1(p_ids bigint[], p_gone bigint[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE sql STABLE AS $$
    SELECT h.id,
        CASE WHEN h.id = ANY (coalesce(p_gone, ARRAY[]::bigint[])) THEN 'ok'
             WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                 THEN 'state_invalid'
             ELSE 'not_found' END
    FROM unnest(p_ids) AS h(id);
$$;

-- Delete (ack) many held messages. One outcome per id: 'ok', 'state_invalid' (held under
-- another lock token, or not held) or 'not_found'. Only the limits of the channels that have
-- one are written; otherwise an ack is the DELETE and one tally row per channel.
CREATE FUNCTION {schema}.message_delete_many_v1(p_ids bigint[], p_lock_tokens uuid[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_gone bigint[];
    v_q text[];
    v_c text[];
    v_s boolean[];
    v_l boolean[];
BEGIN
    WITH gone AS (
        DELETE FROM {schema}.message m
        WHERE m.id = ANY (p_ids)
          AND m.lock_token = p_lock_tokens[array_position(p_ids, m.id)]
        RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
    )
    SELECT array_agg(g.id), array_agg(g.queue), array_agg(g.channel), array_agg(g.sized),
           array_agg(g.slotted)
    INTO v_gone, v_q, v_c, v_s, v_l FROM gone g;
    IF v_gone IS NOT NULL THEN
        INSERT INTO {schema}.tally (queue, channel, acked)
        SELECT u.q, u.c, count(*) FROM unnest(v_q, v_c) AS u(q, c) GROUP BY u.q, u.c;
        IF true = ANY (v_s) OR true = ANY (v_l) THEN
            PERFORM {schema}.ack_give_back_v1(v_q, v_c, v_s, v_l);
        END IF;
    END IF;
    IF coalesce(cardinality(v_gone), 0) = cardinality(p_ids) THEN
        RETURN QUERY SELECT h.id, 'ok'::text FROM unnest(p_ids) AS h(id);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.ack_outcome_v1(p_ids, v_gone);
END;
$$;

-- Delete (acknowledge) a held message. result_code: 'ok', 'state_invalid' (the message is
-- held under another lock token, or not held) or 'not_found'.
CREATE FUNCTION {schema}.message_delete_v1(p_id bigint, p_lock_token uuid, OUT result_code text)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT d.result_code INTO result_code
    FROM {schema}.message_delete_many_v1(ARRAY[p_id], ARRAY[p_lock_token]) AS d;
END;
$$;

-- Defer a held message: unlock it, due again after p_delay_ms (NULL: in its old place, as
-- RabbitMQ's requeue), with new state when p_set_state. Attempts are kept. result_code as for
-- delete.
CREATE FUNCTION {schema}.message_defer_v1(
    p_id bigint, p_lock_token uuid, p_delay_ms bigint, p_set_state boolean, p_state bytea,
    OUT result_code text
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    r record;
BEGIN
    UPDATE {schema}.message m SET
        locked_until = NULL,
        lock_token = NULL,
        slotted = false,
        txid = pg_current_xact_id(),
        arrival = 1,
        dequeue_at = CASE WHEN p_delay_ms IS NULL THEN m.dequeue_at
            ELSE clock_timestamp() + p_delay_ms * interval '1 millisecond' END,
        state = CASE WHEN p_set_state THEN p_state ELSE m.state END
    FROM (SELECT o.id, o.slotted FROM {schema}.message o
          WHERE o.id = p_id AND o.lock_token = p_lock_token
          FOR UPDATE) AS old
    WHERE m.id = old.id
    RETURNING m.queue, m.channel, old.slotted INTO r;
    IF r.queue IS NULL THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    INSERT INTO {schema}.tally (queue, channel, deferred) VALUES (r.queue, r.channel, 1);
    IF r.slotted THEN
        PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, 0, 1);
    END IF;
    PERFORM {schema}.wake_v1(r.queue);
    result_code := 'ok';
END;
$$;

-- Extend the locks of held messages. Returns the ids whose lock was extended (a message
-- whose token no longer matches is left out) with their new lock expiry.
CREATE FUNCTION {schema}.message_heartbeat_v1(p_ids bigint[], p_lock_tokens uuid[], p_lock_ms bigint)
RETURNS TABLE (message_id bigint, locked_until timestamptz)
LANGUAGE sql AS $$
    WITH extended AS (
        UPDATE {schema}.message m SET locked_until = clock_timestamp() + p_lock_ms * interval '1 millisecond'
        FROM unnest(p_ids, p_lock_tokens) AS h(id, lock_token)
        WHERE m.id = h.id AND m.lock_token = h.lock_token
        RETURNING m.id, m.queue, m.channel, m.locked_until
    ), tallied AS (
        -- (a lock extended for less than it had: the ingest's hint of the next expiry)
        INSERT INTO {schema}.tally (queue, channel, lock_until, lock_id)
        SELECT DISTINCT ON (e.queue, e.channel) e.queue, e.channel, e.locked_until, e.id
        FROM extended e ORDER BY e.queue, e.channel, e.locked_until
    )
    SELECT e.id, e.locked_until FROM extended e;
$$;

-- Move messages (in any state) to the dead letters of their queue, or delete them where the
-- queue keeps no dead letters, and give back what they held on limited channels. Returns
-- what was removed; the caller counts it.
CREATE FUNCTION {schema}.message_bury_v1(p_ids bigint[], p_reason text)
RETURNS TABLE (
    message_id bigint, held boolean, queue_name text, channel_name text, message_name text,
    message_attempts integer, message_created_at timestamptz
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    r record;
    v_q text[] := ARRAY[]::text[];
    v_c text[] := ARRAY[]::text[];
    v_s boolean[] := ARRAY[]::boolean[];
    v_l boolean[] := ARRAY[]::boolean[];
BEGIN
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.message m WHERE m.id = ANY (p_ids)
            RETURNING m.*
        ), kept AS (
            INSERT INTO {schema}.dead_message
                (id, queue, channel, name, priority, attempts, reason, created_at, dead_at,
                 content, state)
            SELECT g.id, g.queue, g.channel, g.name, g.priority, g.attempts, p_reason,
                   g.created_at, clock_timestamp(), g.content, g.state
            FROM gone g
            WHERE coalesce((SELECT q.dead_letter FROM {schema}.queue q WHERE q.name = g.queue), true)
            ON CONFLICT (id) DO NOTHING
        )
        SELECT g.id, g.locked_until IS NOT NULL AS held, g.queue, g.channel, g.name, g.attempts,
               g.created_at, g.sized, g.slotted
        FROM gone g ORDER BY g.id
    LOOP
        IF r.sized OR r.slotted THEN
            v_q := v_q || r.queue;
            v_c := v_c || r.channel;
            v_s := v_s || r.sized;
            v_l := v_l || r.slotted;
        END IF;
        message_id := r.id;
        held := r.held;
        queue_name := r.queue;
        channel_name := r.channel;
        message_name := r.name;
        message_attempts := r.attempts;
        message_created_at := r.created_at;
        RETURN NEXT;
    END LOOP;
    FOR r IN
        SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
               count(*) FILTER (WHERE u.l)::integer AS l
        FROM unnest(v_q, v_c, v_s, v_l) AS u(q, c, s, l)
        GROUP BY u.q, u.c ORDER BY u.q, u.c
    LOOP
        PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
    END LOOP;
END;
$$;

-- Reject a held message without requeue: it goes to the dead letters of its queue (or is
-- deleted where the queue keeps none). result_code as for delete.
CREATE FUNCTION {schema}.message_reject_v1(
    p_id bigint, p_lock_token uuid, p_reason text, OUT result_code text
)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    r record;
BEGIN
    PERFORM 1 FROM {schema}.message m
    WHERE m.id = p_id AND m.lock_token = p_lock_token
    FOR UPDATE;
    IF NOT FOUND THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    FOR r IN SELECT * FROM {schema}.message_bury_v1(ARRAY[p_id], coalesce(p_reason, 'rejected')) LOOP
        INSERT INTO {schema}.tally (queue, channel, dead, dead_held)
        VALUES (r.queue_name, r.channel_name, 1, 1);
    END LOOP;
    result_code := 'ok';
END;
$$;

