-- lonnymq's current schema, one family of it: the files of this folder are read in the order of
-- their numbers for a fresh install (README.md beside them: the model, the placeholders
-- {{schema}}, {{wake}} and {{lock_prefix}}).

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

ALTER FUNCTION {schema}.message_dequeue_v3(text[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_dequeue_hinted_v1(text[], bigint[], integer, bigint, bigint[], uuid[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.sleep_v1(text[], text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.sleep_v2(text[], text[], text[], text[], text[], bigint, text, bigint, text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.sleep_v3(text[], text[], text[], text[], text[], bigint, text, bigint, text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

ALTER FUNCTION {schema}.message_publish_v2(text, text, text, text, bytea, integer, bigint, bigint, boolean)
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

ALTER FUNCTION {schema}.queue_expiring_v1()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
