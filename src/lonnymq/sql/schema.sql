-- lonnymq schema: the full current version, used for a fresh install.
--
-- Placeholders filled in by lonnymq.migrations through psycopg.sql composition:
--   {{schema}}      the schema, as a quoted identifier
--   {{wake}}        the NOTIFY channel of this schema, as a string literal
--   {{lock_prefix}} the prefix of this schema's advisory lock keys, as a string literal
-- Every object is qualified with the schema; nothing relies on search_path.
--
-- The model (docs/design.md, "The hot path"):
--   message   one row per message, keyed by its queue and channel names: a producer writes
--             nothing else, so no producer waits for another (no shared row, no row that must
--             exist first). Each row carries the transaction that made it ready (txid).
--   discovery append-only: the latest row is the ingest position (a snapshot: every ready
--             message visible in it has been seen) and the per-queue scan positions. One
--             consumer at a time ingests what committed since (new messages, requeues) and
--             folds the tallies; consumers deliver only what has been ingested.
--   lane      append-only versions, one live version per (queue, channel) with something to
--             serve: its turn (round-robin key), when it was served, and per priority the
--             position its messages start at, so no scan walks what was consumed before.
--             Written by consumers only: the one that owns the lane for a dequeue (advisory
--             lock) and the ingest.
--   tally     insert-only event counts (per call and channel); folded into channel_count and
--             queue_count, from which the counters and the gauges (size, in flight) derive.
--   channel   only channels with a policy of their own or a limit in force: the exact counts a
--             limit needs (messages held, messages in flight), under the row's lock.

-- Contents, in the order of creation (Postgres checks a signature's types and a LANGUAGE sql
-- body when the function is created; a plpgsql body is resolved when it runs):
--    1. Tables and storage
--    2. Keys, wake-up and small helpers
--    3. Create
--    4. Ingest, discovery and fold
--    5. Counts
--    6. Dequeue
--    7. Acks and finalize: delete (ack), defer, heartbeat, bury (dead-letter), reject
--    8. Policies and limits
--    9. Queues: declare, purge, delete, stats
--   10. Routing: exchanges, bindings, publish
--   11. Expiry and housekeeping
--   12. Status, inspection and operator functions
--   13. Security: rights


