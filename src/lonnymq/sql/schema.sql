-- lonnymq schema: the full current version, used for a fresh install.
--
-- Placeholders filled in by lonnymq.migrations through psycopg.sql composition:
--   {{schema}}      the schema, as a quoted identifier
--   {{wake}}        the NOTIFY channel of this schema, as a string literal
--   {{lock_prefix}} the prefix of this schema's advisory lock keys, as a string literal
-- Every object is qualified with the schema; nothing relies on search_path.
--
-- The model (see docs/design.md):
--   queue    one row per Kombu queue, holding the queue-wide default channel policy.
--   channel  one row per (queue, channel) that holds messages or has a policy of its own.
--            It carries the effective policy, exact counters and the round-robin key
--            `waiting_since`: the time since which the channel has been waiting for its next
--            turn, or NULL when it has nothing to hand out (no unlocked message, or it is at
--            max_concurrency). Dequeue serves channels in waiting_since order.
--   message  one row per message; locked while a consumer holds it (locked_until, lock_token).

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE {schema}.migration (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.queue (
    id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    max_concurrency integer CHECK (max_concurrency >= 0),
    max_size integer CHECK (max_size >= 0),
    -- Kombu queue arguments: x-expires (delete the queue when unused that long) and
    -- x-message-ttl (drop messages not delivered within it)
    expires_ms bigint CHECK (expires_ms > 0),
    message_ttl_ms bigint CHECK (message_ttl_ms >= 0),
    used_at timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(),
    name text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 255),
    -- dead letters on or off, deliveries before a message is dead-lettered (NULL: no
    -- limit), how long dead letters are kept
    dead_letter boolean NOT NULL DEFAULT true,
    max_attempts integer DEFAULT 20 CHECK (max_attempts > 0),
    dead_retention_ms bigint NOT NULL DEFAULT 1209600000 CHECK (dead_retention_ms > 0)
);

CREATE INDEX queue_expiring_idx ON {schema}.queue (used_at) WHERE expires_ms IS NOT NULL;

