-- What does the whole distribution of each latency look like? The CDF of TTFT, TPOT, ITL, E2E
-- latency and queueing time of each run (see latency.sql for the metrics), as a fixed number of
-- points whatever the trace's size: the value at each `points`-th of the cumulative share (0, 1 /
-- points, ..., 1), and the `tail` largest values one by one so that the tail keeps its shape.
-- param: points = 200  CDF levels kept per run and metric (evenly spaced in the cumulative share)
-- param: tail = 20  largest values of each run and metric kept one by one
--
-- How close: every value is read from a histogram (see _latency_hist), within 0.1% of the exact
-- one; exact at 0 and 1 (the min and the max) and wherever a bin holds a single value, as the
-- largest values of a sparse tail do. The k-th largest value has cdf (num_values - k) /
-- (num_values - 1), the level at which the interpolated percentile is exactly that value (1 for a
-- single value; ties count apart), so the tail and the evenly spaced levels draw one rising curve.
--
-- Columns, one row per point kept, by run, metric and value:
--   run_id, metric
--   metric_order   1..5 for ttft, tpot, itl, e2el, queueing
--   value_ms       a latency (ms)
--   cdf            the level (0..1) whose percentile value_ms is (linear interpolation, as numpy)
--   num_values     values of this metric in the run (sequences, or gaps for itl)
WITH points AS (
    SELECT run_id, metric, value_ms,
           -- the k-th largest (rank n - k): the level whose percentile it is, (n - k) / (n - 1)
           coalesce(level, CASE WHEN num_values > 1 THEN rank / (num_values - 1) ELSE 1.0 END) AS cdf,
           num_values
    FROM _latency_quantiles(list_transform(range(0, $points + 1), lambda i: i / $points), $tail)
    WHERE level IS NULL OR level < 1 OR $tail < 1      -- the max is the tail's first value
)
SELECT run_id, metric,
       list_position(['ttft', 'tpot', 'itl', 'e2el', 'queueing'], metric) AS metric_order,
       value_ms, cdf, num_values::BIGINT AS num_values
FROM points
ORDER BY run_id, metric_order, value_ms, cdf;
