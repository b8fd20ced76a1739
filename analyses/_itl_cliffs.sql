-- Helper: _itl_cliffs(fixed_threshold_ms, median_multiple), every inter-token gap above its
-- run's threshold with the cause read from the trace (see itl_cliffs.sql for the rules and the
-- columns). Every row also carries its run's ITL p50 and p99 (approximate: within 0.1% of the
-- exact ones, see _latency_hist) and the threshold; a run with gaps but no cliff gets one row
-- whose req_id and cause are null, so that summaries see every run.
CREATE OR REPLACE MACRO _itl_cliffs(fixed_threshold_ms, median_multiple) AS TABLE
-- two passes over the gaps, neither holding them all: the run's p50 and p99 from the histogram of
-- _latency_hist (each within 0.1% of the exact one), then the gaps above the threshold
WITH thresholds AS (
    SELECT run_id, itl_p50_ms, itl_p99_ms,
           -- the threshold: fixed_threshold_ms when > 0, else the larger of median_multiple x p50 and p99
           CASE WHEN fixed_threshold_ms > 0 THEN fixed_threshold_ms::DOUBLE
                ELSE greatest(median_multiple * itl_p50_ms, itl_p99_ms) END AS threshold_ms
    FROM (SELECT run_id,
                 max(value_ms) FILTER (WHERE level = 0.5) AS itl_p50_ms,
                 max(value_ms) FILTER (WHERE level = 0.99) AS itl_p99_ms
          FROM _latency_quantiles([0.5, 0.99], 0)
          WHERE metric = 'itl'
          GROUP BY run_id)
),
cliffs AS (
    SELECT g.*, t.threshold_ms
    FROM _itl g JOIN thresholds t USING (run_id)
    WHERE g.gap_ms > t.threshold_ms
),
-- the part of each cliff the sequence spent preempted, swapped out or re-prefilling
stalls AS (
    SELECT c.run_id, c.req_id, c.sample, c.idx,
           sum(_overlap_ms(s.start_s, s.end_s, c.start_s, c.end_s)) FILTER (WHERE s.state = 'preempted') AS preempted_ms,
           sum(_overlap_ms(s.start_s, s.end_s, c.start_s, c.end_s)) FILTER (WHERE s.state = 'swapped') AS swapped_ms,
           sum(_overlap_ms(s.start_s, s.end_s, c.start_s, c.end_s)) FILTER (WHERE s.state = 'reprefill') AS reprefill_ms
    FROM cliffs c
    JOIN _stall_spans s
      ON s.run_id = c.run_id AND s.req_id = c.req_id AND s.sample = c.sample
     AND s.start_s < c.end_s AND s.end_s > c.start_s
     AND s.state IN ('preempted', 'swapped', 'reprefill')
    GROUP BY c.run_id, c.req_id, c.sample, c.idx
),
attributed AS (
    SELECT c.run_id, c.req_id, c.sample, c.idx, c.gap_ms,
           _itl_cause(st.swapped_ms, st.preempted_ms, st.reprefill_ms, step.prefill_tokens) AS cause,
           c.start_s, c.end_s, c.prev_step, c.step,
           coalesce(st.preempted_ms, 0) AS preempted_ms,
           coalesce(st.swapped_ms, 0) AS swapped_ms,
           coalesce(st.reprefill_ms, 0) AS reprefill_ms,
           step.prefill_tokens AS step_prefill_tokens,
           step.device_ms AS step_device_ms
    FROM cliffs c
    LEFT JOIN stalls st USING (run_id, req_id, sample, idx)
    LEFT JOIN steps step ON step.run_id = c.run_id AND step.server = c.server AND step.step = c.step
)
SELECT t.run_id, a.req_id, a.sample, a.idx, a.gap_ms, t.threshold_ms, a.cause, a.start_s, a.end_s,
       a.prev_step, a.step, a.preempted_ms, a.swapped_ms, a.reprefill_ms, a.step_prefill_tokens,
       a.step_device_ms, t.itl_p50_ms, t.itl_p99_ms
FROM thresholds t LEFT JOIN attributed a USING (run_id);
