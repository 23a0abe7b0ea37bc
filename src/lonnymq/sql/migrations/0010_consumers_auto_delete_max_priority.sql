-- lonnymq migration 10.

-- =============================================================================================
-- Consumers, auto_delete and max_priority queues, queues that went (issue 27)
-- =============================================================================================
--
-- * consumer: every Kombu consumer of every process, written when it starts or stops and by
--   its client's heartbeat thread (never by a dequeue): who consumes a queue (host, pid,
--   Celery node, since when, last delivery) for the web view and `lonnymq status`; a
--   consumer not heard of for three beats is removed by the sweep (expire_v1).
-- * queue.auto_delete (Kombu's auto_delete): the queue goes when its last consumer cancels,
--   its connection closes or it is presumed gone (consumer_sync_v1, expire_v1).
-- * queue.max_priority (x-max-priority): a higher priority is taken as it, at every create
--   (message_create_v1, message_create_many_v1).
-- * queue_gone: queues an expiry or an auto_delete deleted; a publish by the default
--   exchange to one of them (a late rpc result) is dropped instead of re-creating the queue
--   without its x-expires (message_publish_v1). Kept a day (housekeep_v1).
-- * channel_list_v3: one channel's figures too (channel_list_v2 is its projection).
-- * message_list_v2: in due order too, with the ends of each content (a Celery task's name
--   and arguments for the web view); message_list_v1 is its projection.

ALTER TABLE {schema}.queue
    ADD COLUMN auto_delete boolean NOT NULL DEFAULT false,
    ADD COLUMN max_priority smallint CHECK (max_priority BETWEEN 1 AND 255);

-- Kombu consumers (basic_consume): one row per consumer tag of a kombu connection in a
-- process (`client`: one per transport), so that every process sees who consumes a queue
-- (the web view, `lonnymq status`), and a queue declared auto_delete goes when its last
-- consumer does. Written when a consumer starts or stops, and by each client's heartbeat
-- thread every few seconds (seen_at, delivered_at: its last delivery, as the client
-- reports it), never by a dequeue. A consumer not seen for three of its beats (beat_ms) is
-- presumed gone (its process killed or cut off) and removed by the next sweep (expire_v1).
CREATE TABLE {schema}.consumer (
    client uuid NOT NULL,
    tag text NOT NULL,
    queue text COLLATE "C" NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    -- Celery's node name of the worker (name@host), when the client knows it
    node text,
    no_ack boolean NOT NULL,
    prefetch integer,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    seen_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at timestamptz,
    beat_ms integer NOT NULL CHECK (beat_ms > 0),
    PRIMARY KEY (client, tag)
);

CREATE INDEX consumer_queue_idx ON {schema}.consumer (queue);

-- Queues an expiry (x-expires) or their last consumer's going (auto_delete) deleted, kept a
-- day (housekeep_v1): a publish to one of them through the default exchange (a late rpc
-- result to a reply queue that went) is dropped, as on RabbitMQ, instead of re-creating the
-- queue without its x-expires. A declare brings the queue back.
CREATE TABLE {schema}.queue_gone (
    name text COLLATE "C" PRIMARY KEY,
    expires_ms bigint,
    reason text NOT NULL CHECK (reason IN ('expired', 'auto_delete')),
    gone_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX queue_gone_at_idx ON {schema}.queue_gone (gone_at);

ALTER TABLE {schema}.consumer SET (fillfactor = 50);

-- Remember a queue as gone (see queue_gone): its x-expires, and why.
CREATE FUNCTION {schema}.queue_forget_v1(p_queue text, p_expires_ms bigint, p_reason text)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO {schema}.queue_gone (name, expires_ms, reason) VALUES (p_queue, p_expires_ms, p_reason)
    ON CONFLICT (name) DO UPDATE
        SET expires_ms = EXCLUDED.expires_ms, reason = EXCLUDED.reason, gone_at = EXCLUDED.gone_at;
$$;

-- Delete the auto_delete queues among p_queues that no consumer consumes any more (with
-- their messages and bindings, as queue_delete_v1 does), and remember them as gone. The
-- caller holds the ingest key and has locked these queue rows (FOR UPDATE, in name order)
-- before removing their consumers, so that a last consumer going and a new one coming are
-- never both unseen. Returns the queues deleted.
CREATE FUNCTION {schema}.queue_auto_delete_v1(p_queues text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_gone text[] := ARRAY[]::text[];
    r record;
BEGIN
    FOR r IN
        SELECT q.name, q.expires_ms FROM {schema}.queue q
        WHERE q.name = ANY (p_queues) AND q.auto_delete
          AND NOT EXISTS (SELECT 1 FROM {schema}.consumer c WHERE c.queue = q.name)
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(r.name);
        PERFORM {schema}.queue_forget_v1(r.name, r.expires_ms, 'auto_delete');
        v_gone := v_gone || r.name::text;
    END LOOP;
    RETURN v_gone;
END;
$$;

-- A client's consumers as they are now (p_tags, with their queue, no-ack flag, prefetch and
-- last delivery): those it no longer has are removed, the others added or refreshed
-- (seen_at), and their queues marked used (x-expires). Called when a consumer starts or
-- stops, and by the client's heartbeat. Returns the auto_delete queues deleted because
-- their last consumer went ('deleted'), and the queues consumed that do not exist
-- ('missing': deleted while consumed).
CREATE FUNCTION {schema}.consumer_sync_v1(
    p_client uuid, p_host text, p_pid integer, p_node text, p_beat_ms integer,
    p_tags text[], p_queues text[], p_no_ack boolean[], p_prefetch integer[],
    p_delivered_at timestamptz[]
)
RETURNS TABLE (queue_name text, state text)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_changed text[];
    v_gone text[];
BEGIN
    SELECT array_agg(DISTINCT x.q) INTO v_changed FROM (
        SELECT u.q FROM unnest(p_tags, p_queues) AS u(t, q)
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.consumer c
                          WHERE c.client = p_client AND c.tag = u.t)
        UNION ALL
        SELECT c.queue FROM {schema}.consumer c
        WHERE c.client = p_client AND c.tag <> ALL (p_tags)
    ) AS x;
    IF EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = ANY (v_changed) AND q.auto_delete)
    THEN
        -- (the ingest key first, as expire_v1 and queue_delete_v1 take it)
        PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
        PERFORM 1 FROM {schema}.queue q WHERE q.name = ANY (v_changed) AND q.auto_delete
        ORDER BY q.name FOR UPDATE;
    END IF;
    WITH gone AS (
        DELETE FROM {schema}.consumer c WHERE c.client = p_client AND c.tag <> ALL (p_tags)
        RETURNING c.queue
    )
    SELECT array_agg(DISTINCT g.queue) INTO v_gone FROM gone g;
    INSERT INTO {schema}.consumer AS c
        (client, tag, queue, host, pid, node, no_ack, prefetch, started_at, seen_at,
         delivered_at, beat_ms)
    SELECT p_client, u.t, u.q, p_host, p_pid, p_node, u.na, u.pf, v_now, v_now, u.d, p_beat_ms
    FROM unnest(p_tags, p_queues, p_no_ack, p_prefetch, p_delivered_at) AS u(t, q, na, pf, d)
    ON CONFLICT (client, tag) DO UPDATE SET
        seen_at = EXCLUDED.seen_at, node = EXCLUDED.node, prefetch = EXCLUDED.prefetch,
        beat_ms = EXCLUDED.beat_ms, delivered_at = greatest(c.delivered_at, EXCLUDED.delivered_at);
    PERFORM {schema}.queue_touch_v1(p_queues);
    RETURN QUERY
        SELECT d.q, 'deleted'::text
        FROM unnest({schema}.queue_auto_delete_v1(coalesce(v_gone, ARRAY[]::text[]))) AS d(q)
        UNION ALL
        SELECT DISTINCT u.q, 'missing'::text FROM unnest(p_queues) AS u(q)
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = u.q);
END;
$$;

