-- lonnymq migration 7.

-- =============================================================================================
-- Heads read in index order, never as a bitmap (issue 19)
-- =============================================================================================
--
-- A lane's heads (the dequeue's `FOR UPDATE SKIP LOCKED` read of its first due messages, and
-- lane_next_v1's read of a lane's next position) are meant to be ordered index scans of
-- message_ready_idx that stop after the few rows they need. Their generic plans estimate one
-- row, and on a table with no statistics (autovacuum off, never analysed) the planner chose a
-- bitmap heap scan and a sort instead: every row from the position on, backlog and dead
-- versions, read and sorted at each call. Under a held snapshot with a backlog of 30,000 that
-- was 2,200 buffers and 28 ms per dequeue (auto_explain), and one channel's prefetch-1
-- consumers fell from 1,100 to 82 msgs/s. With bitmap scans off in these two functions (and in
-- what the dequeue calls), the only plans left are the index scans.

ALTER FUNCTION {schema}.lane_next_v1({schema}.lane, pg_snapshot) SET enable_bitmapscan = off;

-- (the settings again in the order a fresh install gives them: its own, then the entry point's)
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    RESET ALL;
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off;
ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
