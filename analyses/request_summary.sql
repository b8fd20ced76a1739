-- How did each request fare? One row per sequence: its latencies, its preemptions and the work
-- they cost it, the table an explorer sorts (kvtrace explore).
--
-- Columns, one row per sequence in `requests`, in order of arrival within each run:
--   run_id, req_id, sample
--   arrival_s          when it arrived (s on the run's clock)
--   prompt_tokens, output_tokens, finish_reason   from `requests`
--   ttft_ms, tpot_ms, e2el_ms, queueing_ms        see _sequence_latency.sql (ms; null where the
--                                                 sequence has no such value)
--   preemptions        times preempted (preempt events, any mode)
--   swaps              of those, by swap
--   recomputed_tokens  positions computed again after its recompute preemptions (tokens)
--   stall_ms           time spent preempted or swapped out (ms; 0 if never preempted)
SELECT l.run_id, l.req_id, l.sample, r.arrival_s, r.prompt_tokens, l.output_tokens, r.finish_reason,
       l.ttft_ms, l.tpot_ms, l.e2el_ms, l.queueing_ms,
       coalesce(p.preemptions, 0) AS preemptions,
       coalesce(p.swaps, 0) AS swaps,
       coalesce(p.recomputed_tokens, 0) AS recomputed_tokens,
       coalesce(p.stall_ms, 0) AS stall_ms
FROM _sequence_latency l
JOIN requests r USING (run_id, req_id, sample)
LEFT JOIN _most_preempted p USING (run_id, req_id, sample)
ORDER BY l.run_id, r.arrival_s, l.req_id, l.sample;
