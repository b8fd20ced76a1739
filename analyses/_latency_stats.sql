-- Helper: latency distributions per run and metric, as `vllm bench serve` reports them (ms).
--
-- _latency_stats: one row per run and metric.
--   run_id
--   metric       ttft | tpot | itl | e2el | queueing (see _latency_samples)
--   metric_order 1..5 in that order, for sorting
--   num_values   sequences (ttft, tpot, e2el, queueing) or gaps (itl) measured
--   mean_ms, p50_ms, p90_ms, p95_ms, p99_ms, p999_ms (p99.9), max_ms
-- Percentiles interpolate linearly between values (numpy's default, as vLLM computes them).
CREATE OR REPLACE VIEW _latency_stats AS
WITH stats AS (
    SELECT run_id, metric, count(ms) AS num_values, avg(ms) AS mean_ms,
           quantile_cont(ms, [0.5, 0.9, 0.95, 0.99, 0.999]) AS q, max(ms) AS max_ms
    FROM _latency_samples
    WHERE ms IS NOT NULL
    GROUP BY run_id, metric
)
SELECT run_id, metric,
       list_position(['ttft', 'tpot', 'itl', 'e2el', 'queueing'], metric) AS metric_order,
       num_values, mean_ms,
       q[1] AS p50_ms, q[2] AS p90_ms, q[3] AS p95_ms, q[4] AS p99_ms, q[5] AS p999_ms,
       max_ms
FROM stats;
