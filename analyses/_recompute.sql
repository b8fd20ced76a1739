-- Helper: recompute preemption's wasted work per run (see recompute.sql for the columns).
--
-- _recompute_servers: the same per run and server (each server's own KV events and steps; a run of
--   one server, or with nothing recorded yet, has one row, server ''). The columns of recompute.sql,
--   with `server` after run_id.
-- _recompute: per run, the servers' figures added up (a share divides the sums).
CREATE OR REPLACE VIEW _recompute_servers AS
WITH events AS (
    SELECT run_id, server,
           count(*) FILTER (WHERE kind = 'preempt') AS preemptions,
           count(*) FILTER (WHERE kind = 'preempt' AND reason <> 'swap') AS recompute_preemptions,
           count(*) FILTER (WHERE kind = 'reprefill') AS reprefills,
           coalesce(sum(num_recomputed_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS recomputed_tokens,
           coalesce(sum(num_cached_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS reprefill_cached_tokens
    FROM kv_events
    WHERE kind IN ('preempt', 'reprefill')
    GROUP BY run_id, server
),
work AS (
    SELECT run_id, server,
           sum(prefill_tokens)::BIGINT AS prefill_tokens,
           sum(prefill_tokens + decode_tokens)::BIGINT AS processed_tokens,
           sum(device_ms) AS device_ms,
           -- a step's device time, shared among its tokens in proportion: the recomputed ones' part
           sum(device_ms * recompute_tokens / nullif(prefill_tokens + decode_tokens, 0)) AS recompute_device_ms
    FROM steps
    GROUP BY run_id, server
),
per_server AS (
    SELECT * FROM events FULL JOIN work USING (run_id, server)
)
SELECT runs.run_id, coalesce(p.server, '') AS server,
       coalesce(p.preemptions, 0) AS preemptions,
       coalesce(p.recompute_preemptions, 0) AS recompute_preemptions,
       coalesce(p.reprefills, 0) AS reprefills,
       coalesce(p.recomputed_tokens, 0) AS recomputed_tokens,
       coalesce(p.reprefill_cached_tokens, 0) AS reprefill_cached_tokens,
       coalesce(p.prefill_tokens, 0) AS prefill_tokens,
       coalesce(p.processed_tokens, 0) AS processed_tokens,
       coalesce(p.recomputed_tokens, 0) / nullif(p.prefill_tokens, 0) AS recompute_share_of_prefill,
       coalesce(p.recomputed_tokens, 0) / nullif(p.processed_tokens, 0) AS recompute_share_of_processed,
       coalesce(p.recompute_device_ms, 0) AS recompute_device_ms,
       p.device_ms,
       coalesce(p.recompute_device_ms, 0) / nullif(p.device_ms, 0) AS recompute_device_share
FROM runs
LEFT JOIN per_server p USING (run_id);

CREATE OR REPLACE VIEW _recompute AS
WITH sums AS (
    SELECT run_id,
           sum(preemptions)::BIGINT AS preemptions,
           sum(recompute_preemptions)::BIGINT AS recompute_preemptions,
           sum(reprefills)::BIGINT AS reprefills,
           sum(recomputed_tokens)::BIGINT AS recomputed_tokens,
           sum(reprefill_cached_tokens)::BIGINT AS reprefill_cached_tokens,
           sum(prefill_tokens)::BIGINT AS prefill_tokens,
           sum(processed_tokens)::BIGINT AS processed_tokens,
           sum(recompute_device_ms) AS recompute_device_ms,
           sum(device_ms) AS device_ms
    FROM _recompute_servers
    GROUP BY run_id
)
SELECT run_id, preemptions, recompute_preemptions, reprefills, recomputed_tokens, reprefill_cached_tokens,
       prefill_tokens, processed_tokens,
       recomputed_tokens / nullif(prefill_tokens, 0) AS recompute_share_of_prefill,
       recomputed_tokens / nullif(processed_tokens, 0) AS recompute_share_of_processed,
       recompute_device_ms, device_ms,
       recompute_device_ms / nullif(device_ms, 0) AS recompute_device_share
FROM sums;
