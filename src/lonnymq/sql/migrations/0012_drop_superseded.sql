-- lonnymq migration 12.

-- =============================================================================================
-- Superseded functions that no supported client calls go (docs/design.md, "Schema
-- management": a function superseded by a new version stays for one release, for the
-- processes of the previous release still connected during an upgrade, then a migration drops
-- it)
-- =============================================================================================
--
-- The processes of release 0.1.0 (schema version 8) and of this one call none of these: the
-- dequeues of clients of versions 2 and 4 (message_dequeue_v1 and _v2, message_ack_dequeue_v1),
-- the policy setters and the channel listing of clients of version 7 and before, and
-- channel_headroom_v1, which nothing has called since version 8 (channel_headroom_v2) and
-- no role was granted. Each drop takes its grants with it.

DROP FUNCTION {schema}.message_dequeue_v1(text[], integer, bigint);
DROP FUNCTION {schema}.message_dequeue_v2(text[], integer, bigint);
DROP FUNCTION {schema}.message_ack_dequeue_v1(bigint[], uuid[], text[], integer, bigint);
DROP FUNCTION {schema}.channel_policy_set_v1(text, text, integer, integer);
DROP FUNCTION {schema}.queue_policy_set_v1(text, integer, integer);
DROP FUNCTION {schema}.channel_list_v1(text, integer);
DROP FUNCTION {schema}.channel_headroom_v1(text, text);
