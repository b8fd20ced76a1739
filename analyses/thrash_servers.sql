-- Did each server thrash? thrash.sql's verdict and evidence per server of a run (a run joined from
-- several servers' captures: the data-parallel ranks of a vLLM server, a fleet's hosts), each judged
-- on its own steps, pool and KV events; rates over the run's span. A run of one server has one row,
-- server '', the same as thrash.sql's.
-- param: window_s = 5  the window judged at each step, in seconds
-- param: full_pool_frac = 0.95  a step's pool is full when used_blocks / total_blocks >= this
-- param: min_preempt_per_s = 1  preemptions per second a thrashing window has at least
-- param: min_recompute_share = 0.2  recomputed share of the window's computed positions, or...
-- param: min_full_pool_share = 0.5  ...share of the window's steps with a full pool
--
-- Columns, one row per run and server: run_id, server, then thrash.sql's (verdict, preemptions,
-- peak_preempt_per_s, thrash_windows, thrash_s, preempted_sequences, repreempted_sequences,
-- full_pool_step_share, recompute_share, processed_tokens, useful_tokens, processed_tok_s, useful_tok_s,
-- reloaded_tokens)
SELECT t.* EXCLUDE (steps, full_pool_steps), coalesce(r.reloaded_tokens, 0)::BIGINT AS reloaded_tokens
FROM _thrash_servers($window_s, $full_pool_frac, $min_preempt_per_s, $min_recompute_share, $min_full_pool_share) t
LEFT JOIN (SELECT run_id, server, sum(tier_tokens) AS reloaded_tokens FROM _preemptions GROUP BY run_id, server) r
    USING (run_id, server)
ORDER BY run_id, server;
