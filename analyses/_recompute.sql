-- Helper: recompute preemption's wasted work per run (see recompute.sql for the columns).
CREATE OR REPLACE VIEW _recompute AS
WITH events AS (
    SELECT run_id,
           count(*) FILTER (WHERE kind = 'preempt') AS preemptions,
           count(*) FILTER (WHERE kind = 'preempt' AND reason <> 'swap') AS recompute_preemptions,
           count(*) FILTER (WHERE kind = 'reprefill') AS reprefills,
           coalesce(sum(num_recomputed_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS recomputed_tokens,
           coalesce(sum(num_cached_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS reprefill_cached_tokens
    FROM kv_events
    WHERE kind IN ('preempt', 'reprefill')
    GROUP BY run_id
),
work AS (
    SELECT run_id,
           sum(prefill_tokens)::BIGINT AS prefill_tokens,
           sum(prefill_tokens + decode_tokens)::BIGINT AS processed_tokens,
           sum(device_ms) AS device_ms,
           -- a step's device time, shared among its tokens in proportion: the recomputed ones' part
           sum(device_ms * recompute_tokens / nullif(prefill_tokens + decode_tokens, 0)) AS recompute_device_ms
    FROM steps
    GROUP BY run_id
)
SELECT runs.run_id,
       coalesce(e.preemptions, 0) AS preemptions,
       coalesce(e.recompute_preemptions, 0) AS recompute_preemptions,
       coalesce(e.reprefills, 0) AS reprefills,
       coalesce(e.recomputed_tokens, 0) AS recomputed_tokens,
       coalesce(e.reprefill_cached_tokens, 0) AS reprefill_cached_tokens,
       coalesce(w.prefill_tokens, 0) AS prefill_tokens,
       coalesce(w.processed_tokens, 0) AS processed_tokens,
       coalesce(e.recomputed_tokens, 0) / nullif(w.prefill_tokens, 0) AS recompute_share_of_prefill,
       coalesce(e.recomputed_tokens, 0) / nullif(w.processed_tokens, 0) AS recompute_share_of_processed,
       coalesce(w.recompute_device_ms, 0) AS recompute_device_ms,
       w.device_ms,
       coalesce(w.recompute_device_ms, 0) / nullif(w.device_ms, 0) AS recompute_device_share
FROM runs
LEFT JOIN events e USING (run_id)
LEFT JOIN work w USING (run_id);
