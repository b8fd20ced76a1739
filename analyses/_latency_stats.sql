-- Helper: latency distributions per run and metric, as `vllm bench serve` reports them (ms).
--
-- _latency_stats: one row per run and metric.
--   run_id
--   metric       ttft | tpot | itl | e2el | queueing (see _latency_samples)
--   metric_order 1..5 in that order, for sorting
--   num_values   sequences (ttft, tpot, e2el, queueing) or gaps (itl) measured
--   mean_ms, p50_ms, p90_ms, p95_ms, p99_ms, p999_ms (p99.9), max_ms
-- Percentiles interpolate linearly between values (numpy's default, as vLLM computes them). They
-- are read from histograms so that memory does not grow with the trace: approximate, each within
-- 0.1% of the exact value (see _latency_hist). num_values, mean_ms and max_ms are exact.
CREATE OR REPLACE VIEW _latency_stats AS
WITH q AS (
    SELECT run_id, metric, any_value(num_values) AS num_values, any_value(mean_ms) AS mean_ms,
           any_value(max_ms) AS max_ms,
           max(value_ms) FILTER (WHERE level = 0.5) AS p50_ms,
           max(value_ms) FILTER (WHERE level = 0.9) AS p90_ms,
           max(value_ms) FILTER (WHERE level = 0.95) AS p95_ms,
           max(value_ms) FILTER (WHERE level = 0.99) AS p99_ms,
           max(value_ms) FILTER (WHERE level = 0.999) AS p999_ms
    FROM _latency_quantiles([0.5, 0.9, 0.95, 0.99, 0.999], 0)
    GROUP BY run_id, metric
)
SELECT run_id, metric,
       list_position(['ttft', 'tpot', 'itl', 'e2el', 'queueing'], metric) AS metric_order,
       num_values::BIGINT AS num_values, mean_ms,
       p50_ms, p90_ms, p95_ms, p99_ms, p999_ms,
       max_ms
FROM q;

-- _latency_by_run: one row per run, the p50 and p99 of each metric side by side (ms), for the
-- analyses that put a run's figures in one row (summary.sql, sweep_summary.sql).
CREATE OR REPLACE VIEW _latency_by_run AS
SELECT run_id,
       max(p50_ms) FILTER (WHERE metric = 'ttft') AS ttft_p50_ms,
       max(p99_ms) FILTER (WHERE metric = 'ttft') AS ttft_p99_ms,
       max(p50_ms) FILTER (WHERE metric = 'tpot') AS tpot_p50_ms,
       max(p99_ms) FILTER (WHERE metric = 'tpot') AS tpot_p99_ms,
       max(p50_ms) FILTER (WHERE metric = 'itl') AS itl_p50_ms,
       max(p99_ms) FILTER (WHERE metric = 'itl') AS itl_p99_ms,
       max(p50_ms) FILTER (WHERE metric = 'e2el') AS e2el_p50_ms,
       max(p99_ms) FILTER (WHERE metric = 'e2el') AS e2el_p99_ms
FROM _latency_stats
GROUP BY run_id;