CREATE TABLE {schema}.exchange (
    name text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 255),
    type text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    durable boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.binding (
    exchange text NOT NULL,
    routing_key text NOT NULL,
    queue text NOT NULL CHECK (length(queue) BETWEEN 1 AND 255),
    -- topic exchanges: the routing key as a regular expression (kombu's translation)
    pattern text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

CREATE TABLE {schema}.channel (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue_id integer NOT NULL,
    current_size integer NOT NULL DEFAULT 0 CHECK (current_size >= 0),
    current_concurrency integer NOT NULL DEFAULT 0 CHECK (current_concurrency >= 0),
    -- effective policy: the channel's own when has_policy, else the queue default
    max_concurrency integer,
    max_size integer,
    has_policy boolean NOT NULL DEFAULT false,
    own_max_concurrency integer CHECK (own_max_concurrency >= 0),
    own_max_size integer CHECK (own_max_size >= 0),
    served_at timestamptz NOT NULL DEFAULT '-infinity',
    waiting_since timestamptz,
    name text NOT NULL CHECK (length(name) BETWEEN 1 AND 255),
    UNIQUE (queue_id, name),
    -- cumulative counters, carried on the row every operation updates anyway
    n_enqueued bigint NOT NULL DEFAULT 0,
    n_delivered bigint NOT NULL DEFAULT 0,
    n_acked bigint NOT NULL DEFAULT 0,
    n_deferred bigint NOT NULL DEFAULT 0,
    n_dead bigint NOT NULL DEFAULT 0,
    n_expired bigint NOT NULL DEFAULT 0,
    n_dropped bigint NOT NULL DEFAULT 0
);

CREATE INDEX channel_waiting_idx ON {schema}.channel (queue_id, waiting_since, id)
    WHERE waiting_since IS NOT NULL;

CREATE TABLE {schema}.message (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel_id bigint NOT NULL,
    queue_id integer NOT NULL,
    priority smallint NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 255),
    attempts integer NOT NULL DEFAULT 0,
    dequeue_at timestamptz NOT NULL,
    locked_until timestamptz,
    lock_token uuid,
    expires_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    name text CHECK (length(name) BETWEEN 1 AND 255),
    content bytea NOT NULL,
    state bytea
);

-- Unlocked messages of a channel in the order they are handed out.
CREATE INDEX message_ready_idx ON {schema}.message (channel_id, priority DESC, dequeue_at, id)
    WHERE locked_until IS NULL;
-- Locked messages of a queue, oldest lock expiry first.
CREATE INDEX message_locked_idx ON {schema}.message (queue_id, locked_until)
    WHERE locked_until IS NOT NULL;
-- De-duplication: one never-dequeued message per (channel, name).
CREATE UNIQUE INDEX message_name_idx ON {schema}.message (channel_id, name)
    WHERE name IS NOT NULL AND attempts = 0;
-- Messages with a time to live, soonest expiry first.
CREATE INDEX message_expires_idx ON {schema}.message (expires_at) WHERE expires_at IS NOT NULL;

-- Counters of channels that are gone (a channel row is deleted when it empties) and of
-- events that touch no channel row (redeliveries after a lock expired): insert-only, so no
-- operation ever waits on it; housekeep_v1 folds the rows of a queue into one.
CREATE TABLE {schema}.counter (
    queue_id integer NOT NULL,
    enqueued bigint NOT NULL DEFAULT 0,
    delivered bigint NOT NULL DEFAULT 0,
    redelivered bigint NOT NULL DEFAULT 0,
    acked bigint NOT NULL DEFAULT 0,
    deferred bigint NOT NULL DEFAULT 0,
    dead bigint NOT NULL DEFAULT 0,
    expired bigint NOT NULL DEFAULT 0,
    dropped bigint NOT NULL DEFAULT 0
);

-- Dead letters: messages rejected without requeue, or delivered max_attempts times.
CREATE TABLE {schema}.dead_message (
    id bigint PRIMARY KEY,
    queue text NOT NULL,
    channel text NOT NULL,
    name text,
    priority smallint NOT NULL,
    attempts integer NOT NULL,
    reason text NOT NULL,
    created_at timestamptz NOT NULL,
    dead_at timestamptz NOT NULL,
    content bytea NOT NULL,
    state bytea
);

CREATE INDEX dead_message_queue_idx ON {schema}.dead_message (queue, id);
CREATE INDEX dead_message_dead_at_idx ON {schema}.dead_message (dead_at);


-- The id of a queue, created on first use.
CREATE FUNCTION {schema}.queue_ensure_v1(p_queue text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_id integer;
BEGIN
    SELECT q.id INTO v_id FROM {schema}.queue q WHERE q.name = p_queue;
    IF v_id IS NULL THEN
        INSERT INTO {schema}.queue (name) VALUES (p_queue)
        ON CONFLICT (name) DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NULL THEN
            SELECT q.id INTO v_id FROM {schema}.queue q WHERE q.name = p_queue;
        END IF;
    END IF;
    RETURN v_id;
END;
$$;


-- The earliest dequeue_at among a channel's unlocked messages (NULL if none).
-- One index descent per distinct priority present in the channel.
CREATE FUNCTION {schema}.channel_next_due_v1(p_channel_id bigint) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_priority smallint;
    v_at timestamptz;
    v_min timestamptz;
BEGIN
    SELECT m.priority, m.dequeue_at INTO v_priority, v_at
    FROM {schema}.message m
    WHERE m.channel_id = p_channel_id AND m.locked_until IS NULL
    ORDER BY m.priority DESC, m.dequeue_at, m.id
    LIMIT 1;
    WHILE v_priority IS NOT NULL LOOP
        v_min := LEAST(v_min, v_at);
        SELECT m.priority, m.dequeue_at INTO v_priority, v_at
        FROM {schema}.message m
        WHERE m.channel_id = p_channel_id AND m.locked_until IS NULL AND m.priority < v_priority
        ORDER BY m.priority DESC, m.dequeue_at, m.id
        LIMIT 1;
    END LOOP;
    RETURN v_min;
END;
$$;


-- The waiting_since a channel should have, from scratch.
CREATE FUNCTION {schema}.channel_waiting_v1(p_channel {schema}.channel) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_due timestamptz;
BEGIN
    IF p_channel.max_concurrency IS NOT NULL
       AND p_channel.current_concurrency >= p_channel.max_concurrency THEN
        RETURN NULL;
    END IF;
    v_due := {schema}.channel_next_due_v1(p_channel.id);
    IF v_due IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN GREATEST(v_due, p_channel.served_at);
END;
$$;


-- Lock the channel row of (queue, channel), creating it with the queue's default policy.
CREATE FUNCTION {schema}.channel_lock_v1(p_queue_id integer, p_channel text)
RETURNS {schema}.channel
LANGUAGE plpgsql AS $$
DECLARE
    v_channel {schema}.channel;
BEGIN
    LOOP
        SELECT * INTO v_channel FROM {schema}.channel c
        WHERE c.queue_id = p_queue_id AND c.name = p_channel
        FOR UPDATE;
        IF FOUND THEN
            RETURN v_channel;
        END IF;
        INSERT INTO {schema}.channel (queue_id, name, max_concurrency, max_size)
        SELECT p_queue_id, p_channel, q.max_concurrency, q.max_size
        FROM {schema}.queue q WHERE q.id = p_queue_id
        ON CONFLICT (queue_id, name) DO NOTHING
        RETURNING * INTO v_channel;
        IF v_channel.id IS NOT NULL THEN
            RETURN v_channel;
        END IF;
    END LOOP;
END;
$$;


-- Apply a channel row's new counters/policy; recompute waiting_since when saturation changed
-- (or when asked to), delete the row when it is empty and has no policy of its own (keeping
-- its cumulative counters in the counter table), and NOTIFY when the channel has something
-- to hand out that it did not have before.
CREATE FUNCTION {schema}.channel_store_v1(
    p_old {schema}.channel, p_new {schema}.channel, p_recompute boolean
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_saturated boolean;
    v_was_saturated boolean;
BEGIN
    IF p_new.current_size = 0 AND NOT p_new.has_policy THEN
        DELETE FROM {schema}.channel WHERE id = p_new.id;
        IF p_new.n_enqueued + p_new.n_delivered + p_new.n_acked + p_new.n_deferred
           + p_new.n_dead + p_new.n_expired + p_new.n_dropped > 0 THEN
            INSERT INTO {schema}.counter
                (queue_id, enqueued, delivered, acked, deferred, dead, expired, dropped)
            VALUES (p_new.queue_id, p_new.n_enqueued, p_new.n_delivered, p_new.n_acked,
                    p_new.n_deferred, p_new.n_dead, p_new.n_expired, p_new.n_dropped);
        END IF;
        RETURN;
    END IF;
    v_saturated := p_new.max_concurrency IS NOT NULL
        AND p_new.current_concurrency >= p_new.max_concurrency;
    v_was_saturated := p_old.max_concurrency IS NOT NULL
        AND p_old.current_concurrency >= p_old.max_concurrency;
    IF v_saturated THEN
        p_new.waiting_since := NULL;
    ELSIF p_recompute OR v_was_saturated THEN
        p_new.waiting_since := {schema}.channel_waiting_v1(p_new);
    END IF;
    UPDATE {schema}.channel SET
        current_size = p_new.current_size,
        current_concurrency = p_new.current_concurrency,
        max_concurrency = p_new.max_concurrency,
        max_size = p_new.max_size,
        has_policy = p_new.has_policy,
        own_max_concurrency = p_new.own_max_concurrency,
        own_max_size = p_new.own_max_size,
        served_at = p_new.served_at,
        waiting_since = p_new.waiting_since,
        n_enqueued = p_new.n_enqueued,
        n_delivered = p_new.n_delivered,
        n_acked = p_new.n_acked,
        n_deferred = p_new.n_deferred,
        n_dead = p_new.n_dead,
        n_expired = p_new.n_expired,
        n_dropped = p_new.n_dropped
    WHERE id = p_new.id;
    IF p_new.waiting_since IS NOT NULL
       AND (p_old.waiting_since IS NULL OR p_new.waiting_since < p_old.waiting_since) THEN
        PERFORM pg_notify({wake}, (SELECT q.name FROM {schema}.queue q WHERE q.id = p_new.queue_id));
    END IF;
END;
$$;


-- Create a message. result_code: 'created', 'deduplicated' (message_id is the existing one)
-- or 'dropped' (the channel is at max_size). p_ttl_ms (NULL: none): the message is dropped
-- if not dequeued within that time after it is due.
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
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_old {schema}.channel;
    v_new {schema}.channel;
    v_at timestamptz;
    v_due timestamptz;
    v_waiting timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended({lock_prefix} || p_queue, 0));
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    -- the channel row, locked (created by channel_lock_v1 when new)
    SELECT * INTO v_old FROM {schema}.channel c
    WHERE c.queue_id = v_queue_id AND c.name = p_channel FOR UPDATE;
    IF NOT FOUND THEN
        v_old := {schema}.channel_lock_v1(v_queue_id, p_channel);
    END IF;
    IF p_name IS NOT NULL THEN
        SELECT m.id INTO message_id FROM {schema}.message m
        WHERE m.channel_id = v_old.id AND m.name = p_name AND m.attempts = 0;
        IF message_id IS NOT NULL THEN
            result_code := 'deduplicated';
            RETURN;
        END IF;
    END IF;
    IF v_old.max_size IS NOT NULL AND v_old.current_size >= v_old.max_size THEN
        v_new := v_old;
        result_code := 'dropped';
        v_new.n_dropped := v_old.n_dropped + 1;
        -- a channel row created by this call and left empty must not linger
        PERFORM {schema}.channel_store_v1(v_old, v_new, false);
        RETURN;
    END IF;
    v_at := clock_timestamp() + p_delay_ms * interval '1 millisecond';
    INSERT INTO {schema}.message (channel_id, queue_id, priority, dequeue_at, expires_at, name, content)
    VALUES (v_old.id, v_queue_id, p_priority, v_at, v_at + p_ttl_ms * interval '1 millisecond',
            p_name, p_content)
    RETURNING id INTO message_id;
    -- the row's new counters and turn, written directly (this is channel_store_v1's work for
    -- a create, without its generality: one function call less on the hottest path)
    v_waiting := v_old.waiting_since;
    IF v_old.max_concurrency IS NULL OR v_old.current_concurrency < v_old.max_concurrency THEN
        v_due := GREATEST(v_at, v_old.served_at);
        IF v_waiting IS NULL OR v_due < v_waiting THEN
            v_waiting := v_due;
        END IF;
    END IF;
    UPDATE {schema}.channel SET
        current_size = v_old.current_size + 1,
        n_enqueued = v_old.n_enqueued + 1,
        waiting_since = v_waiting
    WHERE id = v_old.id;
    IF v_waiting IS DISTINCT FROM v_old.waiting_since THEN
        PERFORM pg_notify({wake}, p_queue);
    END IF;
    result_code := 'created';
END;
$$;


-- Up to p_limit unlocked, due messages of a channel, best first, with their rank.
-- Within a channel: highest priority, then earliest due, then oldest. One bounded index
-- range scan per distinct priority, so delayed messages are never scanned.
CREATE FUNCTION {schema}.channel_take_v1(p_channel_id bigint, p_limit integer, p_now timestamptz)
RETURNS SETOF bigint
LANGUAGE plpgsql STABLE ROWS 10 AS $$
DECLARE
    v_priority smallint;
    v_left integer := p_limit;
    v_n integer;
BEGIN
    SELECT m.priority INTO v_priority FROM {schema}.message m
    WHERE m.channel_id = p_channel_id AND m.locked_until IS NULL
    ORDER BY m.priority DESC, m.dequeue_at, m.id
    LIMIT 1;
    WHILE v_priority IS NOT NULL AND v_left > 0 LOOP
        RETURN QUERY
            SELECT m.id FROM {schema}.message m
            WHERE m.channel_id = p_channel_id AND m.locked_until IS NULL
              AND m.priority = v_priority AND m.dequeue_at <= p_now
            ORDER BY m.priority DESC, m.dequeue_at, m.id
            LIMIT v_left;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_left := v_left - v_n;
        EXIT WHEN v_left <= 0;
        SELECT m.priority INTO v_priority FROM {schema}.message m
        WHERE m.channel_id = p_channel_id AND m.locked_until IS NULL AND m.priority < v_priority
        ORDER BY m.priority DESC, m.dequeue_at, m.id
        LIMIT 1;
    END LOOP;
END;
$$;


-- Milliseconds until something in the given queues may become available: a channel's turn
-- (a delayed message falling due) or a lock expiring. NULL when nothing is pending.
CREATE FUNCTION {schema}.queue_retry_ms_v1(p_queue_ids integer[]) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_next timestamptz;
BEGIN
    SELECT LEAST(
        (SELECT min(w.at) FROM unnest(p_queue_ids) AS qid CROSS JOIN LATERAL (
            SELECT c.waiting_since AS at FROM {schema}.channel c
            WHERE c.queue_id = qid AND c.waiting_since IS NOT NULL
            ORDER BY c.waiting_since LIMIT 1) AS w),
        (SELECT min(l.at) FROM unnest(p_queue_ids) AS qid CROSS JOIN LATERAL (
            SELECT m.locked_until AS at FROM {schema}.message m
            WHERE m.queue_id = qid AND m.locked_until IS NOT NULL
            ORDER BY m.locked_until LIMIT 1) AS l)
    ) INTO v_next;
    IF v_next IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN GREATEST(0, ceil(extract(epoch FROM v_next - clock_timestamp()) * 1000))::bigint;
END;
$$;


-- Dequeue up to p_limit messages from the given queues and lock them for p_lock_ms.
-- Messages whose lock expired come first (their holder is gone); then channels with a due
-- message are served round-robin, the one waiting longest first, skipping channels at
-- max_concurrency. Rows come back in delivery order. When no message is available, one row
-- comes back with message_id NULL and retry_ms: milliseconds until something may become
-- available (NULL: nothing is pending). A message already delivered max_attempts times (of
-- its queue) is not delivered again: it goes to the dead letters and comes back as a row
-- with event 'dead' (no lock token, no content), for the caller's log. The event of a
-- delivered message is 'delivered', or 'redelivered' when its previous lock had expired.
CREATE FUNCTION {schema}.message_dequeue_v2(p_queues text[], p_limit integer, p_lock_ms bigint)
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
    retry_ms bigint,
    event text
)
-- Generic plans: re-planning a dozen statements on every call (custom plans) cost more than
-- executing them; tests/test_plans.py checks the generic plans use the indexes. lock_timeout:
-- see step 2; 10 ms (50 ms in version 1 gave a light tenant's message a 50-100 ms p99 when
-- its dequeue met a busy channel row).
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET lock_timeout = '10ms' AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_queue_ids integer[];
    v_queue_names text[];
    v_expired_locks boolean;
    v_got integer := 0;
    v_left integer;
    v_n integer;
    v_channels {schema}.channel[];
    v_cids bigint[];
    v_taken integer[];
    v_done boolean[];
    v_dropped integer[];
    v_dead integer[];
    v_known boolean[];
    v_seen boolean[];
    v_head integer;
    v_due boolean;
    v_next timestamptz;
    v_wait timestamptz;
    v_gone integer;
    v_buried integer;
    v_next_at timestamptz[];
    v_caps integer[];
    v_relock bigint[];
    v_locked bigint[];
    v_new {schema}.channel;
    v_batch bigint[];
    v_p_ids bigint[];
    v_p_ranks integer[];
    v_p_orders integer[];
    v_ids bigint[] := ARRAY[]::bigint[];
    v_ranks integer[] := ARRAY[]::integer[];
    v_orders integer[] := ARRAY[]::integer[];
    v_quota integer;
    v_budget integer;
    v_open integer;
    v_cap integer;
    v_try integer := 0;
    v_wait_id bigint;
    v_max_attempts integer[];
    v_poison bigint[];
    -- dead-lettered this call: id, queue, channel, name, attempts, created_at
    v_d_ids bigint[] := ARRAY[]::bigint[];
    v_d_queues text[] := ARRAY[]::text[];
    v_d_channels text[] := ARRAY[]::text[];
    v_d_names text[] := ARRAY[]::text[];
    v_d_attempts integer[] := ARRAY[]::integer[];
    v_d_created timestamptz[] := ARRAY[]::timestamptz[];
    b_ids bigint[];
    b_channel_ids bigint[];
    b_queues text[];
    b_channels text[];
    b_names text[];
    b_attempts integer[];
    b_created timestamptz[];
    v_rec record;
    v_served timestamptz;
    v_sooner integer[];
    i integer;
