-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

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
    -- (0-255, name 1-255 characters: checked by the functions that write them, not by CHECK
    -- constraints; see the note after the table)
    priority smallint NOT NULL DEFAULT 0,
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
    name text,
    content bytea NOT NULL,
    state bytea
);

-- No CHECK constraint on message (schema version 27): Postgres reads a table's CHECK
-- constraints back from the catalog's text and plans them at every statement that inserts or
-- updates its rows, 11 us of a one-row INSERT's 78 of server CPU with the three this table had
-- (docs/design.md, "The hot path: traps measured"), and every create and every lock pays it.
-- What they checked is kept by the functions: the priority (0-255) and the name (1-255
-- characters) by those that write them (message_create_v1, message_create_many_v1,
-- message_update_v1, SQLSTATE 23514 as before), and the lock pair, a message is locked
-- when it has both locked_until and lock_token (statements that find a message by id and lock
-- token rely on it, and so stay on the primary key, off message_locked_idx, which a held
-- snapshot fills with the dead entries of everything consumed), by every function that locks
-- or unlocks one; the test suite checks it in every test's schema at the test's end.

-- Unlocked messages of a channel in the order they are handed out. Read from a lane's
-- position per priority, never from the start.
CREATE INDEX message_ready_idx ON {schema}.message (queue, channel, priority DESC, dequeue_at, id)
    WHERE locked_until IS NULL;

-- What became ready, by transaction: the ingest reads what committed since its snapshot.
-- (Its predicate names lock_token, message_ready_idx's locked_until: the same rows by the
-- lock pair (the note above), but no statement written for one index can be planned on the
-- other; a generic plan read this whole index, backlog and dead entries, for a lane's next
-- position.)
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

-- Transports that take messages handed to them by a publish (schema version 21; see
-- handoff_v1): one row per LISTEN session, written when the queues it consumes change. holder:
-- random, its own; the session holds the key 'holder' of it while it lives, and the key
-- 'asleep <holder>' of each queue it sleeps on with room. secret: signs each hand-off (any
-- role may NOTIFY; the owner and admin roles read this table).
CREATE TABLE {schema}.sleeper (
    holder bigint PRIMARY KEY,
    queues text[] COLLATE "C" NOT NULL,
    secret text NOT NULL,
    lock_ms bigint NOT NULL CHECK (lock_ms > 0),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- (schema version 23) those of its queues it consumes without acks: a message handed to it
    -- for one of them has no row (see handoff_v1)
    no_ack text[] COLLATE "C" NOT NULL DEFAULT '{{}}'
);

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

