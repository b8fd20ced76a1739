-- Did the engine thrash? A verdict per run, none / occasional / sustained, with its evidence.
--
-- Thrashing is preemption that keeps coming back while the pool stays full, so that a good part
-- of the compute redoes work already done. Every step is judged over the window of `window_s`
-- seconds ending with it: the window thrashes when it has at least
-- `min_preempt_per_s` preemptions per second AND either at least `min_recompute_share` of the
-- positions computed in it were recomputed (recompute mode) or at least `min_full_pool_share`
-- of its steps ran with the pool `full_pool_frac` full (swap mode shows up here).
-- Verdict: none = no preemption at all; sustained = some window thrashes (the thrash windows,
-- periods of consecutive thrashing steps, are listed by thrash_windows.sql); occasional = preemptions, but no window thrashes.
-- The defaults call it sustained from 5 preemptions in 5 s with a fifth of the compute wasted
-- or the pool full in half the steps.
-- param: window_s = 5  the window judged at each step, in seconds
-- param: full_pool_frac = 0.95  a step's pool is full when used_blocks / total_blocks >= this
-- param: min_preempt_per_s = 1  preemptions per second a thrashing window has at least
-- param: min_recompute_share = 0.2  recomputed share of the window's computed positions, or...
-- param: min_full_pool_share = 0.5  ...share of the window's steps with a full pool
--
-- Columns, one row per run:
--   run_id, verdict
--   preemptions            preempt events
--   peak_preempt_per_s     highest windowed preemption rate (1/s)
--   thrash_windows         periods of time that thrash (see thrash_windows.sql)
--   thrash_s               their total length (s)
--   preempted_sequences    sequences preempted at least once
--   repreempted_sequences  sequences preempted more than once
--   full_pool_step_share   share of all steps with a full pool
--   recompute_share        recomputed positions / positions computed, whole run
--   processed_tokens       positions computed, prefill + decode (tokens)
--   useful_tokens          of those, computed for the first time (tokens)
--   processed_tok_s        processed_tokens / duration_s (tokens/s)
--   useful_tok_s           useful_tokens / duration_s: the effective throughput (tokens/s)
--   reloaded_tokens        positions preempted sequences got back from a KV tier instead of recomputing
--                          them (schema 6; 0 without a tier): the thrash a tier absorbed
SELECT t.*, coalesce(r.reloaded_tokens, 0)::BIGINT AS reloaded_tokens
FROM _thrash($window_s, $full_pool_frac, $min_preempt_per_s, $min_recompute_share, $min_full_pool_share) t
LEFT JOIN (SELECT run_id, sum(tier_tokens) AS reloaded_tokens FROM _preemptions GROUP BY run_id) r USING (run_id)
ORDER BY run_id;
