-- What does the whole distribution of each latency look like? The empirical CDF of TTFT, TPOT,
-- ITL, E2E latency and queueing time of each run (see latency.sql for the metrics), downsampled:
-- one point per `points`-th of the cumulative share, and the `tail` largest values one by one so
-- that the tail keeps its shape.
-- param: points = 200  CDF levels kept per run and metric (evenly spaced in the cumulative share)
-- param: tail = 20  largest values of each run and metric kept one by one
--
-- Columns, one row per point kept, by run, metric and value:
--   run_id, metric
--   metric_order   1..5 for ttft, tpot, itl, e2el, queueing
--   value_ms       a latency (ms)
--   cdf            share of the run's values of this metric <= value_ms
--   num_values     values of this metric in the run (sequences, or gaps for itl)
WITH ranked AS (
    SELECT run_id, metric, ms,
           cume_dist() OVER (PARTITION BY run_id, metric ORDER BY ms) AS cdf,
           row_number() OVER (PARTITION BY run_id, metric ORDER BY ms DESC) AS from_top,
           count(*) OVER (PARTITION BY run_id, metric) AS num_values
    FROM _latency_samples
),
points AS (
    SELECT run_id, metric, max(ms) AS value_ms, max(cdf) AS cdf, max(num_values) AS num_values
    FROM ranked
    GROUP BY run_id, metric,
             CASE WHEN from_top <= $tail THEN -from_top ELSE floor(cdf * $points) END
)
SELECT run_id, metric,
       list_position(['ttft', 'tpot', 'itl', 'e2el', 'queueing'], metric) AS metric_order,
       value_ms, cdf, num_values
FROM points
ORDER BY run_id, metric_order, value_ms, cdf;
