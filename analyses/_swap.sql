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

-- _swap_by_run: one row per run that swapped: bytes each way and both, and the rate of both (GB/s).
CREATE OR REPLACE VIEW _swap_by_run AS
SELECT run_id,
       max(bytes) FILTER (WHERE direction = 'swap_out') AS swap_out_bytes,
       max(bytes) FILTER (WHERE direction = 'swap_in') AS swap_in_bytes,
       max(bytes) FILTER (WHERE direction = 'both') AS swap_bytes,
       max(gb_s) FILTER (WHERE direction = 'both') AS swap_gb_s
FROM _swap
GROUP BY run_id;
