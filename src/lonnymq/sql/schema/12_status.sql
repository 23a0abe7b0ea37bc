-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

-- ---------------------------------------------------------------------------------------------
-- 12. Status, inspection and operator functions
-- Status, channels, messages by id, dead letters, settings.
-- ---------------------------------------------------------------------------------------------

-- Every queue with its gauges, cumulative counters and settings. Splitting waiting messages
-- into ready and delayed (and finding the oldest ready one) reads them: O(messages waiting);
-- p_count_ready false skips it (those columns are then NULL).
CREATE FUNCTION {schema}.queue_status_v1(p_count_ready boolean)
RETURNS TABLE (
    queue_name text, total bigint, in_flight bigint, ready bigint, delayed bigint,
    oldest_ready_at timestamptz, dead bigint, channels bigint,
    enqueued bigint, delivered bigint, redelivered bigint, acked bigint, deferred bigint,
    dead_lettered bigint, expired bigint, dropped bigint,
    max_concurrency integer, max_size integer, max_attempts integer, dead_letter boolean,
    dead_retention_ms bigint
)
LANGUAGE sql STABLE AS $$
    WITH t AS MATERIALIZED (SELECT * FROM {schema}.channel_totals_v1(NULL)),
    per AS (
        SELECT t.queue,
               sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged) AS total,
               sum(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                   - t.removed_held) AS in_flight,
               count(*) FILTER (WHERE t.enqueued - t.acked - t.dead - t.expired - t.removed
                                      - t.purged > 0) AS channels,
               sum(t.enqueued) AS enqueued, sum(t.delivered) AS delivered,
               sum(t.redelivered) AS redelivered, sum(t.acked) AS acked,
               sum(t.deferred) AS deferred, sum(t.dead) AS dead, sum(t.expired) AS expired,
               sum(t.dropped) AS dropped
        FROM t GROUP BY t.queue
    ), w AS MATERIALIZED (
        SELECT * FROM {schema}.queue_waiting_v1(NULL) WHERE p_count_ready
    )
    SELECT q.name, coalesce(per.total, 0)::bigint, coalesce(per.in_flight, 0)::bigint,
           CASE WHEN p_count_ready THEN coalesce(w.ready, 0) END,
           CASE WHEN p_count_ready THEN coalesce(w.delayed, 0) END,
           w.oldest_ready_at,
           (SELECT count(*) FROM {schema}.dead_message d WHERE d.queue = q.name),
           coalesce(per.channels, 0)::bigint,
           (coalesce(per.enqueued, 0) + coalesce(qc.enqueued, 0))::bigint,
           (coalesce(per.delivered, 0) + coalesce(qc.delivered, 0))::bigint,
           (coalesce(per.redelivered, 0) + coalesce(qc.redelivered, 0))::bigint,
           (coalesce(per.acked, 0) + coalesce(qc.acked, 0))::bigint,
           (coalesce(per.deferred, 0) + coalesce(qc.deferred, 0))::bigint,
           (coalesce(per.dead, 0) + coalesce(qc.dead, 0))::bigint,
           (coalesce(per.expired, 0) + coalesce(qc.expired, 0))::bigint,
           (coalesce(per.dropped, 0) + coalesce(qc.dropped, 0))::bigint,
           q.max_concurrency, q.max_size, q.max_attempts, q.dead_letter, q.dead_retention_ms
    FROM (
        SELECT q.name, q.max_concurrency, q.max_size, q.max_attempts, q.dead_letter,
               q.dead_retention_ms
        FROM {schema}.queue q
        UNION ALL
        -- queues with messages and no row yet (nothing ingested them)
        SELECT p.queue, NULL, NULL, 20, true, 1209600000 FROM per p
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = p.queue)
    ) AS q
    LEFT JOIN per ON per.queue = q.name
    LEFT JOIN {schema}.queue_count qc ON qc.queue = q.name
    LEFT JOIN w ON w.queue = q.name
    ORDER BY q.name;
$$;

