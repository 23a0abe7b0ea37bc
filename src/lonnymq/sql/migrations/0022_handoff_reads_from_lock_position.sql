-- lonnymq migration 22.

-- =============================================================================================
-- A hand-off reads the queue's locks from its lock position
-- (issue "A real Celery worker wakes within milliseconds")
-- =============================================================================================
--
-- handoff_v1 (version 21) checked that no lane of the queue is due and no lock of it past its
-- expiry with NOT EXISTS: its generic plan turned both into anti joins that read the index
-- from the queue's start up to now, the position from the last ingest only a filter. Every
-- message handed and acked leaves its entry in message_locked_idx; while another session holds
-- a snapshot those entries stay, and the publish read them all once their locks' time had
-- passed: measured here, a publish to a sleeping consumer at 50 a second went from 2.2-2.4 ms
-- to 2.9-3.3 ms three to four minutes into a held snapshot (one such publish's plan: 3,480
-- heap fetches; benchmarks/bench_handoff_held.py).
-- The checks are now the first entry in index order from the position, as the dequeue's are.
-- Same signature, same rules. And the position itself moved only with a dequeue's ingest
-- (the fallback poll's, every 5 s by default, with hand-offs only): housekeep_v1's ingest now
-- moves those of the queues a transport sleeps on too, every expire_interval.

CREATE OR REPLACE FUNCTION {schema}.handoff_v1(
    p_queue text, p_channel text, p_content bytea, p_priority integer, p_ttl_ms bigint
) RETURNS bigint
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off
    SET enable_bitmapscan = off AS $$
DECLARE
    v_key bigint := {schema}.queue_key_v1('sleep', p_queue);
    v_now timestamptz := clock_timestamp();
    v_to {schema}.sleeper;
    v_id bigint;
BEGIN
    -- (nobody sleeps on the queue when its key is free: tried and given back at once)
    IF coalesce(current_setting('lonnymq.hinted', true), '') <> ''
       OR (CASE WHEN pg_try_advisory_lock(v_key) THEN pg_advisory_unlock(v_key) ELSE false END) THEN
        RETURN NULL;
    END IF;
    WITH d AS MATERIALIZED (
        SELECT d.* FROM {schema}.discovery d ORDER BY d.id DESC LIMIT 1
    ), unseen AS MATERIALIZED (
        SELECT m.queue
        FROM d CROSS JOIN LATERAL (
            SELECT m.queue FROM {schema}.message m
            WHERE m.txid >= pg_snapshot_xmax(d.snap) AND m.lock_token IS NULL
            ORDER BY m.txid LIMIT 64) AS m
        UNION ALL
        SELECT m.queue
        FROM d CROSS JOIN LATERAL pg_snapshot_xip(d.snap) AS x(txid)
        CROSS JOIN LATERAL (
            SELECT m.queue FROM {schema}.message m
            WHERE m.txid = x.txid AND m.lock_token IS NULL
            LIMIT 64) AS m
    ), quiet AS MATERIALIZED (
        SELECT 1
        FROM d
        LEFT JOIN {schema}.queue q ON q.name = p_queue
        LEFT JOIN {schema}.channel c ON c.queue = p_queue AND c.name = p_channel
        WHERE CASE WHEN c.has_policy
                   THEN c.own_max_concurrency IS NULL AND c.own_rate_count IS NULL
                   ELSE q.max_concurrency IS NULL AND q.rate_count IS NULL END
          AND (SELECT count(*) FROM unseen) < 64
          AND NOT EXISTS (SELECT 1 FROM unseen u WHERE u.queue = p_queue)
          AND p_queue = ANY (d.queues) AND NOT p_queue = ANY (d.pend_queue)
          AND NOT EXISTS (SELECT 1 FROM {schema}.channel f WHERE f.queue = p_queue AND f.freed)
          -- (the first due lane and the first expired lock, each in its index's order from
          -- the queue's position: as NOT EXISTS, the generic plan read every entry of the
          -- queue up to now, which a held snapshot keeps: schema version 22)
          AND (SELECT l.turn_at FROM {schema}.lane l
               WHERE l.queue = p_queue
                 AND l.turn_at >= d.turn_from[array_position(d.queues, p_queue)]
                 AND l.turn_at <= v_now + interval '1 millisecond'
               ORDER BY l.queue, l.turn_at LIMIT 1) IS NULL
          AND (SELECT e.locked_until FROM {schema}.message e
               WHERE e.queue = p_queue
                 AND e.locked_until >= d.lock_from[array_position(d.queues, p_queue)]
                 AND e.locked_until <= v_now
               ORDER BY e.queue, e.locked_until LIMIT 1) IS NULL
    )
    -- the sessions registered for the queue, in random order: the first asleep on it (holds
    -- the key, tried and given back at once) and not being handed a message meanwhile
    SELECT s.* INTO v_to
    FROM (SELECT s.* FROM quiet, {schema}.sleeper s WHERE p_queue = ANY (s.queues)
          ORDER BY random()) AS s
    WHERE CASE WHEN pg_try_advisory_lock({schema}.queue_key_v1('asleep ' || s.holder, p_queue))
               THEN NOT pg_advisory_unlock({schema}.queue_key_v1('asleep ' || s.holder, p_queue))
               -- (asleep: then, and only then, its 'handoff' key)
               ELSE pg_try_advisory_xact_lock({schema}.queue_key_v1('handoff', s.holder::text))
          END
    LIMIT 1;
    IF v_to.holder IS NULL THEN
        RETURN NULL;
    END IF;
    WITH made AS (
        INSERT INTO {schema}.message (queue, channel, priority, attempts, arrival, txid,
                                      dequeue_at, locked_until, lock_token, expires_at, content)
        VALUES (p_queue, p_channel, p_priority, 1, 1, pg_current_xact_id(), v_now,
                v_now + v_to.lock_ms * interval '1 millisecond',
                (lpad(to_hex(v_to.holder), 16, '0')
                 || right(replace(gen_random_uuid()::text, '-', ''), 16))::uuid,
                v_now + p_ttl_ms * interval '1 millisecond', p_content)
        RETURNING id, lock_token, created_at, locked_until
    ), tallied AS (
        INSERT INTO {schema}.tally (queue, channel, enqueued, delivered, lock_until, lock_id)
        SELECT p_queue, p_channel, 1, 1, m.locked_until, m.id FROM made m
    )
    SELECT m.id INTO v_id
    FROM made m,
         LATERAL (SELECT concat_ws(' ', m.id, m.lock_token, p_priority,
                                   extract(epoch FROM m.created_at),
                                   extract(epoch FROM m.locked_until), length(p_queue),
                                   length(p_channel))
                         || ' ' || p_queue || p_channel
                         || translate(encode(p_content, 'base64'), E'\n', '') AS body) AS b,
         LATERAL (SELECT set_config('lonnymq.hinted', 'on', true),
                         pg_notify('lonnymq_hand_' || v_to.holder,
                                   encode(sha256(convert_to(v_to.secret, 'UTF8')
                                                 || sha256(convert_to(v_to.secret || b.body,
                                                                      'UTF8'))), 'hex')
                                   || ' ' || b.body)) AS n;
    RETURN v_id;
END;
$$;

-- Housekeeping, run by consumers every expire_interval: prune dead letters older than their
-- queue's retention (at most p_limit), ingest and fold the counts, and remove the lanes of
-- channels empty for 5 minutes (at most p_limit). The ingest moves the positions of the queues
-- a transport sleeps on (schema version 22): a consumer that is handed every message runs no
-- dequeue, and each hand-off's checks read the locked index from its queue's lock position
-- (handoff_v1), past the entries of what was handed and acked since, which a held snapshot
-- keeps.
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
    PERFORM {schema}.ingest_v1(
        ARRAY(SELECT DISTINCT u.q FROM {schema}.sleeper s CROSS JOIN LATERAL unnest(s.queues) AS u(q)
              ORDER BY u.q),
        true, true);
    -- channels empty for 5 minutes: their lanes and counts go
    -- (at most 1,000 a call: each takes a lane key, a slot of the server's lock table)
    PERFORM {schema}.lane_prune_v1(LEAST(p_limit, 1000), interval '5 minutes');
END;
$$;

-- CREATE OR REPLACE resets the settings: as before, with the owner's rights, a fixed
-- search_path and no JIT.
ALTER FUNCTION {schema}.housekeep_v1(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
