-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 10. Routing: exchanges, bindings, publish
-- Kombu's exchanges and bindings, persisted in Postgres so that every process routes alike.
-- ---------------------------------------------------------------------------------------------

-- Declare an exchange. Raises (SQLSTATE LM001) when it exists with another type.
CREATE FUNCTION {schema}.exchange_declare_v1(
    p_exchange text, p_type text, p_durable boolean, p_auto_delete boolean
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_type text;
BEGIN
    INSERT INTO {schema}.exchange (name, type, durable, auto_delete)
    VALUES (p_exchange, p_type, p_durable, p_auto_delete)
    ON CONFLICT (name) DO NOTHING;
    SELECT e.type INTO v_type FROM {schema}.exchange e WHERE e.name = p_exchange;
    IF v_type <> p_type THEN
        RAISE EXCEPTION USING ERRCODE = 'LM001',
            MESSAGE = format('exchange %L exists with type %L, not %L', p_exchange, v_type, p_type);
    END IF;
END;
$$;

-- Delete an exchange and its bindings.
CREATE FUNCTION {schema}.exchange_delete_v1(p_exchange text) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM {schema}.binding WHERE exchange = p_exchange;
    DELETE FROM {schema}.exchange WHERE name = p_exchange;
$$;

-- Bind a queue to an exchange (idempotent).
CREATE FUNCTION {schema}.queue_bind_v1(
    p_exchange text, p_routing_key text, p_queue text, p_pattern text
) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {schema}.binding (exchange, routing_key, queue, pattern)
    VALUES (p_exchange, p_routing_key, p_queue, p_pattern)
    ON CONFLICT (exchange, routing_key, queue) DO NOTHING;
$$;

CREATE FUNCTION {schema}.queue_unbind_v1(p_exchange text, p_routing_key text, p_queue text)
RETURNS void
LANGUAGE sql AS $$
    DELETE FROM {schema}.binding
    WHERE exchange = p_exchange AND routing_key = p_routing_key AND queue = p_queue;
$$;

-- The queues a message published to (exchange, routing key) goes to, sorted (so that a
-- publish to several queues locks them in a consistent order). The anonymous exchange ''
-- routes to the queue named by the routing key.
CREATE FUNCTION {schema}.route_v1(p_exchange text, p_routing_key text) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_type text;
    v_queues text[];
BEGIN
    IF p_exchange = '' THEN
        RETURN ARRAY[p_routing_key];
    END IF;
    SELECT e.type INTO v_type FROM {schema}.exchange e WHERE e.name = p_exchange;
    IF v_type = 'fanout' THEN
        SELECT array_agg(DISTINCT b.queue ORDER BY b.queue) INTO v_queues
        FROM {schema}.binding b WHERE b.exchange = p_exchange;
    ELSIF v_type = 'topic' THEN
        SELECT array_agg(DISTINCT b.queue ORDER BY b.queue) INTO v_queues
        FROM {schema}.binding b WHERE b.exchange = p_exchange AND p_routing_key ~ b.pattern;
    ELSE
        SELECT array_agg(DISTINCT b.queue ORDER BY b.queue) INTO v_queues
        FROM {schema}.binding b WHERE b.exchange = p_exchange AND b.routing_key = p_routing_key;
    END IF;
    RETURN coalesce(v_queues, ARRAY[]::text[]);
END;
$$;

-- Publish: route, then create the message in every queue it goes to. The tenant channel is
-- p_channel, else the routing key, else the queue name. One row per queue reached (none when
-- the message is unroutable, as on RabbitMQ).
CREATE FUNCTION {schema}.message_publish_v1(
    p_exchange text,
    p_routing_key text,
    p_channel text,
    p_name text,
    p_content bytea,
    p_priority integer,
    p_delay_ms bigint,
    p_ttl_ms bigint
)
RETURNS TABLE (queue_name text, result_code text, message_id bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_queue text;
    v_ttl bigint;
BEGIN
    FOREACH v_queue IN ARRAY {schema}.route_v1(p_exchange, p_routing_key) LOOP
        SELECT LEAST(p_ttl_ms, q.message_ttl_ms) INTO v_ttl
        FROM {schema}.queue q WHERE q.name = v_queue;
        -- a queue an expiry or its last consumer's going deleted is not re-created by a
        -- publish to its name (a late rpc result): the message is dropped, as on RabbitMQ
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