-- ---------------------------------------------------------------------------------------------
-- 1. Tables and storage
-- The tables, their indexes and storage settings: first, since the functions' signatures
-- name their row types and LANGUAGE sql bodies are checked against them.
-- ---------------------------------------------------------------------------------------------

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
    name text COLLATE "C" NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 255),
    -- dead letters on or off, deliveries before a message is dead-lettered (NULL: no
    -- limit), how long dead letters are kept
    dead_letter boolean NOT NULL DEFAULT true,
    max_attempts integer DEFAULT 20 CHECK (max_attempts > 0),
    dead_retention_ms bigint NOT NULL DEFAULT 1209600000 CHECK (dead_retention_ms > 0),
    -- the queue-wide default rate: at most rate_count deliveries per rate_per_ms of a channel,
    -- burst at once
    rate_count integer CHECK (rate_count > 0),
    rate_per_ms bigint CHECK (rate_per_ms > 0),
    burst integer CHECK (burst > 0),
    -- Kombu's auto_delete (the queue goes when its last consumer does) and x-max-priority
    -- (higher message priorities are taken as it)
    auto_delete boolean NOT NULL DEFAULT false,
    max_priority smallint CHECK (max_priority BETWEEN 1 AND 255),
    CONSTRAINT queue_rate_whole CHECK (
        (rate_count IS NULL) = (rate_per_ms IS NULL) AND (rate_count IS NULL) = (burst IS NULL))
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
    queue text COLLATE "C" NOT NULL CHECK (length(queue) BETWEEN 1 AND 255),
    -- topic exchanges: the routing key as a regular expression (kombu's translation)
    pattern text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX binding_queue_idx ON {schema}.binding (queue);

-- Channels with a policy of their own, or with a limit in force (their own or the queue's
-- default): the exact counts the limits need. current_size counts the channel's messages
-- marked `sized` (created while a max_size applied, or held when one was set),
-- current_concurrency its messages marked `slotted` (locked while a max_concurrency applied).
-- `freed`: a slot came free while the channel was at its max_concurrency; the ingest gives
-- its lane a turn again.
CREATE TABLE {schema}.channel (
    queue text COLLATE "C" NOT NULL,
    name text COLLATE "C" NOT NULL CHECK (length(name) BETWEEN 1 AND 255),
    has_policy boolean NOT NULL DEFAULT false,
    own_max_concurrency integer CHECK (own_max_concurrency >= 0),
    own_max_size integer CHECK (own_max_size >= 0),
    current_size integer NOT NULL DEFAULT 0 CHECK (current_size >= 0),
    current_concurrency integer NOT NULL DEFAULT 0 CHECK (current_concurrency >= 0),
    freed boolean NOT NULL DEFAULT false,
    own_rate_count integer CHECK (own_rate_count > 0),
    own_rate_per_ms bigint CHECK (own_rate_per_ms > 0),
    own_burst integer CHECK (own_burst > 0),
    -- a rate in force (its own or the queue's): the GCRA's theoretical arrival time, and the
    -- emission interval it was reckoned with (a changed rate rescales what is owed)
    rate_tat timestamptz,
    rate_interval interval,
    PRIMARY KEY (queue, name),
    CONSTRAINT channel_rate_whole CHECK (
        (own_rate_count IS NULL) = (own_rate_per_ms IS NULL)
        AND (own_rate_count IS NULL) = (own_burst IS NULL))
);

CREATE INDEX channel_freed_idx ON {schema}.channel (queue, name) WHERE freed;

CREATE TABLE {schema}.message (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    priority smallint NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 255),
    attempts integer NOT NULL DEFAULT 0,
    -- how it became ready in the transaction txid: 0 created, 1 deferred or requeued,
    -- 2 made due now by an operator
    arrival smallint NOT NULL DEFAULT 0,
    -- counted in its channel row's current_size / current_concurrency
    sized boolean NOT NULL DEFAULT false,
    slotted boolean NOT NULL DEFAULT false,
    txid xid8 NOT NULL,
    dequeue_at timestamptz NOT NULL,
    locked_until timestamptz,
    lock_token uuid,
    expires_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    name text CHECK (length(name) BETWEEN 1 AND 255),
    content bytea NOT NULL,
    state bytea,
    -- a message is locked when it has both: statements that find a message by id and lock
    -- token rely on it, and so stay on the primary key, off message_locked_idx (which a held
    -- snapshot fills with the dead entries of everything consumed)
    CONSTRAINT message_lock_pair CHECK ((locked_until IS NULL) = (lock_token IS NULL))
);

-- Unlocked messages of a channel in the order they are handed out. Read from a lane's
-- position per priority, never from the start.
CREATE INDEX message_ready_idx ON {schema}.message (queue, channel, priority DESC, dequeue_at, id)
    WHERE locked_until IS NULL;

-- What became ready, by transaction: the ingest reads what committed since its snapshot.
-- (Its predicate names lock_token, message_ready_idx's locked_until: the same rows by
-- message_lock_pair, but no statement written for one index can be planned on the other; a
-- generic plan read this whole index, backlog and dead entries, for a lane's next position.)
CREATE INDEX message_txid_idx ON {schema}.message (txid) WHERE lock_token IS NULL;

-- Locked messages of a queue, by lock expiry. Read from the queue's lock position.
CREATE INDEX message_locked_idx ON {schema}.message (queue, locked_until)
    WHERE locked_until IS NOT NULL;

-- De-duplication: one never-dequeued message per (queue, channel, name).
CREATE UNIQUE INDEX message_name_idx ON {schema}.message (queue, channel, name)
    WHERE name IS NOT NULL AND attempts = 0;

-- Messages with a time to live, soonest expiry first.
CREATE INDEX message_expires_idx ON {schema}.message (expires_at) WHERE expires_at IS NOT NULL;

-- The ingest's position: append-only, the row with the highest id is the current one (read
-- with a backward scan of the primary key, so superseded rows are never walked). `snap`:
-- every message that became ready in a transaction visible in it has been ingested.
-- `folded`: the tallies of the transactions visible in it are in channel_count/queue_count.
-- Per queue (parallel arrays): turn_from, no live lane turn is earlier;
-- lock_from, no live lock of the queue expired before it without being handled; lock_next,
-- no live lock of the queue expires before it (NULL: none is known), and while the message
-- lock_id still has that expiry, it is the next one (kept from the tallies of the calls that
-- take or extend locks, and checked by primary key: never found by walking message_locked_idx,
-- whose entries of acked messages a held snapshot keeps).
CREATE TABLE {schema}.discovery (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    snap pg_snapshot NOT NULL,
    folded pg_snapshot NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    folded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    queues text[] COLLATE "C" NOT NULL DEFAULT '{{}}',
    turn_from timestamptz[] NOT NULL DEFAULT '{{}}',
    lock_from timestamptz[] NOT NULL DEFAULT '{{}}',
    lock_next timestamptz[] NOT NULL DEFAULT '{{}}',
    lock_id bigint[] NOT NULL DEFAULT '{{}}',
    expire_from timestamptz NOT NULL DEFAULT '-infinity',
    -- lanes this ingest could not write (their owner was serving them): their new heads per
    -- priority, applied by the next ingest (nobody waits for anybody)
    pend_queue text[] COLLATE "C" NOT NULL DEFAULT '{{}}',
    pend_channel text[] COLLATE "C" NOT NULL DEFAULT '{{}}',
    pend_prio smallint[] NOT NULL DEFAULT '{{}}',
    pend_at timestamptz[] NOT NULL DEFAULT '{{}}',
    pend_id bigint[] NOT NULL DEFAULT '{{}}'
);

-- A channel's lane: append-only versions, the one with the highest id per (queue, channel)
-- is live (the others are deleted when superseded). turn_at: when it is the lane's turn
-- (NULL: nothing to hand out, or at max_concurrency); served_at: when a dequeue last took
-- from it. prios/pos_at/pos_id: per priority present, where its ready messages start (in
-- message_ready_idx order); nothing ready of that priority lies before it except what the
-- ingest has yet to see (the ingest lowers it). limited: a max_concurrency or a rate applies
-- (only the lane's owner serves it, under its channel row).
-- A lane stays when its channel empties (its newest version is then found first, whatever
-- dead versions a held snapshot keeps); housekeeping removes it once the channel has been
-- empty for a while (lane_idle).
CREATE TABLE {schema}.lane (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    turn_at timestamptz,
    served_at timestamptz NOT NULL DEFAULT '-infinity',
    written_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    limited boolean NOT NULL DEFAULT false,
    prios smallint[] NOT NULL DEFAULT '{{}}',
    pos_at timestamptz[] NOT NULL DEFAULT '{{}}',
    pos_id bigint[] NOT NULL DEFAULT '{{}}',
    -- a rated channel out of tokens: no turn before its next token (the ingest keeps to it)
    not_before timestamptz
);

CREATE INDEX lane_latest_idx ON {schema}.lane (queue, channel, id DESC);

CREATE INDEX lane_turn_idx ON {schema}.lane (queue, turn_at, id) WHERE turn_at IS NOT NULL;

-- Channels found empty by a fold, since when: housekeeping (lane_prune_v1) removes the lane
-- and the counts of those still empty after a while. One row per channel, written when it
-- empties and when it is looked at, not per message.
CREATE TABLE {schema}.lane_idle (
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    since timestamptz NOT NULL,
    PRIMARY KEY (queue, channel)
);

CREATE INDEX lane_idle_since_idx ON {schema}.lane_idle (since);

-- Event counts, insert-only (one row per call and channel), folded by the ingest into
-- channel_count; what is not folded yet is read by txid.
CREATE TABLE {schema}.tally (
    txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    enqueued integer NOT NULL DEFAULT 0,
    delivered integer NOT NULL DEFAULT 0,
    redelivered integer NOT NULL DEFAULT 0,
    acked integer NOT NULL DEFAULT 0,
    deferred integer NOT NULL DEFAULT 0,
    dead integer NOT NULL DEFAULT 0,
    dead_held integer NOT NULL DEFAULT 0,
    expired integer NOT NULL DEFAULT 0,
    dropped integer NOT NULL DEFAULT 0,
    removed integer NOT NULL DEFAULT 0,
    removed_held integer NOT NULL DEFAULT 0,
    purged integer NOT NULL DEFAULT 0,
    -- the earliest expiry of the locks this call took or extended (the ingest's hint of the
    -- next expiry comes from here, not from a walk of message_locked_idx, whose entries of
    -- acked messages a held snapshot keeps)
    lock_until timestamptz,
    lock_id bigint
);

CREATE INDEX tally_txid_idx ON {schema}.tally (txid);

-- Folded counts per channel that holds or held messages since it was last empty; a channel
-- left empty (and without a policy) moves its counts to queue_count. Gauges derive from them:
-- size = enqueued - acked - dead - expired - removed - purged,
-- in flight = delivered - redelivered - acked - deferred - dead_held - removed_held.
CREATE TABLE {schema}.channel_count (
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
    enqueued bigint NOT NULL DEFAULT 0,
    delivered bigint NOT NULL DEFAULT 0,
    redelivered bigint NOT NULL DEFAULT 0,
    acked bigint NOT NULL DEFAULT 0,
    deferred bigint NOT NULL DEFAULT 0,
    dead bigint NOT NULL DEFAULT 0,
    dead_held bigint NOT NULL DEFAULT 0,
    expired bigint NOT NULL DEFAULT 0,
    dropped bigint NOT NULL DEFAULT 0,
    removed bigint NOT NULL DEFAULT 0,
    removed_held bigint NOT NULL DEFAULT 0,
    purged bigint NOT NULL DEFAULT 0,
    -- a row per channel, replaced (not updated) by each fold: the newest id is the live one
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY
);

CREATE INDEX channel_count_latest_idx ON {schema}.channel_count (queue, channel, id DESC);

-- The counts of a queue's channels that emptied.
CREATE TABLE {schema}.queue_count (
    queue text COLLATE "C" PRIMARY KEY,
    enqueued bigint NOT NULL DEFAULT 0,
    delivered bigint NOT NULL DEFAULT 0,
    redelivered bigint NOT NULL DEFAULT 0,
    acked bigint NOT NULL DEFAULT 0,
    deferred bigint NOT NULL DEFAULT 0,
    dead bigint NOT NULL DEFAULT 0,
    dead_held bigint NOT NULL DEFAULT 0,
    expired bigint NOT NULL DEFAULT 0,
    dropped bigint NOT NULL DEFAULT 0,
    removed bigint NOT NULL DEFAULT 0,
    removed_held bigint NOT NULL DEFAULT 0,
    purged bigint NOT NULL DEFAULT 0
);

-- Dead letters: messages rejected without requeue, or delivered max_attempts times.
CREATE TABLE {schema}.dead_message (
    id bigint PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    channel text COLLATE "C" NOT NULL,
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

-- Storage: the hot tables churn; leave room on each page for updated row versions (HOT
-- updates), and let autovacuum, where it runs, visit them early.
ALTER TABLE {schema}.message SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.01);

ALTER TABLE {schema}.lane SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000);

ALTER TABLE {schema}.discovery SET (autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000);

ALTER TABLE {schema}.tally SET (autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000);

ALTER TABLE {schema}.channel SET (fillfactor = 70);

ALTER TABLE {schema}.channel_count SET (fillfactor = 70);

ALTER TABLE {schema}.consumer SET (fillfactor = 50);


-- ---------------------------------------------------------------------------------------------
-- 2. Keys, wake-up and small helpers
-- Advisory lock keys, the NOTIFY of sleeping consumers, queue ids, lane versions.
-- ---------------------------------------------------------------------------------------------

-- The advisory lock key of a lane: held (transaction lock) by the dequeue that owns the lane
-- for its call, and by the ingest and the policy changes that rewrite it.
CREATE FUNCTION {schema}.lane_key_v1(p_queue text, p_channel text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended({lock_prefix} || 'lane:' || p_queue || chr(31) || p_channel, 0)
$$;

-- Keys of a queue: 'produce' is held shared by every producer transaction of the queue until
-- it ends; 'sleep' is held shared (session lock) by consumers that found nothing and wait for
-- a NOTIFY. Neither is ever waited for by a producer.
CREATE FUNCTION {schema}.queue_key_v1(p_kind text, p_queue text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended({lock_prefix} || p_kind || ':' || p_queue, 0)
$$;

-- Wake consumers of a queue that sleep (they hold its 'sleep' key): NOTIFY only then, so a
-- busy queue's producers pay no NOTIFY (each costs a database-wide lock at commit).
CREATE FUNCTION {schema}.wake_v1(p_queue text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('sleep', p_queue);
BEGIN
    -- (this session's next dequeue ingests first, waiting for a running ingest: so that a
    -- session that requeues or creates and then dequeues sees what it did, in its place)
    PERFORM set_config('lonnymq.fresh', 'on', false);
    -- (a session's own sleep lock does not stop its own try: that session is told by the
    -- setting it keeps of its sleep keys)
    IF pg_try_advisory_lock(v_key) THEN
        PERFORM pg_advisory_unlock(v_key);
        IF v_key <> ALL (string_to_array(coalesce(current_setting('lonnymq.sleeping', true), ''),
                                         ',')::bigint[]) THEN
            RETURN;
        END IF;
    END IF;
    PERFORM pg_notify({wake}, p_queue);
END;
$$;

-- Hold and release the shared `sleep` keys of queues on this session, queue by queue (the
-- transport holds them on its LISTEN session, for the queues of its idle channels; see
-- docs/design.md, "Wake-ups"): takes those of p_take, releases those of p_drop (keys the
-- session holds), and returns the queues of p_check with a producer transaction open (their
-- `produce` key is held), in name order. A client that takes a key looks for messages again
-- afterwards, and again each time a queue it checked has no producer transaction open any
-- more: the protocol of the dequeue's step 6.
CREATE FUNCTION {schema}.sleep_v1(p_take text[], p_drop text[], p_check text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared({schema}.queue_key_v1('sleep', d.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_drop) AS u(q) ORDER BY u.q) AS d;
    PERFORM pg_advisory_lock_shared({schema}.queue_key_v1('sleep', t.q))
    FROM (SELECT DISTINCT u.q FROM unnest(p_take) AS u(q) ORDER BY u.q) AS t;
    RETURN ARRAY(SELECT DISTINCT c.q FROM unnest(p_check) AS c(q)
                 WHERE NOT {schema}.queue_idle_v1(c.q) ORDER BY c.q);
END;
$$;

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

-- A lane's live version (NULL when the channel has none): the first entry of lane_latest_idx
-- from (p_queue, p_channel) on, newest first. (Written as a range in that index's order, which
-- no other index gives: with `queue = $1 AND channel = $2 ORDER BY id DESC` the planner may read
-- the primary key backwards and filter, every lane version of every channel written since,
-- live or dead: 8,000 buffers per ingest three minutes into a held snapshot.)
CREATE FUNCTION {schema}.lane_get_v1(p_queue text, p_channel text) RETURNS {schema}.lane
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    v_lane {schema}.lane;
BEGIN
    SELECT * INTO v_lane FROM {schema}.lane l WHERE (l.queue, l.channel) >= (p_queue, p_channel)
    ORDER BY l.queue, l.channel, l.id DESC LIMIT 1;
    IF v_lane.queue IS DISTINCT FROM p_queue OR v_lane.channel IS DISTINCT FROM p_channel THEN
        RETURN NULL;
    END IF;
    RETURN v_lane;
END;
$$;

-- Replace a lane's version by a new one: the old row is deleted, the new one inserted (so a
-- read of the latest version never walks superseded ones). The caller holds the lane's key,
-- or the live version's row lock (lane_lock_v1). Nothing is written when the old version is
-- no longer the live one, or is locked by another transaction (lane_lock_v1).
-- (Rows of lane and channel_count are found by their whole key, (queue, channel, id), never by
-- id alone: after a VACUUM the planner may serve `id = $1` from lane_latest_idx, whose last
-- column is the id, read whole: 3,300 buffers per delete late in a held snapshot. With the
-- whole key, either index finds the row at once.)
CREATE FUNCTION {schema}.lane_put_v1(p_old_id bigint, p_new {schema}.lane) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
BEGIN
    IF p_old_id IS NOT NULL THEN
        -- (compare and swap: only over the live version, and not one that a writer holding
        -- the ingest key has locked, lane_lock_v1: that one's write wins; a dequeue never
        -- waits for it)
        DELETE FROM {schema}.lane l
        WHERE l.queue = p_new.queue AND l.channel = p_new.channel AND l.id = p_old_id
          AND l.id = (SELECT x.id FROM {schema}.lane x
                      WHERE x.queue = p_new.queue AND x.channel = p_new.channel
                        AND x.id = p_old_id
                      FOR UPDATE SKIP LOCKED);
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    INSERT INTO {schema}.lane (queue, channel, turn_at, served_at, limited, prios, pos_at, pos_id,
                               not_before)
    VALUES (p_new.queue, p_new.channel, p_new.turn_at, p_new.served_at, p_new.limited,
            p_new.prios, p_new.pos_at, p_new.pos_id, p_new.not_before);
END;
$$;

-- Lock a lane's live version (FOR UPDATE) and return it (NULL: the channel has no lane), for
-- a writer that holds the ingest key (a policy change, a purge, a queue delete), in place of
-- the lane's advisory key: such a key is a slot of the server's lock table until commit, and
-- a queue-wide change over 100,000 channels ran out of them. A dequeue that owns the lane
-- meanwhile may still serve the version it read; its rewrite (lane_put_v1) then finds the
-- version locked and writes nothing. A version its owner is replacing right now is waited
-- for (a dequeue: a short transaction), and its successor locked instead.
CREATE FUNCTION {schema}.lane_lock_v1(p_queue text, p_channel text) RETURNS {schema}.lane
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lane {schema}.lane;
BEGIN
    LOOP
        v_lane := {schema}.lane_get_v1(p_queue, p_channel);
        IF v_lane.id IS NULL THEN
            RETURN NULL;
        END IF;
        PERFORM 1 FROM {schema}.lane l
        WHERE l.queue = p_queue AND l.channel = p_channel AND l.id = v_lane.id
        FOR UPDATE;
        IF FOUND THEN
            RETURN v_lane;
        END IF;
    END LOOP;
END;
$$;

-- A lane's positions tightened to its first message per priority (ready or delayed, ingested,
-- not locked by a committed dequeue; one locked by a dequeue still running counts, so that no
-- position passes a message that such a dequeue may still give back), the priorities that
-- still have one, and when the first of them falls due (NULL: none).
-- (Bitmap scans off, here and in the dequeue: a bitmap heap scan reads and sorts every row from
-- the position on, where an index scan stops after the first; see migration 7.)
CREATE FUNCTION {schema}.lane_next_v1(
    p_lane {schema}.lane, p_snap pg_snapshot, OUT next_at timestamptz, OUT prios smallint[],
    OUT pos_at timestamptz[], OUT pos_id bigint[]
)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
BEGIN
    SELECT min(n.dequeue_at),
           coalesce(array_agg(p.prio ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}'),
           coalesce(array_agg(n.dequeue_at ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}'),
           coalesce(array_agg(n.id ORDER BY p.prio DESC) FILTER (WHERE n.id IS NOT NULL), '{{}}')
    INTO next_at, prios, pos_at, pos_id
    FROM unnest(p_lane.prios, p_lane.pos_at, p_lane.pos_id) AS p(prio, at, pid)
    LEFT JOIN LATERAL (
        SELECT m.dequeue_at, m.id FROM {schema}.message m
        WHERE m.queue = p_lane.queue AND m.channel = p_lane.channel AND m.locked_until IS NULL
          AND m.priority = p.prio AND (m.dequeue_at, m.id) >= (p.at, p.pid)
          AND pg_visible_in_snapshot(m.txid, p_snap)
        ORDER BY m.priority DESC, m.dequeue_at, m.id
        LIMIT 1
    ) AS n ON true;
END;
$$;


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


-- ---------------------------------------------------------------------------------------------
-- 4. Ingest, discovery and fold
-- The ingest position (discovery), what committed since, and the fold of the tallies.
-- ---------------------------------------------------------------------------------------------

-- The current snapshot, with the caller's own transaction among the running ones. (A
-- transaction's own snapshot leaves its xid out: what it writes after the ingest, such as
-- its tally, would pass for ingested and never be.)
CREATE FUNCTION {schema}.snapshot_v1() RETURNS pg_snapshot
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_snap pg_snapshot := pg_current_snapshot();
    v_own xid8 := pg_current_xact_id_if_assigned();
BEGIN
    IF v_own IS NULL OR NOT pg_visible_in_snapshot(v_own, v_snap) THEN
        RETURN v_snap;
    END IF;
    RETURN format('%s:%s:%s', LEAST(pg_snapshot_xmin(v_snap), v_own), pg_snapshot_xmax(v_snap),
        array_to_string(ARRAY(
            SELECT x FROM (SELECT pg_snapshot_xip(v_snap) AS x UNION SELECT v_own) AS u
            ORDER BY x), ','))::pg_snapshot;
END;
$$;

-- The ingest's first position (only when there is none: a repair of the schema must not claim
-- what is not ingested), with the installing transaction among the running ones: what it
-- creates after the install (inside a caller's transaction) is not taken as ingested, even
-- when a later transaction committed meanwhile.
INSERT INTO {schema}.discovery (snap, folded)
SELECT {schema}.snapshot_v1(), {schema}.snapshot_v1()
WHERE NOT EXISTS (SELECT 1 FROM {schema}.discovery);

-- Positions merged: per priority, the earlier of the old and the new (p_* are the new ones).
CREATE FUNCTION {schema}.positions_merge_v1(
    p_lane {schema}.lane, p_prios smallint[], p_at timestamptz[], p_id bigint[],
    OUT prios smallint[], OUT pos_at timestamptz[], OUT pos_id bigint[]
)
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    SELECT array_agg(x.prio ORDER BY x.prio DESC), array_agg(x.at ORDER BY x.prio DESC),
           array_agg(x.pid ORDER BY x.prio DESC)
    INTO prios, pos_at, pos_id
    FROM (
        SELECT DISTINCT ON (u.prio) u.prio, u.at, u.pid
        FROM (
            SELECT * FROM unnest(p_lane.prios, p_lane.pos_at, p_lane.pos_id) AS o(prio, at, pid)
            UNION ALL
            SELECT * FROM unnest(p_prios, p_at, p_id) AS n(prio, at, pid)
        ) AS u
        ORDER BY u.prio, u.at, u.pid
    ) AS x;
END;
$$;

-- Ingest what became ready in transactions that committed since the last snapshot (new
-- messages, deferred and requeued ones): give their lanes a turn, or an earlier one, and lower
-- the lanes' positions to them; count the created ones; give a turn back to lanes whose
-- channel got a slot back (`freed`); advance the scan positions of p_queues; fold the tallies
-- (at most once a second, or now with p_fold). One caller at a time (advisory lock): with
-- p_wait it waits for the current one, else it returns the latest state. Consumers deliver
-- only what is ingested.
CREATE FUNCTION {schema}.ingest_v1(p_queues text[], p_wait boolean, p_fold boolean)
RETURNS {schema}.discovery
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_old {schema}.discovery;
    v_new {schema}.discovery;
    v_snap pg_snapshot;
    v_now timestamptz;
    v_xip xid8[];
    r record;
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_merged record;
    v_max integer;
    v_in_flight integer;
    v_tf timestamptz;
    v_at timestamptz;
    v_i integer;
    v_q text;
    v_last_queue text := '';
    v_cq text[] := ARRAY[]::text[];
    v_cc text[] := ARRAY[]::text[];
    v_cn integer[] := ARRAY[]::integer[];
    v_fold boolean;
    v_limited boolean;
    v_next record;
    v_next_id bigint;
    -- lane keys taken (each holds a slot of the server's lock table until commit: at most
    -- max_locks_per_transaction x max_connections in all, 6,400 by default)
    v_keys integer := 0;
    -- heads of the lanes left for the next ingest (pend_*), and how many
    v_pq text[] := ARRAY[]::text[];
    v_pc text[] := ARRAY[]::text[];
    v_pp smallint[] := ARRAY[]::smallint[];
    v_pa timestamptz[] := ARRAY[]::timestamptz[];
    v_pi bigint[] := ARRAY[]::bigint[];
    v_np integer := 0;
    v_k integer;
BEGIN
    IF p_wait THEN
        PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    ELSIF NOT pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        SELECT * INTO v_old FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        RETURN v_old;
    END IF;
    SELECT * INTO v_old FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    v_snap := {schema}.snapshot_v1();
    v_now := clock_timestamp();
    v_new := v_old;
    -- what was in progress then and has committed since
    v_xip := ARRAY(SELECT x FROM pg_snapshot_xip(v_old.snap) AS x
                   WHERE pg_visible_in_snapshot(x, v_snap));
    FOR r IN
        WITH fresh AS MATERIALIZED (
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(v_old.snap) AND m.txid < pg_snapshot_xmax(v_snap)
              AND m.lock_token IS NULL AND pg_visible_in_snapshot(m.txid, v_snap)
            UNION ALL
            -- (by the txid index, one probe per transaction: another partial index of the
            -- same predicate would be read whole, dead entries and all; OFFSET 0 keeps the
            -- planner from flattening the probes into a hash join over such a read)
            SELECT m.queue, m.channel, m.priority, m.dequeue_at, m.id, m.arrival
            FROM unnest(v_xip) AS x(txid)
            CROSS JOIN LATERAL (
                SELECT m.* FROM {schema}.message m
                WHERE m.txid = x.txid AND m.lock_token IS NULL
                OFFSET 0
            ) AS m
            UNION ALL
            -- the heads the last ingest could not write (counted then)
            SELECT p.q, p.c, p.prio, p.at, p.id, 1::smallint
            FROM unnest(v_old.pend_queue, v_old.pend_channel, v_old.pend_prio, v_old.pend_at,
                        v_old.pend_id) AS p(q, c, prio, at, id)
        ), heads AS (
            SELECT DISTINCT ON (f.queue, f.channel, f.priority)
                   f.queue, f.channel, f.priority, f.dequeue_at, f.id
            FROM fresh f ORDER BY f.queue, f.channel, f.priority, f.dequeue_at, f.id
        ), counts AS (
            SELECT f.queue, f.channel,
                   count(*) FILTER (WHERE f.arrival = 0)::integer AS created,
                   min(f.dequeue_at) AS due
            FROM fresh f GROUP BY f.queue, f.channel
        )
        SELECT c.queue, c.channel, c.created, c.due,
               array_agg(h.priority ORDER BY h.priority DESC) AS prios,
               array_agg(h.dequeue_at ORDER BY h.priority DESC) AS pos_at,
               array_agg(h.id ORDER BY h.priority DESC) AS pos_id
        FROM counts c JOIN heads h ON h.queue = c.queue AND h.channel = c.channel
        GROUP BY c.queue, c.channel, c.created, c.due
        ORDER BY c.queue, c.channel
    LOOP
        IF r.queue <> v_last_queue THEN
            v_last_queue := r.queue;
            IF NOT EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = r.queue) THEN
                INSERT INTO {schema}.queue (name) VALUES (r.queue) ON CONFLICT (name) DO NOTHING;
            END IF;
            v_i := array_position(v_old.queues, r.queue);
            v_tf := CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_old.turn_from[v_i] END;
        END IF;
        IF r.created > 0 THEN
            v_cq := v_cq || r.queue;
            v_cc := v_cc || r.channel;
            v_cn := v_cn || r.created;
        END IF;
        -- A channel without a lane gets one, and needs no key: no dequeue can own a lane that
        -- has no version, and whoever else creates lanes holds the ingest key. A lane that
        -- exists is written under its key: one its owner is serving right now waits for the
        -- next ingest (no waiting), and so do those past the first 1,000 keys of this ingest
        -- (each key holds a slot of the lock table until commit: 100,000 of them made every
        -- ingest fail with `out of shared memory`).
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        IF v_lane.id IS NOT NULL THEN
            IF v_keys >= 1000
               OR NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel)) THEN
                -- (appended in place, element by element: `||` would copy the arrays at each)
                FOR v_k IN 1 .. cardinality(r.prios) LOOP
                    v_np := v_np + 1;
                    v_pq[v_np] := r.queue;
                    v_pc[v_np] := r.channel;
                    v_pp[v_np] := r.prios[v_k];
                    v_pa[v_np] := r.pos_at[v_k];
                    v_pi[v_np] := r.pos_id[v_k];
                END LOOP;
                CONTINUE;
            END IF;
            v_keys := v_keys + 1;
            -- (again, under the key: its owner may have written a newer version meanwhile)
            v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        END IF;
        v_put := v_lane;
        IF v_lane.id IS NULL THEN
            SELECT l.max_concurrency IS NOT NULL OR l.rate_count IS NOT NULL INTO v_limited
            FROM {schema}.channel_limits_v2(r.queue, r.channel) l;
            v_put := ROW(NULL, r.queue, r.channel, NULL, '-infinity', v_now, v_limited,
                         '{{}}', '{{}}', '{{}}', NULL)::{schema}.lane;
        END IF;
        SELECT * INTO v_merged FROM {schema}.positions_merge_v1(v_put, r.prios, r.pos_at, r.pos_id);
        v_put.prios := v_merged.prios;
        v_put.pos_at := v_merged.pos_at;
        v_put.pos_id := v_merged.pos_id;
        -- (a rated lane out of tokens: not before its next one)
        v_at := GREATEST(r.due, v_put.served_at, v_tf, v_put.not_before);
        IF v_put.turn_at IS NOT NULL THEN
            v_put.turn_at := LEAST(v_put.turn_at, v_at);
        ELSE
            -- no turn: nothing was ready, or the channel is at its max_concurrency
            v_in_flight := 0;
            IF v_put.limited THEN
                SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.channel) l;
                SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
                WHERE c.queue = r.queue AND c.name = r.channel;
            END IF;
            IF NOT v_put.limited OR v_max IS NULL OR coalesce(v_in_flight, 0) < v_max THEN
                v_put.turn_at := v_at;
            END IF;
        END IF;
        IF v_lane.id IS NULL OR v_put.turn_at IS DISTINCT FROM v_lane.turn_at
           OR v_put.prios IS DISTINCT FROM v_lane.prios OR v_put.pos_at IS DISTINCT FROM v_lane.pos_at
           OR v_put.pos_id IS DISTINCT FROM v_lane.pos_id THEN
            PERFORM {schema}.lane_put_v1(v_lane.id, v_put);
        END IF;
    END LOOP;

    v_new.pend_queue := v_pq;
    v_new.pend_channel := v_pc;
    v_new.pend_prio := v_pp;
    v_new.pend_at := v_pa;
    v_new.pend_id := v_pi;

    -- channels that got a slot back while at their max_concurrency: their lanes' turn again
    -- (the lane, then the channel row: the order of the dequeue; an ack locks only the row)
    -- (a lane being served, or a row an ack holds, waits for the next ingest)
    FOR r IN SELECT c.queue, c.name FROM {schema}.channel c WHERE c.freed ORDER BY c.queue, c.name LOOP
        EXIT WHEN v_keys >= 1000;
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.name));
        v_keys := v_keys + 1;
        SELECT c.current_concurrency INTO v_in_flight FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND c.freed FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        v_lane := {schema}.lane_get_v1(r.queue, r.name);
        IF v_lane.id IS NOT NULL AND v_lane.turn_at IS NULL THEN
            SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(r.queue, r.name) l;
            IF v_max IS NULL OR v_in_flight < v_max THEN
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
                IF v_next.next_at IS NOT NULL THEN
                    v_i := array_position(v_old.queues, r.queue);
                    v_lane.turn_at := GREATEST(v_next.next_at, v_lane.served_at, v_lane.not_before,
                        CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_old.turn_from[v_i] END);
                    PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                END IF;
            END IF;
        END IF;
        UPDATE {schema}.channel c SET freed = false WHERE c.queue = r.queue AND c.name = r.name;
        DELETE FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.name AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0
          AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
    END LOOP;

    -- the locks taken or extended since the last ingest: per queue, the earliest (and its
    -- message) lowers the queue's next expiry (every queue known, the caller's or not)
    FOR r IN
        SELECT DISTINCT ON (t.queue) t.queue, t.lock_until, t.lock_id
        FROM (
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid >= pg_snapshot_xmax(v_old.snap) AND t.txid < pg_snapshot_xmax(v_snap)
              AND pg_visible_in_snapshot(t.txid, v_snap) AND t.lock_until IS NOT NULL
            UNION ALL
            SELECT t.queue, t.lock_until, t.lock_id FROM {schema}.tally t
            WHERE t.txid = ANY (v_xip) AND t.lock_until IS NOT NULL
        ) AS t
        ORDER BY t.queue, t.lock_until, t.lock_id
    LOOP
        v_i := array_position(v_new.queues, r.queue);
        IF v_i IS NOT NULL AND (v_new.lock_next[v_i] IS NULL OR r.lock_until < v_new.lock_next[v_i]) THEN
            v_new.lock_next[v_i] := r.lock_until;
            v_new.lock_id[v_i] := r.lock_id;
        END IF;
    END LOOP;

    -- scan positions of the caller's queues
    FOREACH v_q IN ARRAY ARRAY(SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q) ORDER BY u.q) LOOP
        v_i := array_position(v_new.queues, v_q);
        IF v_i IS NULL THEN
            v_new.queues := v_new.queues || v_q;
            v_new.turn_from := v_new.turn_from || '-infinity'::timestamptz;
            v_new.lock_from := v_new.lock_from || '-infinity'::timestamptz;
            v_new.lock_next := v_new.lock_next || '-infinity'::timestamptz;
            v_new.lock_id := v_new.lock_id || NULL::bigint;
            v_i := cardinality(v_new.queues);
        END IF;
        -- no live turn of the queue is earlier than the first one found from the old position
        -- (every later turn is written at or after its writer's clock, or by an ingest)
        v_new.turn_from[v_i] := LEAST(v_now, coalesce((
            SELECT l.turn_at FROM {schema}.lane l
            WHERE l.queue = v_q AND l.turn_at >= v_new.turn_from[v_i]
            ORDER BY l.turn_at, l.id LIMIT 1), v_now));
        -- locks that expired and are not handled yet, else now
        v_new.lock_from[v_i] := coalesce((
            SELECT m.locked_until FROM {schema}.message m
            WHERE m.queue = v_q AND m.locked_until >= v_new.lock_from[v_i]
              AND m.locked_until <= v_now
            ORDER BY m.locked_until LIMIT 1), v_now);
        -- the next lock expiry: while the message named still has it, it is the next one;
        -- else (acked, extended, taken over) the first live lock from it on (the entries
        -- between, of acked messages, are walked about once: the bound moves on past them)
        IF v_new.lock_next[v_i] IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM {schema}.message m
            WHERE m.id = v_new.lock_id[v_i] AND m.queue = v_q
              AND m.locked_until = v_new.lock_next[v_i]) THEN
            SELECT m.locked_until, m.id INTO v_at, v_next_id FROM {schema}.message m
            WHERE m.queue = v_q AND m.locked_until >= v_new.lock_next[v_i]
            ORDER BY m.locked_until LIMIT 1;
            v_new.lock_next[v_i] := v_at;  -- (NULL: no lock)
            v_new.lock_id[v_i] := v_next_id;
        END IF;
    END LOOP;

    v_fold := p_fold OR v_old.folded_at < v_now - interval '1 second';
    IF v_fold THEN
        PERFORM {schema}.fold_v1(v_old.folded, v_snap, v_cq, v_cc, v_cn);
        v_new.folded := v_snap;
        v_new.folded_at := v_now;
    ELSIF cardinality(v_cq) > 0 THEN
        INSERT INTO {schema}.tally (queue, channel, enqueued)
        SELECT * FROM unnest(v_cq, v_cc, v_cn);
    END IF;
    v_new.snap := v_snap;
    v_new.taken_at := v_now;
    INSERT INTO {schema}.discovery
        (snap, folded, taken_at, folded_at, queues, turn_from, lock_from, lock_next, lock_id,
         expire_from, pend_queue, pend_channel, pend_prio, pend_at, pend_id)
    VALUES (v_new.snap, v_new.folded, v_new.taken_at, v_new.folded_at, v_new.queues,
            v_new.turn_from, v_new.lock_from, v_new.lock_next, v_new.lock_id, v_new.expire_from,
            v_new.pend_queue, v_new.pend_channel, v_new.pend_prio, v_new.pend_at, v_new.pend_id)
    RETURNING * INTO v_new;
    DELETE FROM {schema}.discovery d WHERE d.id = v_old.id;
    RETURN v_new;
