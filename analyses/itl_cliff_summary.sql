-- How much of the ITL tail does each cause explain? Per run and cause: the cliffs (see
-- itl_cliffs.sql for the threshold and the causes) and their share of the tail time, with the
-- run's ITL p99 / p50 ratio (how far the tail stands from the typical gap).
-- param: threshold_ms = 0  fixed cliff threshold (ms); <= 0 uses the run's own ITL distribution
-- param: median_multiple = 5  with no fixed threshold, cliffs are above this x the median ITL (and p99)
--
-- Columns, one row per run with token gaps and per cause (all five causes, in the order of
-- itl_cliffs.sql):
--   run_id, cause
--   cliffs          gaps above the threshold with this cause
--   tail_ms         their total length (ms)
--   tail_share      tail_ms / all cliffs' total length in the run (0 when the run has none)
--   max_gap_ms      the longest of them (ms; null with none)
--   threshold_ms    the run's threshold (ms)
--   itl_p50_ms, itl_p99_ms, p99_p50_ratio   the run's ITL distribution (ms); the percentiles are
--                   approximate, each within 0.1% of the exact one (see _latency_hist)
WITH cliffs AS MATERIALIZED (
    SELECT * FROM _itl_cliffs($threshold_ms, $median_multiple)
),
causes(cause, cause_order) AS (
    VALUES ('swap_wait', 1), ('preempted', 2), ('reprefill', 3), ('prefill_interference', 4), ('other', 5)
),
per_run AS (
    SELECT DISTINCT run_id, threshold_ms, itl_p50_ms, itl_p99_ms FROM cliffs
),
per_cause AS (
    SELECT run_id, cause, count(*) AS cliffs, sum(gap_ms) AS tail_ms, max(gap_ms) AS max_gap_ms
    FROM cliffs
    WHERE cause IS NOT NULL
    GROUP BY run_id, cause
)
SELECT t.run_id, c.cause,
       coalesce(p.cliffs, 0) AS cliffs,
       coalesce(p.tail_ms, 0) AS tail_ms,
       coalesce(p.tail_ms / nullif(sum(p.tail_ms) OVER (PARTITION BY t.run_id), 0), 0) AS tail_share,
       p.max_gap_ms,
       t.threshold_ms, t.itl_p50_ms, t.itl_p99_ms,
       t.itl_p99_ms / nullif(t.itl_p50_ms, 0) AS p99_p50_ratio
FROM per_run t
CROSS JOIN causes c
LEFT JOIN per_cause p ON p.run_id = t.run_id AND p.cause = c.cause
ORDER BY t.run_id, c.cause_order;
