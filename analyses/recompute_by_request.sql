-- Which sequences had their work thrown away by recompute preemption, and how much?
--
-- Columns, one row per sequence with a recompute preemption or a re-prefill, most recomputed
-- first within each run:
--   run_id, req_id, sample
--   recompute_preemptions    times preempted by recompute (or swap-full-fallback)
--   reprefills               re-prefills done (or cut short)
--   recomputed_tokens        positions computed again (tokens)
--   reprefill_cached_tokens  positions of its re-prefills served by the prefix cache (tokens)
--   prompt_tokens, output_tokens   from `requests` (null if the sequence has no row yet)
--   recompute_ratio          recomputed_tokens / (prompt_tokens + output_tokens): the sequence's
--                            own length computed again, e.g. 1.0 = once more in full
--   recompute_device_ms_est  recomputed_tokens times its server's device time per recomputed
--                            position (see recompute.sql; ms, estimate)
WITH per_sequence AS (
    SELECT run_id, server, req_id, sample,
           count(*) FILTER (WHERE kind = 'preempt') AS recompute_preemptions,
           count(*) FILTER (WHERE kind = 'reprefill') AS reprefills,
           coalesce(sum(num_recomputed_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS recomputed_tokens,
           coalesce(sum(num_cached_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS reprefill_cached_tokens
    FROM kv_events
    WHERE kind = 'reprefill' OR (kind = 'preempt' AND reason <> 'swap')
    GROUP BY run_id, server, req_id, sample
)
SELECT p.run_id, p.req_id, p.sample, p.recompute_preemptions, p.reprefills,
       p.recomputed_tokens, p.reprefill_cached_tokens,
       r.prompt_tokens, r.output_tokens,
       p.recomputed_tokens / nullif(r.prompt_tokens + r.output_tokens, 0) AS recompute_ratio,
       p.recomputed_tokens * rc.recompute_device_ms / nullif(rc.recomputed_tokens, 0) AS recompute_device_ms_est
FROM per_sequence p
LEFT JOIN requests r USING (run_id, req_id, sample)
LEFT JOIN _recompute_servers rc ON rc.run_id = p.run_id AND rc.server = p.server
ORDER BY p.run_id, p.recomputed_tokens DESC, p.req_id, p.sample;