END;
$$;

-- Ingest, waiting (at most 50 ms) for an ingest another consumer is running: what it brings
-- in is not deliverable before it commits. Past the 50 ms, the latest state as it is.
CREATE FUNCTION {schema}.ingest_wait_v1(p_queues text[]) RETURNS {schema}.discovery
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_d {schema}.discovery;
    v_timeout text := current_setting('lock_timeout');
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', '50ms', true);
        v_d := {schema}.ingest_v1(p_queues, true, false);
    EXCEPTION WHEN lock_not_available THEN
        SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    END;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN v_d;
END;
$$;

-- Fold the tallies of the transactions visible in p_snap and not in p_from (with p_q/p_c/p_n
-- enqueued counts of the caller) into channel_count; a channel left empty, without a policy,
-- is noted in lane_idle (its lane and counts go when it has stayed empty for a while:
-- lane_prune_v1). Run by the ingest.
CREATE FUNCTION {schema}.fold_v1(
    p_from pg_snapshot, p_snap pg_snapshot, p_q text[], p_c text[], p_n integer[]
) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_xip xid8[];
    r {schema}.channel_count;
    v_idle_q text[] := ARRAY[]::text[];
    v_idle_c text[] := ARRAY[]::text[];
BEGIN
    v_xip := ARRAY(SELECT x FROM pg_snapshot_xip(p_from) AS x WHERE pg_visible_in_snapshot(x, p_snap));
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.tally t
            WHERE t.txid >= pg_snapshot_xmax(p_from) AND t.txid < pg_snapshot_xmax(p_snap)
              AND pg_visible_in_snapshot(t.txid, p_snap)
            RETURNING t.*
        ), gone_late AS (
            DELETE FROM {schema}.tally t WHERE t.txid = ANY (v_xip)
            RETURNING t.*
        ), delta AS (
            SELECT g.queue, g.channel, sum(g.enqueued) AS enqueued, sum(g.delivered) AS delivered,
                   sum(g.redelivered) AS redelivered, sum(g.acked) AS acked,
                   sum(g.deferred) AS deferred, sum(g.dead) AS dead, sum(g.dead_held) AS dead_held,
                   sum(g.expired) AS expired, sum(g.dropped) AS dropped, sum(g.removed) AS removed,
                   sum(g.removed_held) AS removed_held, sum(g.purged) AS purged
            FROM (
                SELECT * FROM gone
                UNION ALL SELECT * FROM gone_late
                UNION ALL
                SELECT NULL::xid8, u.q, u.c, u.n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                       NULL::timestamptz, NULL::bigint
                FROM unnest(p_q, p_c, p_n) AS u(q, c, n)
            ) AS g
            WHERE EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = g.queue)
            GROUP BY g.queue, g.channel
        ), old AS (
            -- (each channel's row is replaced, not updated: its newest version is found first
            -- by channel_count_latest_idx, whatever dead versions a held snapshot keeps; an
            -- update in place would make every fold walk the row's chain of versions, and a
            -- delete and insert of the same key every dead entry of that key)
            SELECT d.*, o.id AS old_id, o.enqueued AS o_enqueued, o.delivered AS o_delivered,
                   o.redelivered AS o_redelivered, o.acked AS o_acked, o.deferred AS o_deferred,
                   o.dead AS o_dead, o.dead_held AS o_dead_held, o.expired AS o_expired,
                   o.dropped AS o_dropped, o.removed AS o_removed,
                   o.removed_held AS o_removed_held, o.purged AS o_purged
            FROM delta d
            -- (the newest row from (queue, channel) on, in channel_count_latest_idx order: a
            -- range no other index gives, so the primary key is never read backwards instead)
            LEFT JOIN LATERAL (
                SELECT x.* FROM (
                    SELECT * FROM {schema}.channel_count c
                    WHERE (c.queue, c.channel) >= (d.queue, d.channel)
                    ORDER BY c.queue, c.channel, c.id DESC LIMIT 1
                ) AS x
                WHERE x.queue = d.queue AND x.channel = d.channel
            ) AS o ON true
        ), replaced AS (
            DELETE FROM {schema}.channel_count c USING old o
            WHERE c.queue = o.queue AND c.channel = o.channel AND c.id = o.old_id
        ), merged AS (
            INSERT INTO {schema}.channel_count AS cc (queue, channel, enqueued, delivered,
                redelivered, acked, deferred, dead, dead_held, expired, dropped, removed,
                removed_held, purged)
            SELECT o.queue, o.channel,
                   coalesce(o.o_enqueued, 0) + o.enqueued,
                   coalesce(o.o_delivered, 0) + o.delivered,
                   coalesce(o.o_redelivered, 0) + o.redelivered,
                   coalesce(o.o_acked, 0) + o.acked,
                   coalesce(o.o_deferred, 0) + o.deferred,
                   coalesce(o.o_dead, 0) + o.dead,
                   coalesce(o.o_dead_held, 0) + o.dead_held,
                   coalesce(o.o_expired, 0) + o.expired,
                   coalesce(o.o_dropped, 0) + o.dropped,
                   coalesce(o.o_removed, 0) + o.removed,
                   coalesce(o.o_removed_held, 0) + o.removed_held,
                   coalesce(o.o_purged, 0) + o.purged
            FROM old o ORDER BY o.queue, o.channel
            RETURNING cc.*
        )
        SELECT m.* FROM merged m
        WHERE m.enqueued - m.acked - m.dead - m.expired - m.removed - m.purged <= 0
        ORDER BY m.queue, m.channel
    LOOP
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = r.queue AND c.name = r.channel AND c.has_policy);
        -- (its lane stays: deleted now and needed again a moment later, it would be looked up
        -- through every dead version a held snapshot keeps of it)
        v_idle_q := v_idle_q || r.queue;
        v_idle_c := v_idle_c || r.channel;
    END LOOP;
    IF cardinality(v_idle_q) > 0 THEN
        INSERT INTO {schema}.lane_idle (queue, channel, since)
        SELECT u.q, u.c, clock_timestamp() FROM unnest(v_idle_q, v_idle_c) AS u(q, c)
        ORDER BY u.q, u.c
        ON CONFLICT (queue, channel) DO NOTHING;
    END IF;
