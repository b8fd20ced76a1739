-- Each preemption: who needed the blocks, why this victim, and what it cost the victim.
--
-- Requester and victim reason are recorded from schema 3 on (null before). What a preemption cost
-- is read from the victim's events until its next preemption (see _preemptions.sql).
-- param: req_id = ''  the victim (workload id); '' = every request
-- param: sample = -1  the victim's sample (0..n-1); < 0 = every sample
--
-- Columns, one row per preemption, in order within each victim:
--   run_id, req_id, sample   the victim
--   preemption_no      1 = its first preemption
--   step, ts_s         when (the step; s)
--   reason             recompute | swap | swap-full-fallback
--   requester_req_id, requester_sample   the sequence whose allocation could not be served
--   victim_reason      newest | lowest-priority | fewest-computed | only-candidate | swap-group
--   self_preempted     the victim was its own requester (its own growth)
--   positions_lost     KV positions it had computed (by swap: copied out instead)
--   resumed_s, wait_ms when it was admitted again (s), and the wait (ms)
--   cached_tokens      positions served from the prefix cache on resume
--   recomputed_tokens  positions computed again
--   recompute_ms_est   their device time (ms, estimate: the run's device time per recomputed position)
--   swap_ms            its swap copies' measured time (ms)
--   tier_tokens        positions loaded back from a KV tier instead (schema 6; 0 without a tier)
--   tier_load_ms       those loads' time (ms; null where none was timed)
--   tier               the tier they came from (null without a load)
SELECT run_id, req_id, sample, preemption_no, step, ts_s, reason, requester_req_id, requester_sample,
       victim_reason, self_preempted, positions_lost, resumed_s, wait_ms, cached_tokens, recomputed_tokens,
       recompute_ms_est, swap_ms, tier_tokens, tier_load_ms, tier
FROM _preemptions
WHERE ($req_id = '' OR req_id = $req_id) AND ($sample < 0 OR sample = $sample)
ORDER BY run_id, req_id, sample, preemption_no;
