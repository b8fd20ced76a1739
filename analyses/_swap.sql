-- Helper: swap traffic per run and direction (see swap.sql for the columns).
CREATE OR REPLACE VIEW _swap AS
SELECT run_id,
       coalesce(kind, 'both') AS direction,
       count(*) AS copies,
       sum(num_blocks)::BIGINT AS blocks,
       sum(num_tokens)::BIGINT AS tokens,
       sum(bytes)::BIGINT AS bytes,
       quantile_cont(duration_ms, 0.5) AS p50_copy_ms,
       max(duration_ms) AS max_copy_ms,
       sum(duration_ms) AS total_copy_ms,
       quantile_cont(bytes / duration_ms / 1e6, 0.5) FILTER (WHERE duration_ms > 0) AS p50_copy_gb_s,
       min(bytes / duration_ms / 1e6) FILTER (WHERE duration_ms > 0) AS min_copy_gb_s,
       sum(bytes) FILTER (WHERE duration_ms > 0) / sum(duration_ms) FILTER (WHERE duration_ms > 0) / 1e6 AS gb_s
FROM kv_events
WHERE kind IN ('swap_out', 'swap_in')
GROUP BY GROUPING SETS ((run_id, kind), (run_id));