END;
$$;

-- Remove the lanes and counts of channels that have stayed empty since a fold found them so,
-- p_idle ago or more (at most p_limit, oldest first): each channel's folded counts go to its
-- queue's row (one write per queue), its channel row too when nothing holds it (no policy, no
-- count, no rate owed). A channel whose lane was written after it emptied (a message came) is
-- left alone; the next fold that finds it empty notes it again. Run by housekeeping, after an
-- ingest (so every committed message has written its lane). Returns the channels removed.
CREATE FUNCTION {schema}.lane_prune_v1(p_limit integer, p_idle interval) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_d {schema}.discovery;
    r record;
    v_lane {schema}.lane;
    v_count {schema}.channel_count;
    v_gone {schema}.channel_count[] := ARRAY[]::{schema}.channel_count[];
    v_n integer := 0;
BEGIN
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        SELECT i.queue, i.channel, i.since FROM {schema}.lane_idle i
        WHERE i.since < v_now - p_idle
        ORDER BY i.since LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    LOOP
        -- (a lane being served is busy, not idle)
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({schema}.lane_key_v1(r.queue, r.channel));
        DELETE FROM {schema}.lane_idle i WHERE i.queue = r.queue AND i.channel = r.channel;
        v_lane := {schema}.lane_get_v1(r.queue, r.channel);
        CONTINUE WHEN v_lane.id IS NOT NULL
            AND (v_lane.written_at > r.since OR v_lane.turn_at IS NOT NULL);
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM unnest(v_d.pend_queue, v_d.pend_channel) AS p(q, c)
            WHERE p.q = r.queue AND p.c = r.channel);
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM {schema}.channel c
            WHERE c.queue = r.queue AND c.name = r.channel AND c.has_policy);
        IF v_lane.id IS NOT NULL THEN
            DELETE FROM {schema}.lane l
            WHERE l.queue = r.queue AND l.channel = r.channel AND l.id = v_lane.id;
        END IF;
        SELECT x.* INTO v_count FROM (
            SELECT * FROM {schema}.channel_count c
            WHERE (c.queue, c.channel) >= (r.queue, r.channel)
            ORDER BY c.queue, c.channel, c.id DESC LIMIT 1
        ) AS x
        WHERE x.queue = r.queue AND x.channel = r.channel;
        IF v_count.id IS NOT NULL THEN
            DELETE FROM {schema}.channel_count cc
            WHERE cc.queue = r.queue AND cc.channel = r.channel AND cc.id = v_count.id;
            v_gone := v_gone || v_count;
        END IF;
        DELETE FROM {schema}.channel c
        WHERE c.queue = r.queue AND c.name = r.channel AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
          AND (c.rate_tat IS NULL OR c.rate_tat <= v_now);
        v_n := v_n + 1;
    END LOOP;
    -- the removed channels' counts go to their queue's row in one write per queue (a write per
    -- channel would grow that row's chain of versions by every channel removed)
    IF cardinality(v_gone) > 0 THEN
        INSERT INTO {schema}.queue_count AS qc (queue, enqueued, delivered, redelivered, acked,
            deferred, dead, dead_held, expired, dropped, removed, removed_held, purged)
        SELECT g.queue, sum(g.enqueued), sum(g.delivered), sum(g.redelivered), sum(g.acked),
               sum(g.deferred), sum(g.dead), sum(g.dead_held), sum(g.expired), sum(g.dropped),
               sum(g.removed), sum(g.removed_held), sum(g.purged)
        FROM unnest(v_gone) AS g
        WHERE EXISTS (SELECT 1 FROM {schema}.queue q WHERE q.name = g.queue)
        GROUP BY g.queue ORDER BY g.queue
        ON CONFLICT (queue) DO UPDATE SET
            enqueued = qc.enqueued + EXCLUDED.enqueued,
            delivered = qc.delivered + EXCLUDED.delivered,
            redelivered = qc.redelivered + EXCLUDED.redelivered,
            acked = qc.acked + EXCLUDED.acked,
            deferred = qc.deferred + EXCLUDED.deferred,
            dead = qc.dead + EXCLUDED.dead,
            dead_held = qc.dead_held + EXCLUDED.dead_held,
            expired = qc.expired + EXCLUDED.expired,
            dropped = qc.dropped + EXCLUDED.dropped,
            removed = qc.removed + EXCLUDED.removed,
            removed_held = qc.removed_held + EXCLUDED.removed_held,
            purged = qc.purged + EXCLUDED.purged;
    END IF;
    RETURN v_n;
END;
$$;


-- ---------------------------------------------------------------------------------------------
-- 5. Counts
-- What is folded plus what is not yet: the gauges and counters. LANGUAGE sql, read by the
-- sql bodies of groups 9 and 12, so before them.
-- ---------------------------------------------------------------------------------------------

-- The counts of every channel of p_queue (NULL: of every queue), exact as of this statement:
-- what is folded, plus the tallies not folded yet, plus the messages created and not ingested
-- yet. Gauges derive from them (see channel_count).
CREATE FUNCTION {schema}.channel_totals_v1(p_queue text)
RETURNS TABLE (
    queue text, channel text, enqueued bigint, delivered bigint, redelivered bigint,
    acked bigint, deferred bigint, dead bigint, dead_held bigint, expired bigint,
    dropped bigint, removed bigint, removed_held bigint, purged bigint
)
LANGUAGE sql STABLE AS $$
    WITH d AS (SELECT * FROM {schema}.discovery ORDER BY id DESC LIMIT 1)
    SELECT p.queue, p.channel, sum(p.enqueued)::bigint, sum(p.delivered)::bigint,
           sum(p.redelivered)::bigint, sum(p.acked)::bigint, sum(p.deferred)::bigint,
           sum(p.dead)::bigint, sum(p.dead_held)::bigint, sum(p.expired)::bigint,
           sum(p.dropped)::bigint, sum(p.removed)::bigint, sum(p.removed_held)::bigint,
           sum(p.purged)::bigint
    FROM (
        SELECT cc.queue, cc.channel, cc.enqueued, cc.delivered, cc.redelivered, cc.acked,
               cc.deferred, cc.dead, cc.dead_held, cc.expired, cc.dropped, cc.removed,
               cc.removed_held, cc.purged
        FROM {schema}.channel_count cc WHERE p_queue IS NULL OR cc.queue = p_queue
        UNION ALL
        SELECT t.queue, t.channel, t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred,
               t.dead, t.dead_held, t.expired, t.dropped, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid >= pg_snapshot_xmax(d.folded) AND (p_queue IS NULL OR t.queue = p_queue)
        UNION ALL
        SELECT t.queue, t.channel, t.enqueued, t.delivered, t.redelivered, t.acked, t.deferred,
               t.dead, t.dead_held, t.expired, t.dropped, t.removed, t.removed_held, t.purged
        FROM d, {schema}.tally t
        WHERE t.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.folded)))
          AND (p_queue IS NULL OR t.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.channel, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL AND m.arrival = 0
          AND (p_queue IS NULL OR m.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.channel, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM d, {schema}.message m
        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snap))) AND m.lock_token IS NULL
          AND m.arrival = 0 AND (p_queue IS NULL OR m.queue = p_queue)
    ) AS p
    GROUP BY p.queue, p.channel
$$;

-- Ready and delayed messages of p_queue (NULL: every queue) and the oldest ready one, read
-- from the lanes' positions (never from the start of an index) and from what is not ingested
-- yet. O(messages waiting).
CREATE FUNCTION {schema}.queue_waiting_v1(p_queue text)
RETURNS TABLE (queue text, ready bigint, delayed bigint, oldest_ready_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH d AS (SELECT * FROM {schema}.discovery ORDER BY id DESC LIMIT 1),
    w AS (
        SELECT m.queue, m.dequeue_at
        FROM d, {schema}.lane l
        CROSS JOIN LATERAL unnest(l.prios, l.pos_at, l.pos_id) AS p(prio, at, pid)
        JOIN {schema}.message m ON m.queue = l.queue AND m.channel = l.channel
             AND m.locked_until IS NULL AND m.priority = p.prio
             AND (m.dequeue_at, m.id) >= (p.at, p.pid)
        WHERE (p_queue IS NULL OR l.queue = p_queue) AND pg_visible_in_snapshot(m.txid, d.snap)
          AND l.id = (SELECT max(l2.id) FROM {schema}.lane l2
                      WHERE l2.queue = l.queue AND l2.channel = l.channel)
        UNION ALL
        SELECT m.queue, m.dequeue_at FROM d, {schema}.message m
        WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
          AND (p_queue IS NULL OR m.queue = p_queue)
        UNION ALL
        SELECT m.queue, m.dequeue_at FROM d, {schema}.message m
        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(d.snap))) AND m.lock_token IS NULL
          AND (p_queue IS NULL OR m.queue = p_queue)
    )
    SELECT w.queue, count(*) FILTER (WHERE w.dequeue_at <= clock_timestamp()),
           count(*) FILTER (WHERE w.dequeue_at > clock_timestamp()),
           min(w.dequeue_at) FILTER (WHERE w.dequeue_at <= clock_timestamp())
    FROM w GROUP BY w.queue
$$;


-- ---------------------------------------------------------------------------------------------
-- 6. Dequeue
-- ---------------------------------------------------------------------------------------------

