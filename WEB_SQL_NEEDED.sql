-- Read-only SQL the web view (src/lonnymq/web/) needs to render every page of a queue of
-- 1,000,000 messages in 100,000 channels in under 300 ms without keeping readings. Not applied:
-- src/lonnymq/sql/ belongs to the hot-path work; whoever owns it decides where these go (a
-- migration, with a version suffix) and adds the queue-API calls.
--
-- Measured with benchmarks/bench_web.py (schema filled with queue.batch(): 999,800 messages,
-- 949,500 ready, 50,000 delayed, 300 in flight, 200 dead letters, 100,000 channels; the
-- tenants 0..99 hold 5,000 messages each, the others ~5; every 100th channel has a policy) on
-- the 2-core machine, Postgres 15, 2026-12-02. Times are server-side (psql \timing) or of one
-- queue-API call from Python (median of 10).
--
-- Meanwhile the web view keeps the two slow readings (the status, a queue's channel listing)
-- and refreshes them in the background (src/lonnymq/web/readings.py): pages then render in
-- 4-10 ms, but the first page after a start waits for them (3.1 s, 1.8 s), and the figures
-- they show are up to ~5x the reading's duration old (15 s for the status of that queue).


-- 1. The channels of a queue by backlog, limited BEFORE the per-channel lookups.
--
-- channel_list_v1(p_queue, p_limit) calls channel_limits_v1 (plpgsql) and looks up the latest
-- lane of EVERY channel of the queue, then sorts and applies the limit: 1,892 ms for the top
-- 50 of 100,000 channels (1,655 ms for the top 1). channel_totals_v1(p_queue) alone is 62 ms.
-- The same result with the limit applied first: 326 ms (measured: this function created in
-- the benchmark's own schema). What is left is the full join with `channel` and the sort of
-- 100,000 rows; under 100 ms would need the sizes kept sorted (an index on the live
-- channel_count rows by size, say), which is a hot-path decision.
-- (channel_list_v1 also runs ingest_v1 first; this one does not, so it stays STABLE and
-- read-only: a web view needs no write, and may then run on a read-only role or a replica.)
-- Also wanted here: the age of each channel's oldest ready message. The page shows how long a
-- channel has waited for its turn (lane.turn_at, NULL while it is at its max_concurrency:
-- then it says "at limit"); the oldest ready message of a channel is, to the ingest's
-- knowledge, min(pos_at) of its live lane (the first ready message per priority), a column
-- this function could return from the lane row it already reads:
--     (SELECT min(p) FROM unnest(l.pos_at) AS p WHERE p <= clock_timestamp()) AS oldest_ready_at
CREATE FUNCTION {schema}.channel_top_v1(p_queue text, p_limit integer)
RETURNS TABLE (
    channel_name text, size integer, in_flight integer, max_concurrency integer,
    max_size integer, has_policy boolean, waiting_since timestamptz, served_at timestamptz,
    enqueued bigint, delivered bigint, acked bigint, deferred bigint, dead bigint,
    expired bigint, dropped bigint
)
LANGUAGE sql STABLE AS $$
    WITH t AS MATERIALIZED (SELECT * FROM {schema}.channel_totals_v1(p_queue)),
    c AS (
        SELECT coalesce(t.channel, ch.name) AS channel,
               coalesce(t.enqueued - t.acked - t.dead - t.expired - t.removed - t.purged, 0) AS size,
               coalesce(t.delivered - t.redelivered - t.acked - t.deferred - t.dead_held
                        - t.removed_held, 0) AS in_flight,
               t.enqueued, t.delivered, t.acked, t.deferred, t.dead, t.expired, t.dropped,
               coalesce(ch.has_policy, false) AS has_policy
        FROM t FULL JOIN (SELECT * FROM {schema}.channel x
                          WHERE x.queue = p_queue AND x.has_policy) AS ch
            ON ch.name = t.channel
    ),
    top AS MATERIALIZED (
        SELECT * FROM c WHERE c.size > 0 OR c.has_policy
        ORDER BY c.size DESC, c.in_flight DESC, c.channel
        LIMIT p_limit
    )
    SELECT top.channel, top.size::integer, top.in_flight::integer, lim.max_concurrency,
           lim.max_size, top.has_policy, l.turn_at, nullif(l.served_at, '-infinity'),
           coalesce(top.enqueued, 0), coalesce(top.delivered, 0), coalesce(top.acked, 0),
           coalesce(top.deferred, 0), coalesce(top.dead, 0), coalesce(top.expired, 0),
           coalesce(top.dropped, 0)
    FROM top
    CROSS JOIN LATERAL {schema}.channel_limits_v1(p_queue, top.channel) AS lim
    LEFT JOIN LATERAL (
        SELECT x.turn_at, x.served_at FROM {schema}.lane x  -- (and x.pos_at, see above)
        WHERE x.queue = p_queue AND x.channel = top.channel ORDER BY x.id DESC LIMIT 1
    ) AS l ON true
    ORDER BY top.size DESC, top.in_flight DESC, top.channel
$$;


-- 2. The ready/delayed split and the oldest ready message, without reading every waiting
--    message.
--
-- queue_status_v1(true) takes 3,000 ms on that queue, of which queue_waiting_v1(NULL) is
-- 2,811 ms (it joins every lane's positions with every waiting message); with
-- p_count_ready = false it is 300 ms (the sum over 100,000 channels' counts), without ready,
-- delayed and the oldest ready age, which the overview must show.
-- Measured alternative: a partial index
--     CREATE INDEX message_due_idx ON {schema}.message (queue, dequeue_at)
--         WHERE locked_until IS NULL;
-- gives, per queue, the delayed count (an index range past now: 50,000 entries) and the
-- oldest ready (the first entry) in 245 ms for both, on a table not vacuumed since the fill
-- (index-only scans would do better once the visibility map is set); ready = waiting -
-- delayed. But that index is one more entry written by every create, lock and unlock: a
-- hot-path cost for the owner of schema.sql to weigh. Without it, a per-queue count of
-- delayed messages kept by the fold (the ingest knows each message's dequeue_at) would do.
--     queue_status_v2(p_count_ready boolean) -- same columns as v1, ready/delayed/oldest
--     from the index (or the fold), and the per-queue sums from queue-level counts kept by
--     the fold instead of a GROUP BY over every channel's counts.


-- 3. A channel's messages, paged in delivery order.
--
-- message_list_v1 with a channel filter walks the primary key (id order) and filters: for a
-- channel of 5 messages among 1,000,000 it reads the whole table, 230 ms (the page: 250 ms
-- median, 330 ms max with the readings refreshing beside it; the only page over 300 ms).
-- Paged in delivery order (priority DESC, dequeue_at, id) from message_ready_idx it is
-- 1.4 ms (measured: the query below, the first page of a 5-message and of a 5,000-message
-- channel). Locked messages of a channel come from message_locked_idx (queue, locked_until)
-- filtered by channel, dead letters from dead_message_queue_idx.
CREATE FUNCTION {schema}.channel_messages_v1(
    p_queue text, p_channel text,
    p_after_priority smallint, p_after_at timestamptz, p_after_id bigint, p_limit integer
)
RETURNS TABLE (
    message_id bigint, message_name text, priority smallint, attempts integer,
    dequeue_at timestamptz, created_at timestamptz, size integer
)
LANGUAGE sql STABLE AS $$
    SELECT m.id, m.name, m.priority, m.attempts, m.dequeue_at, m.created_at, length(m.content)
    FROM {schema}.message m
    WHERE m.queue = p_queue AND m.channel = p_channel AND m.locked_until IS NULL
      AND (p_after_id IS NULL
           OR (-m.priority, m.dequeue_at, m.id) > (-p_after_priority, p_after_at, p_after_id))
    ORDER BY m.priority DESC, m.dequeue_at, m.id
    LIMIT p_limit
$$;


-- 4. Not SQL for the web view, found while filling the benchmark: a queue whose 100,000
--    channels were all created before any consumer ran cannot be consumed at all. The first
--    dequeue's ingest writes a lane for every new channel in one transaction and fails with
--    "out of shared memory / You might need to increase max_locks_per_transaction"
--    (max_locks_per_transaction = 64, max_connections = 100), inside lane_put_v1 called by
--    ingest_v1 (message_dequeue_v3 -> ingest_wait_v1); every later dequeue fails the same
--    way, so the backlog is stuck. benchmarks/bench_web.py now calls ingest_v1 after every
--    10,000 created messages, as a running consumer would. The ingest needs to take new
--    channels in bounded slices.