-- What holds back the database's cleanup horizon, oldest first: sessions of this database
-- with a snapshot or a transaction id (a transaction left idle, a long report, pg_dump),
-- prepared transactions and replication slots (a standby with hot_standby_feedback). Rows
-- deleted since they began stay, dead, until they end: lonnymq's scans start past them, but
-- its tables grow. Sessions of other roles show only if the schema's owner may read them
-- (pg_read_all_stats); a row of kind 'hidden' counts those it may not.
CREATE FUNCTION {schema}.horizon_v1(p_limit integer)
RETURNS TABLE (
    kind text, pid integer, application_name text, state text, since timestamptz,
    age_s double precision, xid_age integer, detail text
)
LANGUAGE sql STABLE AS $$
    SELECT h.* FROM (
        SELECT 'session'::text AS kind, a.pid, a.application_name::text, a.state,
               coalesce(a.xact_start, a.backend_start) AS since,
               extract(epoch FROM clock_timestamp() - coalesce(a.xact_start, a.backend_start))::double precision AS age_s,
               GREATEST(age(a.backend_xmin), age(a.backend_xid)) AS xid_age, left(a.query, 200) AS detail
        FROM pg_catalog.pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
          AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
        UNION ALL
        SELECT 'prepared', NULL, p.gid, 'prepared', p.prepared,
               extract(epoch FROM clock_timestamp() - p.prepared), age(p.transaction),
               p.owner::text
        FROM pg_catalog.pg_prepared_xacts p
        WHERE p.database = current_database()
        UNION ALL
        SELECT 'slot', s.active_pid, s.slot_name, CASE WHEN s.active THEN 'active' ELSE 'inactive' END,
               NULL, NULL, GREATEST(age(s.xmin), age(s.catalog_xmin)), s.slot_type
        FROM pg_catalog.pg_replication_slots s
        WHERE s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL
        UNION ALL
        SELECT 'hidden', NULL, NULL, NULL, NULL, NULL, NULL, count(*)::text
        FROM pg_catalog.pg_stat_activity a
        WHERE a.datname = current_database() AND a.query = '<insufficient privilege>'
        HAVING count(*) > 0
    ) AS h
    ORDER BY h.xid_age DESC NULLS LAST, h.age_s DESC NULLS LAST
    LIMIT p_limit
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
CREATE FUNCTION {schema}.channel_list_v2(p_queue text, p_limit integer)
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

