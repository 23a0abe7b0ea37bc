-- lonnymq migration 4: faster dequeue and ack (same functions, same results).
--
-- * message_dequeue_v2 reads the heads of all the channels of a pass in one statement and
--   locks what it takes in one UPDATE (was: one function call and one UPDATE per channel);
--   the head read also tells when a served channel is due again, so most channels need no
--   second look; a dequeue that locks one channel (one tenant, or a prefetch of 1) takes a
--   shorter path; the expired-lock probe locks nothing unless there is an expired lock; a
--   dequeue that finds the due channel held by another transaction waits for its row lock
--   (at most lock_timeout) instead of sleeping 1 ms.
-- * message_ack_dequeue_v1: a consumer's acks and its next dequeue in one statement (they
--   were two statements pipelined in one round trip).
-- * message_delete_many_v1 settles the one channel of its acks with one UPDATE (was: a call
--   of channel_release_v1, which locked the row first).
-- * The set-based channel UPDATEs of both find their rows by primary key (a generic plan
--   had chosen a sequential scan of the channel table, whose cost grows with the number of
--   channels and with dead rows).

-- Dequeue up to p_limit messages from the given queues and lock them for p_lock_ms.
-- Messages whose lock expired come first (their holder is gone); then channels with a due
-- message are served round-robin, the one waiting longest first, skipping channels at
-- max_concurrency. Rows come back in delivery order. When no message is available, one row
-- comes back with message_id NULL and retry_ms: milliseconds until something may become
-- available (NULL: nothing is pending). A message already delivered max_attempts times (of
-- its queue) is not delivered again: it goes to the dead letters and comes back as a row
-- with event 'dead' (no lock token, no content), for the caller's log. The event of a
-- delivered message is 'delivered', or 'redelivered' when its previous lock had expired.
CREATE OR REPLACE FUNCTION {schema}.message_dequeue_v2(p_queues text[], p_limit integer, p_lock_ms bigint)
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


-- Delete (ack) many held messages. One outcome per id, as message_delete_v1. The channels
-- are locked in id order (the order every caller uses) in one statement and settled in sets:
-- one UPDATE for those that keep messages, one DELETE for those left empty (their counters
-- kept in one counter row per queue).
CREATE OR REPLACE FUNCTION {schema}.message_delete_many_v1(p_ids bigint[], p_lock_tokens uuid[])
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


-- CREATE OR REPLACE keeps the grants but resets the settings: as before, both run with the
-- owner's rights and a fixed search_path.
ALTER FUNCTION {schema}.message_delete_many_v1(bigint[], uuid[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_dequeue_v2(text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint)
    FROM PUBLIC;

-- Roles that may dequeue (lonnymq.grant worker or admin) may ack and dequeue in one call.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = '{schema}'::regnamespace
          AND p.proname = 'message_dequeue_v2'
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s',
            '{schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint)'::regprocedure,
            r.role);
    END LOOP;
END;
$$;
