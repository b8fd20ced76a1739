-- Helper: every preempted sequence with its preemptions and stall time, ranked within its run
-- (see most_preempted.sql for the columns).
CREATE OR REPLACE VIEW _most_preempted AS
WITH preempts AS (
    -- the preemptions and the recomputed positions of each sequence, in one pass over the events
    SELECT run_id, req_id, sample,
           count(*) FILTER (WHERE kind = 'preempt') AS preemptions,
           count(*) FILTER (WHERE kind = 'preempt' AND reason = 'swap') AS swaps,
           coalesce(sum(num_recomputed_tokens) FILTER (WHERE kind = 'reprefill'), 0)::BIGINT AS recomputed_tokens
    FROM kv_events
    WHERE kind IN ('preempt', 'reprefill')
    GROUP BY run_id, req_id, sample
    HAVING count(*) FILTER (WHERE kind = 'preempt') > 0
),
stalls AS (
    SELECT run_id, req_id, sample, sum(end_s - start_s) * 1000 AS stall_ms
    FROM _stall_spans
    WHERE state IN ('preempted', 'swapped')
    GROUP BY run_id, req_id, sample
)
SELECT p.run_id, p.req_id, p.sample, p.preemptions, p.swaps,
       p.recomputed_tokens,
       coalesce(st.stall_ms, 0) AS stall_ms,
       (r.finish_s - r.arrival_s) * 1000 AS e2el_ms,
       coalesce(st.stall_ms, 0) / nullif((r.finish_s - r.arrival_s) * 1000, 0) AS stall_share,
       r.output_tokens, r.finish_reason,
       row_number() OVER (PARTITION BY p.run_id
                          ORDER BY p.preemptions DESC, coalesce(st.stall_ms, 0) DESC, p.req_id, p.sample) AS rank
FROM preempts p
LEFT JOIN stalls st USING (run_id, req_id, sample)
LEFT JOIN requests r USING (run_id, req_id, sample);