-- Every consumer of p_queue (of every queue when NULL), oldest first: who (host, pid,
-- Celery node), since when, when last heard of and its last delivery; `alive` false for one
-- not heard of for three beats since the server started (the next sweep removes it).
CREATE FUNCTION {schema}.consumer_list_v1(p_queue text)
RETURNS TABLE (
    queue_name text, client uuid, tag text, host text, pid integer, node text,
    no_ack boolean, prefetch integer, started_at timestamptz, seen_at timestamptz,
    delivered_at timestamptz, alive boolean
)
LANGUAGE sql STABLE AS $$
    SELECT c.queue::text, c.client, c.tag, c.host, c.pid, c.node, c.no_ack, c.prefetch,
           c.started_at, c.seen_at, c.delivered_at,
           greatest(c.seen_at, pg_postmaster_start_time())
               >= clock_timestamp() - 3 * c.beat_ms * interval '1 millisecond'
    FROM {schema}.consumer c
    WHERE p_queue IS NULL OR c.queue = p_queue
    ORDER BY c.queue, c.started_at, c.client, c.tag
    LIMIT 10000;
$$;

-- Declare a queue with kombu's arguments: as queue_declare_v1, and auto_delete (the queue
-- goes when its last consumer does) and max_priority (a message's priority above it is
-- stored as it). A declare brings back a queue that went (queue_gone).
CREATE FUNCTION {schema}.queue_declare_v2(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint, p_auto_delete boolean,
    p_max_priority integer, OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT d.waiting, d.in_flight INTO waiting, in_flight
    FROM {schema}.queue_declare_v1(p_queue, p_expires_ms, p_message_ttl_ms) AS d;
    UPDATE {schema}.queue q SET auto_delete = p_auto_delete, max_priority = p_max_priority
    WHERE q.name = p_queue
      AND (q.auto_delete IS DISTINCT FROM p_auto_delete
           OR q.max_priority IS DISTINCT FROM p_max_priority);
    DELETE FROM {schema}.queue_gone g WHERE g.name = p_queue;
END;
$$;

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
    PERFORM {schema}.wake_v1(p_queue);
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
    v_sized := ARRAY(
        SELECT i.n FROM unnest(p_queues, p_channels) WITH ORDINALITY AS i(q, c, n)
        CROSS JOIN LATERAL {schema}.channel_limits_v1(i.q, i.c) AS l
        WHERE l.max_size IS NOT NULL
    );
    FOR r IN
        SELECT i.n, i.q, i.c, i.name, i.content, i.prio, i.delay, i.ttl
        FROM unnest(p_queues, p_channels, p_names, p_contents, p_priorities, p_delays, p_ttls)
            WITH ORDINALITY AS i(q, c, name, content, prio, delay, ttl, n)
        WHERE i.n = ANY (v_sized)
        ORDER BY i.q, i.c, i.name NULLS FIRST, i.n
    LOOP
        SELECT s.result_code, s.message_id INTO v_code, v_id1
        FROM {schema}.message_create_sized_v1(r.q, r.c, r.name, r.content, r.prio, r.delay,
            r.ttl) AS s;
        v_codes[r.n] := v_code;
        v_ids[r.n] := v_id1;
    END LOOP;
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

CREATE OR REPLACE FUNCTION {schema}.message_publish_v1(
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

CREATE OR REPLACE FUNCTION {schema}.expire_v1(p_limit integer, OUT messages bigint, OUT queues bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_d {schema}.discovery;
    v_from timestamptz;
    v_stale text[];
    r record;
BEGIN
    messages := 0;
    queues := 0;
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        -- (by primary key from an array: `id IN (subquery)` was planned as a semi join that
        -- read the whole primary key, every message and dead version, at each sweep: 28,000
        -- buffers and 150 ms two minutes into a held snapshot, under the ingest key)
        WITH gone AS (
            DELETE FROM {schema}.message m
            WHERE m.id = ANY (ARRAY(
                SELECT x.id FROM {schema}.message x
                WHERE x.expires_at >= v_d.expire_from AND x.expires_at <= v_now
                  AND x.locked_until IS NULL
                ORDER BY x.expires_at LIMIT p_limit
                FOR UPDATE SKIP LOCKED))
            RETURNING m.queue, m.channel, m.sized,
                      m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap) AS fresh
        ), per AS (
            SELECT g.queue, g.channel, count(*)::integer AS n,
                   count(*) FILTER (WHERE g.sized)::integer AS s,
                   count(*) FILTER (WHERE g.fresh)::integer AS f
            FROM gone g GROUP BY g.queue, g.channel
        ), counted AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, expired)
            SELECT p.queue, p.channel, p.f, p.n FROM per p
        )
        SELECT * FROM per ORDER BY queue, channel
    LOOP
        messages := messages + r.n;
        IF r.s > 0 THEN
            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, r.s, 0);
        END IF;
    END LOOP;
    -- the next sweep starts at the first message with a time to live still here and past it
    -- (held by a consumer), else now
    IF messages < p_limit THEN
        v_from := coalesce((
            SELECT x.expires_at FROM {schema}.message x
            WHERE x.expires_at >= v_d.expire_from AND x.expires_at <= v_now
            ORDER BY x.expires_at LIMIT 1), v_now);
        IF v_from > v_d.expire_from THEN
            INSERT INTO {schema}.discovery
                (snap, folded, taken_at, folded_at, queues, turn_from, lock_from, lock_next, lock_id,
                 expire_from, pend_queue, pend_channel, pend_prio, pend_at, pend_id)
            VALUES (v_d.snap, v_d.folded, v_d.taken_at, v_d.folded_at, v_d.queues,
                    v_d.turn_from, v_d.lock_from, v_d.lock_next, v_d.lock_id, v_from, v_d.pend_queue,
                    v_d.pend_channel, v_d.pend_prio, v_d.pend_at, v_d.pend_id);
            DELETE FROM {schema}.discovery d WHERE d.id = v_d.id;
        END IF;
    END IF;
    -- consumers not heard of for three of their beats: their process is gone (killed, or
    -- cut off); an auto_delete queue goes with its last one (see consumer_sync_v1). (Since
    -- the server started, at the earliest: after a restart, every client is given that long
    -- to come back.)
    SELECT array_agg(DISTINCT c.queue) INTO v_stale FROM {schema}.consumer c
    WHERE greatest(c.seen_at, pg_postmaster_start_time())
          < v_now - 3 * c.beat_ms * interval '1 millisecond';
    IF v_stale IS NOT NULL THEN
        PERFORM 1 FROM {schema}.queue q WHERE q.name = ANY (v_stale) AND q.auto_delete
        ORDER BY q.name FOR UPDATE;
        DELETE FROM {schema}.consumer c
        WHERE greatest(c.seen_at, pg_postmaster_start_time())
              < v_now - 3 * c.beat_ms * interval '1 millisecond';
        queues := queues + cardinality({schema}.queue_auto_delete_v1(v_stale));
    END IF;
    FOR r IN
        SELECT q.name, q.expires_ms FROM {schema}.queue q
        WHERE q.expires_ms IS NOT NULL
          AND q.used_at < v_now - q.expires_ms * interval '1 millisecond'
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(r.name);
        PERFORM {schema}.queue_forget_v1(r.name, r.expires_ms, 'expired');
        queues := queues + 1;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.housekeep_v1(p_limit integer, OUT dead_pruned bigint)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_shortest bigint;
