-- Which inter-token gaps were cliffs, and what caused each one?
--
-- A cliff is a gap between consecutive tokens of a sequence longer than its run's threshold:
-- `threshold_ms` when > 0, else the larger of `median_multiple` x the run's median ITL and the
-- run's p99 ITL. The median and p99 are read from a histogram, each within 0.1% of the exact
-- one (see _latency_hist), so a gap within 0.1% of a threshold they set can fall either side.
-- Its cause, read from the trace, first rule that holds:
--   swap_wait             the sequence was swapped out during the gap (preempted with swap,
--                         waiting for swap-in)
--   preempted             it was preempted by recompute during the gap and spent at least as
--                         long waiting for readmission as re-prefilling
--   reprefill             ...and spent longer re-prefilling its history (from its admit with
--                         reason resume-recompute until the re-prefill completed)
--   prefill_interference  not preempted, but the step producing the second token also computed
--                         prefill (prefill_tokens > 0, other sequences' prompts)
--   other                 none of the above (step-time noise, scheduling, host stalls)
-- param: threshold_ms = 0  fixed cliff threshold (ms); <= 0 uses the run's own ITL distribution
-- param: median_multiple = 5  with no fixed threshold, cliffs are above this x the median ITL (and p99)
--
-- Columns, one row per cliff, longest first within each run:
--   run_id, req_id, sample
--   idx                  position of the token that ended the gap
--   gap_ms, threshold_ms (ms)
--   cause
--   start_s, end_s       the two tokens' times (s)
--   prev_step, step      the steps that produced them
--   preempted_ms, swapped_ms, reprefill_ms   the parts of the gap spent in those states (ms)
--   step_prefill_tokens  prefill positions computed in `step`
--   step_device_ms       device time of `step` (ms)
SELECT run_id, req_id, sample, idx, gap_ms, threshold_ms, cause, start_s, end_s, prev_step, step,
       preempted_ms, swapped_ms, reprefill_ms, step_prefill_tokens, step_device_ms
FROM _itl_cliffs($threshold_ms, $median_multiple)
WHERE cause IS NOT NULL
ORDER BY run_id, gap_ms DESC, req_id, sample, idx;
