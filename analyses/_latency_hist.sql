-- Helper: the latency distributions of every run in bounded memory: histograms with bins 0.1%
-- wide, and percentiles read from them within 0.1% of the exact ones.
--
-- An exact percentile needs every value in memory (100 M gaps on a long trace); a histogram does
-- not. Values are binned on a log scale, bin k holding [1.001^k, 1.001^(k+1)) ms (mirrored for
-- negative values, 0 a bin of its own), and each bin keeps its count, sum, min and max: a few
-- thousand rows per run and metric, whatever the trace's size.
--
-- _latency_bin(ms): the bin of a value, ordered as the values are.
-- _latency_hist: one row per run, metric (as in _latency_samples) and bin that has values.
--   run_id, metric, bin
--   n               values in the bin
--   sum_ms          their sum (ms)
--   min_ms, max_ms  the smallest and largest of them (ms)
-- _latency_quantiles(levels, top): one row per run, metric and level (a list of shares in
-- [0, 1]), and one per value of the `top` largest of each run and metric (level null).
--   run_id, metric, level
--   rank            level * (num_values - 1), or num_values - k for the k-th largest value (0-based)
--   num_values      values of the metric in the run
--   mean_ms, max_ms their mean and the largest (exact)
--   value_ms        the value at `rank`, as quantile_cont and numpy compute a percentile: linear
--                   interpolation between the values of the two whole ranks around it
-- How close: a value of rank r is read in the bin holding rank r, by linear interpolation between
-- the bin's min and max; both lie in the same 0.1%-wide bin as the true value, so it is off by
-- less than 0.1% of it, and so is the percentile interpolated between two such values. Exact where
-- a bin holds one value (as in a sparse tail), and at levels 0 and 1 (the min and the max).
CREATE OR REPLACE MACRO _latency_bin(ms) AS
    CASE WHEN ms > 0 THEN greatest(floor(ln(ms) / ln(1.001))::BIGINT + 1000000, 1)
         WHEN ms < 0 THEN -greatest(floor(ln(-ms) / ln(1.001))::BIGINT + 1000000, 1)
         ELSE 0 END;

CREATE OR REPLACE VIEW _latency_hist AS
SELECT run_id, metric, _latency_bin(ms) AS bin,
       count(*) AS n, sum(ms) AS sum_ms, min(ms) AS min_ms, max(ms) AS max_ms
FROM _latency_samples
WHERE ms IS NOT NULL
GROUP BY run_id, metric, bin;

CREATE OR REPLACE MACRO _latency_quantiles(levels, top) AS TABLE
WITH bins AS MATERIALIZED (
    SELECT *,
           sum(n) OVER (PARTITION BY run_id, metric ORDER BY bin ROWS UNBOUNDED PRECEDING) - n AS rank_from,
           sum(n) OVER (PARTITION BY run_id, metric) AS num_values,
           sum(sum_ms) OVER (PARTITION BY run_id, metric) AS total_ms,
           max(max_ms) OVER (PARTITION BY run_id, metric) AS largest_ms
    FROM _latency_hist
),
runs_metrics AS (
    SELECT DISTINCT run_id, metric, num_values, total_ms / num_values AS mean_ms, largest_ms AS max_ms FROM bins
),
wanted AS (
    SELECT *, floor(pos)::BIGINT AS rank_lo, ceil(pos)::BIGINT AS rank_hi
    FROM (SELECT r.*, l.level, l.level * (r.num_values - 1) AS pos
          FROM runs_metrics r, (SELECT unnest(levels)::DOUBLE AS level) l
          UNION ALL
          SELECT r.*, NULL, r.num_values - k
          FROM runs_metrics r, range(1, top + 1) t(k)
          WHERE k <= r.num_values)
),
-- the values of ranks rank_lo and rank_hi (0-based), each read in the bin that holds it
ranked AS (
    SELECT w.run_id, w.metric, w.num_values, w.mean_ms, w.max_ms, w.level, w.pos, w.rank_lo,
           max(b.min_ms + (b.max_ms - b.min_ms) * (w.rank_lo - b.rank_from) / greatest(b.n - 1, 1))
               FILTER (WHERE w.rank_lo >= b.rank_from AND w.rank_lo < b.rank_from + b.n) AS value_lo,
           max(b.min_ms + (b.max_ms - b.min_ms) * (w.rank_hi - b.rank_from) / greatest(b.n - 1, 1))
               FILTER (WHERE w.rank_hi >= b.rank_from AND w.rank_hi < b.rank_from + b.n) AS value_hi
    FROM wanted w
    JOIN bins b ON b.run_id = w.run_id AND b.metric = w.metric
               AND b.rank_from <= w.rank_hi AND b.rank_from + b.n > w.rank_lo
    GROUP BY ALL
)
SELECT run_id, metric, level, pos AS rank, num_values, mean_ms, max_ms,
       value_lo + (pos - rank_lo) * (value_hi - value_lo) AS value_ms
FROM ranked;