-- Producers of a queue whose transactions are still open (they hold its 'produce' key)?
CREATE FUNCTION {schema}.queue_idle_v1(p_queue text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('produce', p_queue);
BEGIN
    IF pg_try_advisory_lock(v_key) THEN
        PERFORM pg_advisory_unlock(v_key);
        RETURN true;
    END IF;
    RETURN false;
END;
$$;

-- Milliseconds until something in the given queues may become available: a lane's turn (a
-- delayed message falling due) or a lock expiring (from the ingest's hint). NULL when nothing
-- is pending.
CREATE FUNCTION {schema}.queue_retry_ms_v1(p_queues text[], p_d {schema}.discovery) RETURNS bigint
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_next timestamptz;
BEGIN
    SELECT LEAST(
        (SELECT min(w.at) FROM unnest(p_queues) AS u(q) CROSS JOIN LATERAL (
            SELECT l.turn_at AS at FROM {schema}.lane l
            WHERE l.queue = u.q
              AND l.turn_at >= coalesce(p_d.turn_from[array_position(p_d.queues, u.q)], '-infinity')
            ORDER BY l.turn_at LIMIT 1) AS w),
        (SELECT min(p_d.lock_next[array_position(p_d.queues, u.q)]) FROM unnest(p_queues) AS u(q))
    ) INTO v_next;
    IF v_next IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN GREATEST(0, ceil(extract(epoch FROM v_next - v_now) * 1000))::bigint;
END;
$$;

-- Dequeue up to p_limit messages from the given queues and lock them for p_lock_ms; with
-- p_ack_ids/p_ack_tokens, delete those held messages first (a consumer's acks travel with
-- its next dequeue: rows 'ack_state_invalid' / 'ack_not_found' for those that did not
-- apply). Messages whose lock expired come first (their holder is gone); then lanes whose
-- turn it is are served round-robin, the one waiting longest first, an equal share each,
-- within a channel's max_concurrency; within a lane, highest priority, then earliest due,
-- then oldest. Rows come back in delivery order. When nothing is available, one row comes
-- back with message_id NULL and retry_ms: milliseconds until something may become available
-- (NULL: nothing is pending). With p_listen, a caller that gets nothing is registered as
-- sleeping on its queues until its next call: their producers then send a NOTIFY. A message
-- delivered max_attempts times already (of its queue) goes to the dead letters instead and
-- comes back as a row with event 'dead'; a delivered message's event is 'delivered', or
-- 'redelivered' when its previous lock had expired.
--
-- Nothing here waits for another transaction: a consumer owns a lane for its call when it
-- gets the lane's advisory key (it then moves the lane to the back and its positions past
-- what it took); a lane owned by another consumer is served too, without being written,
-- unless it has a max_concurrency (whose count is under the channel row, locked by its owner).
CREATE FUNCTION {schema}.message_dequeue_v3(
    p_queues text[], p_limit integer, p_lock_ms bigint, p_ack_ids bigint[],
    p_ack_tokens uuid[], p_listen boolean
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
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lock interval := p_lock_ms * interval '1 millisecond';
    v_lock_until timestamptz;
    v_lock_id bigint;
    v_d {schema}.discovery;
    v_ingested boolean := false;
    v_slept boolean := false;
    v_waited boolean := false;
    v_qi integer;
    v_rows integer;
    v_busy boolean := false;
    v_got integer := 0;
    v_left integer;
    v_n integer;
    v_k integer;
    r record;
    v_keys text;
    -- events for the tally: queue, channel, kind
    e_q text[] := ARRAY[]::text[];
    e_c text[] := ARRAY[]::text[];
    e_k text[] := ARRAY[]::text[];
    -- acks
    v_gone bigint[];
    v_gq text[];
    v_gc text[];
    v_gs boolean[];
    v_gl boolean[];
    -- queues
    v_qn text[];
    v_qmax integer[];
    v_qtf timestamptz[];
    v_qlf timestamptz[];
    v_expired boolean;
    v_relock bigint[];
    v_poison bigint[];
    -- lanes, and per lane: owned, cap, max_concurrency, taken, more due, done
    v_cands {schema}.lane[];
    v_own boolean[];
    v_cap integer[];
    v_room integer[];
    v_max integer[];
    -- rated lanes: emission interval, burst, tat (at least now) and tokens when the call began
    v_rt interval[];
    v_burst integer[];
    v_tat timestamptz[];
    v_tok integer[];
    v_wait timestamptz;
    v_taken integer[];
    v_more boolean[];
    v_done boolean[];
    v_open integer;
    v_share integer;
    v_passes integer;
    v_lanes integer[];
    v_quota integer[];
    -- a pass's heads: id, lane, rank in lane
    h_id bigint[];
    h_lane integer[];
    h_rn integer[];
    v_take bigint[];
    v_slotted bigint[];
    v_locked bigint[];
    v_served timestamptz;
    v_lane {schema}.lane;
    v_next record;
    v_retry bigint;
    v_snap pg_snapshot;
    v_dead integer := 0;
    i integer;
BEGIN
    -- 0. a caller that slept (it found nothing last time) is awake again
    v_keys := current_setting('lonnymq.sleeping', true);
    IF v_keys IS NOT NULL AND v_keys <> '' THEN
        PERFORM pg_advisory_unlock_shared(k.key)
        FROM unnest(string_to_array(v_keys, ',')::bigint[]) AS k(key)
        WHERE EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks l
            WHERE l.pid = pg_backend_pid() AND l.locktype = 'advisory' AND l.objsubid = 1
              AND l.mode = 'ShareLock' AND l.granted
              AND l.classid::bigint = (k.key >> 32) & 4294967295
              AND l.objid::bigint = k.key & 4294967295);
        PERFORM set_config('lonnymq.sleeping', '', false);
    END IF;

    -- 1. acks
    IF coalesce(cardinality(p_ack_ids), 0) > 0 THEN
        WITH gone AS (
            DELETE FROM {schema}.message m
            WHERE m.id = ANY (p_ack_ids)
              AND m.lock_token = p_ack_tokens[array_position(p_ack_ids, m.id)]
            RETURNING m.id, m.queue, m.channel, m.sized, m.slotted
        )
        SELECT array_agg(g.id), array_agg(g.queue), array_agg(g.channel), array_agg(g.sized),
               array_agg(g.slotted)
        INTO v_gone, v_gq, v_gc, v_gs, v_gl FROM gone g;
        IF v_gone IS NOT NULL THEN
            e_q := v_gq;
            e_c := v_gc;
            e_k := array_fill('acked'::text, ARRAY[cardinality(v_gone)]);
            IF true = ANY (v_gs) OR true = ANY (v_gl) THEN
                FOR r IN
                    SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
                           count(*) FILTER (WHERE u.l)::integer AS l
                    FROM unnest(v_gq, v_gc, v_gs, v_gl) AS u(q, c, s, l)
                    WHERE u.s OR u.l GROUP BY u.q, u.c ORDER BY u.q, u.c
                LOOP
                    PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
                END LOOP;
            END IF;
        END IF;
        IF coalesce(cardinality(v_gone), 0) < cardinality(p_ack_ids) THEN
            RETURN QUERY
                SELECT h.id, NULL::text, NULL::text, NULL::text, NULL::smallint, NULL::integer,
                       NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, NULL::bigint,
                       CASE WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                            THEN 'ack_state_invalid' ELSE 'ack_not_found' END
                FROM unnest(p_ack_ids) AS h(id)
                WHERE h.id <> ALL (coalesce(v_gone, ARRAY[]::bigint[]));
        END IF;
    END IF;

    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    LOOP
        -- 2. ingest what committed since the snapshot: every 10 ms (which also moves the
        --    points from which lanes are read past the versions consumers superseded
        --    meanwhile: dead rows that a snapshot held elsewhere keeps from being vacuumed),
        --    and below when this call finds nothing in what is ingested. Not at every call:
        --    an ingest costs several times a delivery, and with messages waiting a consumer
        --    has no need of the newest ones.
        IF NOT v_ingested AND current_setting('lonnymq.fresh', true) = 'on' THEN
            PERFORM set_config('lonnymq.fresh', '', false);
            v_d := {schema}.ingest_wait_v1(p_queues);
            v_ingested := true;
            v_now := clock_timestamp();
        ELSIF NOT v_ingested
           AND (v_d.taken_at < v_now - interval '10 milliseconds'
                OR v_d.folded_at < v_now - interval '1 second'
                OR NOT (p_queues <@ v_d.queues)
                -- (heads an ingest could not write, their lane being served: soon, not at
                -- once, or a busy lane would have every call ingest)
                OR (cardinality(v_d.pend_queue) > 0
                    AND v_d.taken_at < v_now - interval '5 milliseconds')) THEN
            v_d := {schema}.ingest_v1(p_queues, false, false);
            v_ingested := true;
            v_now := clock_timestamp();
        END IF;

        -- the queues, their settings and positions; is there a lock past its expiry?
        -- (Every statement's plan is set up again in each transaction, aggregates and sorts
        -- most of all: the usual cases, one queue and one lane, take statements without.)
        IF cardinality(p_queues) = 1 THEN
            v_qi := array_position(v_d.queues, p_queues[1]);
            SELECT ARRAY[q.name::text], ARRAY[coalesce(q.max_attempts, 2147483647)],
                   ARRAY[coalesce(v_d.turn_from[v_qi], '-infinity')],
                   ARRAY[coalesce(v_d.lock_from[v_qi], '-infinity')],
                   -- (the first one in lock order, from the queue's lock position: an EXISTS
                   -- loses the order, and was planned as a read of the whole locked index)
                   (SELECT e.locked_until FROM {schema}.message e
                    WHERE e.queue = p_queues[1]
                      AND e.locked_until >= coalesce(v_d.lock_from[v_qi], '-infinity')
                      AND e.locked_until <= v_now
                    ORDER BY e.queue, e.locked_until LIMIT 1) IS NOT NULL
            INTO v_qn, v_qmax, v_qtf, v_qlf, v_expired
            FROM {schema}.queue q WHERE q.name = p_queues[1];
        ELSE
            SELECT array_agg(q.name ORDER BY q.name),
                   array_agg(coalesce(q.max_attempts, 2147483647) ORDER BY q.name),
                   array_agg(coalesce(v_d.turn_from[array_position(v_d.queues, q.name)],
                                      '-infinity') ORDER BY q.name),
                   array_agg(coalesce(v_d.lock_from[array_position(v_d.queues, q.name)],
                                      '-infinity') ORDER BY q.name),
                   coalesce(bool_or(x.found), false)
            INTO v_qn, v_qmax, v_qtf, v_qlf, v_expired
            FROM {schema}.queue q
            LEFT JOIN LATERAL (
                SELECT true AS found FROM {schema}.message e
                WHERE e.queue = q.name
                  AND e.locked_until >= coalesce(v_d.lock_from[array_position(v_d.queues, q.name)],
                                                 '-infinity')
                  AND e.locked_until <= v_now
                ORDER BY e.locked_until LIMIT 1
            ) AS x ON true
            WHERE q.name = ANY (p_queues);
        END IF;
        v_left := p_limit - v_got;

        -- 3. messages whose lock expired: they still count against their channel's
        --    concurrency and are taken over without touching any lane
        IF v_expired AND v_left > 0 THEN
            v_relock := ARRAY(
                SELECT x.id FROM unnest(v_qn, v_qlf) AS u(q, lf)
                CROSS JOIN LATERAL (
                    SELECT e.id, e.locked_until FROM {schema}.message e
                    WHERE e.queue = u.q AND e.locked_until >= u.lf AND e.locked_until <= v_now
                    ORDER BY e.locked_until LIMIT v_left
                    FOR UPDATE SKIP LOCKED
                ) AS x
                ORDER BY x.locked_until LIMIT v_left);
            -- delivered max_attempts times already, its holder dying each time: a poison
            -- message, dead-lettered instead
            v_poison := ARRAY(
                SELECT m.id FROM {schema}.message m
                WHERE m.id = ANY (v_relock) AND m.attempts >= v_qmax[array_position(v_qn, m.queue)]
                ORDER BY m.id);
            IF cardinality(v_poison) > 0 THEN
                FOR r IN SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b LOOP
                    v_dead := v_dead + 1;
                    e_q := e_q || r.queue_name || r.queue_name;
                    e_c := e_c || r.channel_name || r.channel_name;
                    e_k := e_k || 'dead'::text || 'dead_held'::text;
                    RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name, r.message_name,
                        NULL::smallint, r.message_attempts, NULL::uuid, r.message_created_at,
                        NULL::bytea, NULL::bytea, NULL::bigint, 'dead'::text;
                END LOOP;
            END IF;
            FOR r IN
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1
                WHERE m.id = ANY (v_relock) AND m.id <> ALL (v_poison)
                RETURNING m.*
            LOOP
                e_q := e_q || r.queue || r.queue;
                e_c := e_c || r.channel || r.channel;
                e_k := e_k || 'delivered'::text || 'redelivered'::text;
                v_got := v_got + 1;
                IF v_lock_until IS NULL OR r.locked_until < v_lock_until THEN
                    v_lock_until := r.locked_until;
                    v_lock_id := r.id;
                END IF;
                RETURN QUERY SELECT r.id, r.queue::text, r.channel::text, r.name, r.priority,
                    r.attempts, r.lock_token, r.created_at, r.content, r.state, NULL::bigint,
                    'redelivered'::text;
            END LOOP;
            v_left := p_limit - v_got;
        END IF;

        -- 4. lanes whose turn it is, oldest turn first (one more than needed, to know
        --    whether another one waits)
        v_n := 0;
        IF v_left > 0 AND v_qn IS NOT NULL THEN
            -- (the ingest's state is read again in the same statement: a lane version is
            -- never newer than the snapshot its positions are read with)
            -- (due: at most a millisecond from now, so that a lane another consumer has
            -- just moved to the back, at its clock, is due for this one too)
            v_now := clock_timestamp();
            IF cardinality(v_qn) = 1 THEN
                SELECT ARRAY(
                    SELECT l FROM {schema}.lane l
                    WHERE l.queue = v_qn[1] AND l.turn_at >= v_qtf[1]
                      AND l.turn_at <= v_now + interval '1 millisecond'
                    ORDER BY l.turn_at, l.id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_cands, v_snap;
            ELSE
                SELECT ARRAY(
                    SELECT x.l FROM unnest(v_qn, v_qtf) AS u(q, tf)
                    CROSS JOIN LATERAL (
                        SELECT l FROM {schema}.lane l
                        WHERE l.queue = u.q AND l.turn_at >= u.tf
                          AND l.turn_at <= v_now + interval '1 millisecond'
                        ORDER BY l.turn_at, l.id LIMIT v_left + 1
                    ) AS x
                    ORDER BY (x.l).turn_at, (x.l).id LIMIT v_left + 1),
                    (SELECT d.snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1)
                INTO v_cands, v_snap;
            END IF;
            v_d.snap := v_snap;
            v_n := LEAST(cardinality(v_cands), v_left);
        END IF;
        IF v_n > 0 THEN
            v_own := array_fill(false, ARRAY[v_n]);
            v_cap := array_fill(0, ARRAY[v_n]);
            v_room := array_fill(NULL::integer, ARRAY[v_n]);
            v_max := array_fill(NULL::integer, ARRAY[v_n]);
            -- (rated lanes only: filled as they are met, NULL elsewhere)
            v_rt := NULL;
            v_burst := NULL;
            v_tat := NULL;
            v_tok := NULL;
            v_taken := array_fill(0, ARRAY[v_n]);
            v_more := array_fill(false, ARRAY[v_n]);
            v_done := array_fill(false, ARRAY[v_n]);
            FOR i IN 1 .. v_n LOOP
                v_own[i] := pg_try_advisory_xact_lock(
                    {schema}.lane_key_v1((v_cands[i]).queue, (v_cands[i]).channel));
                IF NOT (v_cands[i]).limited THEN
                    v_cap[i] := v_left;
                ELSIF v_own[i] THEN
                    SELECT h.* INTO r
                    FROM {schema}.channel_headroom_v2((v_cands[i]).queue, (v_cands[i]).channel,
                                                      v_now) AS h;
                    IF r.headroom IS NULL THEN
                        -- its channel row is busy (an open transaction of a producer of a
                        -- channel with a max_size, or of an ack): not served this time, and
                        -- its turn a little later, so that it does not hold back the point
                        -- from which the lanes are read (which would then walk every lane
                        -- version written meanwhile)
                        v_own[i] := false;
                        v_lane := v_cands[i];
                        v_lane.turn_at := GREATEST(v_lane.turn_at,
                                                   clock_timestamp() + interval '10 milliseconds');
                        IF EXISTS (SELECT 1 FROM {schema}.lane l
                                   WHERE l.queue = v_lane.queue AND l.channel = v_lane.channel
                                     AND l.id = v_lane.id) THEN
                            PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
                        END IF;
                    ELSE
                        v_room[i] := r.room;
                        v_cap[i] := LEAST(r.headroom, v_left);
                        v_max[i] := r.max_concurrency;
                        v_rt[i] := r.rate_interval;
                        v_burst[i] := r.burst;
                        v_tat[i] := r.tat;
                        v_tok[i] := r.tokens;
                    END IF;
                END IF;
            END LOOP;
            -- passes: an equal share of what is left to each lane that may give more
            v_passes := 0;
            LOOP
                v_passes := v_passes + 1;
                IF v_n = 1 THEN
                    v_lanes := CASE WHEN NOT v_done[1] AND v_cap[1] > v_taken[1]
                                    THEN ARRAY[1] ELSE ARRAY[]::integer[] END;
                ELSE
                    v_lanes := ARRAY(SELECT g.i FROM generate_series(1, v_n) AS g(i)
                                     WHERE NOT v_done[g.i] AND v_cap[g.i] > v_taken[g.i] ORDER BY g.i);
                END IF;
                v_open := cardinality(v_lanes);
                EXIT WHEN v_open = 0 OR v_left <= 0 OR v_passes > 8;
                v_share := ceil(v_left::numeric / v_open)::integer;
                IF v_open = 1 THEN
                    v_quota := ARRAY[LEAST(v_share, v_cap[v_lanes[1]] - v_taken[v_lanes[1]])];
                ELSE
                    v_quota := ARRAY(SELECT LEAST(v_share, v_cap[u.i] - v_taken[u.i])
                                     FROM unnest(v_lanes) AS u(i));
                END IF;
                -- each lane's head from its positions: due, ingested, not held by anyone; one
                -- more than its quota tells whether it has more
                IF v_open = 1 AND cardinality((v_cands[v_lanes[1]]).prios) = 1 THEN
                    v_k := v_lanes[1];
                    h_id := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.queue = (v_cands[v_k]).queue AND m.channel = (v_cands[v_k]).channel
                          AND m.locked_until IS NULL AND m.priority = ((v_cands[v_k]).prios)[1]
                          AND (m.dequeue_at, m.id) >= (((v_cands[v_k]).pos_at)[1],
                                                       ((v_cands[v_k]).pos_id)[1])
                          AND m.dequeue_at <= v_now
                          AND pg_visible_in_snapshot(m.txid, v_d.snap)
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT v_quota[1] + 1
                        FOR UPDATE SKIP LOCKED);
                    h_lane := array_fill(v_k, ARRAY[cardinality(h_id)]);
                    h_rn := ARRAY(SELECT generate_series(1, cardinality(h_id)));
                ELSE
                SELECT array_agg(h.id ORDER BY h.rn, h.i), array_agg(h.i ORDER BY h.rn, h.i),
                       array_agg(h.rn ORDER BY h.rn, h.i)
                INTO h_id, h_lane, h_rn
                FROM unnest(v_lanes, v_quota) AS u(i, quota)
                CROSS JOIN LATERAL (
                    SELECT u.i, z.id, z.priority, z.dequeue_at,
                           (row_number() OVER (ORDER BY z.priority DESC, z.dequeue_at, z.id))::integer AS rn
                    FROM (
                        SELECT m.id, m.priority, m.dequeue_at
                        FROM unnest((v_cands[u.i]).prios, (v_cands[u.i]).pos_at,
                                    (v_cands[u.i]).pos_id) AS p(prio, at, pid)
                        CROSS JOIN LATERAL (
                            SELECT m.id, m.priority, m.dequeue_at FROM {schema}.message m
                            WHERE m.queue = (v_cands[u.i]).queue
                              AND m.channel = (v_cands[u.i]).channel
                              AND m.locked_until IS NULL AND m.priority = p.prio
                              AND (m.dequeue_at, m.id) >= (p.at, p.pid) AND m.dequeue_at <= v_now
                              AND pg_visible_in_snapshot(m.txid, v_d.snap)
                            ORDER BY m.priority DESC, m.dequeue_at, m.id
                            LIMIT u.quota + 1
                            FOR UPDATE SKIP LOCKED
                        ) AS m
                        ORDER BY m.priority DESC, m.dequeue_at, m.id
                        LIMIT u.quota + 1
                    ) AS z
                ) AS h;
                END IF;
                FOR i IN 1 .. v_open LOOP
                    v_k := v_lanes[i];
                    v_more[v_k] := coalesce(array_length(array_positions(h_lane, v_k), 1), 0) > v_quota[i];
                    IF NOT v_more[v_k] THEN
                        v_done[v_k] := true;
                    END IF;
                END LOOP;
                -- (the quotas are rounded up: never more than the call has left, in rank order)
                IF v_open = 1 THEN
                    v_take := h_id[1:v_quota[1]];
                ELSE
                    v_take := ARRAY(
                        SELECT t.id FROM unnest(h_id, h_lane, h_rn) AS t(id, l, rn)
                        JOIN unnest(v_lanes, v_quota) AS u(i, quota) ON u.i = t.l
                        WHERE t.rn <= u.quota
                        ORDER BY t.rn, t.l LIMIT v_left);
                END IF;
                EXIT WHEN coalesce(cardinality(v_take), 0) = 0;
                IF v_open = 1 THEN
                    v_slotted := CASE WHEN v_max[v_lanes[1]] IS NOT NULL THEN v_take
                                      ELSE ARRAY[]::bigint[] END;
                ELSE
                    v_slotted := ARRAY(
                        SELECT t.id FROM unnest(h_id, h_lane) AS t(id, l)
                        WHERE t.id = ANY (v_take) AND v_max[t.l] IS NOT NULL);
                END IF;
                -- lock them (by primary key from the array); those past their time to live or
                -- delivered max_attempts times are left out, and handled below
                v_locked := ARRAY[]::bigint[];
                IF v_open = 1 THEN
                    -- (one lane: its heads are in rank order already)
                    RETURN QUERY
                        WITH locked AS (
                            UPDATE {schema}.message m SET
                                locked_until = v_now + v_lock,
                                lock_token = gen_random_uuid(),
                                attempts = m.attempts + 1,
                                slotted = m.id = ANY (v_slotted)
                            WHERE m.id = ANY (v_take)
                              AND (m.expires_at IS NULL OR m.expires_at > v_now)
                              AND m.attempts < v_qmax[array_position(v_qn, m.queue)]
                            RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                                      m.lock_token, m.created_at, m.content, m.state, m.dequeue_at
                        )
                        SELECT l.id, l.queue::text, l.channel::text, l.name, l.priority, l.attempts,
                               l.lock_token, l.created_at, l.content, l.state, NULL::bigint,
                               'delivered'::text
                        FROM locked l ORDER BY l.priority DESC, l.dequeue_at, l.id;
                    GET DIAGNOSTICS v_rows = ROW_COUNT;
                    IF v_rows = cardinality(v_take) THEN
                        v_locked := v_take;
                    ELSIF v_rows > 0 THEN
                        v_locked := ARRAY(SELECT m.id FROM {schema}.message m
                                          WHERE m.id = ANY (v_take) AND m.lock_token IS NOT NULL);
                    END IF;
                    v_k := v_lanes[1];
                    v_taken[v_k] := v_taken[v_k] + cardinality(v_locked);
                    IF cardinality(v_locked) > 0 THEN
                        e_q := e_q || array_fill((v_cands[v_k]).queue::text,
                                                 ARRAY[cardinality(v_locked)]);
                        e_c := e_c || array_fill((v_cands[v_k]).channel::text,
                                                 ARRAY[cardinality(v_locked)]);
                        e_k := e_k || array_fill('delivered'::text, ARRAY[cardinality(v_locked)]);
                    END IF;
                ELSE
                FOR r IN
                    WITH locked AS (
                        UPDATE {schema}.message m SET
                            locked_until = v_now + v_lock,
                            lock_token = gen_random_uuid(),
                            attempts = m.attempts + 1,
                            slotted = m.id = ANY (v_slotted)
                        WHERE m.id = ANY (v_take) AND (m.expires_at IS NULL OR m.expires_at > v_now)
                          AND m.attempts < v_qmax[array_position(v_qn, m.queue)]
                        RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                                  m.lock_token, m.created_at, m.content, m.state
                    )
                    SELECT l.*, t.l AS lane, v_taken[t.l] + t.rn AS rnk
                    FROM locked l
                    JOIN unnest(h_id, h_lane, h_rn) AS t(id, l, rn) ON t.id = l.id
                    ORDER BY rnk, lane
                LOOP
                    v_locked := v_locked || r.id;
                    message_id := r.id;
                    queue_name := r.queue;
                    channel_name := r.channel;
                    message_name := r.name;
                    message_priority := r.priority;
                    message_attempts := r.attempts;
                    message_lock_token := r.lock_token;
                    message_created_at := r.created_at;
                    message_content := r.content;
                    message_state := r.state;
                    retry_ms := NULL;
                    event := 'delivered';
                    RETURN NEXT;
                END LOOP;
                FOR i IN 1 .. cardinality(h_id) LOOP
                    IF h_id[i] = ANY (v_locked) THEN
                        v_taken[h_lane[i]] := v_taken[h_lane[i]] + 1;
                        e_q := e_q || (v_cands[h_lane[i]]).queue;
                        e_c := e_c || (v_cands[h_lane[i]]).channel;
                        e_k := e_k || 'delivered'::text;
                    END IF;
                END LOOP;
                END IF;
                v_got := v_got + cardinality(v_locked);
                v_left := p_limit - v_got;
                IF cardinality(v_locked) > 0
                   AND (v_lock_until IS NULL OR v_now + v_lock < v_lock_until) THEN
                    v_lock_until := v_now + v_lock;
                    v_lock_id := v_locked[1];
                END IF;
                IF cardinality(v_locked) < cardinality(v_take) THEN
                    -- past their time to live: deleted
                    FOR r IN
                        DELETE FROM {schema}.message m
                        WHERE m.id = ANY (v_take) AND m.id <> ALL (v_locked) AND m.expires_at <= v_now
                        RETURNING m.id, m.queue, m.channel, m.sized
                    LOOP
                        e_q := e_q || r.queue;
                        e_c := e_c || r.channel;
                        e_k := e_k || 'expired'::text;
                        IF r.sized THEN
                            PERFORM {schema}.channel_give_back_v1(r.queue, r.channel, 1, 0);
                        END IF;
                    END LOOP;
                    -- delivered max_attempts times: dead-lettered
                    v_poison := ARRAY(
                        SELECT m.id FROM {schema}.message m
                        WHERE m.id = ANY (v_take) AND m.id <> ALL (v_locked) AND m.locked_until IS NULL
                        ORDER BY m.id);
                    IF cardinality(v_poison) > 0 THEN
                        FOR r IN SELECT * FROM {schema}.message_bury_v1(v_poison, 'max_attempts') AS b LOOP
                            v_dead := v_dead + 1;
                            e_q := e_q || r.queue_name;
                            e_c := e_c || r.channel_name;
                            e_k := e_k || 'dead'::text;
                            RETURN QUERY SELECT r.message_id, r.queue_name, r.channel_name,
                                r.message_name, NULL::smallint, r.message_attempts, NULL::uuid,
                                r.message_created_at, NULL::bytea, NULL::bytea, NULL::bigint,
                                'dead'::text;
                        END LOOP;
                    END IF;
                END IF;
            END LOOP;

            -- 5. the owned lanes: positions past what they took, the turn to the back (or at
            --    the next due message, or none). Positions are read with the latest snapshot of
            --    the ingest: one that looked at a lane and left it as it was (its positions
            --    covered what it found) did so before this call took the lane's key.
            v_served := clock_timestamp();
            SELECT d.snap INTO v_snap FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
            FOR i IN 1 .. v_n LOOP
                CONTINUE WHEN NOT v_own[i];
                v_lane := v_cands[i];
                IF (v_max[i] IS NOT NULL OR v_rt[i] IS NOT NULL) AND v_taken[i] > 0 THEN
                    UPDATE {schema}.channel c SET
                        current_concurrency = c.current_concurrency
                            + CASE WHEN v_max[i] IS NOT NULL THEN v_taken[i] ELSE 0 END,
                        rate_tat = CASE WHEN v_rt[i] IS NOT NULL
                                        THEN v_tat[i] + v_taken[i] * v_rt[i] ELSE c.rate_tat END,
                        rate_interval = coalesce(v_rt[i], c.rate_interval)
                    WHERE c.queue = v_lane.queue AND c.name = v_lane.channel;
                END IF;
                -- a rated lane that spent its tokens: its turn not before the next one
                v_wait := CASE WHEN v_rt[i] IS NOT NULL AND v_tok[i] - v_taken[i] <= 0
                    THEN v_tat[i] + (v_taken[i] - v_burst[i] + 1) * v_rt[i] END;
                -- a lone lane with more to give, written a moment ago: not written now (its
                -- positions lag by what was taken since; the next write catches up)
                CONTINUE WHEN v_n = 1 AND cardinality(v_cands) = 1 AND v_more[i]
                    AND NOT v_lane.limited AND v_lane.served_at > '-infinity'
                    AND v_lane.written_at > v_now - interval '5 milliseconds';
                -- positions at the first message not taken (what this call took is locked
                -- now; what another running dequeue holds still counts)
                SELECT * INTO v_next FROM {schema}.lane_next_v1(v_lane, v_snap);
                v_lane.prios := v_next.prios;
                v_lane.pos_at := v_next.pos_at;
                v_lane.pos_id := v_next.pos_id;
                v_lane.limited := v_max[i] IS NOT NULL OR v_rt[i] IS NOT NULL;
                v_lane.not_before := v_wait;
                IF v_taken[i] > 0 THEN
                    v_lane.served_at := v_served + i * interval '1 microsecond';
                END IF;
                IF v_max[i] IS NOT NULL AND v_room[i] - v_taken[i] <= 0 THEN
                    v_lane.turn_at := NULL;  -- at its max_concurrency: no turn until a slot frees
                ELSIF v_more[i] THEN
                    v_lane.turn_at := GREATEST(v_lane.served_at, v_lane.turn_at, v_wait);
                ELSE
                    v_lane.turn_at := CASE WHEN v_next.next_at IS NOT NULL
                        THEN GREATEST(v_next.next_at, v_lane.served_at, (v_cands[i]).turn_at,
                                      v_wait) END;
                END IF;
                -- (a version superseded meanwhile by its previous owner is left as it is)
                IF EXISTS (SELECT 1 FROM {schema}.lane l
                           WHERE l.queue = v_lane.queue AND l.channel = v_lane.channel
                             AND l.id = (v_cands[i]).id) THEN
                    PERFORM {schema}.lane_put_v1((v_cands[i]).id, v_lane);
                END IF;
            END LOOP;
        END IF;
        EXIT WHEN v_got > 0;

        -- 6. nothing. A listening caller registers as sleeping, checks for producers still
        --    in their transactions (they may have looked for sleepers before), then looks
        --    once more: a producer that commits after that sees it sleeping and notifies.
        IF p_listen AND NOT v_slept THEN
            v_slept := true;
            v_keys := (SELECT string_agg({schema}.queue_key_v1('sleep', u.q)::text, ',')
                       FROM (SELECT DISTINCT u.q FROM unnest(p_queues) AS u(q)) AS u);
            PERFORM pg_advisory_lock_shared(k.key)
            FROM unnest(string_to_array(v_keys, ',')::bigint[]) AS k(key);
            PERFORM set_config('lonnymq.sleeping', v_keys, false);
            v_busy := EXISTS (SELECT 1 FROM unnest(p_queues) AS u(q)
                              WHERE NOT {schema}.queue_idle_v1(u.q));
            v_ingested := false;
            v_now := clock_timestamp();
            CONTINUE;
        END IF;
        -- (then ingest, waiting a little for an ingest another consumer is running: what it
        -- brings in is not deliverable before it commits, and answering "nothing" meanwhile
        -- would send this caller to sleep while messages wait)
        EXIT WHEN v_waited;
        v_waited := true;
        v_d := {schema}.ingest_wait_v1(p_queues);
        v_ingested := true;
        v_now := clock_timestamp();
    END LOOP;

    -- the tally of this call: one row per channel (one channel, the usual case, without an
    -- aggregate)
    IF cardinality(e_q) > 0 AND e_q <@ ARRAY[e_q[1]] AND e_c <@ ARRAY[e_c[1]] THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired, dead,
                                    dead_held, lock_until, lock_id)
        VALUES (e_q[1], e_c[1], cardinality(array_positions(e_k, 'delivered')),
                cardinality(array_positions(e_k, 'redelivered')),
                cardinality(array_positions(e_k, 'acked')),
                cardinality(array_positions(e_k, 'expired')),
                cardinality(array_positions(e_k, 'dead')),
                cardinality(array_positions(e_k, 'dead_held')),
                CASE WHEN 'delivered' = ANY (e_k) OR 'redelivered' = ANY (e_k) THEN v_lock_until END,
                CASE WHEN 'delivered' = ANY (e_k) OR 'redelivered' = ANY (e_k) THEN v_lock_id END);
    ELSIF cardinality(e_q) > 0 THEN
        INSERT INTO {schema}.tally (queue, channel, delivered, redelivered, acked, expired, dead,
                                    dead_held, lock_until, lock_id)
        SELECT u.q, u.c, count(*) FILTER (WHERE u.k = 'delivered'),
               count(*) FILTER (WHERE u.k = 'redelivered'), count(*) FILTER (WHERE u.k = 'acked'),
               count(*) FILTER (WHERE u.k = 'expired'), count(*) FILTER (WHERE u.k = 'dead'),
               count(*) FILTER (WHERE u.k = 'dead_held'),
               CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN v_lock_until END,
               CASE WHEN bool_or(u.k IN ('delivered', 'redelivered')) THEN v_lock_id END
        FROM unnest(e_q, e_c, e_k) AS u(q, c, k)
        GROUP BY u.q, u.c;
    END IF;

    IF v_got = 0 THEN
        -- (after dead-lettering, look again at once: what comes next may be deliverable)
        v_retry := CASE WHEN v_dead > 0 THEN 0 ELSE {schema}.queue_retry_ms_v1(p_queues, v_d) END;
        IF v_busy THEN
            v_retry := LEAST(coalesce(v_retry, 20), 20);
        END IF;
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
            NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea, v_retry,
            NULL::text;
    END IF;