BEGIN
    SELECT least(min(q.dead_retention_ms), 1209600000) INTO v_shortest FROM {schema}.queue q;
    WITH old AS (
        SELECT d.id FROM {schema}.dead_message d
        LEFT JOIN {schema}.queue q ON q.name = d.queue
        WHERE d.dead_at < v_now - coalesce(v_shortest, 1209600000) * interval '1 millisecond'
          AND d.dead_at < v_now - coalesce(q.dead_retention_ms, 1209600000)
              * interval '1 millisecond'
        ORDER BY d.dead_at
        LIMIT p_limit
    ), gone AS (
        DELETE FROM {schema}.dead_message d WHERE d.id = ANY (ARRAY(SELECT o.id FROM old o))
        RETURNING 1
    )
    SELECT count(*) INTO dead_pruned FROM gone;
    -- queues that went a day ago: a publish to their name creates them again
    DELETE FROM {schema}.queue_gone g WHERE g.name = ANY (ARRAY(
        SELECT o.name FROM {schema}.queue_gone o
        WHERE o.gone_at < v_now - interval '1 day' ORDER BY o.gone_at LIMIT p_limit));
    PERFORM {schema}.ingest_v1(ARRAY[]::text[], true, true);
    -- channels empty for 5 minutes: their lanes and counts go
    -- (at most 1,000 a call: each takes a lane key, a slot of the server's lock table)
    PERFORM {schema}.lane_prune_v1(LEAST(p_limit, 1000), interval '5 minutes');
END;
$$;

-- Messages (and dead letters) by id after p_after, at most p_limit, filtered by queue,
-- channel and state; or, with p_order 'due', the live messages (not the dead letters) in the
-- order they fall due, after (p_after_at, p_after). With p_peek > 0, the first p_peek bytes of
-- each one's content (`head`) and, when it is longer, its last p_peek bytes (`tail`): where a
-- Kombu message keeps its headers (a Celery task's name and arguments).
CREATE FUNCTION {schema}.message_list_v2(
    p_queue text, p_channel text, p_state text, p_after bigint, p_limit integer,
    p_order text, p_after_at timestamptz, p_peek integer
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    priority smallint, attempts integer, state text, dequeue_at timestamptz,
    locked_until timestamptz, created_at timestamptz, dead_at timestamptz, reason text,
    size integer, head bytea, tail bytea
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    IF p_state IS NOT NULL AND p_state NOT IN ('ready', 'delayed', 'locked', 'dead') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('unknown message state %L (ready, delayed, locked or dead)', p_state);
    END IF;
    IF p_order IS NULL OR p_order NOT IN ('id', 'due') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('unknown message order %L (id or due)', p_order);
    END IF;
    IF p_order = 'due' THEN
        IF p_state = 'dead' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = 'dead letters are not due: list them by id';
        END IF;
        -- (a statement of its own per filter, planned with its values: a queue's or a
        -- channel's messages from message_ready_idx, not every message)
        RETURN QUERY EXECUTE format(
            'SELECT m.id, m.queue::text, m.channel::text, m.name, m.priority, m.attempts,
                    CASE WHEN m.locked_until IS NOT NULL THEN %L
                         WHEN m.dequeue_at > $5 THEN %L ELSE %L END,
                    m.dequeue_at, m.locked_until, m.created_at, NULL::timestamptz, NULL::text,
                    length(m.content),
                    CASE WHEN $7 > 0 THEN substring(m.content FROM 1 FOR $7) END,
                    CASE WHEN $7 > 0 AND length(m.content) > $7
                         THEN substring(m.content FROM greatest($7 + 1, length(m.content) - $7 + 1))
                    END
             FROM {schema}.message m
             WHERE (m.dequeue_at, m.id) > ($3, $4) %s %s %s
             ORDER BY m.dequeue_at, m.id
             LIMIT $6',
            'locked', 'delayed', 'ready',
            CASE p_state
                WHEN 'ready' THEN 'AND m.locked_until IS NULL AND m.dequeue_at <= $5'
                WHEN 'delayed' THEN 'AND m.locked_until IS NULL AND m.dequeue_at > $5'
                WHEN 'locked' THEN 'AND m.locked_until IS NOT NULL'
                ELSE '' END,
            CASE WHEN p_queue IS NULL THEN '' ELSE 'AND m.queue = $1' END,
            CASE WHEN p_channel IS NULL THEN '' ELSE 'AND m.channel = $2' END)
        USING p_queue, p_channel, coalesce(p_after_at, '-infinity'::timestamptz), p_after,
              v_now, p_limit, p_peek;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT x.* FROM (
            (SELECT m.id, m.queue::text, m.channel::text, m.name, m.priority, m.attempts,
                    CASE WHEN m.locked_until IS NOT NULL THEN 'locked'
                         WHEN m.dequeue_at > v_now THEN 'delayed'
                         ELSE 'ready' END,
                    m.dequeue_at, m.locked_until, m.created_at, NULL::timestamptz, NULL::text,
                    length(m.content),
                    CASE WHEN p_peek > 0 THEN substring(m.content FROM 1 FOR p_peek) END,
                    CASE WHEN p_peek > 0 AND length(m.content) > p_peek
                         THEN substring(m.content
                                        FROM greatest(p_peek + 1, length(m.content) - p_peek + 1))
                    END
             FROM {schema}.message m
             WHERE m.id > p_after
               AND (p_queue IS NULL OR m.queue = p_queue)
               AND (p_channel IS NULL OR m.channel = p_channel)
               AND (p_state IS NULL
                    OR (p_state = 'locked' AND m.locked_until IS NOT NULL)
                    OR (p_state = 'delayed' AND m.locked_until IS NULL AND m.dequeue_at > v_now)
                    OR (p_state = 'ready' AND m.locked_until IS NULL AND m.dequeue_at <= v_now))
             ORDER BY m.id
             LIMIT p_limit)
            UNION ALL
            (SELECT d.id, d.queue::text, d.channel::text, d.name, d.priority, d.attempts,
                    'dead'::text, NULL::timestamptz, NULL::timestamptz, d.created_at, d.dead_at,
                    d.reason, length(d.content),
                    CASE WHEN p_peek > 0 THEN substring(d.content FROM 1 FOR p_peek) END,
                    CASE WHEN p_peek > 0 AND length(d.content) > p_peek
                         THEN substring(d.content
                                        FROM greatest(p_peek + 1, length(d.content) - p_peek + 1))
                    END
             FROM {schema}.dead_message d
             WHERE d.id > p_after
               AND (p_queue IS NULL OR d.queue = p_queue)
               AND (p_channel IS NULL OR d.channel = p_channel)
               AND (p_state IS NULL OR p_state = 'dead')
             ORDER BY d.id
             LIMIT p_limit)
        ) AS x
        ORDER BY 1
        LIMIT p_limit;
END;
$$;

-- Messages and dead letters by id (clients of schema versions 3 to 9): message_list_v2's.
CREATE OR REPLACE FUNCTION {schema}.message_list_v1(
    p_queue text, p_channel text, p_state text, p_after bigint, p_limit integer
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    priority smallint, attempts integer, state text, dequeue_at timestamptz,
    locked_until timestamptz, created_at timestamptz, dead_at timestamptz, reason text,
    size integer
)
LANGUAGE sql STABLE AS $$
    SELECT l.message_id, l.queue_name, l.channel_name, l.message_name, l.priority, l.attempts,
           l.state, l.dequeue_at, l.locked_until, l.created_at, l.dead_at, l.reason, l.size
    FROM {schema}.message_list_v2(p_queue, p_channel, p_state, p_after, p_limit, 'id', NULL, 0)
        AS l;
$$;

-- The channels of a queue, largest first, with their policies (rates too), counters, the
-- state of their rate: deliveries allowed now (`tokens`) and, when none is, when the next one
-- is (`next_token_at`); and since when their oldest ready message has been due.
-- With p_channel: that channel alone (whatever it holds).
CREATE FUNCTION {schema}.channel_list_v3(p_queue text, p_limit integer, p_channel text)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint, rate_count integer, rate_per_ms bigint, burst integer,
    tokens integer, next_token_at timestamptz, oldest_ready_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    -- what committed since the ingest's snapshot (a lane's turn after a freed slot, say)
    PERFORM {schema}.ingest_v1(ARRAY[p_queue], false, false);
    RETURN QUERY
    WITH t AS MATERIALIZED (SELECT * FROM {schema}.channel_totals_v1(p_queue)),
    c AS (
        SELECT coalesce(t.channel, ch.name) AS channel,
               coalesce(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged, 0) AS size,
               coalesce(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held, 0) AS in_flight,
               t.enqueued, t.delivered, t.acked, t.deferred, t.dead, t.expired, t.dropped,
               coalesce(ch.has_policy, false) AS has_policy
        FROM t FULL JOIN (SELECT * FROM {schema}.channel x WHERE x.queue = p_queue AND x.has_policy) AS ch
            ON ch.name = t.channel
    ),
    -- (the largest first, limited before the per-channel lookups: with them first, the top 50
    -- of 100,000 channels took 1,892 ms, limited first 326 ms)
    top AS MATERIALIZED (
        SELECT * FROM c
        WHERE CASE WHEN p_channel IS NULL THEN c.size > 0 OR c.has_policy
                   ELSE c.channel = p_channel END
        ORDER BY c.size DESC, c.in_flight DESC, c.channel
        LIMIT p_limit
    )
    SELECT top.channel, top.size::integer, top.in_flight::integer, lim.max_concurrency,
           lim.max_size, top.has_policy, l.turn_at, nullif(l.served_at, '-infinity'),
           coalesce(top.enqueued, 0), coalesce(top.delivered, 0), coalesce(top.acked, 0),
           coalesce(top.deferred, 0), coalesce(top.dead, 0), coalesce(top.expired, 0),
           coalesce(top.dropped, 0), lim.rate_count, lim.rate_per_ms, lim.burst, st.tokens,
           GREATEST(st.next_at, l.not_before),
           -- (its lane's positions: the due time of its first ready message per priority; at
           -- most that old, as a position may lag behind what was just taken)
           (SELECT min(p.at) FROM unnest(l.pos_at) AS p(at) WHERE p.at <= v_now)
    FROM top
    CROSS JOIN LATERAL {schema}.channel_limits_v2(p_queue, top.channel) AS lim
    LEFT JOIN LATERAL {schema}.lane_get_v1(p_queue, top.channel) AS l ON true
    LEFT JOIN {schema}.channel ch ON ch.queue = p_queue AND ch.name = top.channel
    LEFT JOIN LATERAL {schema}.rate_state_v1(ch.rate_tat, ch.rate_interval, lim.rate_count,
                                             lim.rate_per_ms, lim.burst, v_now) AS st ON true
    ORDER BY top.size DESC, top.in_flight DESC, top.channel;
END;
$$;

-- The largest channels of a queue (clients of schema versions 8 and 9): channel_list_v3's.
CREATE OR REPLACE FUNCTION {schema}.channel_list_v2(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint, rate_count integer, rate_per_ms bigint, burst integer,
    tokens integer, next_token_at timestamptz, oldest_ready_at timestamptz
)
LANGUAGE sql AS $$
    SELECT * FROM {schema}.channel_list_v3(p_queue, p_limit, NULL);
$$;

-- Rights: the new functions are not executable by PUBLIC (lonnymq.grant gives them to the
-- roles of their kind); the entry points run as the schema's owner (the replaced ones get
-- their settings again: CREATE OR REPLACE reset them).
REVOKE ALL ON FUNCTION {schema}.queue_forget_v1(text, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_auto_delete_v1(text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.consumer_sync_v1(uuid, text, integer, text, integer, text[], text[], boolean[], integer[], timestamptz[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.consumer_list_v1(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.message_list_v2(text, text, text, bigint, integer, text, timestamptz, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION {schema}.channel_list_v3(text, integer, text) FROM PUBLIC;

ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_create_many_v1(text[], text[], text[], bytea[], integer[], bigint[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_publish_v1(text, text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.expire_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.housekeep_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_list_v1(text, text, text, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_list_v2(text, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_list_v3(text, integer, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.consumer_sync_v1(uuid, text, integer, text, integer, text[], text[], boolean[], integer[], timestamptz[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.consumer_list_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_list_v2(text, text, text, bigint, integer, text, timestamptz, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

-- Roles granted a kind of rights before this migration get the new functions of their kind
-- (see lonnymq.roles): whoever may declare queues may declare them with the new arguments
-- and list consumers; whoever may dequeue registers its consumers; whoever may list
-- messages lists them in due order, and an admin reads the new tables (as every table).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role, p.proname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname IN ('queue_declare_v1', 'message_dequeue_v3', 'message_get_v1')
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        IF r.proname = 'queue_declare_v1' THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s, %s TO %s',
                '{schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)'::regprocedure,
                '{schema}.consumer_list_v1(text)'::regprocedure, r.role);
        ELSIF r.proname = 'message_dequeue_v3' THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
                '{schema}.consumer_sync_v1(uuid, text, integer, text, integer, text[], text[], boolean[], integer[], timestamptz[])'::regprocedure,
                r.role);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s, %s TO %s',
                '{schema}.message_list_v2(text, text, text, bigint, integer, text, timestamptz, integer)'::regprocedure,
                '{schema}.channel_list_v3(text, integer, text)'::regprocedure, r.role);
            EXECUTE format('GRANT SELECT ON %s, %s TO %s', '{schema}.consumer'::regclass,
                '{schema}.queue_gone'::regclass, r.role);
        END IF;
    END LOOP;
END;
$$;