BEGIN
    SELECT array_agg(q.id), array_agg(q.name), array_agg(coalesce(q.max_attempts, 2147483647)),
           coalesce(bool_or(x.found), false)
    INTO v_queue_ids, v_queue_names, v_max_attempts, v_expired_locks
    FROM {schema}.queue q
    LEFT JOIN LATERAL (
        SELECT true AS found FROM {schema}.message e
        WHERE e.queue_id = q.id AND e.locked_until <= v_now
        ORDER BY e.locked_until
        LIMIT 1
    ) AS x ON true
    WHERE q.name = ANY (p_queues);
    IF v_queue_ids IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, NULL::bigint,
            NULL::text;
        RETURN;
    END IF;

    -- 1. Messages whose lock expired. They still count against their channel's concurrency,
    --    so they are re-locked without touching the channel row. Usually there is none, and
    --    one index probe per queue (above), without locking anything, is all it costs. Each queue is
    --    read in index order, stopping at p_limit: no sort of every expired lock (after a
    --    crash there may be thousands).
    IF v_expired_locks THEN
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
    ELSE
        v_relock := ARRAY[]::bigint[];
    END IF;
    IF cardinality(v_relock) > 0 THEN
        -- Delivered max_attempts times already, and its holder died each time: a poison
        -- message. Dead-letter it instead (and give up until the next call if a channel row
        -- is busy: lock_timeout, as in step 2).
        v_poison := ARRAY(
            SELECT m.id FROM {schema}.message m
            WHERE m.id = ANY (v_relock)
              AND m.attempts >= v_max_attempts[array_position(v_queue_ids, m.queue_id)]
            ORDER BY m.id
        );
        IF cardinality(v_poison) > 0 THEN
            v_relock := ARRAY(SELECT u.id FROM unnest(v_relock) AS u(id) WHERE u.id <> ALL (v_poison));
            BEGIN
                SELECT array_agg(b.message_id), array_agg(b.channel_id), array_agg(b.queue_name),
                       array_agg(b.channel_name), array_agg(b.message_name),
                       array_agg(b.message_attempts), array_agg(b.message_created_at)
                INTO b_ids, b_channel_ids, b_queues, b_channels, b_names, b_attempts, b_created
                FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b;
                FOR v_rec IN
                    SELECT x.channel_id, count(*)::integer AS n
                    FROM unnest(b_channel_ids) AS x(channel_id)
                    GROUP BY x.channel_id ORDER BY x.channel_id
                LOOP
                    PERFORM {schema}.channel_release_v1(v_rec.channel_id, -v_rec.n, NULL, v_rec.n, 'dead');
                END LOOP;
                v_d_ids := v_d_ids || b_ids;
                v_d_queues := v_d_queues || b_queues;
                v_d_channels := v_d_channels || b_channels;
                v_d_names := v_d_names || b_names;
                v_d_attempts := v_d_attempts || b_attempts;
                v_d_created := v_d_created || b_created;
            EXCEPTION WHEN lock_not_available THEN
                NULL;  -- left as they are: the next call tries again
            END;
        END IF;
    END IF;
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
            ), counted AS (
                INSERT INTO {schema}.counter (queue_id, delivered, redelivered)
                SELECT x.queue_id, count(*), count(*) FROM relocked x GROUP BY x.queue_id
            )
            SELECT r.id, q.name, c.name, r.name, r.priority, r.attempts, r.lock_token,
                   r.created_at, r.content, r.state, NULL::bigint, 'redelivered'::text
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
            SELECT array_agg(s.c ORDER BY (s.c).waiting_since, (s.c).id),
                   array_agg((s.c).id ORDER BY (s.c).waiting_since, (s.c).id)
            INTO v_channels, v_cids
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
        -- Wait for the holder (its transaction is usually one function call: an ack, a
        -- create or another dequeue) and look again as soon as it commits: twice on the row
        -- lock, then by sleeping 1 ms (the holder may be a long transaction of a producer).
        -- A wait is at most lock_timeout (10 ms, set on this function): the SKIP LOCKED pass
        -- above may have left rows locked that it did not return (a row updated since our
        -- snapshot is locked, then fails the recheck), and waiting on a lock while holding
        -- one could deadlock with a batch of creates; lock_timeout ends such a wait first.
        IF v_try <= 2 THEN
            BEGIN
                PERFORM 1 FROM {schema}.channel c WHERE c.id = v_wait_id FOR UPDATE;
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
        ELSE
            PERFORM pg_sleep(0.001);
        END IF;
        v_now := clock_timestamp();
        v_wait_id := NULL;
    END LOOP;

    IF cardinality(v_channels) = 1 THEN
        -- One channel (one tenant, or a prefetch of 1): steps 3 and 4 below for one channel,
        -- in fewer statements. Its head: the first cap + 1 unlocked messages in delivery
        -- order; when the first cap are due, they are the ones to take (else channel_take_v1
        -- looks priority by priority), and the next one tells when the channel is due again.
        v_cap := v_left;
        IF v_channels[1].max_concurrency IS NOT NULL THEN
            v_cap := LEAST(v_cap, v_channels[1].max_concurrency - v_channels[1].current_concurrency);
        END IF;
        v_n := 0;
        v_gone := 0;
        v_buried := 0;
        v_due := false;
        IF v_cap > 0 THEN
            SELECT count(h.id)::integer,
                   coalesce(bool_and(h.dequeue_at <= v_now) FILTER (WHERE h.rn <= v_cap), true),
                   array_agg(h.id ORDER BY h.rn) FILTER (WHERE h.rn <= v_cap),
                   min(h.dequeue_at) FILTER (WHERE h.rn = v_cap + 1)
            INTO v_head, v_due, v_batch, v_next
            FROM (
                SELECT m.id, m.dequeue_at,
                       row_number() OVER (ORDER BY m.priority DESC, m.dequeue_at, m.id) AS rn
                FROM {schema}.message m
                WHERE m.channel_id = v_cids[1] AND m.locked_until IS NULL
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT v_cap + 1
            ) AS h;
            IF NOT v_due THEN
                v_batch := ARRAY(
                    SELECT x.id FROM {schema}.channel_take_v1(v_cids[1], v_cap, v_now)
                        WITH ORDINALITY AS x(id, rn)
                    ORDER BY x.rn
                );
            END IF;
            IF coalesce(cardinality(v_batch), 0) > 0 THEN
                RETURN QUERY
                    WITH locked AS (
                        UPDATE {schema}.message m SET
                            locked_until = v_now + v_lock,
                            lock_token = gen_random_uuid(),
                            attempts = m.attempts + 1
                        WHERE m.id = ANY (v_batch)
                          AND (m.expires_at IS NULL OR m.expires_at > v_now)
                          AND m.attempts < v_max_attempts[array_position(v_queue_ids, m.queue_id)]
                        RETURNING m.id, m.queue_id, m.name, m.priority, m.attempts, m.lock_token,
                                  m.created_at, m.content, m.state
                    )
                    SELECT l.id, v_queue_names[array_position(v_queue_ids, l.queue_id)],
                           (v_channels[1]).name, l.name, l.priority, l.attempts, l.lock_token,
                           l.created_at, l.content, l.state, NULL::bigint, 'delivered'::text
                    FROM locked l
                    ORDER BY array_position(v_batch, l.id);
                GET DIAGNOSTICS v_n = ROW_COUNT;
                IF v_n < cardinality(v_batch) THEN
                    -- not locked: past their time to live (deleted) or delivered max_attempts
                    -- times (dead-lettered); the channel's turn is computed from scratch
                    v_due := false;
                    WITH gone AS (
                        DELETE FROM {schema}.message m
                        WHERE m.id = ANY (v_batch) AND m.locked_until IS NULL
                          AND m.expires_at <= v_now
                        RETURNING m.id
                    )
                    SELECT count(*)::integer INTO v_gone FROM gone;
                    v_poison := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.id = ANY (v_batch) AND m.locked_until IS NULL ORDER BY m.id
                    );
                    IF cardinality(v_poison) > 0 THEN
                        SELECT array_agg(b.message_id), array_agg(b.queue_name),
                               array_agg(b.channel_name), array_agg(b.message_name),
                               array_agg(b.message_attempts), array_agg(b.message_created_at)
                        INTO b_ids, b_queues, b_channels, b_names, b_attempts, b_created
                        FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b;
                        v_buried := coalesce(cardinality(b_ids), 0);
                        v_d_ids := v_d_ids || b_ids;
                        v_d_queues := v_d_queues || b_queues;
                        v_d_channels := v_d_channels || b_channels;
                        v_d_names := v_d_names || b_names;
                        v_d_attempts := v_d_attempts || b_attempts;
                        v_d_created := v_d_created || b_created;
                    END IF;
                END IF;
            END IF;
        END IF;
        v_got := v_got + v_n;
        IF v_channels[1].current_size - v_gone - v_buried > 0 OR v_channels[1].has_policy THEN
            v_served := CASE WHEN v_n > 0 THEN clock_timestamp() ELSE v_channels[1].served_at END;
            IF v_channels[1].max_concurrency IS NOT NULL
               AND v_channels[1].current_concurrency + v_n >= v_channels[1].max_concurrency THEN
                v_wait := NULL;  -- saturated: no turn until a slot comes free
            ELSIF v_due AND v_head <= v_cap THEN
                v_wait := NULL;  -- every unlocked message was taken
            ELSIF v_due AND v_next <= v_served THEN
                v_wait := v_served;  -- its next message is due: back of the round
            ELSE
                v_next := {schema}.channel_next_due_v1(v_cids[1]);
                v_wait := CASE WHEN v_next IS NOT NULL THEN GREATEST(v_next, v_served) END;
            END IF;
            UPDATE {schema}.channel c SET
                current_concurrency = c.current_concurrency + v_n,
                current_size = c.current_size - v_gone - v_buried,
                n_delivered = c.n_delivered + v_n,
                n_expired = c.n_expired + v_gone,
                n_dead = c.n_dead + v_buried,
                served_at = v_served,
                waiting_since = v_wait
            WHERE c.id = v_cids[1];
            IF v_wait IS NOT NULL AND (v_channels[1].waiting_since IS NULL
                                       OR v_wait < v_channels[1].waiting_since) THEN
                PERFORM pg_notify({wake}, v_queue_names[array_position(v_queue_ids, v_channels[1].queue_id)]);
            END IF;
        ELSE
            v_new := v_channels[1];
            v_new.current_concurrency := v_new.current_concurrency + v_n;
            v_new.current_size := 0;
            v_new.n_delivered := v_new.n_delivered + v_n;
            v_new.n_expired := v_new.n_expired + v_gone;
            v_new.n_dead := v_new.n_dead + v_buried;
            PERFORM {schema}.channel_store_v1(v_channels[1], v_new, true);
        END IF;
    ELSIF v_channels IS NOT NULL THEN
        -- 3. Take messages in passes: each open channel gets an equal share of what is left;
        --    a channel that filled its share stays open for the next pass. Each pass reads
        --    the heads of all its channels in one statement and locks what it takes in one
        --    UPDATE.
        v_n := cardinality(v_channels);
        v_taken := array_fill(0, ARRAY[v_n]);
        v_done := array_fill(false, ARRAY[v_n]);
        v_dropped := array_fill(0, ARRAY[v_n]);
        v_dead := array_fill(0, ARRAY[v_n]);
        v_known := array_fill(false, ARRAY[v_n]);
        v_seen := array_fill(false, ARRAY[v_n]);
        v_next_at := array_fill(NULL::timestamptz, ARRAY[v_n]);
        v_open := v_n;
        WHILE v_left > 0 AND v_open > 0 LOOP
            v_quota := ceil(v_left::numeric / v_open)::integer;
            v_budget := v_left;
            v_caps := array_fill(0, ARRAY[v_n]);
            FOR i IN 1 .. v_n LOOP
                EXIT WHEN v_budget <= 0;
                CONTINUE WHEN v_done[i];
                v_cap := LEAST(v_quota, v_budget);
                IF v_channels[i].max_concurrency IS NOT NULL THEN
                    v_cap := LEAST(v_cap, v_channels[i].max_concurrency
                        - v_channels[i].current_concurrency - v_taken[i]);
                END IF;
                IF v_cap <= 0 THEN
                    v_done[i] := true;  -- at max_concurrency: no turn (step 4)
                    v_seen[i] := true;
                    CONTINUE;
                END IF;
                v_caps[i] := v_cap;
                v_budget := v_budget - v_cap;
            END LOOP;
            -- The head of each channel: its first cap + 1 unlocked messages in delivery order
            -- (one bounded index range scan each). When the first cap of them are all due,
            -- they are the channel's best due messages, and the next one tells when the
            -- channel is due again. Otherwise (a delayed message of a higher priority is at
            -- the head) channel_take_v1 looks priority by priority.
            v_p_ids := ARRAY[]::bigint[];
            v_p_ranks := ARRAY[]::integer[];
            v_p_orders := ARRAY[]::integer[];
            FOR v_rec IN
                SELECT u.ord::integer AS ord, u.cap, count(h.id)::integer AS n,
                       coalesce(bool_and(h.dequeue_at <= v_now) FILTER (WHERE h.rn <= u.cap), true) AS due,
                       array_agg(h.id ORDER BY h.rn) FILTER (WHERE h.rn <= u.cap) AS ids,
                       min(h.dequeue_at) FILTER (WHERE h.rn = u.cap + 1) AS next_at
                FROM unnest(v_cids, v_caps) WITH ORDINALITY AS u(cid, cap, ord)
                LEFT JOIN LATERAL (
                    SELECT m.id, m.dequeue_at,
                           row_number() OVER (ORDER BY m.priority DESC, m.dequeue_at, m.id) AS rn
                    FROM {schema}.message m
                    WHERE m.channel_id = u.cid AND m.locked_until IS NULL
                    ORDER BY m.priority DESC, m.dequeue_at, m.id
                    LIMIT u.cap + 1
                ) AS h ON true
                WHERE u.cap > 0
                GROUP BY u.ord, u.cap
                ORDER BY u.ord
            LOOP
                i := v_rec.ord;
                v_seen[i] := true;
                IF v_rec.due THEN
                    v_batch := v_rec.ids;
                    v_known[i] := true;
                    v_next_at[i] := v_rec.next_at;
                    IF v_rec.n <= v_rec.cap THEN
                        v_done[i] := true;  -- all its unlocked messages taken
                    END IF;
                ELSE
                    v_batch := ARRAY(
                        SELECT x.id FROM {schema}.channel_take_v1(v_cids[i], v_rec.cap, v_now)
                            WITH ORDINALITY AS x(id, rn)
                        ORDER BY x.rn
                    );
                    v_known[i] := false;
                    IF coalesce(cardinality(v_batch), 0) < v_rec.cap THEN
                        v_done[i] := true;  -- nothing more due in this channel
                    END IF;
                END IF;
                CONTINUE WHEN coalesce(cardinality(v_batch), 0) = 0;
                v_p_ids := v_p_ids || v_batch;
                v_p_ranks := v_p_ranks
                    || ARRAY(SELECT v_taken[i] + g FROM generate_series(1, cardinality(v_batch)) AS g);
                v_p_orders := v_p_orders || array_fill(i, ARRAY[cardinality(v_batch)]);
            END LOOP;
            EXIT WHEN cardinality(v_p_ids) = 0;
            -- Lock them, by primary key from the array (never a join the planner could hash);
            -- messages past their time to live are left out, and dropped below, and so are
            -- those delivered max_attempts times (dead-lettered below).
            WITH locked AS (
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1
                WHERE m.id = ANY (v_p_ids) AND (m.expires_at IS NULL OR m.expires_at > v_now)
                  AND m.attempts < v_max_attempts[array_position(v_queue_ids, m.queue_id)]
                RETURNING m.id
            )
            SELECT array_agg(l.id) INTO v_locked FROM locked l;
            IF coalesce(cardinality(v_locked), 0) < cardinality(v_p_ids) THEN
                -- Expired ones are deleted, those at max_attempts dead-lettered (the channel
                -- rows are ours already: counted in step 4); their channels are done for this
                -- call (look again on the next).
                FOR v_rec IN
                    WITH failed AS (
                        SELECT p.id, p.ord FROM unnest(v_p_ids, v_p_orders) AS p(id, ord)
                        WHERE p.id <> ALL (coalesce(v_locked, ARRAY[]::bigint[]))
                    ), gone AS (
                        DELETE FROM {schema}.message m
                        WHERE m.id = ANY (ARRAY(SELECT f.id FROM failed f)) AND m.expires_at <= v_now
                        RETURNING m.id
                    )
                    SELECT f.ord, count(*) FILTER (WHERE g.id IS NOT NULL)::integer AS expired,
                           array_agg(f.id) FILTER (WHERE g.id IS NULL) AS poison
                    FROM failed f LEFT JOIN gone g ON g.id = f.id
                    GROUP BY f.ord
                LOOP
                    v_dropped[v_rec.ord] := v_dropped[v_rec.ord] + v_rec.expired;
                    v_done[v_rec.ord] := true;
                    v_known[v_rec.ord] := false;
                    IF v_rec.poison IS NOT NULL THEN
                        SELECT array_agg(b.message_id), array_agg(b.queue_name),
                               array_agg(b.channel_name), array_agg(b.message_name),
                               array_agg(b.message_attempts), array_agg(b.message_created_at)
                        INTO b_ids, b_queues, b_channels, b_names, b_attempts, b_created
                        FROM {schema}.message_bury_v1(v_rec.poison, 'max_attempts') AS b;
                        v_dead[v_rec.ord] := v_dead[v_rec.ord] + coalesce(cardinality(b_ids), 0);
                        v_d_ids := v_d_ids || b_ids;
                        v_d_queues := v_d_queues || b_queues;
                        v_d_channels := v_d_channels || b_channels;
                        v_d_names := v_d_names || b_names;
                        v_d_attempts := v_d_attempts || b_attempts;
                        v_d_created := v_d_created || b_created;
                    END IF;
                END LOOP;
                SELECT array_agg(p.id ORDER BY p.n), array_agg(p.rnk ORDER BY p.n),
                       array_agg(p.ord ORDER BY p.n)
                INTO v_p_ids, v_p_ranks, v_p_orders
                FROM unnest(v_p_ids, v_p_ranks, v_p_orders) WITH ORDINALITY AS p(id, rnk, ord, n)
                WHERE p.id = ANY (coalesce(v_locked, ARRAY[]::bigint[]));
                EXIT WHEN v_p_ids IS NULL;
            END IF;
            FOR i IN 1 .. cardinality(v_p_ids) LOOP
                v_taken[v_p_orders[i]] := v_taken[v_p_orders[i]] + 1;
            END LOOP;
            v_ids := v_ids || v_p_ids;
            v_ranks := v_ranks || v_p_ranks;
            v_orders := v_orders || v_p_orders;
            v_left := v_left - cardinality(v_p_ids);
            v_open := 0;
            FOR i IN 1 .. v_n LOOP
                IF NOT v_done[i] THEN
                    v_open := v_open + 1;
                END IF;
            END LOOP;
        END LOOP;

        RETURN QUERY
            SELECT m.id, v_queue_names[array_position(v_queue_ids, m.queue_id)],
                   (v_channels[s.ord]).name, m.name, m.priority, m.attempts, m.lock_token,
                   m.created_at, m.content, m.state, NULL::bigint, 'delivered'::text
            FROM unnest(v_ids, v_ranks, v_orders) AS s(id, rnk, ord)
            JOIN {schema}.message m ON m.id = s.id
            ORDER BY s.rnk, s.ord;

        -- 4. Move the served channels to the back of the round, in the order served: one
        --    UPDATE for all of them (their served_at a microsecond apart keeps that order).
        --    A served channel's turn comes from the head read in step 3 when it can (its next
        --    message is due: now), else from scratch (NULL when saturated or nothing is
        --    pending); a channel locked but not served keeps its turn. A channel left empty
        --    (its messages expired or dead) goes through channel_store_v1, which deletes it
        --    and keeps its counters.
        v_served := clock_timestamp();
        WITH moved AS (
            UPDATE {schema}.channel c SET
                current_concurrency = c.current_concurrency + s.taken,
                current_size = c.current_size - s.dropped - s.dead,
                n_delivered = c.n_delivered + s.taken,
                n_expired = c.n_expired + s.dropped,
                n_dead = c.n_dead + s.dead,
                served_at = CASE WHEN s.taken > 0 THEN v_served + s.ord * interval '1 microsecond'
                                 ELSE c.served_at END,
                waiting_since = CASE
                    WHEN NOT s.seen THEN c.waiting_since
                    WHEN c.max_concurrency IS NOT NULL
                         AND c.current_concurrency + s.taken >= c.max_concurrency THEN NULL
                    WHEN s.known AND s.next_at IS NULL THEN NULL
                    WHEN s.known AND s.next_at <= v_served THEN
                        CASE WHEN s.taken > 0 THEN v_served + s.ord * interval '1 microsecond'
                             ELSE GREATEST(s.next_at, c.served_at) END
                    ELSE (SELECT GREATEST(d.due, CASE WHEN s.taken > 0
                                 THEN v_served + s.ord * interval '1 microsecond'
                                 ELSE c.served_at END)
                          FROM (SELECT {schema}.channel_next_due_v1(c.id) AS due) AS d
                          WHERE d.due IS NOT NULL)
                    END
            FROM unnest(v_cids, v_taken, v_dropped, v_dead, v_seen, v_known, v_next_at)
                WITH ORDINALITY AS s(id, taken, dropped, dead, seen, known, next_at, ord)
            WHERE c.id = ANY (v_cids) AND c.id = s.id
              AND (c.current_size - s.dropped - s.dead > 0 OR c.has_policy)
            RETURNING c.queue_id, c.waiting_since, s.ord
        )
        SELECT array_agg(DISTINCT m.queue_id) INTO v_sooner FROM moved m
        WHERE m.waiting_since IS NOT NULL
          AND ((v_channels[m.ord]).waiting_since IS NULL
               OR m.waiting_since < (v_channels[m.ord]).waiting_since);
        FOR i IN 1 .. coalesce(cardinality(v_sooner), 0) LOOP
            PERFORM pg_notify({wake}, (SELECT q.name FROM {schema}.queue q WHERE q.id = v_sooner[i]));
        END LOOP;
        FOR i IN 1 .. v_n LOOP
            CONTINUE WHEN v_channels[i].current_size - v_dropped[i] - v_dead[i] > 0
                OR v_channels[i].has_policy;
            v_new := v_channels[i];
            v_new.current_concurrency := v_new.current_concurrency + v_taken[i];
            v_new.current_size := 0;
            v_new.n_delivered := v_new.n_delivered + v_taken[i];
            v_new.n_expired := v_new.n_expired + v_dropped[i];
            v_new.n_dead := v_new.n_dead + v_dead[i];
            PERFORM {schema}.channel_store_v1(v_channels[i], v_new, true);
        END LOOP;
        v_got := v_got + cardinality(v_ids);
    END IF;

    IF cardinality(v_d_ids) > 0 THEN
        RETURN QUERY
            SELECT d.id, d.q, d.c, d.n, NULL::smallint, d.a, NULL::uuid, d.t, NULL::bytea,
                   NULL::bytea, NULL::bigint, 'dead'::text
            FROM unnest(v_d_ids, v_d_queues, v_d_channels, v_d_names, v_d_attempts, v_d_created)
                AS d(id, q, c, n, a, t);
    END IF;
    IF v_got = 0 THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
            CASE WHEN cardinality(v_d_ids) > 0 THEN 0::bigint
                 ELSE {schema}.queue_retry_ms_v1(v_queue_ids) END,
            NULL::text;
    END IF;
