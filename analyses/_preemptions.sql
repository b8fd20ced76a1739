-- Helper: every preemption with its cause (schema 3) and what it cost the victim.
--
-- A preemption's aftermath is what its victim's events say until its next preemption: the admit
-- that resumed it, the re-prefill of its history (recompute) or the swap copies (swap), and with a KV
-- tier (schema 6) the loads that brought its history back from the tier instead of recomputing it.
--
-- _preemptions: one row per preempt event.
--   run_id, req_id, sample   the victim
--   preemption_no      1 = the victim's first preemption
--   seq, step, ts_s    the preempt event (kv_events.seq), its step and time (s)
--   reason             recompute | swap | swap-full-fallback (kv_events.reason)
--   requester_req_id, requester_sample   the sequence whose allocation could not be served (it
--                      needed the blocks; the victim itself when it was its own growth); null in
--                      traces before schema 3
--   victim_reason      why the policy chose this victim: newest | lowest-priority |
--                      fewest-computed | only-candidate | swap-group (null before schema 3)
--   self_preempted     requester and victim are the same sequence
--   positions_lost     KV positions the victim had computed (kv_events.num_tokens); by swap they are
--                      copied out, not lost
--   resumed_s          when it was admitted again (null if never): when the scheduler decided it,
--                      which for a vLLM capture (events stamped at their step's end) is the start
--                      of the admitting step, as in _sequence_states
--   wait_ms            resumed_s - the preemption's decision time (ms; the same rule)
--   cached_tokens      of its history, positions served from the prefix cache on resume
--   recomputed_tokens  positions computed again on resume (the re-prefill, done or cut short)
--   recompute_ms_est   recomputed_tokens x its server's device time per recomputed position
--                      (_recompute_servers: a step's device time shared among its tokens; ms, estimate)
--   swap_ms            measured copy time of its swap-out and swap-in (ms; 0 by recompute)
--   tier_tokens        positions loaded back from a KV tier on resume (its `load` events that did not
--                      fail; 0 without a tier)
--   tier_load_ms       those loads' time (ms; their duration_ms, null where no load was timed)
--   tier               the tier they came from (the first load's; null without a load)
--   server             the victim's server ('' in a run of one)
CREATE OR REPLACE VIEW _preemptions AS
WITH events AS (
    SELECT e.run_id, e.server, e.req_id, e.sample, e.seq, e.step, e.ts_s, e.kind, e.reason, e.num_tokens,
           e.num_cached_tokens, e.num_recomputed_tokens, e.duration_ms, e.requester_req_id,
           e.requester_sample, e.victim_reason, e.tier,
           CASE WHEN e.ts_s >= st.end_s THEN st.start_s ELSE e.ts_s END AS decided_s,
           sum(CASE WHEN e.kind = 'preempt' THEN 1 ELSE 0 END)
               OVER (PARTITION BY e.run_id, e.req_id, e.sample ORDER BY e.seq) AS preemption_no
    FROM kv_events e
    LEFT JOIN steps st USING (run_id, server, step)
    WHERE e.kind IN ('preempt', 'admit', 'reprefill', 'swap_out', 'swap_in', 'load') AND e.req_id <> ''
),
aftermath AS (
    SELECT run_id, req_id, sample, preemption_no,
           min(decided_s) FILTER (WHERE kind = 'admit') AS resumed_s,
           coalesce(sum(num_cached_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS cached_tokens,
           coalesce(sum(num_recomputed_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS recomputed_tokens,
           coalesce(sum(duration_ms) FILTER (WHERE kind IN ('swap_out', 'swap_in')), 0) AS swap_ms,
           coalesce(sum(num_tokens) FILTER (WHERE kind = 'load' AND reason IS DISTINCT FROM 'failed'), 0)::BIGINT
               AS tier_tokens,
           sum(duration_ms) FILTER (WHERE kind = 'load') AS tier_load_ms,
           arg_min(tier, seq) FILTER (WHERE kind = 'load') AS tier
    FROM events
    WHERE preemption_no > 0
    GROUP BY run_id, req_id, sample, preemption_no
)
SELECT e.run_id, e.req_id, e.sample, e.preemption_no::BIGINT AS preemption_no, e.seq, e.step, e.ts_s,
       e.reason, e.requester_req_id, e.requester_sample, e.victim_reason,
       e.requester_req_id = e.req_id AND e.requester_sample = e.sample AS self_preempted,
       e.num_tokens AS positions_lost,
       a.resumed_s, (a.resumed_s - e.decided_s) * 1000 AS wait_ms,
       a.cached_tokens, a.recomputed_tokens,
       a.recomputed_tokens * rc.recompute_device_ms / nullif(rc.recomputed_tokens, 0) AS recompute_ms_est,
       a.swap_ms, a.tier_tokens, a.tier_load_ms, a.tier, e.server
FROM events e
JOIN aftermath a USING (run_id, req_id, sample, preemption_no)
LEFT JOIN _recompute_servers rc USING (run_id, server)
WHERE e.kind = 'preempt';
