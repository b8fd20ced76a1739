-- Which setting should I run with? One row per point of a sweep (`kvtrace sweep`), with the
-- figures that decide it; `kvtrace sweep show` presents these rows and names the best point.
--
-- A point is a run whose meta.json carries the sweep's marker (name, index, settings); runs that
-- are not points of a sweep get null sweep columns. Every figure comes from the helper that
-- defines it (_throughput, _thrash, _goodput, _latency_stats, _recompute, _swap), with the same
-- params and defaults as summary.sql.
-- param: ttft_ms = 2000  SLO for time to first token (ms); <= 0 disables it
-- param: tpot_ms = 100  SLO for time per output token (ms); <= 0 disables it
-- param: e2el_ms = 0  SLO for end-to-end latency (ms); <= 0 disables it
-- param: window_s = 5  thrash: the window judged at each step, in seconds
-- param: full_pool_frac = 0.95  thrash: a step's pool is full when used_blocks / total_blocks >= this
-- param: min_preempt_per_s = 1  thrash: preemptions per second a thrashing window has at least
-- param: min_recompute_share = 0.2  thrash: recomputed share of the window's computed positions, or...
-- param: min_full_pool_share = 0.5  thrash: ...share of the window's steps with a full pool
--
-- Columns, one row per run, points in grid order:
--   sweep, point        the sweep's name and the point's index in its grid
--   settings            the knobs the point set, a JSON object of strings ({"max_num_seqs": "32"})
--   run_id, status      the point's run and how it ended (completed | interrupted | failed)
--   duration_s          as in throughput.sql (s)
--   completed_requests  requests whose every sample finished by stop or length
--   output_tok_s        output tokens per second (throughput.sql)
--   useful_tok_s        positions computed for the first time per second (thrash.sql): throughput
--                       with recomputed work taken out
--   goodput_req_s, good_share   requests per second meeting every SLO, and their share (goodput.sql)
--   ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms   latency.sql's percentiles (ms)
--   preemptions, recomputed_tokens, recompute_share    recompute.sql (share of positions computed)
--   swap_bytes          bytes copied by swap, both directions (swap.sql)
--   thrash_verdict      none | occasional | sustained (thrash.sql)
SELECT json_extract_string(runs.meta_json, '$.sweep.name') AS sweep,
       CAST(json_extract(runs.meta_json, '$.sweep.index') AS INTEGER) AS point,
       CAST(json_extract(runs.meta_json, '$.sweep.settings') AS VARCHAR) AS settings,
       runs.run_id, runs.status,
       t.duration_s, t.completed_requests, t.output_tok_s, th.useful_tok_s,
       g.goodput_req_s, g.good_share,
       l.ttft_p50_ms, l.ttft_p99_ms, l.itl_p50_ms, l.itl_p99_ms,
       rc.preemptions, rc.recomputed_tokens, rc.recompute_share_of_processed AS recompute_share,
       coalesce(s.swap_bytes, 0) AS swap_bytes,
       th.verdict AS thrash_verdict
FROM runs
LEFT JOIN _throughput t USING (run_id)
LEFT JOIN _goodput($ttft_ms, $tpot_ms, $e2el_ms) g USING (run_id)
LEFT JOIN _latency_by_run l USING (run_id)
LEFT JOIN _recompute rc USING (run_id)
LEFT JOIN _swap_by_run s USING (run_id)
LEFT JOIN _thrash($window_s, $full_pool_frac, $min_preempt_per_s, $min_recompute_share, $min_full_pool_share) th
       USING (run_id)
ORDER BY sweep, point, runs.ordinal;