-- A channel's own policy, the queue default (rates too), its gauges (messages held, in flight)
-- and the state of its rate.
CREATE FUNCTION {schema}.channel_get_v2(p_queue text, p_channel text)
RETURNS TABLE (
    has_policy boolean, own_max_concurrency integer, own_max_size integer,
    max_concurrency integer, max_size integer, size bigint, in_flight bigint,
    own_rate_count integer, own_rate_per_ms bigint, own_burst integer, rate_count integer,
    rate_per_ms bigint, burst integer, tokens integer, next_token_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT g.*, c.own_rate_count, c.own_rate_per_ms, c.own_burst, q.rate_count, q.rate_per_ms,
           q.burst, st.tokens, GREATEST(st.next_at, l.not_before)
    FROM {schema}.channel_get_v1(p_queue, p_channel) AS g
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel AND c.has_policy
    CROSS JOIN LATERAL {schema}.channel_limits_v2(p_queue, p_channel) AS lim
    LEFT JOIN {schema}.channel ch ON ch.queue = p_queue AND ch.name = p_channel
    LEFT JOIN LATERAL {schema}.rate_state_v1(ch.rate_tat, ch.rate_interval, lim.rate_count,
                                             lim.rate_per_ms, lim.burst, v_now) AS st ON true
    LEFT JOIN LATERAL {schema}.lane_get_v1(p_queue, p_channel) AS l ON true;
END;
$$;

-- Per queue, the channels whose rate holds back messages that are due now (their lane waits
-- for its next token), and how many such messages they hold ready (read from the lanes'
-- positions: O(messages they hold)).
CREATE FUNCTION {schema}.rate_held_v1()
RETURNS TABLE (queue_name text, channels bigint, messages bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    SELECT l.queue::text, count(*), coalesce(sum(n.ready), 0)::bigint
    FROM (
        SELECT DISTINCT ON (x.queue, x.channel) x.*
        FROM {schema}.lane x WHERE x.limited
        ORDER BY x.queue, x.channel, x.id DESC
    ) AS l
    CROSS JOIN LATERAL (
        SELECT count(*) AS ready
        FROM unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
        CROSS JOIN LATERAL (
            SELECT 1 FROM {schema}.message m
            WHERE m.queue = l.queue AND m.channel = l.channel AND m.locked_until IS NULL
              AND m.priority = p.prio AND (m.dequeue_at, m.id) >= (p.at, p.pid)
              AND m.dequeue_at <= v_now
        ) AS m
    ) AS n
    WHERE l.not_before > v_now AND n.ready > 0
    GROUP BY l.queue;
END;
$$;

-- A channel's own policy, the queue default, and its gauges (messages held, in flight).
CREATE FUNCTION {schema}.channel_get_v1(p_queue text, p_channel text)
RETURNS TABLE (
    has_policy boolean, own_max_concurrency integer, own_max_size integer,
    max_concurrency integer, max_size integer, size bigint, in_flight bigint
)
LANGUAGE sql STABLE AS $$
    SELECT coalesce(c.has_policy, false), c.own_max_concurrency, c.own_max_size,
           q.max_concurrency, q.max_size,
           (SELECT coalesce(sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged), 0)
            FROM {schema}.channel_totals_v1(p_queue) AS t WHERE t.channel = p_channel)::bigint,
           (SELECT coalesce(sum(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                                - t.removed_held), 0)
            FROM {schema}.channel_totals_v1(p_queue) AS t WHERE t.channel = p_channel)::bigint
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel
    WHERE q.name IS NOT NULL OR c.name IS NOT NULL;
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
CREATE FUNCTION {schema}.message_list_v1(
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

-- One message, live or dead, with its content and saved state (no row: not found).
CREATE FUNCTION {schema}.message_get_v1(p_id bigint)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    priority smallint, attempts integer, state text, dequeue_at timestamptz,
    locked_until timestamptz, expires_at timestamptz, created_at timestamptz,
    dead_at timestamptz, reason text, content bytea, saved_state bytea
)
LANGUAGE sql STABLE AS $$
    SELECT m.id, m.queue::text, m.channel::text, m.name, m.priority, m.attempts,
           CASE WHEN m.locked_until IS NOT NULL THEN 'locked'
                WHEN m.dequeue_at > clock_timestamp() THEN 'delayed'
                ELSE 'ready' END,
           m.dequeue_at, m.locked_until, m.expires_at, m.created_at, NULL::timestamptz,
           NULL::text, m.content, m.state
    FROM {schema}.message m
    WHERE m.id = p_id
    UNION ALL
    SELECT d.id, d.queue::text, d.channel::text, d.name, d.priority, d.attempts, 'dead', NULL,
           NULL, NULL, d.created_at, d.dead_at, d.reason, d.content, d.state
    FROM {schema}.dead_message d
    WHERE d.id = p_id;
$$;

-- Delete messages by id, whatever their state (a held one's holder then finds it gone), and
-- dead letters. result_code per id: 'deleted' or 'not_found'.
CREATE FUNCTION {schema}.message_remove_v1(p_ids bigint[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql AS $$
DECLARE
    v_d {schema}.discovery;
    v_gone bigint[] := ARRAY[]::bigint[];
    v_dead bigint[];
    r record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.message m WHERE m.id = ANY (p_ids)
            RETURNING m.id, m.queue, m.channel, m.locked_until IS NOT NULL AS held, m.sized,
                      m.slotted,
                      m.arrival = 0 AND m.locked_until IS NULL
                      AND NOT pg_visible_in_snapshot(m.txid, v_d.snap) AS fresh
        ), per AS (
            SELECT g.queue, g.channel, array_agg(g.id) AS ids, count(*)::integer AS n,
                   count(*) FILTER (WHERE g.held)::integer AS h,
                   count(*) FILTER (WHERE g.sized)::integer AS s,
                   count(*) FILTER (WHERE g.slotted)::integer AS l,
                   count(*) FILTER (WHERE g.fresh)::integer AS f
            FROM gone g GROUP BY g.queue, g.channel
        ), counted AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, removed, removed_held)
            SELECT p.queue, p.channel, p.f, p.n, p.h FROM per p
        )
        SELECT * FROM per ORDER BY queue, channel
    LOOP
        v_gone := v_gone || r.ids;
        IF r.s > 0 OR r.l > 0 THEN
            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, r.s, r.l);
        END IF;
    END LOOP;
    WITH dead AS (
        DELETE FROM {schema}.dead_message d WHERE d.id = ANY (p_ids) RETURNING d.id
    )
    SELECT array_agg(d.id) INTO v_dead FROM dead d;
    RETURN QUERY
        SELECT h.id,
               CASE WHEN h.id = ANY (v_gone) OR h.id = ANY (coalesce(v_dead, ARRAY[]::bigint[]))
                    THEN 'deleted' ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