END;
$$;


-- Version 1 of dequeue, for clients of the previous schema version: version 2 without the
-- rows of dead-lettered messages.
CREATE FUNCTION {schema}.message_dequeue_v1(p_queues text[], p_limit integer, p_lock_ms bigint)
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
LANGUAGE sql AS $$
    SELECT d.message_id, d.queue_name, d.channel_name, d.message_name, d.message_priority,
           d.message_attempts, d.message_lock_token, d.message_created_at, d.message_content,
           d.message_state, d.retry_ms
    FROM {schema}.message_dequeue_v2(p_queues, p_limit, p_lock_ms) AS d
    WHERE d.event IS DISTINCT FROM 'dead';
$$;


-- Release held (or, with p_count 0, waiting) messages' slots on their channel after they
-- were deleted, deferred or dead-lettered. p_event names the counter to add p_count to:
-- 'ack', 'defer', 'dead' or 'remove' (none).
CREATE FUNCTION {schema}.channel_release_v1(
    p_channel_id bigint, p_size_delta integer, p_due timestamptz, p_count integer DEFAULT 1,
    p_event text DEFAULT 'ack'
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old {schema}.channel;
    v_new {schema}.channel;
    v_due timestamptz;
BEGIN
    -- channel_store_v1's work for a release, written out (one function call less per ack)
    SELECT * INTO v_old FROM {schema}.channel c WHERE c.id = p_channel_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_new := v_old;
    v_new.current_size := GREATEST(0, v_old.current_size + p_size_delta);
    v_new.current_concurrency := GREATEST(0, v_old.current_concurrency - p_count);
    IF p_event = 'ack' THEN
        v_new.n_acked := v_old.n_acked + p_count;
    ELSIF p_event = 'defer' THEN
        v_new.n_deferred := v_old.n_deferred + p_count;
    ELSIF p_event = 'dead' THEN
        v_new.n_dead := v_old.n_dead + p_count;
    END IF;
    IF p_due IS NOT NULL THEN
        v_due := GREATEST(p_due, v_old.served_at);
        IF v_old.waiting_since IS NULL OR v_due < v_old.waiting_since THEN
            v_new.waiting_since := v_due;
        END IF;
    END IF;
    IF v_new.current_size = 0 AND NOT v_new.has_policy THEN
        DELETE FROM {schema}.channel WHERE id = v_new.id;
        INSERT INTO {schema}.counter
            (queue_id, enqueued, delivered, acked, deferred, dead, expired, dropped)
        VALUES (v_new.queue_id, v_new.n_enqueued, v_new.n_delivered, v_new.n_acked,
                v_new.n_deferred, v_new.n_dead, v_new.n_expired, v_new.n_dropped);
        RETURN;
    END IF;
    IF v_new.max_concurrency IS NOT NULL
       AND v_new.current_concurrency >= v_new.max_concurrency THEN
        v_new.waiting_since := NULL;  -- still saturated (its limit was lowered): no turn
    ELSIF v_old.max_concurrency IS NOT NULL
       AND v_old.current_concurrency >= v_old.max_concurrency THEN
        -- a slot came free in a saturated channel: its turn, from scratch
        v_new.waiting_since := {schema}.channel_waiting_v1(v_new);
    END IF;
    UPDATE {schema}.channel SET
        current_size = v_new.current_size,
        current_concurrency = v_new.current_concurrency,
        waiting_since = v_new.waiting_since,
        n_acked = v_new.n_acked,
        n_deferred = v_new.n_deferred,
        n_dead = v_new.n_dead
    WHERE id = v_new.id;
    IF v_new.waiting_since IS NOT NULL
       AND (v_old.waiting_since IS NULL OR v_new.waiting_since < v_old.waiting_since) THEN
        PERFORM pg_notify({wake}, (SELECT q.name FROM {schema}.queue q WHERE q.id = v_new.queue_id));
    END IF;
END;
$$;


-- Delete (acknowledge) a held message. result_code: 'ok', 'state_invalid' (the message is
-- held under another lock token, or not held) or 'not_found'.
CREATE FUNCTION {schema}.message_delete_v1(p_id bigint, p_lock_token uuid, OUT result_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_channel_id bigint;
BEGIN
    DELETE FROM {schema}.message m
    WHERE m.id = p_id AND m.lock_token = p_lock_token AND m.locked_until IS NOT NULL
    RETURNING m.channel_id INTO v_channel_id;
    IF v_channel_id IS NULL THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    PERFORM {schema}.channel_release_v1(v_channel_id, -1, NULL);
    result_code := 'ok';
END;
$$;


-- Defer a held message: unlock it, due again after p_delay_ms, with new state when
-- p_set_state. Attempts are kept. result_code as for delete.
CREATE FUNCTION {schema}.message_defer_v1(
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
    PERFORM {schema}.channel_release_v1(v_channel_id, 0, v_at, 1, 'defer');
    result_code := 'ok';
END;
$$;


-- Extend the locks of held messages. Returns the ids whose lock was extended (a message
-- whose token no longer matches is left out) with their new lock expiry.
CREATE FUNCTION {schema}.message_heartbeat_v1(p_ids bigint[], p_lock_tokens uuid[], p_lock_ms bigint)
RETURNS TABLE (message_id bigint, locked_until timestamptz)
LANGUAGE sql AS $$
    UPDATE {schema}.message m SET locked_until = clock_timestamp() + p_lock_ms * interval '1 millisecond'
    FROM unnest(p_ids, p_lock_tokens) AS h(id, lock_token)
    WHERE m.id = h.id AND m.lock_token = h.lock_token AND m.locked_until IS NOT NULL
    RETURNING m.id, m.locked_until;
$$;


-- Move messages (in any state) to the dead letters of their queue, or delete them where the
-- queue keeps no dead letters. Returns what was removed; the caller updates the channels.
CREATE FUNCTION {schema}.message_bury_v1(p_ids bigint[], p_reason text)
RETURNS TABLE (
    message_id bigint, channel_id bigint, held boolean, queue_name text, channel_name text,
    message_name text, message_attempts integer, message_created_at timestamptz
)
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM {schema}.message m WHERE m.id = ANY (p_ids)
        RETURNING m.*
    ), named AS (
        SELECT g.*, q.name AS q_name, c.name AS c_name, q.dead_letter
        FROM gone g
        JOIN {schema}.queue q ON q.id = g.queue_id
        JOIN {schema}.channel c ON c.id = g.channel_id
    ), kept AS (
        INSERT INTO {schema}.dead_message
            (id, queue, channel, name, priority, attempts, reason, created_at, dead_at,
             content, state)
        SELECT n.id, n.q_name, n.c_name, n.name, n.priority, n.attempts, p_reason,
               n.created_at, clock_timestamp(), n.content, n.state
        FROM named n WHERE n.dead_letter
        ON CONFLICT (id) DO NOTHING
    )
    SELECT n.id, n.channel_id, n.locked_until IS NOT NULL, n.q_name, n.c_name, n.name,
           n.attempts, n.created_at
    FROM named n ORDER BY n.id;
$$;


-- Reject a held message without requeue: it goes to the dead letters of its queue (or is
-- deleted where the queue keeps none). result_code as for delete.
CREATE FUNCTION {schema}.message_reject_v1(
    p_id bigint, p_lock_token uuid, p_reason text, OUT result_code text
)
LANGUAGE plpgsql AS $$
DECLARE
    v_channel_id bigint;
BEGIN
    PERFORM 1 FROM {schema}.message m
    WHERE m.id = p_id AND m.lock_token = p_lock_token AND m.locked_until IS NOT NULL
    FOR UPDATE;
    IF NOT FOUND THEN
        result_code := CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = p_id)
            THEN 'state_invalid' ELSE 'not_found' END;
        RETURN;
    END IF;
    SELECT b.channel_id INTO v_channel_id
    FROM {schema}.message_bury_v1(ARRAY[p_id], coalesce(p_reason, 'rejected')) AS b;
    PERFORM {schema}.channel_release_v1(v_channel_id, -1, NULL, 1, 'dead');
    result_code := 'ok';
END;
$$;


-- Set a channel's own policy (NULL: no limit). Applies at once to the messages it holds.
CREATE FUNCTION {schema}.channel_policy_set_v1(
    p_queue text, p_channel text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old {schema}.channel;
    v_new {schema}.channel;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended({lock_prefix} || p_queue, 0));
    v_old := {schema}.channel_lock_v1({schema}.queue_ensure_v1(p_queue), p_channel);
    v_new := v_old;
    v_new.has_policy := true;
    v_new.own_max_concurrency := p_max_concurrency;
    v_new.own_max_size := p_max_size;
    v_new.max_concurrency := p_max_concurrency;
    v_new.max_size := p_max_size;
    PERFORM {schema}.channel_store_v1(v_old, v_new, true);
END;
$$;


-- Remove a channel's own policy: it falls back to the queue default.
CREATE FUNCTION {schema}.channel_policy_clear_v1(p_queue text, p_channel text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old {schema}.channel;
    v_new {schema}.channel;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended({lock_prefix} || p_queue, 0));
    SELECT c.* INTO v_old FROM {schema}.channel c
    JOIN {schema}.queue q ON q.id = c.queue_id
    WHERE q.name = p_queue AND c.name = p_channel
    FOR UPDATE OF c;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_new := v_old;
    v_new.has_policy := false;
    v_new.own_max_concurrency := NULL;
    v_new.own_max_size := NULL;
    SELECT q.max_concurrency, q.max_size INTO v_new.max_concurrency, v_new.max_size
    FROM {schema}.queue q WHERE q.id = v_old.queue_id;
    PERFORM {schema}.channel_store_v1(v_old, v_new, true);
END;
$$;


-- Set (or, with NULLs, clear) the queue-wide default policy, applied at once to every channel
-- of the queue that has no policy of its own.
CREATE FUNCTION {schema}.queue_policy_set_v1(
    p_queue text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_old {schema}.channel;
    v_new {schema}.channel;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || p_queue, 0));
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue SET max_concurrency = p_max_concurrency, max_size = p_max_size
    WHERE id = v_queue_id;
    FOR v_old IN
        SELECT * FROM {schema}.channel c
        WHERE c.queue_id = v_queue_id AND NOT c.has_policy
        ORDER BY c.name
        FOR UPDATE
    LOOP
        v_new := v_old;
        v_new.max_concurrency := p_max_concurrency;
        v_new.max_size := p_max_size;
        PERFORM {schema}.channel_store_v1(v_old, v_new, true);
    END LOOP;
