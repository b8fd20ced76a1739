-- Which sequences were preempted most, and how long did they stall?
-- param: limit = 10  rows per run
--
-- Columns, one row per preempted sequence, the `limit` most preempted of each run:
--   run_id, req_id, sample
--   rank               1 = most preempted in its run (ties: longer stall first)
--   preemptions        times preempted
--   swaps              of those, by swap
--   recomputed_tokens  positions computed again after its recompute preemptions (tokens)
--   stall_ms           time spent preempted or swapped out (ms)
--   e2el_ms            finish - arrival (ms; null if it has no `requests` row yet)
--   stall_share        stall_ms / e2el_ms
--   output_tokens, finish_reason   from `requests`
SELECT run_id, req_id, sample, rank, preemptions, swaps, recomputed_tokens, stall_ms,
       e2el_ms, stall_share, output_tokens, finish_reason
FROM _most_preempted
WHERE rank <= $limit
ORDER BY run_id, rank;
