-- Helper: every preempted sequence with its preemptions and stall time, ranked within its run
-- (see most_preempted.sql for the columns).
CREATE OR REPLACE VIEW _most_preempted AS
WITH preempts AS (
    SELECT run_id, req_id, sample, count(*) AS preemptions,
           count(*) FILTER (WHERE reason = 'swap') AS swaps
    FROM kv_events
    WHERE kind = 'preempt'
    GROUP BY run_id, req_id, sample
),
recomputed AS (
    SELECT run_id, req_id, sample, sum(num_recomputed_tokens)::BIGINT AS recomputed_tokens
    FROM kv_events
    WHERE kind = 'reprefill'
    GROUP BY run_id, req_id, sample
),
stalls AS (
    SELECT run_id, req_id, sample, sum(end_s - start_s) * 1000 AS stall_ms
    FROM _stall_spans
    WHERE state IN ('preempted', 'swapped')
    GROUP BY run_id, req_id, sample
)
SELECT p.run_id, p.req_id, p.sample, p.preemptions, p.swaps,
       coalesce(rc.recomputed_tokens, 0) AS recomputed_tokens,
       coalesce(st.stall_ms, 0) AS stall_ms,
       (r.finish_s - r.arrival_s) * 1000 AS e2el_ms,
       coalesce(st.stall_ms, 0) / nullif((r.finish_s - r.arrival_s) * 1000, 0) AS stall_share,
       r.output_tokens, r.finish_reason,
       row_number() OVER (PARTITION BY p.run_id
                          ORDER BY p.preemptions DESC, coalesce(st.stall_ms, 0) DESC, p.req_id, p.sample) AS rank
FROM preempts p
LEFT JOIN recomputed rc USING (run_id, req_id, sample)
LEFT JOIN stalls st USING (run_id, req_id, sample)
LEFT JOIN requests r USING (run_id, req_id, sample);