END;
$$;


-- Delete every message of a queue that is not held by a consumer (ready and delayed ones).
-- Returns how many were deleted. Held messages stay until acked or their lock expires.
CREATE FUNCTION {schema}.queue_purge_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_old {schema}.channel;
    v_new {schema}.channel;
    v_n bigint;
    v_total bigint := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || p_queue, 0));
    FOR v_old IN
        SELECT c.* FROM {schema}.channel c
        JOIN {schema}.queue q ON q.id = c.queue_id
        WHERE q.name = p_queue
        ORDER BY c.name
        FOR UPDATE OF c
    LOOP
        DELETE FROM {schema}.message m WHERE m.channel_id = v_old.id AND m.locked_until IS NULL;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_total := v_total + v_n;
        v_new := v_old;
        v_new.current_size := v_old.current_size - v_n;
        v_new.waiting_since := NULL;
        PERFORM {schema}.channel_store_v1(v_old, v_new, false);
    END LOOP;
    RETURN v_total;
END;
$$;


-- Delete a queue: all its messages (held ones too), channels, policies and counters. Its
-- dead letters stay until their retention ends. Returns how many messages were deleted.
CREATE FUNCTION {schema}.queue_delete_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
    v_n bigint := 0;
    v_m bigint;
    v_channel_id bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || p_queue, 0));
    DELETE FROM {schema}.binding WHERE queue = p_queue;
    SELECT q.id INTO v_queue_id FROM {schema}.queue q WHERE q.name = p_queue FOR UPDATE;
    IF v_queue_id IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_channel_id IN
        SELECT c.id FROM {schema}.channel c WHERE c.queue_id = v_queue_id ORDER BY c.name FOR UPDATE
    LOOP
        DELETE FROM {schema}.message m WHERE m.channel_id = v_channel_id;
        GET DIAGNOSTICS v_m = ROW_COUNT;
        v_n := v_n + v_m;
        DELETE FROM {schema}.channel WHERE id = v_channel_id;
    END LOOP;
    DELETE FROM {schema}.counter WHERE queue_id = v_queue_id;
    DELETE FROM {schema}.queue WHERE id = v_queue_id;
    RETURN v_n;