END;
$$;

-- Version 2 of dequeue (clients of schema version 4 and before): version 3 without acks,
-- listening.
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
LANGUAGE sql AS $$
    SELECT * FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, NULL, NULL, true);
$$;

-- Version 1 of dequeue, for clients of schema version 2: version 2 without the rows of
-- dead-lettered messages.
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
    FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, NULL, NULL, true) AS d
    WHERE d.event IS DISTINCT FROM 'dead';
$$;

-- Acks and dequeue in one call (clients of schema version 4): version 3, listening.
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
LANGUAGE sql AS $$
    SELECT * FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, p_ids,
                                              p_lock_tokens, true);
$$;


-- ---------------------------------------------------------------------------------------------
-- 7. Acks and finalize: delete (ack), defer, heartbeat, bury (dead-letter), reject
-- ---------------------------------------------------------------------------------------------

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
    r record;
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
            FOR r IN
                SELECT u.q, u.c, count(*) FILTER (WHERE u.s)::integer AS s,
                       count(*) FILTER (WHERE u.l)::integer AS l
                FROM unnest(v_q, v_c, v_s, v_l) AS u(q, c, s, l)
                WHERE u.s OR u.l GROUP BY u.q, u.c ORDER BY u.q, u.c
            LOOP
                PERFORM {schema}.channel_give_back_v1(r.q, r.c, r.s, r.l);
            END LOOP;
        END IF;
    END IF;
    IF coalesce(cardinality(v_gone), 0) = cardinality(p_ids) THEN
        RETURN QUERY SELECT h.id, 'ok'::text FROM unnest(p_ids) AS h(id);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT h.id,
            CASE WHEN h.id = ANY (coalesce(v_gone, ARRAY[]::bigint[])) THEN 'ok'
                 WHEN EXISTS (SELECT 1 FROM {schema}.message m WHERE m.id = h.id)
                     THEN 'state_invalid'
                 ELSE 'not_found' END
        FROM unnest(p_ids) AS h(id);
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


