-- Which requests fared worst: the slowest first token, the longest end to end, the longest stall
-- between tokens, or the most preemptions?
-- param: by = 'e2e'  ttft | e2e | itl | preemptions
-- param: limit = 10  rows per run
-- param: at_s = -1  a time on the run's clock (s): only the sequences in flight then (arrived by it and not
--                   finished before it); < 0 = every sequence
--
-- Columns, one row per sequence, the `limit` worst of each run by `by` (ties: longer e2e first):
--   run_id, req_id, sample
--   rank              1 = the worst in its run
--   ttft_ms           first token - arrival (ms; null without a token)
--   e2el_ms           finish - arrival (ms; null if unfinished), whatever the finish reason
--   max_itl_ms        its longest inter-token gap (ms; null under 2 tokens)
--   queueing_ms       first scheduled - arrival (ms)
--   preemptions, recomputed_tokens, output_tokens, finish_reason   from `requests`
--   arrival_s, finish_s   from `requests` (run seconds): when it was in flight
WITH gaps AS (
    SELECT run_id, req_id, sample, max(gap_ms) AS max_itl_ms
    FROM _itl
    GROUP BY ALL
),
measured AS (
    SELECT r.run_id, r.req_id, r.sample,
           (r.first_token_s - r.arrival_s) * 1000 AS ttft_ms,
           (r.finish_s - r.arrival_s) * 1000 AS e2el_ms,
           g.max_itl_ms,
           (r.first_scheduled_s - r.arrival_s) * 1000 AS queueing_ms,
           r.preemptions, r.recomputed_tokens, r.output_tokens, r.finish_reason, r.arrival_s, r.finish_s
    FROM requests r
    LEFT JOIN gaps g USING (run_id, req_id, sample)
),
ranked AS (
    SELECT *, row_number() OVER (
        PARTITION BY run_id
        ORDER BY CASE $by WHEN 'ttft' THEN ttft_ms WHEN 'itl' THEN max_itl_ms
                          WHEN 'preemptions' THEN preemptions ELSE e2el_ms END DESC NULLS LAST,
                 e2el_ms DESC NULLS LAST, req_id, sample) AS rank
    FROM measured
    WHERE CASE WHEN $by IN ('ttft', 'e2e', 'itl', 'preemptions') THEN true
               ELSE error('worst_requests: by must be ttft, e2e, itl or preemptions, got ' || $by) END
      AND ($at_s < 0 OR (arrival_s <= $at_s AND (finish_s IS NULL OR finish_s >= $at_s)))
)
SELECT run_id, req_id, sample, rank, ttft_ms, e2el_ms, max_itl_ms, queueing_ms, preemptions, recomputed_tokens,
       output_tokens, finish_reason, arrival_s, finish_s
FROM ranked
WHERE rank <= $limit
ORDER BY run_id, rank;
