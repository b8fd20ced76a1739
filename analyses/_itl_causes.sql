-- Helper: the cause of every inter-token gap, by the rules of itl_cliffs.sql (a cliff is such a gap
-- above its run's threshold; see there for what each cause means).
--
-- _itl_cause(swapped_ms, preempted_ms, reprefill_ms, step_prefill_tokens): the cause of a gap from
--   the parts of it the sequence spent swapped out, preempted and re-prefilling (ms) and the prefill
--   positions of the step that ended it; the first rule that holds.
CREATE OR REPLACE MACRO _itl_cause(swapped_ms, preempted_ms, reprefill_ms, step_prefill_tokens) AS
    CASE WHEN coalesce(swapped_ms, 0) > 0 THEN 'swap_wait'
         WHEN coalesce(preempted_ms, 0) > 0 AND preempted_ms >= coalesce(reprefill_ms, 0) THEN 'preempted'
         WHEN coalesce(reprefill_ms, 0) > 0 THEN 'reprefill'
         WHEN step_prefill_tokens > 0 THEN 'prefill_interference'
         ELSE 'other' END;

-- _overlap_ms(a_start_s, a_end_s, b_start_s, b_end_s): how long two spans overlap, in ms (0 if apart)
CREATE OR REPLACE MACRO _overlap_ms(a_start_s, a_end_s, b_start_s, b_end_s) AS
    greatest(least(a_end_s, b_end_s) - greatest(a_start_s, b_start_s), 0) * 1000;

-- _itl_causes: one row per row of _itl (every gap, cliff or not), what the Prometheus exporter's
-- ITL histogram observes (kvtrace/vllm/metrics.py).
--   run_id, req_id, sample, idx, step, prev_step, start_s, end_s, gap_ms   as in _itl
--   cause        swap_wait | preempted | reprefill | prefill_interference | other
CREATE OR REPLACE VIEW _itl_causes AS
WITH stalls AS (
    SELECT g.run_id, g.req_id, g.sample, g.idx,
           sum(_overlap_ms(s.start_s, s.end_s, g.start_s, g.end_s)) FILTER (WHERE s.state = 'preempted') AS preempted_ms,
           sum(_overlap_ms(s.start_s, s.end_s, g.start_s, g.end_s)) FILTER (WHERE s.state = 'swapped') AS swapped_ms,
           sum(_overlap_ms(s.start_s, s.end_s, g.start_s, g.end_s)) FILTER (WHERE s.state = 'reprefill') AS reprefill_ms
    FROM _itl g
    JOIN _stall_spans s
      ON s.run_id = g.run_id AND s.req_id = g.req_id AND s.sample = g.sample
     AND s.start_s < g.end_s AND s.end_s > g.start_s
    GROUP BY g.run_id, g.req_id, g.sample, g.idx
)
SELECT g.run_id, g.req_id, g.sample, g.idx, g.step, g.prev_step, g.start_s, g.end_s, g.gap_ms,
       _itl_cause(st.swapped_ms, st.preempted_ms, st.reprefill_ms, step.prefill_tokens) AS cause
FROM _itl g
LEFT JOIN stalls st USING (run_id, req_id, sample, idx)
LEFT JOIN steps step ON step.run_id = g.run_id AND step.server = g.server AND step.step = g.step;