END;
$$;


-- Counters of a queue, exact, from its channel rows (ready and delayed are counted from the
-- messages: O(messages not held)).
CREATE FUNCTION {schema}.queue_stats_v1(p_queue text, p_count_ready boolean)
RETURNS TABLE (
    total bigint, in_flight bigint, ready bigint, delayed bigint, channels bigint,
    max_concurrency integer, max_size integer
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_queue {schema}.queue;
    v_now timestamptz := clock_timestamp();
BEGIN
    SELECT * INTO v_queue FROM {schema}.queue q WHERE q.name = p_queue;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint, 0::bigint, 0::bigint, 0::bigint,
            NULL::integer, NULL::integer;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT coalesce(sum(c.current_size), 0)::bigint,
               coalesce(sum(c.current_concurrency), 0)::bigint,
               CASE WHEN p_count_ready THEN (
                   SELECT count(*) FROM {schema}.channel c2
                   JOIN {schema}.message m ON m.channel_id = c2.id AND m.locked_until IS NULL
                   WHERE c2.queue_id = v_queue.id AND m.dequeue_at <= v_now) END,
               CASE WHEN p_count_ready THEN (
                   SELECT count(*) FROM {schema}.channel c2
                   JOIN {schema}.message m ON m.channel_id = c2.id AND m.locked_until IS NULL
                   WHERE c2.queue_id = v_queue.id AND m.dequeue_at > v_now) END,
               count(c.id) FILTER (WHERE c.current_size > 0),
               v_queue.max_concurrency,
               v_queue.max_size
        FROM {schema}.channel c WHERE c.queue_id = v_queue.id;
END;
$$;


-- ---------------------------------------------------------------------------------------------
-- Kombu: exchanges and bindings persisted in Postgres, so that every process routes alike;
-- queue arguments (x-expires, x-message-ttl) so that abandoned queues and stale broadcasts go.
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


-- Declare a queue with its arguments; returns (messages waiting, messages in flight).
CREATE FUNCTION {schema}.queue_declare_v1(
    p_queue text, p_expires_ms bigint, p_message_ttl_ms bigint,
    OUT waiting bigint, OUT in_flight bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id integer;
BEGIN
    v_queue_id := {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue q SET
        expires_ms = p_expires_ms,
        message_ttl_ms = p_message_ttl_ms,
        used_at = clock_timestamp()
    WHERE q.id = v_queue_id
      AND (q.expires_ms IS DISTINCT FROM p_expires_ms
           OR q.message_ttl_ms IS DISTINCT FROM p_message_ttl_ms
           OR (p_expires_ms IS NOT NULL AND q.used_at < clock_timestamp() - interval '1 second'));
    SELECT coalesce(sum(c.current_size - c.current_concurrency), 0),
           coalesce(sum(c.current_concurrency), 0)
    INTO waiting, in_flight
    FROM {schema}.channel c WHERE c.queue_id = v_queue_id;
END;
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
LANGUAGE plpgsql AS $$
DECLARE
    v_queue text;
    v_ttl bigint;
BEGIN
    FOREACH v_queue IN ARRAY {schema}.route_v1(p_exchange, p_routing_key) LOOP
        SELECT LEAST(p_ttl_ms, q.message_ttl_ms) INTO v_ttl
        FROM {schema}.queue q WHERE q.name = v_queue;
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


-- Delete (ack) many held messages. One outcome per id, as message_delete_v1. The channels
-- are locked in id order (the order every caller uses) in one statement and settled in sets:
-- one UPDATE for those that keep messages, one DELETE for those left empty (their counters
-- kept in one counter row per queue).
CREATE FUNCTION {schema}.message_delete_many_v1(p_ids bigint[], p_lock_tokens uuid[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_gone bigint[];
    v_channels bigint[];
    v_ids bigint[];
    v_counts integer[];
    v_locked {schema}.channel[];
    v_emptied bigint[];
    v_sooner integer[];
    v_first bigint;
    v_last bigint;
    v_n integer;
    i integer;
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
    SELECT array_agg(g.id), array_agg(g.channel_id), min(g.channel_id), max(g.channel_id)
    INTO v_gone, v_channels, v_first, v_last FROM gone g;
    IF v_gone IS NULL THEN
        RETURN QUERY
            SELECT h.id,
                CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                     THEN 'state_invalid' ELSE 'not_found' END
            FROM unnest(p_ids) AS h(id);
        RETURN;
    END IF;
    IF v_first = v_last THEN
        -- one channel (the usual case): a slot freed per message, in one UPDATE of its row,
        -- unless the channel empties or was saturated (then channel_release_v1 deletes it,
        -- or gives it its turn back)
        v_n := cardinality(v_gone);
        UPDATE {schema}.channel c SET
            current_size = c.current_size - v_n,
            current_concurrency = GREATEST(0, c.current_concurrency - v_n),
            n_acked = c.n_acked + v_n
        WHERE c.id = v_first AND (c.current_size - v_n > 0 OR c.has_policy)
          AND (c.max_concurrency IS NULL OR c.current_concurrency < c.max_concurrency);
        IF NOT FOUND THEN
            PERFORM {schema}.channel_release_v1(v_first, -v_n, NULL, v_n);
        END IF;
        IF v_n = cardinality(p_ids) THEN
            RETURN QUERY SELECT h.id, 'ok'::text FROM unnest(p_ids) AS h(id);
            RETURN;
        END IF;
        RETURN QUERY
            SELECT h.id,
                CASE WHEN h.id = ANY (v_gone) THEN 'ok'
                     WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                         THEN 'state_invalid'
                     ELSE 'not_found' END
            FROM unnest(p_ids) AS h(id);
        RETURN;
    END IF;
    SELECT array_agg(x.channel_id ORDER BY x.channel_id), array_agg(x.n ORDER BY x.channel_id)
    INTO v_ids, v_counts
    FROM (
        SELECT u.channel_id, count(*)::integer AS n FROM unnest(v_channels) AS u(channel_id)
        GROUP BY u.channel_id
    ) AS x;
    v_locked := ARRAY(
        SELECT c FROM {schema}.channel c WHERE c.id = ANY (v_ids) ORDER BY c.id FOR UPDATE
    );
    -- left empty, without a policy of their own: deleted, their counters kept
    SELECT array_agg(l.id) INTO v_emptied
    FROM unnest(v_locked) AS l
    JOIN unnest(v_ids, v_counts) AS p(id, n) ON p.id = l.id
    WHERE l.current_size - p.n <= 0 AND NOT l.has_policy;
    IF v_emptied IS NOT NULL THEN
        DELETE FROM {schema}.channel c WHERE c.id = ANY (v_emptied);
        INSERT INTO {schema}.counter
            (queue_id, enqueued, delivered, acked, deferred, dead, expired, dropped)
        SELECT l.queue_id, sum(l.n_enqueued), sum(l.n_delivered), sum(l.n_acked + p.n),
               sum(l.n_deferred), sum(l.n_dead), sum(l.n_expired), sum(l.n_dropped)
        FROM unnest(v_locked) AS l
        JOIN unnest(v_ids, v_counts) AS p(id, n) ON p.id = l.id
        WHERE l.id = ANY (v_emptied)
        GROUP BY l.queue_id;
    END IF;
    -- the others: a slot freed each; a channel that was saturated gets its turn back
    WITH settled AS (
        UPDATE {schema}.channel c SET
            current_size = GREATEST(0, c.current_size - p.n),
            current_concurrency = GREATEST(0, c.current_concurrency - p.n),
            n_acked = c.n_acked + p.n,
            waiting_since = CASE
                WHEN NOT p.was_saturated THEN c.waiting_since
                WHEN GREATEST(0, c.current_concurrency - p.n) >= c.max_concurrency THEN NULL
                ELSE (SELECT GREATEST(d.due, c.served_at)
                      FROM (SELECT {schema}.channel_next_due_v1(c.id) AS due) AS d
                      WHERE d.due IS NOT NULL)
                END
        FROM (
            SELECT l.id, q.n, l.max_concurrency IS NOT NULL
                AND l.current_concurrency >= l.max_concurrency AS was_saturated
            FROM unnest(v_locked) AS l
            JOIN unnest(v_ids, v_counts) AS q(id, n) ON q.id = l.id
            WHERE l.id <> ALL (coalesce(v_emptied, ARRAY[]::bigint[]))
        ) AS p
        WHERE c.id = ANY (v_ids) AND c.id = p.id
        RETURNING c.queue_id, p.was_saturated AND c.waiting_since IS NOT NULL AS sooner
    )
    SELECT array_agg(DISTINCT s.queue_id) FILTER (WHERE s.sooner) INTO v_sooner FROM settled s;
    FOR i IN 1 .. coalesce(cardinality(v_sooner), 0) LOOP
        PERFORM pg_notify({wake}, (SELECT q.name FROM {schema}.queue q WHERE q.id = v_sooner[i]));
    END LOOP;
    RETURN QUERY
        SELECT h.id,
            CASE WHEN h.id = ANY (v_gone) THEN 'ok'
                 WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                     THEN 'state_invalid'
                 ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
END;
$$;


-- Delete (ack) held messages, then dequeue, in one call (one statement, one transaction): a
-- consumer's acks travel with its next dequeue. The rows are message_dequeue_v2's, after a
-- row per ack that did not apply: message_id, and event 'ack_state_invalid' (held under
-- another lock token, or not held) or 'ack_not_found' (as message_delete_many_v1).
CREATE FUNCTION {schema}.message_ack_dequeue_v1(
    p_ids bigint[], p_lock_tokens uuid[], p_queues text[], p_limit integer, p_lock_ms bigint
)
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
    retry_ms bigint,
    event text
)
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_ids) > 0 THEN
        RETURN QUERY
            SELECT a.message_id, NULL::text, NULL::text, NULL::text, NULL::smallint,
                   NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                   NULL::bigint, 'ack_' || a.result_code
            FROM {schema}.message_delete_many_v1(p_ids, p_lock_tokens) AS a
            WHERE a.result_code <> 'ok';
    END IF;
    RETURN QUERY SELECT * FROM {schema}.message_dequeue_v2(p_queues, p_limit, p_lock_ms);
END;
$$;


-- Mark queues with an x-expires as used now (consumers call this periodically).
CREATE FUNCTION {schema}.queue_touch_v1(p_queues text[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.queue SET used_at = clock_timestamp()
    WHERE name = ANY (p_queues) AND expires_ms IS NOT NULL
      AND used_at < clock_timestamp() - interval '1 second';
$$;


-- Delete expired messages (not held by a consumer) and queues unused for longer than their
-- x-expires, at most p_limit messages a call. Returns (messages, queues) deleted.
CREATE FUNCTION {schema}.expire_v1(p_limit integer, OUT messages bigint, OUT queues bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_old {schema}.channel;
    v_new {schema}.channel;
    v_n bigint;
    v_queue text;
BEGIN
    messages := 0;
    queues := 0;
    -- channels first, then their messages: the lock order of dequeue
    FOR v_old IN
        SELECT c.* FROM {schema}.channel c
        WHERE c.id IN (
            SELECT DISTINCT m.channel_id FROM (
                SELECT m.channel_id FROM {schema}.message m
                WHERE m.expires_at <= v_now
                ORDER BY m.expires_at LIMIT p_limit
            ) AS m
        )
        ORDER BY c.id
        FOR UPDATE SKIP LOCKED
    LOOP
        DELETE FROM {schema}.message m
        WHERE m.channel_id = v_old.id AND m.expires_at <= v_now AND m.locked_until IS NULL;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        CONTINUE WHEN v_n = 0;
        messages := messages + v_n;
        v_new := v_old;
        v_new.current_size := v_old.current_size - v_n;
        v_new.n_expired := v_old.n_expired + v_n;
        PERFORM {schema}.channel_store_v1(v_old, v_new, true);
    END LOOP;
    FOR v_queue IN
        SELECT q.name FROM {schema}.queue q
        WHERE q.expires_ms IS NOT NULL
          AND q.used_at < v_now - q.expires_ms * interval '1 millisecond'
        ORDER BY q.name
    LOOP
        PERFORM {schema}.queue_delete_v1(v_queue);
        queues := queues + 1;
    END LOOP;
END;
$$;


-- ---------------------------------------------------------------------------------------------
-- Operating: status, channels, messages, dead letters, settings, housekeeping.
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
    SELECT q.name, ch.total, ch.in_flight, w.ready, w.delayed, w.oldest,
           (SELECT count(*) FROM {schema}.dead_message d WHERE d.queue = q.name), ch.channels,
           ch.enqueued + coalesce(co.enqueued, 0), ch.delivered + coalesce(co.delivered, 0),
           coalesce(co.redelivered, 0), ch.acked + coalesce(co.acked, 0),
           ch.deferred + coalesce(co.deferred, 0), ch.dead + coalesce(co.dead, 0),
           ch.expired + coalesce(co.expired, 0), ch.dropped + coalesce(co.dropped, 0),
           q.max_concurrency, q.max_size, q.max_attempts, q.dead_letter, q.dead_retention_ms
    FROM {schema}.queue q
    CROSS JOIN LATERAL (
        SELECT coalesce(sum(c.current_size), 0)::bigint AS total,
               coalesce(sum(c.current_concurrency), 0)::bigint AS in_flight,
               count(*) FILTER (WHERE c.current_size > 0) AS channels,
               coalesce(sum(c.n_enqueued), 0)::bigint AS enqueued,
               coalesce(sum(c.n_delivered), 0)::bigint AS delivered,
               coalesce(sum(c.n_acked), 0)::bigint AS acked,
               coalesce(sum(c.n_deferred), 0)::bigint AS deferred,
               coalesce(sum(c.n_dead), 0)::bigint AS dead,
               coalesce(sum(c.n_expired), 0)::bigint AS expired,
               coalesce(sum(c.n_dropped), 0)::bigint AS dropped
        FROM {schema}.channel c WHERE c.queue_id = q.id
    ) AS ch
    LEFT JOIN (
        SELECT x.queue_id, sum(x.enqueued)::bigint AS enqueued,
               sum(x.delivered)::bigint AS delivered, sum(x.redelivered)::bigint AS redelivered,
               sum(x.acked)::bigint AS acked, sum(x.deferred)::bigint AS deferred,
               sum(x.dead)::bigint AS dead, sum(x.expired)::bigint AS expired,
               sum(x.dropped)::bigint AS dropped
        FROM {schema}.counter x GROUP BY x.queue_id
    ) AS co ON co.queue_id = q.id
    LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE m.dequeue_at <= clock_timestamp()) AS ready,
               count(*) FILTER (WHERE m.dequeue_at > clock_timestamp()) AS delayed,
               min(m.dequeue_at) FILTER (WHERE m.dequeue_at <= clock_timestamp()) AS oldest
        FROM {schema}.channel c2
        JOIN {schema}.message m ON m.channel_id = c2.id AND m.locked_until IS NULL
        WHERE c2.queue_id = q.id AND p_count_ready
    ) AS w ON p_count_ready
    ORDER BY q.name;
$$;


-- The channels of a queue, largest first, with their policies and counters.
CREATE FUNCTION {schema}.channel_list_v1(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint
)
LANGUAGE sql STABLE AS $$
    SELECT c.name, c.current_size, c.current_concurrency, c.max_concurrency, c.max_size,
           c.has_policy, c.waiting_since, nullif(c.served_at, '-infinity'), c.n_enqueued, c.n_delivered, c.n_acked,
           c.n_deferred, c.n_dead, c.n_expired, c.n_dropped
    FROM {schema}.channel c
    JOIN {schema}.queue q ON q.id = c.queue_id
    WHERE q.name = p_queue
    ORDER BY c.current_size DESC, c.current_concurrency DESC, c.name
    LIMIT p_limit;
$$;


-- Messages, oldest id first, after p_after (keyset paging), filtered by queue, channel and
-- state ('ready', 'delayed', 'locked', 'dead'; NULL: all); NULL filters match everything.
CREATE FUNCTION {schema}.message_list_v1(
    p_queue text, p_channel text, p_state text, p_after bigint, p_limit integer
)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    priority smallint, attempts integer, state text, dequeue_at timestamptz,
    locked_until timestamptz, created_at timestamptz, dead_at timestamptz, reason text,
    size integer
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    IF p_state IS NOT NULL AND p_state NOT IN ('ready', 'delayed', 'locked', 'dead') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('unknown message state %L (ready, delayed, locked or dead)', p_state);
    END IF;
    RETURN QUERY
        SELECT x.* FROM (
            (SELECT m.id, q.name, c.name, m.name, m.priority, m.attempts,
                    CASE WHEN m.locked_until IS NOT NULL THEN 'locked'
                         WHEN m.dequeue_at > v_now THEN 'delayed'
                         ELSE 'ready' END,
                    m.dequeue_at, m.locked_until, m.created_at, NULL::timestamptz, NULL::text,
                    length(m.content)
             FROM {schema}.message m
             JOIN {schema}.queue q ON q.id = m.queue_id
             JOIN {schema}.channel c ON c.id = m.channel_id
             WHERE m.id > p_after
               AND (p_queue IS NULL OR q.name = p_queue)
               AND (p_channel IS NULL OR c.name = p_channel)
               AND (p_state IS NULL
                    OR (p_state = 'locked' AND m.locked_until IS NOT NULL)
                    OR (p_state = 'delayed' AND m.locked_until IS NULL AND m.dequeue_at > v_now)
                    OR (p_state = 'ready' AND m.locked_until IS NULL AND m.dequeue_at <= v_now))
             ORDER BY m.id
             LIMIT p_limit)
            UNION ALL
            (SELECT d.id, d.queue, d.channel, d.name, d.priority, d.attempts, 'dead'::text,
                    NULL::timestamptz, NULL::timestamptz, d.created_at, d.dead_at, d.reason,
                    length(d.content)
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


-- One message, live or dead, with its content and saved state (no row: not found).
CREATE FUNCTION {schema}.message_get_v1(p_id bigint)
RETURNS TABLE (
    message_id bigint, queue_name text, channel_name text, message_name text,
    priority smallint, attempts integer, state text, dequeue_at timestamptz,
    locked_until timestamptz, expires_at timestamptz, created_at timestamptz,
    dead_at timestamptz, reason text, content bytea, saved_state bytea
)
LANGUAGE sql STABLE AS $$
    SELECT m.id, q.name, c.name, m.name, m.priority, m.attempts,
           CASE WHEN m.locked_until IS NOT NULL THEN 'locked'
                WHEN m.dequeue_at > clock_timestamp() THEN 'delayed'
                ELSE 'ready' END,
           m.dequeue_at, m.locked_until, m.expires_at, m.created_at, NULL::timestamptz,
           NULL::text, m.content, m.state
    FROM {schema}.message m
    JOIN {schema}.queue q ON q.id = m.queue_id
    JOIN {schema}.channel c ON c.id = m.channel_id
    WHERE m.id = p_id
    UNION ALL
    SELECT d.id, d.queue, d.channel, d.name, d.priority, d.attempts, 'dead', NULL, NULL, NULL,
           d.created_at, d.dead_at, d.reason, d.content, d.state
    FROM {schema}.dead_message d
    WHERE d.id = p_id;
$$;


-- Delete messages by id, whatever their state (a held one's holder then finds it gone), and
-- dead letters. result_code per id: 'deleted' or 'not_found'.
CREATE FUNCTION {schema}.message_remove_v1(p_ids bigint[])
RETURNS TABLE (message_id bigint, result_code text)
LANGUAGE plpgsql AS $$
DECLARE
    v_channels bigint[];
    v_held boolean[];
    v_gone bigint[];
    v_dead bigint[];
    r record;
BEGIN
    WITH gone AS (
        DELETE FROM {schema}.message m WHERE m.id = ANY (p_ids)
        RETURNING m.id, m.channel_id, m.locked_until IS NOT NULL AS held
    )
    SELECT array_agg(g.id), array_agg(g.channel_id), array_agg(g.held)
    INTO v_gone, v_channels, v_held FROM gone g;
    -- one update per channel, in id order (the order acks use)
    FOR r IN
        SELECT x.channel_id, count(*)::integer AS n, count(*) FILTER (WHERE x.held)::integer AS h
        FROM unnest(v_channels, v_held) AS x(channel_id, held)
        GROUP BY x.channel_id ORDER BY x.channel_id
    LOOP
        PERFORM {schema}.channel_release_v1(r.channel_id, -r.n, NULL, r.h, 'remove');
    END LOOP;
    WITH dead AS (
        DELETE FROM {schema}.dead_message d WHERE d.id = ANY (p_ids) RETURNING d.id
    )
    SELECT array_agg(d.id) INTO v_dead FROM dead d;
    RETURN QUERY
        SELECT h.id,
               CASE WHEN h.id = ANY (coalesce(v_gone, ARRAY[]::bigint[]))
                      OR h.id = ANY (coalesce(v_dead, ARRAY[]::bigint[]))
                    THEN 'deleted' ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
END;
$$;


-- Retry messages by id: a dead letter goes back to its queue and channel as a new message
-- (attempts start again; 'retried', new_id), a delayed message becomes due now ('due_now').
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
    v_channel_id bigint;
    v_locked timestamptz;
    v_at timestamptz;
BEGIN
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
        SELECT m.channel_id, m.locked_until, m.dequeue_at INTO v_channel_id, v_locked, v_at
        FROM {schema}.message m WHERE m.id = v_id;
        IF NOT FOUND THEN
            result_code := 'not_found';
        ELSIF v_locked IS NOT NULL THEN
            result_code := 'locked';
        ELSIF v_at <= clock_timestamp() THEN
            result_code := 'ready';
        ELSE
            UPDATE {schema}.message m SET dequeue_at = clock_timestamp()
            WHERE m.id = v_id AND m.locked_until IS NULL
            RETURNING m.dequeue_at INTO v_at;
            IF FOUND THEN
                PERFORM {schema}.channel_release_v1(v_channel_id, 0, v_at, 0, 'remove');
                result_code := 'due_now';
            ELSE
                result_code := 'locked';
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
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


-- Housekeeping, run by consumers every expire_interval: prune dead letters older than their
-- queue's retention (at most p_limit), and fold the counter rows of each queue into one.
CREATE FUNCTION {schema}.housekeep_v1(p_limit integer, OUT dead_pruned bigint)
LANGUAGE plpgsql AS $$
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
        DELETE FROM {schema}.dead_message d WHERE d.id IN (SELECT o.id FROM old o) RETURNING 1
    )
    SELECT count(*) INTO dead_pruned FROM gone;
    IF pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'counters', 0)) THEN
        WITH gone AS (
            DELETE FROM {schema}.counter RETURNING *
        )
        INSERT INTO {schema}.counter
            (queue_id, enqueued, delivered, redelivered, acked, deferred, dead, expired, dropped)
        SELECT g.queue_id, sum(g.enqueued), sum(g.delivered), sum(g.redelivered), sum(g.acked),
               sum(g.deferred), sum(g.dead), sum(g.expired), sum(g.dropped)
        FROM gone g
        WHERE EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.id = g.queue_id)
        GROUP BY g.queue_id;
    END IF;
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
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
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
ALTER FUNCTION {schema}.message_dequeue_v2(text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_reject_v1(bigint, uuid, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_status_v1(boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.channel_list_v1(text, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_list_v1(text, text, text, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_get_v1(bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_remove_v1(bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.message_retry_v1(bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION {schema}.dead_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.queue_configure_v1(text, jsonb)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.housekeep_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
