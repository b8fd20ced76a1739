-- What are a run's key figures? One row per run, for `kvtrace compare` and the dashboard.
--
-- Every figure comes from the analysis that defines it: throughput.sql, goodput.sql,
-- latency.sql, recompute.sql, swap.sql, thrash.sql. The params are theirs, with the same
-- defaults.
-- param: ttft_ms = 2000  SLO for time to first token (ms); <= 0 disables it
-- param: tpot_ms = 100  SLO for time per output token (ms); <= 0 disables it
-- param: e2el_ms = 0  SLO for end-to-end latency (ms); <= 0 disables it
-- param: window_s = 5  thrash: the window judged at each step, in seconds
-- param: full_pool_frac = 0.95  thrash: a step's pool is full when used_blocks / total_blocks >= this
-- param: min_preempt_per_s = 1  thrash: preemptions per second a thrashing window has at least
-- param: min_recompute_share = 0.2  thrash: recomputed share of the window's computed positions, or...
-- param: min_full_pool_share = 0.5  thrash: ...share of the window's steps with a full pool
--
-- Columns, one row per run (units as in the source analyses):
--   run_id, model, device, preemption_mode, preemption_policy, block_size, num_gpu_blocks
--   duration_s, completed_requests, output_tokens, output_tok_s, request_throughput
--   goodput_req_s, good_share
--   ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms, itl_p50_ms, itl_p99_ms,
--   e2el_p50_ms, e2el_p99_ms        (approximate: each within 0.1% of the exact value, see latency.sql)
--   preemptions, recomputed_tokens, recompute_share (of positions computed), recompute_device_ms
--   swap_out_bytes, swap_in_bytes, swap_gb_s (both directions)
--   thrash_verdict, peak_preempt_per_s, useful_tok_s
--   servers          the servers whose steps the run holds (1 but in a run joined from several servers'
--                    captures; its figures are then the fleet's: counts added up, the thrash verdict
--                    the worst server's, see thrash_servers.sql for each)
SELECT runs.run_id, runs.model, runs.device, runs.preemption_mode, runs.preemption_policy,
       runs.block_size, runs.num_gpu_blocks,
       t.duration_s, t.completed_requests, t.output_tokens, t.output_tok_s, t.request_throughput,
       g.goodput_req_s, g.good_share,
       l.ttft_p50_ms, l.ttft_p99_ms, l.tpot_p50_ms, l.tpot_p99_ms, l.itl_p50_ms, l.itl_p99_ms,
       l.e2el_p50_ms, l.e2el_p99_ms,
       rc.preemptions, rc.recomputed_tokens, rc.recompute_share_of_processed AS recompute_share,
       rc.recompute_device_ms,
       coalesce(s.swap_out_bytes, 0) AS swap_out_bytes,
       coalesce(s.swap_in_bytes, 0) AS swap_in_bytes,
       s.swap_gb_s,
       th.verdict AS thrash_verdict, th.peak_preempt_per_s, th.useful_tok_s,
       (SELECT count(*) FROM _servers sv WHERE sv.run_id = runs.run_id) AS servers
FROM runs
LEFT JOIN _throughput t USING (run_id)
LEFT JOIN _goodput($ttft_ms, $tpot_ms, $e2el_ms) g USING (run_id)
LEFT JOIN _latency_by_run l USING (run_id)
LEFT JOIN _recompute rc USING (run_id)
LEFT JOIN _swap_by_run s USING (run_id)
LEFT JOIN _thrash($window_s, $full_pool_frac, $min_preempt_per_s, $min_recompute_share, $min_full_pool_share) th
       USING (run_id)
ORDER BY runs.ordinal;
