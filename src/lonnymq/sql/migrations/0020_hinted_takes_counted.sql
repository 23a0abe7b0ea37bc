-- lonnymq migration 20.

-- =============================================================================================
-- Hinted takes in a row, bounded by what this session took, not by the database's traffic
-- (issue "A real Celery worker wakes within milliseconds")
-- =============================================================================================
--
-- Version 19 let a hinted call take again without an ingest while fewer than 100
-- transactions began since the ingest's snapshot: transactions of the whole database, so on
-- one busy with other work (a CI run's other tests did it) the bound was passed within a
-- fraction of a second, and a woken consumer's call after a take fell back to the full
-- dequeue, which is never settled: the look after it came back at every other wake-up. The
-- bound is now the takes this session made since the newest ingest (the session setting
-- lonnymq.taken: that ingest's id and the count), fewer than 32 (each of fewer than 64 rows),
-- which is what it was for: what takes leave behind in message_txid_idx stays short. The
-- call reads the ingest's state once (the settled row read it again). Same signature. No
-- table changes.

-- A dequeue that knows what woke it (schema version 16): p_hints, ids of messages that
-- creates of the call's queues hinted (wake_v2) to this sleeping consumer. When they are all
-- that no ingest has seen yet of these queues, and all of one channel, the call takes them by
-- their ids, as the take (dequeue_take_v1) would have taken them, in one statement instead of
-- message_dequeue_v3's usual read and the take's two (what a woken consumer paid: measured
-- 1.0 ms against 0.6 on this project's machine). The same rules as the take: under the ingest
-- key, tried; what no ingest has seen yet is little (fewer than 64 rows, of every queue); the
-- channel has no limit (no max_concurrency, no rate, its own or the queue's); the queues are
-- in the ingest's state and none has heads pending; no lane of the call's queues is due and
-- no lock of theirs is past its expiry, so that nothing waits that the round robin would
-- serve first; the messages are due, live and under max_attempts. Their creation is counted
-- in the call's tally (`arrival` 1), the lane is not written, and the session's next
-- message_dequeue_v3 call ingests first. Hinted takes follow one another without an ingest
-- (schema version 19; before, the look after a take ingested) while this session made fewer
-- than 32 takes since the newest ingest (lonnymq.taken: that ingest's id and the count;
-- schema version 20, before: while fewer than 100 transactions of the whole database began,
-- which any busy database outruns), so that what takes leave behind in message_txid_idx
-- (read from the ingest's xmax; each take is of fewer than 64 rows) stays short, and not
-- while a slot of a limited channel of the queues was freed (its lane gets its turn back at
-- the next ingest, which may come first). What this session created and no ingest has seen
-- is unseen and not hinted: no take then. When the call took all that waited, one more row
-- says so (event 'settled', with retry_ms as a call that found nothing gives it, or when
-- the locks it took expire, which no ingest has seen yet; schema version 19): nothing else
-- of these queues can be delivered now, and the caller, asleep on them (the hint came), is
-- woken by whatever is created from now on, so it need not look again. The acks, if any,
-- are deleted first (message_delete_many_v1). Otherwise, or when another consumer took
-- them first, message_dequeue_v3 does the call.
CREATE OR REPLACE FUNCTION {schema}.message_dequeue_hinted_v1(
    p_queues text[], p_hints bigint[], p_limit integer, p_lock_ms bigint, p_ack_ids bigint[],
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
    v_d {schema}.discovery;
    v_mark text[] := string_to_array(current_setting('lonnymq.taken', true), ' ');
    v_taken bigint;  -- takes this session made since the newest ingest (see above)
BEGIN
    IF cardinality(p_ack_ids) > 0 THEN
        RETURN QUERY
            SELECT d.message_id, NULL::text, NULL::text, NULL::text, NULL::smallint,
                   NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                   NULL::bigint, 'ack_' || d.result_code
            FROM {schema}.message_delete_many_v1(p_ack_ids, p_ack_tokens) AS d
            WHERE d.result_code <> 'ok';
    END IF;
    IF cardinality(p_hints) > 0 AND p_limit > 0
       AND coalesce(current_setting('lonnymq.sleeping', true), '') = ''
       AND pg_try_advisory_xact_lock(hashtextextended({lock_prefix} || 'ingest', 0)) THEN
        SELECT * INTO v_d FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1;
        v_taken := CASE WHEN v_mark[1] = v_d.id::text THEN v_mark[2]::bigint ELSE 0 END;
        RETURN QUERY
            WITH d AS MATERIALIZED (
                SELECT v_d.*
            ), unseen AS MATERIALIZED (
                -- what no ingest has seen yet, of every queue (as in dequeue_take_v1)
                SELECT m.id, m.queue, m.channel
                FROM d CROSS JOIN LATERAL (
                    SELECT m.* FROM {schema}.message m
                    WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
                    ORDER BY m.txid LIMIT 64) AS m
                UNION ALL
                SELECT m.id, m.queue, m.channel
                FROM d CROSS JOIN LATERAL pg_snapshot_xip(d.snap) AS x(txid)
                CROSS JOIN LATERAL (
                    SELECT m.* FROM {schema}.message m
                    WHERE m.txid = x.txid AND m.lock_token IS NULL
                    LIMIT 64) AS m
            ), mine AS MATERIALIZED (
                -- this call's part of it: all hinted, of one channel; nothing else waiting
                SELECT a.queue, a.channel, a.waiting
                FROM d, (SELECT min(u.queue) AS queue, min(u.channel) AS channel,
                                count(*) AS waiting,
                                count(*) FILTER (WHERE u.id <> ALL (p_hints)) AS others,
                                count(DISTINCT (u.queue, u.channel)) AS lanes
                         FROM unseen u WHERE u.queue = ANY (p_queues)) AS a
                WHERE a.others = 0 AND a.lanes = 1 AND (SELECT count(*) FROM unseen) < 64
                  AND p_queues <@ d.queues AND NOT d.pend_queue && p_queues
                  -- (takes in a row without an ingest: see above)
                  AND (current_setting('lonnymq.fresh', true) IS DISTINCT FROM 'on'
                       OR v_taken < 32)
                  -- (no limited channel's slot freed since the last ingest: see above)
                  AND NOT EXISTS (SELECT 1 FROM {schema}.channel c
                                  WHERE c.queue = ANY (p_queues) AND c.freed)
                  AND NOT EXISTS (
                      SELECT 1 FROM unnest(p_queues) AS w(q) CROSS JOIN LATERAL (
                          SELECT (SELECT l.turn_at FROM {schema}.lane l
                                  WHERE l.queue = w.q
                                    AND l.turn_at >= d.turn_from[array_position(d.queues, w.q)]
                                    AND l.turn_at <= v_now + interval '1 millisecond'
                                  ORDER BY l.turn_at LIMIT 1) AS due,
                                 (SELECT e.locked_until FROM {schema}.message e
                                  WHERE e.queue = w.q
                                    AND e.locked_until >= d.lock_from[array_position(d.queues, w.q)]
                                    AND e.locked_until <= v_now
                                  ORDER BY e.queue, e.locked_until LIMIT 1) AS expired) AS x
                      WHERE x.due IS NOT NULL OR x.expired IS NOT NULL)
            ), picked AS MATERIALIZED (
                SELECT m.id, m.arrival
                FROM mine w
                JOIN {schema}.queue q ON q.name = w.queue
                LEFT JOIN {schema}.channel c ON c.queue = w.queue AND c.name = w.channel
                JOIN {schema}.message m ON m.id = ANY (p_hints)
                -- (what no ingest has seen: one the ingest counted is the dequeue's)
                WHERE m.id IN (SELECT u.id FROM unseen u)
                  AND m.queue = w.queue AND m.channel = w.channel
                  AND CASE WHEN c.has_policy
                           THEN c.own_max_concurrency IS NULL AND c.own_rate_count IS NULL
                           ELSE q.max_concurrency IS NULL AND q.rate_count IS NULL END
                  -- (not locked, written so that the ids are read by the primary key: see
                  -- dequeue_take_v1)
                  AND coalesce(m.lock_token, '00000000-0000-0000-0000-000000000000')
                      = '00000000-0000-0000-0000-000000000000'
                  AND m.dequeue_at <= v_now
                  AND (m.expires_at IS NULL OR m.expires_at > v_now)
                  AND m.attempts < coalesce(q.max_attempts, 2147483647)
                ORDER BY m.priority DESC, m.dequeue_at, m.id
                LIMIT p_limit
                FOR UPDATE OF m SKIP LOCKED
            ), locked AS (
                UPDATE {schema}.message m SET
                    locked_until = v_now + v_lock,
                    lock_token = gen_random_uuid(),
                    attempts = m.attempts + 1,
                    slotted = false,
                    arrival = 1
                FROM picked p
                WHERE m.id = p.id
                RETURNING m.id, m.queue, m.channel, m.name, m.priority, m.attempts,
                          m.lock_token, m.created_at, m.content, m.state, m.dequeue_at,
                          p.arrival AS was
            ), tallied AS (
                INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, lock_until, lock_id)
                SELECT min(k.queue), min(k.channel), count(*) FILTER (WHERE k.was = 0), count(*),
                       v_now + v_lock, min(k.id)
                FROM locked k HAVING count(*) > 0
            )
            (SELECT k.id, k.queue::text, k.channel::text, k.name, k.priority, k.attempts,
                    k.lock_token, k.created_at, k.content, k.state, NULL::bigint,
                    'delivered'::text
             FROM locked k ORDER BY k.priority DESC, k.dequeue_at, k.id)
            UNION ALL
            -- (all that waited was taken: settled, see above)
            SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::smallint,
                   NULL::integer, NULL::uuid, NULL::timestamptz, NULL::bytea, NULL::bytea,
                   LEAST({schema}.queue_retry_ms_v1(p_queues, v_d), p_lock_ms), 'settled'::text
            FROM mine w
            WHERE w.waiting = (SELECT count(*) FROM locked);
        IF FOUND THEN
            PERFORM set_config('lonnymq.fresh', 'on', false),
                    set_config('lonnymq.taken', v_d.id || ' ' || (v_taken + 1), false);
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.message_dequeue_v3(p_queues, p_limit, p_lock_ms, NULL,
                                                           NULL, p_listen);
END;
$$;

-- CREATE OR REPLACE keeps the grants but resets the settings: as before, the dequeue runs
-- with the owner's rights and a fixed search_path.
ALTER FUNCTION {schema}.message_dequeue_hinted_v1(text[], bigint[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