-- ---------------------------------------------------------------------------------------------
-- 8. Policies and limits
-- The channel rows (only channels with a policy of their own or a limit in force have one):
-- the limits in force, the counts a limit needs, and the policies that set them.
-- ---------------------------------------------------------------------------------------------

-- The limits in force for a channel: its own policy, else the queue's default.
CREATE FUNCTION {schema}.channel_limits_v1(
    p_queue text, p_channel text, OUT max_concurrency integer, OUT max_size integer
)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    SELECT CASE WHEN c.has_policy THEN c.own_max_concurrency ELSE q.max_concurrency END,
           CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END
    INTO max_concurrency, max_size
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
END;
$$;

-- The limits in force for a channel, with its rate (its own policy, else the queue's default):
-- at most rate_count deliveries per rate_per_ms, burst at once.
CREATE FUNCTION {schema}.channel_limits_v2(
    p_queue text, p_channel text, OUT max_concurrency integer, OUT max_size integer,
    OUT rate_count integer, OUT rate_per_ms bigint, OUT burst integer
)
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    SELECT CASE WHEN c.has_policy THEN c.own_max_concurrency ELSE q.max_concurrency END,
           CASE WHEN c.has_policy THEN c.own_max_size ELSE q.max_size END,
           CASE WHEN c.has_policy THEN c.own_rate_count ELSE q.rate_count END,
           CASE WHEN c.has_policy THEN c.own_rate_per_ms ELSE q.rate_per_ms END,
           CASE WHEN c.has_policy THEN c.own_burst ELSE q.burst END
    INTO max_concurrency, max_size, rate_count, rate_per_ms, burst
    FROM (SELECT) AS one
    LEFT JOIN {schema}.queue q ON q.name = p_queue
    LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel;
END;
$$;

-- Give back what removed (or unlocked) messages held on their channel row: p_sized messages
-- of its current_size, p_slotted of its current_concurrency. A slot freed in a channel at its
-- max_concurrency marks it `freed`: the next ingest (which the next dequeue runs, seeing it)
-- gives its lane a turn again. (Only owners and the ingest write lanes: that is what keeps
-- the queues' turn positions exact.) A row left with nothing to count and no policy goes.
CREATE FUNCTION {schema}.channel_give_back_v1(
    p_queue text, p_channel text, p_sized integer, p_slotted integer
) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_row {schema}.channel;
    v_max integer;
BEGIN
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_row.current_size := GREATEST(0, v_row.current_size - p_sized);
    IF p_slotted > 0 THEN
        SELECT l.max_concurrency INTO v_max FROM {schema}.channel_limits_v1(p_queue, p_channel) l;
        IF v_max IS NOT NULL AND v_row.current_concurrency >= v_max
           AND v_row.current_concurrency - p_slotted < v_max THEN
            v_row.freed := true;
            PERFORM {schema}.wake_v1(p_queue);
        END IF;
        v_row.current_concurrency := GREATEST(0, v_row.current_concurrency - p_slotted);
    END IF;
    IF NOT v_row.has_policy AND v_row.current_size = 0 AND v_row.current_concurrency = 0
       AND NOT v_row.freed AND (v_row.rate_tat IS NULL OR v_row.rate_tat <= clock_timestamp()) THEN
        DELETE FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel;
    ELSE
        UPDATE {schema}.channel c SET
            current_size = v_row.current_size,
            current_concurrency = v_row.current_concurrency,
            freed = v_row.freed
        WHERE c.queue = p_queue AND c.name = p_channel;
    END IF;
END;
$$;

-- The free slots of a channel with a max_concurrency, its row locked for the caller (created
-- when missing). NULL when another transaction holds the row (a producer of a limited channel
-- or an ack): the lane waits for a later dequeue rather than this one waiting for it.
CREATE FUNCTION {schema}.channel_headroom_v1(p_queue text, p_channel text, OUT headroom integer, OUT max_concurrency integer)
LANGUAGE plpgsql SET lock_timeout = '10ms' SET enable_seqscan = off AS $$
DECLARE
    v_current integer;
BEGIN
    SELECT l.max_concurrency INTO max_concurrency FROM {schema}.channel_limits_v1(p_queue, p_channel) l;
    IF max_concurrency IS NULL THEN
        headroom := 2147483647;
        RETURN;
    END IF;
    SELECT c.current_concurrency INTO v_current FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        headroom := GREATEST(0, max_concurrency - v_current);
        RETURN;
    END IF;
    headroom := NULL;
    IF NOT EXISTS (SELECT 1 FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel) THEN
        BEGIN
            INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                headroom := max_concurrency;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            headroom := NULL;
        END;
    END IF;
END;
$$;

-- A rate's state at p_now: the emission interval T (p_per_ms / p_count), the theoretical
-- arrival time of the next delivery (at least p_now; p_tat rescaled when it was reckoned with
-- another interval: what was owed is kept in deliveries, so a new rate applies within one of
-- its intervals), the deliveries allowed now (whole ones, at most p_burst) and, when none is,
-- when the next one is. See channel_headroom_v2.
CREATE FUNCTION {schema}.rate_state_v1(
    p_tat timestamptz, p_tat_interval interval, p_count integer, p_per_ms bigint, p_burst integer,
    p_now timestamptz, OUT rate_interval interval, OUT tat timestamptz, OUT tokens integer,
    OUT next_at timestamptz
)
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_count IS NULL THEN
        RETURN;
    END IF;
    rate_interval := (p_per_ms::double precision / p_count) * interval '1 millisecond';
    tat := p_tat;
    IF tat > p_now AND p_tat_interval IS DISTINCT FROM rate_interval AND p_tat_interval > '0' THEN
        tat := p_now + (extract(epoch FROM tat - p_now) / extract(epoch FROM p_tat_interval))
                       * rate_interval;
    END IF;
    tat := GREATEST(coalesce(tat, p_now), p_now);
    -- (the 1e-6 absorbs the rounding of timestamps to microseconds: at the time a delivery is
    -- due, it is allowed)
    tokens := LEAST(p_burst, GREATEST(0, floor(p_burst - extract(epoch FROM tat - p_now)
                                                / extract(epoch FROM rate_interval) + 1e-6)))::integer;
    IF tokens = 0 THEN
        next_at := tat - (p_burst - 1) * rate_interval;
    END IF;
END;
$$;

-- What the owner of a limited lane may take now (p_now), its channel row locked for the
-- caller (created when missing): `room`, the free slots under its max_concurrency (NULL: none
-- applies); `tokens`, the deliveries its rate allows now (NULL: no rate); `headroom`, the
-- lesser of the two. All NULL when another transaction holds the row (a producer of a channel
-- with a max_size, or an ack): the lane waits for a later dequeue rather than this one waiting
-- for it.
--
-- The rate is a GCRA (generic cell rate algorithm): with T = rate_per_ms / rate_count (the
-- emission interval), the row keeps `rate_tat`, the theoretical arrival time of the next
-- delivery; n deliveries are allowed at time t when max(tat, t) + n T <= t + burst T, and
-- taking them moves tat to max(tat, t) + n T. So no window of length w holds more than
-- burst + w / T deliveries. `tat` comes back as max(tat, t) (rate_state_v1).
CREATE FUNCTION {schema}.channel_headroom_v2(
    p_queue text, p_channel text, p_now timestamptz, OUT headroom integer,
    OUT max_concurrency integer, OUT room integer, OUT tokens integer, OUT rate_interval interval,
    OUT burst integer, OUT tat timestamptz
)
LANGUAGE plpgsql SET lock_timeout = '10ms' SET enable_seqscan = off AS $$
DECLARE
    v_lim record;
    v_row {schema}.channel;
BEGIN
    SELECT * INTO v_lim FROM {schema}.channel_limits_v2(p_queue, p_channel);
    max_concurrency := v_lim.max_concurrency;
    IF v_lim.max_concurrency IS NULL AND v_lim.rate_count IS NULL THEN
        headroom := 2147483647;
        RETURN;
    END IF;
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {schema}.channel c WHERE c.queue = p_queue AND c.name = p_channel) THEN
            max_concurrency := NULL;
            RETURN;  -- busy
        END IF;
        BEGIN
            INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
            ON CONFLICT DO NOTHING
            RETURNING * INTO v_row;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        IF v_row.name IS NULL THEN
            max_concurrency := NULL;
            RETURN;  -- another transaction is creating it
        END IF;
    END IF;
    IF v_lim.max_concurrency IS NOT NULL THEN
        room := GREATEST(0, v_lim.max_concurrency - v_row.current_concurrency);
    END IF;
    IF v_lim.rate_count IS NOT NULL THEN
        burst := v_lim.burst;
        SELECT r.rate_interval, r.tat, r.tokens INTO rate_interval, tat, tokens
        FROM {schema}.rate_state_v1(v_row.rate_tat, v_row.rate_interval, v_lim.rate_count,
                                    v_lim.rate_per_ms, v_lim.burst, p_now) AS r;
        -- (a rate changed since the row's tat was reckoned: what is owed, rescaled, is kept,
        -- whether or not this call takes anything)
        IF v_row.rate_tat > p_now AND v_row.rate_interval IS DISTINCT FROM rate_interval THEN
            UPDATE {schema}.channel c SET rate_tat = tat, rate_interval = channel_headroom_v2.rate_interval
            WHERE c.queue = p_queue AND c.name = p_channel;
        END IF;
    END IF;
    headroom := LEAST(coalesce(room, 2147483647), coalesce(tokens, 2147483647));
END;
$$;

-- Bring a channel in line with the limits now in force, after a policy change: a limit that
-- starts counting counts what the channel holds (max_size: its messages; max_concurrency: its
-- messages in flight), the lane is marked limited or not and gets its turn back, or loses it
-- at its max_concurrency, or waits for its next token no more. The caller holds the ingest
-- key. Returns whether the lane got a turn it did not have (or an earlier one).
CREATE FUNCTION {schema}.channel_apply_v1(p_queue text, p_channel text) RETURNS boolean
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_lim record;
    v_row {schema}.channel;
    v_n integer;
    v_lane {schema}.lane;
    v_put {schema}.lane;
    v_d {schema}.discovery;
    v_next record;
    v_i integer;
BEGIN
    SELECT * INTO v_lim FROM {schema}.channel_limits_v2(p_queue, p_channel);
    IF v_lim.max_size IS NOT NULL OR v_lim.max_concurrency IS NOT NULL
       OR v_lim.rate_count IS NOT NULL THEN
        INSERT INTO {schema}.channel (queue, name) VALUES (p_queue, p_channel)
        ON CONFLICT DO NOTHING;
    END IF;
    SELECT * INTO v_row FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel FOR UPDATE;
    IF FOUND THEN
        IF v_lim.max_size IS NOT NULL THEN
            WITH marked AS (
                UPDATE {schema}.message m SET sized = true
                WHERE m.id IN (
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.channel = p_channel AND x.locked_until IS NULL
                      AND NOT x.sized
                    UNION ALL
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                      AND x.channel = p_channel AND NOT x.sized)
                RETURNING 1
            )
            SELECT count(*) INTO v_n FROM marked;
            v_row.current_size := v_row.current_size + v_n;
        END IF;
        IF v_lim.max_concurrency IS NOT NULL THEN
            WITH marked AS (
                UPDATE {schema}.message m SET slotted = true
                WHERE m.id IN (
                    SELECT x.id FROM {schema}.message x
                    WHERE x.queue = p_queue AND x.locked_until IS NOT NULL
                      AND x.channel = p_channel AND NOT x.slotted)
                RETURNING 1
            )
            SELECT count(*) INTO v_n FROM marked;
            v_row.current_concurrency := v_row.current_concurrency + v_n;
        END IF;
        UPDATE {schema}.channel c SET
            current_size = v_row.current_size, current_concurrency = v_row.current_concurrency
        WHERE c.queue = p_queue AND c.name = p_channel;
        DELETE FROM {schema}.channel c
        WHERE c.queue = p_queue AND c.name = p_channel AND NOT c.has_policy
          AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
          AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
    END IF;
    v_lane := {schema}.lane_lock_v1(p_queue, p_channel);
    IF v_lane.id IS NULL THEN
        RETURN false;
    END IF;
    v_put := v_lane;
    v_put.limited := v_lim.max_concurrency IS NOT NULL OR v_lim.rate_count IS NOT NULL;
    -- (a lane waiting for its next token under the old rate: its turn is recomputed, and its
    -- owner reckons the tokens under the new one)
    v_put.not_before := NULL;
    IF v_lim.max_concurrency IS NOT NULL
       AND coalesce(v_row.current_concurrency, 0) >= v_lim.max_concurrency THEN
        v_put.turn_at := NULL;
    ELSIF v_put.turn_at IS NULL OR v_lane.not_before IS NOT NULL THEN
        SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        SELECT * INTO v_next FROM {schema}.lane_next_v1(v_put, v_d.snap);
        v_put.prios := v_next.prios;
        v_put.pos_at := v_next.pos_at;
        v_put.pos_id := v_next.pos_id;
        IF v_next.next_at IS NOT NULL THEN
            v_i := array_position(v_d.queues, p_queue);
            v_put.turn_at := GREATEST(v_next.next_at, v_put.served_at,
                CASE WHEN v_i IS NULL THEN '-infinity' ELSE v_d.turn_from[v_i] END);
        END IF;
    END IF;
    IF v_put.limited IS DISTINCT FROM v_lane.limited OR v_put.turn_at IS DISTINCT FROM v_lane.turn_at
       OR v_put.not_before IS DISTINCT FROM v_lane.not_before
       OR v_put.prios IS DISTINCT FROM v_lane.prios OR v_put.pos_at IS DISTINCT FROM v_lane.pos_at
       OR v_put.pos_id IS DISTINCT FROM v_lane.pos_id THEN
        PERFORM {schema}.lane_put_v1(v_lane.id, v_put);
    END IF;
    -- (a turn it did not have, or an earlier one: sleepers may be waiting for the later one)
    RETURN v_put.turn_at IS NOT NULL
        AND (v_lane.turn_at IS NULL
             OR (v_put.turn_at < v_lane.turn_at AND v_lane.turn_at > clock_timestamp()));
END;
$$;

-- Set a channel's own policy (NULL: no limit): max_concurrency, max_size, and a rate of at
-- most p_rate_count deliveries per p_rate_per_ms, p_burst at once (all three or none).
-- Applies at once to the messages it holds.
CREATE FUNCTION {schema}.channel_policy_set_v2(
    p_queue text, p_channel text, p_max_concurrency integer, p_max_size integer,
    p_rate_count integer, p_rate_per_ms bigint, p_burst integer
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    PERFORM {schema}.queue_ensure_v1(p_queue);
    INSERT INTO {schema}.channel AS c (queue, name, has_policy, own_max_concurrency, own_max_size,
                                       own_rate_count, own_rate_per_ms, own_burst)
    VALUES (p_queue, p_channel, true, p_max_concurrency, p_max_size, p_rate_count, p_rate_per_ms,
            p_burst)
    ON CONFLICT (queue, name) DO UPDATE SET
        has_policy = true, own_max_concurrency = EXCLUDED.own_max_concurrency,
        own_max_size = EXCLUDED.own_max_size, own_rate_count = EXCLUDED.own_rate_count,
        own_rate_per_ms = EXCLUDED.own_rate_per_ms, own_burst = EXCLUDED.own_burst;
    IF {schema}.channel_apply_v1(p_queue, p_channel) THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
END;
$$;

-- Version 1 (clients of schema version 7 and before): the limits, keeping the channel's rate.
CREATE FUNCTION {schema}.channel_policy_set_v1(
    p_queue text, p_channel text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT c.own_rate_count, c.own_rate_per_ms, c.own_burst INTO r FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel AND c.has_policy;
    PERFORM {schema}.channel_policy_set_v2(p_queue, p_channel, p_max_concurrency, p_max_size,
                                           r.own_rate_count, r.own_rate_per_ms, r.own_burst);
END;
$$;

-- Remove a channel's own policy: it falls back to the queue default.
CREATE FUNCTION {schema}.channel_policy_clear_v1(p_queue text, p_channel text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    UPDATE {schema}.channel c SET has_policy = false, own_max_concurrency = NULL,
        own_max_size = NULL, own_rate_count = NULL, own_rate_per_ms = NULL, own_burst = NULL
    WHERE c.queue = p_queue AND c.name = p_channel;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF {schema}.channel_apply_v1(p_queue, p_channel) THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
    DELETE FROM {schema}.channel c
    WHERE c.queue = p_queue AND c.name = p_channel AND NOT c.has_policy
      AND c.current_size = 0 AND c.current_concurrency = 0 AND NOT c.freed
      AND (c.rate_tat IS NULL OR c.rate_tat <= clock_timestamp());
END;
$$;

-- Set (or, with NULLs, clear) the queue-wide default policy, applied at once to every channel
-- of the queue that has no policy of its own.
CREATE FUNCTION {schema}.queue_policy_set_v2(
    p_queue text, p_max_concurrency integer, p_max_size integer, p_rate_count integer,
    p_rate_per_ms bigint, p_burst integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_channel text;
    v_woken boolean := false;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    PERFORM {schema}.queue_ensure_v1(p_queue);
    UPDATE {schema}.queue SET max_concurrency = p_max_concurrency, max_size = p_max_size,
        rate_count = p_rate_count, rate_per_ms = p_rate_per_ms, burst = p_burst
    WHERE name = p_queue;
    FOR v_channel IN
        SELECT x.channel FROM (
            SELECT l.channel FROM {schema}.lane l WHERE l.queue = p_queue
            UNION
            SELECT c.name FROM {schema}.channel c WHERE c.queue = p_queue
        ) AS x
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.channel c
                          WHERE c.queue = p_queue AND c.name = x.channel AND c.has_policy)
        ORDER BY x.channel
    LOOP
        IF {schema}.channel_apply_v1(p_queue, v_channel) THEN
            v_woken := true;
        END IF;
    END LOOP;
    IF v_woken THEN
        PERFORM {schema}.wake_v1(p_queue);
    END IF;
END;
$$;

-- Version 1 (clients of schema version 7 and before): the limits, keeping the queue's rate.
CREATE FUNCTION {schema}.queue_policy_set_v1(
    p_queue text, p_max_concurrency integer, p_max_size integer
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT q.rate_count, q.rate_per_ms, q.burst INTO r FROM {schema}.queue q
    WHERE q.name = p_queue;
    PERFORM {schema}.queue_policy_set_v2(p_queue, p_max_concurrency, p_max_size, r.rate_count,
                                         r.rate_per_ms, r.burst);
END;
$$;


-- ---------------------------------------------------------------------------------------------
-- 9. Queues: declare, purge, delete, stats
-- ---------------------------------------------------------------------------------------------

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
    SELECT coalesce(sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged
                        - (t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                           - t.removed_held)), 0),
           coalesce(sum(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held), 0)
    INTO waiting, in_flight
    FROM {schema}.channel_totals_v1(p_queue) AS t;
END;
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

-- Delete every message of a queue that is not held by a consumer (ready and delayed ones).
-- Returns how many were deleted. Held messages stay until acked or their lock expires.
CREATE FUNCTION {schema}.queue_purge_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_d {schema}.discovery;
    v_total bigint := 0;
    r record;
    v_lane {schema}.lane;
BEGIN
    -- with the ingest held, a message not ingested yet is counted as enqueued here
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
    FOR r IN
        WITH gone AS (
            DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NULL
            RETURNING m.channel, m.sized,
                      m.arrival = 0 AND NOT pg_visible_in_snapshot(m.txid, v_d.snap) AS fresh
        ), per AS (
            SELECT g.channel, count(*)::integer AS n, count(*) FILTER (WHERE g.sized)::integer AS s,
                   count(*) FILTER (WHERE g.fresh)::integer AS f
            FROM gone g GROUP BY g.channel
        ), counted AS (
            INSERT INTO {schema}.tally (queue, channel, enqueued, purged)
            SELECT p_queue, p.channel, p.f, p.n FROM per p
        )
        SELECT * FROM per ORDER BY channel
    LOOP
        v_total := v_total + r.n;
        IF r.s > 0 THEN
            PERFORM {schema}.channel_give_back_v1(p_queue, r.channel, r.s, 0);
        END IF;
    END LOOP;
    FOR r IN SELECT DISTINCT l.channel FROM {schema}.lane l WHERE l.queue = p_queue ORDER BY 1 LOOP
        v_lane := {schema}.lane_lock_v1(p_queue, r.channel);
        IF v_lane.turn_at IS NOT NULL OR cardinality(v_lane.prios) > 0 THEN
            v_lane.turn_at := NULL;
            v_lane.prios := '{{}}';
            v_lane.pos_at := '{{}}';
            v_lane.pos_id := '{{}}';
            PERFORM {schema}.lane_put_v1(v_lane.id, v_lane);
        END IF;
    END LOOP;
    RETURN v_total;
END;
$$;

-- Delete a queue: all its messages (held ones too), lanes, policies and counts. Its dead
-- letters stay until their retention ends. Returns how many messages were deleted.
CREATE FUNCTION {schema}.queue_delete_v1(p_queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_n bigint := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0));
    DELETE FROM {schema}.binding WHERE queue = p_queue;
    PERFORM 1 FROM {schema}.queue q WHERE q.name = p_queue FOR UPDATE;
    IF NOT FOUND AND NOT EXISTS (SELECT 1 FROM {schema}.message m WHERE m.queue = p_queue
                                 AND m.locked_until IS NULL) THEN
        RETURN 0;
    END IF;
    PERFORM {schema}.lane_lock_v1(p_queue, l.channel)
    FROM (SELECT DISTINCT l.channel FROM {schema}.lane l WHERE l.queue = p_queue ORDER BY 1) AS l;
    WITH gone AS (
        DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NULL
        RETURNING 1
    ), gone_held AS (
        DELETE FROM {schema}.message m WHERE m.queue = p_queue AND m.locked_until IS NOT NULL
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM gone_held) INTO v_n;
    DELETE FROM {schema}.lane l WHERE l.queue = p_queue;
    DELETE FROM {schema}.channel c WHERE c.queue = p_queue;
    DELETE FROM {schema}.channel_count cc WHERE cc.queue = p_queue;
    DELETE FROM {schema}.queue_count qc WHERE qc.queue = p_queue;
    DELETE FROM {schema}.tally t WHERE t.queue = p_queue;
    DELETE FROM {schema}.queue q WHERE q.name = p_queue;
    RETURN v_n;
END;
$$;

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

-- Counters of a queue, exact (ready and delayed are counted from the messages: O(messages
-- not held)).
CREATE FUNCTION {schema}.queue_stats_v1(p_queue text, p_count_ready boolean)
RETURNS TABLE (
    total bigint, in_flight bigint, ready bigint, delayed bigint, channels bigint,
    max_concurrency integer, max_size integer
)
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged), 0)::bigint,
           coalesce(sum(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held), 0)::bigint,
           CASE WHEN p_count_ready THEN coalesce((SELECT w.ready FROM {schema}.queue_waiting_v1(p_queue) w), 0) END,
           CASE WHEN p_count_ready THEN coalesce((SELECT w.delayed FROM {schema}.queue_waiting_v1(p_queue) w), 0) END,
           count(*) FILTER (WHERE t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged > 0),
           (SELECT q.max_concurrency FROM {schema}.queue q WHERE q.name = p_queue),
           (SELECT q.max_size FROM {schema}.queue q WHERE q.name = p_queue)
    FROM {schema}.channel_totals_v1(p_queue) AS t
$$;


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


-- ---------------------------------------------------------------------------------------------
-- 11. Expiry and housekeeping
-- Kombu's queue arguments (x-expires, x-message-ttl), so that abandoned queues and stale
-- broadcasts go; dead letters past their retention (housekeep_v1, which also folds the
-- counts).
-- ---------------------------------------------------------------------------------------------

-- Mark queues with an x-expires as used now (consumers call this periodically).
CREATE FUNCTION {schema}.queue_touch_v1(p_queues text[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.queue SET used_at = clock_timestamp()
    WHERE name = ANY (p_queues) AND expires_ms IS NOT NULL
      AND used_at < clock_timestamp() - interval '1 second';
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

-- Delete expired messages (not held by a consumer) and queues unused for longer than their
-- x-expires, at most p_limit messages a call. Returns (messages, queues) deleted. Reads the
-- expiry index from the position where the last sweep stopped.
CREATE FUNCTION {schema}.expire_v1(p_limit integer, OUT messages bigint, OUT queues bigint)
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

-- Housekeeping, run by consumers every expire_interval: prune dead letters older than their
-- queue's retention (at most p_limit), ingest and fold the counts, and remove the lanes of
-- channels empty for 5 minutes (at most p_limit).
CREATE FUNCTION {schema}.housekeep_v1(p_limit integer, OUT dead_pruned bigint)
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

-- The channels of a queue, largest first, with their policies and counters (version 1, for
-- clients of schema version 7 and before: channel_list_v2 without the rates).
CREATE FUNCTION {schema}.channel_list_v1(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT c.channel_name, c.size, c.in_flight, c.max_concurrency, c.max_size, c.has_policy,
           c.waiting_since, c.served_at, c.enqueued, c.delivered, c.acked, c.deferred, c.dead,
           c.expired, c.dropped
    FROM {schema}.channel_list_v2(p_queue, p_limit) AS c;
END;
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


-- ---------------------------------------------------------------------------------------------
-- 13. Security: rights
-- Last: the REVOKE applies to every function created above.
-- ---------------------------------------------------------------------------------------------

-- Security: callers run the entry points below with the rights of the schema's owner
-- (SECURITY DEFINER, with a fixed search_path) and need no rights on the tables; nobody may
-- execute a function unless granted (lonnymq.grant / `lonnymq grant`: producer, worker,
-- admin). The internal functions are only called by the entry points.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM PUBLIC;

ALTER FUNCTION {schema}.message_create_v1(text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_create_many_v1(text[], text[], text[], bytea[], integer[], bigint[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_publish_v1(text, text, text, text, bytea, integer, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_dequeue_v1(text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_dequeue_v2(text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.sleep_v1(text[], text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_delete_v1(bigint, uuid)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_defer_v1(bigint, uuid, bigint, boolean, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_heartbeat_v1(bigint[], uuid[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_reject_v1(bigint, uuid, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_policy_set_v1(text, text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_policy_clear_v1(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_policy_set_v2(text, text, integer, integer, integer, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_get_v2(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_policy_set_v2(text, integer, integer, integer, bigint, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_list_v2(text, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.rate_held_v1()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_get_v1(text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_policy_set_v1(text, integer, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_stats_v1(text, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.exchange_declare_v1(text, text, boolean, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.exchange_delete_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_declare_v1(text, bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_bind_v1(text, text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_unbind_v1(text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_touch_v1(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.expire_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_status_v1(boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.horizon_v1(integer)
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

ALTER FUNCTION {schema}.message_update_v1(bigint, bigint, timestamptz, integer, bytea)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.dead_purge_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_configure_v1(text, jsonb)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.housekeep_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.queue_declare_v2(text, bigint, bigint, boolean, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.consumer_sync_v1(uuid, text, integer, text, integer, text[], text[], boolean[], integer[], timestamptz[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.consumer_list_v1(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_list_v2(text, text, text, bigint, integer, text, timestamptz, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.channel_list_v3(text, integer, text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
