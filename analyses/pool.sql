-- How full was the KV pool, step by step? The occupancy timeline of each run's device pool (of each
-- server's, in a run of several servers).
--
-- Columns, one row per step, in time order:
--   run_id, step, start_s, end_s (s)
--   used_blocks     blocks referenced by some sequence, after scheduling
--   free_blocks     blocks free (cached ones included)
--   cached_blocks   free blocks still holding reusable prefix-cache KV
--   total_blocks    the pool's size
--   used_frac       used_blocks / total_blocks
--   kv_tokens       KV positions stored in the used blocks (null in traces without the column)
--   running, waiting, swapped   queue sizes after scheduling
--   preemptions     preemptions decided in the step
--   server          the server whose pool it is ('' but in a run of several servers)
SELECT run_id, step, start_s, end_s, used_blocks, free_blocks, cached_blocks, total_blocks,
       used_blocks / nullif(total_blocks, 0) AS used_frac,
       kv_tokens, running, waiting, swapped, preemptions, server
FROM steps
ORDER BY run_id, server, step;