END;
$$;

-- A kombu payload (JSON) whose headers carry an `eta` (Celery's delayed tasks), with that
-- header made to agree with the message's due time: p_at as ISO 8601 in UTC, or JSON null
-- (what Celery writes for a task without one) when p_at is NULL, the message being due now.
-- A worker goes by the header, not by the database: a task made due now whose header kept
-- its old eta would wait in the worker until then. Any other content comes back unchanged.
CREATE FUNCTION {schema}.message_eta_v1(p_content bytea, p_at timestamptz) RETURNS bytea
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

-- Retry messages by id: a dead letter goes back to its queue and channel as a new message
-- (attempts start again; 'retried', new_id), a delayed message becomes due now ('due_now',
-- its Celery eta header cleared: message_eta_v1).
-- Otherwise: 'ready' (nothing to do), 'locked' (a consumer holds it), 'channel_full' or
-- 'deduplicated' (a never-delivered message of the same name waits, new_id; the dead letter
-- stays in both cases), 'not_found'.
CREATE FUNCTION {schema}.message_retry_v1(p_ids bigint[])
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
CREATE FUNCTION {schema}.message_update_v1(
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

-- Delete the dead letters of a queue; returns how many.
CREATE FUNCTION {schema}.dead_purge_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint;
BEGIN
    DELETE FROM {schema}.dead_message d WHERE d.queue = p_queue;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END;
$$;

-- Change a queue's settings (created with the defaults if new). p_settings holds any of:
-- dead_letter (boolean), max_attempts (integer > 0, or null: no limit), dead_retention_ms
-- (integer > 0). Other keys are refused.
CREATE FUNCTION {schema}.queue_configure_v1(p_queue text, p_settings jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_key text;
BEGIN
    IF jsonb_typeof(p_settings) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'queue settings must be an object';
    END IF;
    FOR v_key IN SELECT jsonb_object_keys(p_settings) LOOP
        IF v_key NOT IN ('dead_letter', 'max_attempts', 'dead_retention_ms') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('unknown queue setting %L', v_key);
        END IF;
    END LOOP;
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        dead_letter = CASE WHEN p_settings ? 'dead_letter'
            THEN (p_settings ->> 'dead_letter')::boolean ELSE q.dead_letter END,
        max_attempts = CASE WHEN p_settings ? 'max_attempts'
            THEN (p_settings ->> 'max_attempts')::integer ELSE q.max_attempts END,
        dead_retention_ms = CASE WHEN p_settings ? 'dead_retention_ms'
            THEN (p_settings ->> 'dead_retention_ms')::bigint ELSE q.dead_retention_ms END
    WHERE q.id = v_queue_id;
END;
$$;

