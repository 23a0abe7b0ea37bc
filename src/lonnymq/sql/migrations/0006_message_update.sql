-- lonnymq migration 6. Each section below is one change, under its own header.

-- =============================================================================================
-- Message update: reschedule or edit a waiting message (issue 15, item 9)
-- =============================================================================================
--
-- * message_update_v1 (admin): a ready or delayed message's due time, priority and content;
--   refused for a message in flight ('locked'), a dead letter or a missing id. Like a defer,
--   the message gets a new txid, so the ingest lowers its lane's position and turn to it.
-- * message_eta_v1: a Celery task's `eta` header made to agree with the due time (the worker
--   holds a task until the eta it reads in the message, whatever the database says).
-- * message_retry_v1: a delayed message made due now loses its eta header (it kept the old
--   one, and the worker waited for it).

-- A kombu payload (JSON) whose headers carry an `eta` (Celery's delayed tasks), with that
-- header made to agree with the message's due time: p_at as ISO 8601 in UTC, or JSON null
-- (what Celery writes for a task without one) when p_at is NULL, the message being due now.
-- A worker goes by the header, not by the database: a task made due now whose header kept
-- its old eta would wait in the worker until then. Any other content comes back unchanged.
CREATE OR REPLACE FUNCTION {schema}.message_eta_v1(p_content bytea, p_at timestamptz) RETURNS bytea
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_doc jsonb;
BEGIN
    IF p_content IS NULL OR position('"eta"'::bytea IN p_content) = 0 THEN
        RETURN p_content;
    END IF;
    BEGIN
        v_doc := convert_from(p_content, 'UTF8')::jsonb;
    EXCEPTION WHEN invalid_text_representation OR character_not_in_repertoire
                   OR untranslatable_character THEN
        RETURN p_content;  -- not JSON: not a kombu message
    END;
    IF jsonb_typeof(v_doc -> 'headers') IS DISTINCT FROM 'object'
       OR NOT (v_doc -> 'headers') ? 'eta' THEN
        RETURN p_content;
    END IF;
    RETURN convert_to(jsonb_set(v_doc, '{{headers,eta}}',
        CASE WHEN p_at IS NULL THEN 'null'::jsonb
             ELSE to_jsonb(to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
        END)::text, 'UTF8');
END;
$$;

-- Reschedule or edit a waiting (ready or delayed) message. Its due time: p_at, else now +
-- p_delay_ms, else kept; a time not after now means due now (a message already due keeps its
-- place, none is dated back before the others). Its priority and content: NULL keeps them.
-- A Celery task's eta header is made to agree with the new due time (message_eta_v1); a time
-- to live counts from the due time, so a message moved later keeps as long to live after it.
-- result_code: 'updated' (due_at, new_priority: what the message has now); 'locked' (in
-- flight: a consumer holds it, or its lock expired and it waits to be taken over); 'dead' (a
-- dead letter: retry it first); 'not_found'.
-- Like a defer, the update gives the message a new txid: the next ingest finds it again and
-- lowers its lane's position and turn to it (moved earlier or to a higher priority, it would
-- otherwise lie before a position that already passed it); it is delivered once ingested.
-- A dequeue locking the row at that moment is waited for (its short transaction), and the
-- message is then in flight and refused; a dequeue that comes while the update holds the row
-- passes it by (SKIP LOCKED) and finds it at its next ingest.
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

-- Retry messages by id: a dead letter goes back to its queue and channel as a new message
-- (attempts start again; 'retried', new_id), a delayed message becomes due now ('due_now',
-- its Celery eta header cleared: message_eta_v1).
-- Otherwise: 'ready' (nothing to do), 'locked' (a consumer holds it), 'channel_full' or
-- 'deduplicated' (a never-delivered message of the same name waits, new_id; the dead letter
-- stays in both cases), 'not_found'.
CREATE OR REPLACE FUNCTION {schema}.message_retry_v1(p_ids bigint[])
RETURNS TABLE (message_id bigint, result_code text, new_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_dead {schema}.dead_message;
    v_code text;
    v_new_id bigint;
    v_queue text;
    v_locked timestamptz;
    v_at timestamptz;
    v_d {schema}.discovery;
BEGIN
    -- with the ingest held: a message made due that was never ingested still counts once
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR v_id IN SELECT DISTINCT u.id FROM unnest(p_ids) AS u(id) ORDER BY u.id LOOP
        message_id := v_id;
        new_id := NULL;
        DELETE FROM {schema}.dead_message d WHERE d.id = v_id RETURNING d.* INTO v_dead;
        IF FOUND THEN
            SELECT c.result_code, c.message_id INTO v_code, v_new_id
            FROM {schema}.message_create_v1(
                v_dead.queue, v_dead.channel, v_dead.name, v_dead.content, v_dead.priority,
                0, NULL) AS c;
            IF v_code = 'dropped' THEN
                INSERT INTO {schema}.dead_message SELECT (v_dead).*;
                result_code := 'channel_full';
            ELSIF v_code = 'deduplicated' THEN
                -- a never-delivered message of that name waits: the dead letter stays
                INSERT INTO {schema}.dead_message SELECT (v_dead).*;
                result_code := 'deduplicated';
                new_id := v_new_id;
            ELSE
                IF v_code = 'created' AND v_dead.state IS NOT NULL THEN
                    UPDATE {schema}.message m SET state = v_dead.state WHERE m.id = v_new_id;
                END IF;
                result_code := 'retried';
                new_id := v_new_id;
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT m.queue, m.locked_until, m.dequeue_at INTO v_queue, v_locked, v_at
        FROM {schema}.message m WHERE m.id = v_id;
        IF NOT FOUND THEN
            result_code := 'not_found';
        ELSIF v_locked IS NOT NULL THEN
            result_code := 'locked';
        ELSIF v_at <= clock_timestamp() THEN
            result_code := 'ready';
        ELSE
            UPDATE {schema}.message m SET dequeue_at = clock_timestamp(),
                txid = pg_current_xact_id(),
                arrival = CASE WHEN m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap)
                    THEN 0 ELSE 2 END,
                content = {schema}.message_eta_v1(m.content, NULL)
            WHERE m.id = v_id AND m.locked_until IS NULL;
            IF FOUND THEN
                PERFORM {schema}.wake_v1(v_queue);
                result_code := 'due_now';
            ELSE
                result_code := 'locked';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION {schema}.message_eta_v1(bytea, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    FROM PUBLIC;
ALTER FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
-- (CREATE OR REPLACE reset what the definition does not say)
ALTER FUNCTION {schema}.message_retry_v1(bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- Roles that may retry messages (admins) may update them.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.oid = '{schema}.message_retry_v1(bigint[])'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)'::regprocedure,
            r.role);
    END LOOP;
END;
$$;
