-- When did the engine thrash? The thrash windows: the periods in which thrashing holds (see
-- thrash.sql for the test applied to the window ending with each step, and for the params; the
-- words: docs/glossary.md).
-- param: window_s = 5  the window judged at each step, in seconds
-- param: full_pool_frac = 0.95  a step's pool is full when used_blocks / total_blocks >= this
-- param: min_preempt_per_s = 1  preemptions per second a thrashing window has at least
-- param: min_recompute_share = 0.2  recomputed share of the window's computed positions, or...
-- param: min_full_pool_share = 0.5  ...share of the window's steps with a full pool
--
-- Columns, one row per run of consecutive thrashing steps, in time order:
--   run_id
--   start_s, end_s         from the window start of its first step to the end of its last (s)
--   duration_s             (s)
--   thrashing_steps        steps in the thrash window
--   peak_preempt_per_s     highest windowed preemption rate (1/s)
--   peak_recompute_share   highest windowed recomputed share of computed positions
--   peak_full_pool_share   highest windowed share of full-pool steps
SELECT *
FROM _thrash_windows($window_s, $full_pool_frac, $min_preempt_per_s, $min_recompute_share, $min_full_pool_share)
ORDER BY run_id, start_s;
