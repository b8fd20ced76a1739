-- Which sequences did a KV tier spare computing again, and what did they wait for it? Per sequence:
-- positions loaded from a tier beside those recomputed, its loads, and the time they took.
--
-- A sequence whose prefix the device no longer holds (resumed after a recompute preemption, or one whose
-- prompt's blocks the prefix cache evicted) has what a tier holds of it loaded instead of computed; it
-- waits for its loads (docs/trace-format.md, "KV tiers"). A run without a tier (every run before
-- schema 6) has no row.
--
-- Columns, one row per sequence of a run with a tier (requests.tier_hit_tokens recorded, or a load),
-- most loaded first within each run:
--   run_id, req_id, sample
--   recomputed_tokens   positions computed again after recompute preemptions (requests; tokens)
--   tier_hit_tokens     positions loaded from a tier instead of computed (requests; tokens)
--   loads               its load events
--   failed_loads        of them, those that failed (their positions were computed instead)
--   load_wait_ms        its loads' durations added up (ms; null where none is known)
WITH per_sequence AS (
    SELECT run_id, req_id, sample,
           count(*) AS loads,
           count(*) FILTER (WHERE reason = 'failed') AS failed_loads,
           sum(duration_ms) AS load_wait_ms
    FROM kv_events
    WHERE kind = 'load'
    GROUP BY run_id, req_id, sample
)
SELECT run_id, req_id, sample,
       r.recomputed_tokens,
       r.tier_hit_tokens,
       coalesce(l.loads, 0)::BIGINT AS loads,
       coalesce(l.failed_loads, 0)::BIGINT AS failed_loads,
       l.load_wait_ms
FROM requests r FULL JOIN per_sequence l USING (run_id, req_id, sample)
WHERE r.tier_hit_tokens IS NOT NULL OR l.loads IS NOT NULL
ORDER BY run_id, r.tier_hit_tokens DESC NULLS LAST, req_id, sample;
