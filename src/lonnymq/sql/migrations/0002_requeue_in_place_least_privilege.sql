-- lonnymq migration 2: requeue in place, acks in bulk.
--
-- * message_defer_v1: a NULL delay requeues the message in its old place (kombu's requeue and
--   restore, as on RabbitMQ); a delay still puts it behind the messages due before then.
-- * message_delete_many_v1: one DELETE for all the rows and one update per channel (it was a
--   delete and a channel update per message); the consumer sends its acks with it.
-- * channel_release_v1: takes the number of slots released (p_count, default 1).
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
