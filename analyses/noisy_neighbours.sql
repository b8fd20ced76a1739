-- Who hurt whom: which requests' growth preempted the most others, and what did it cost them?
--
-- A preemption's requester is the sequence whose allocation could not be served (schema 3; older
-- traces have none and give no rows). Preemptions of a sequence by its own growth are counted
-- apart: they cost nobody else.
-- param: limit = 10  rows per run
--
-- Columns, one row per requester that preempted another sequence, the `limit` worst of each run:
--   run_id, req_id, sample   the requester
--   rank               1 = preempted the most others in its run (ties: more of others' positions lost)
--   preemptions        preemptions of other sequences it caused
--   victims            distinct other sequences it preempted
--   self_preemptions   times it preempted itself
--   positions_lost     others' KV positions dropped or swapped out for it (tokens)
--   recomputed_tokens  of those, positions the victims computed again (tokens)
--   recompute_ms_est   their device time (ms, estimate; see preemptions.sql)
--   victims_wait_ms    the victims' time waiting to resume (ms)
WITH caused AS (
    SELECT run_id, requester_req_id AS req_id, requester_sample AS sample,
           count(*) FILTER (WHERE NOT self_preempted) AS preemptions,
           count(DISTINCT (req_id, sample)) FILTER (WHERE NOT self_preempted) AS victims,
           count(*) FILTER (WHERE self_preempted) AS self_preemptions,
           coalesce(sum(positions_lost) FILTER (WHERE NOT self_preempted), 0)::BIGINT AS positions_lost,
           coalesce(sum(recomputed_tokens) FILTER (WHERE NOT self_preempted), 0)::BIGINT AS recomputed_tokens,
           coalesce(sum(recompute_ms_est) FILTER (WHERE NOT self_preempted), 0) AS recompute_ms_est,
           coalesce(sum(wait_ms) FILTER (WHERE NOT self_preempted), 0) AS victims_wait_ms
    FROM _preemptions
    WHERE requester_req_id IS NOT NULL
    GROUP BY ALL
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY run_id
                                 ORDER BY preemptions DESC, positions_lost DESC, req_id, sample) AS rank
    FROM caused
    WHERE preemptions > 0
)
SELECT run_id, req_id, sample, rank, preemptions, victims, self_preemptions, positions_lost, recomputed_tokens,
       recompute_ms_est, victims_wait_ms
FROM ranked
WHERE rank <= $limit
ORDER BY run_id, rank;
