-- The figures of a request's verdict (kvtrace explain's sentence): its waits by kind with their
-- main cause, its preemptions by requester, what they cost, its gaps above the run's p99 ITL.
--
-- The same numbers as wait_causes.sql, preemptions.sql and itl_cliffs.sql (the gaps: those above
-- the run's p99 ITL, itl_cliffs with threshold_ms 0 and median_multiple 0), totalled per sequence.
-- param: req_id = ''  the request (workload id); '' = every request
-- param: sample = -1  the sample (0..n-1); < 0 = every sample
--
-- Columns, one row per sequence in `requests`:
--   run_id, req_id, sample
--   ttft_ms, e2el_ms   _sequence_latency.sql (ms; null where it has none)
--   queued_ms, resume_wait_ms, swapped_wait_ms
--                      its time waiting, by wait (_waits.sql's states waiting, preempted and
--                      swapped; ms, 0 if none)
--   queued_cause, resume_wait_cause, swapped_wait_cause
--                      the cause with the most time over those waits (wait_causes.sql; ties: by
--                      name), null if none
--   queued_cause_share, resume_wait_cause_share, swapped_wait_cause_share
--                      its time over the waits' time (0..1)
--   preemptions        preempt events of the sequence
--   requesters         list of {req_id, sample, preemptions}: whose allocation each preemption
--                      served (req_id null before schema 3), most preemptions first (ties: by id)
--   victim_reasons     the policy's reasons it was chosen, distinct, sorted
--   positions_lost, cached_tokens, recomputed_tokens   summed over its preemptions (preemptions.sql)
--   recompute_ms_est   summed over its preemptions (ms, estimate; 0 if none)
--   tier_tokens, tier_load_ms, tier   KV tiers (schema 6): positions its resumes loaded back from a tier
--                      instead of recomputing them, the loads' time (ms; null where none was timed), and
--                      the tier (the first's); 0, null, null without a tier (preemptions.sql)
--   gaps               its inter-token gaps above the run's p99 ITL
--   longest_gap_ms, longest_gap_cause   the longest of them (null if none)
--   draft_tokens, accepted_tokens   speculative decoding (requests, schema 5): its draft positions
--                      scheduled and those accepted; null where the run records no drafts
--   lookahead_preemptions   its preemptions caused by speculative decoding (lookahead_preemptions.sql:
--                      its requester's verified token fitted the requester's blocks, its drafts and
--                      lookahead slots did not), in order: list of {step, requester_req_id,
--                      requester_sample, draft_tokens (null: not recorded), lookahead_slots}; empty if none
WITH seqs AS (
    SELECT l.run_id, l.req_id, l.sample, l.ttft_ms, l.e2el_ms
    FROM _sequence_latency l
    WHERE ($req_id = '' OR l.req_id = $req_id) AND ($sample < 0 OR l.sample = $sample)
),
waits AS (
    SELECT w.run_id, w.req_id, w.sample, w.state, sum(w.wait_ms) AS wait_ms
    FROM _waits w JOIN seqs USING (run_id, req_id, sample)
    GROUP BY ALL
),
causes AS (
    SELECT c.run_id, c.req_id, c.sample, c.state, c.cause, sum(c.cause_ms) AS cause_ms
    FROM _wait_causes c JOIN seqs USING (run_id, req_id, sample)
    GROUP BY ALL
),
main_cause AS (
    SELECT c.run_id, c.req_id, c.sample, c.state, c.cause,
           c.cause_ms / nullif(w.wait_ms, 0) AS share
    FROM causes c JOIN waits w USING (run_id, req_id, sample, state)
    QUALIFY row_number() OVER (PARTITION BY c.run_id, c.req_id, c.sample, c.state
                               ORDER BY c.cause_ms DESC, c.cause) = 1
),
by_state AS (
    SELECT w.run_id, w.req_id, w.sample,
           sum(w.wait_ms) FILTER (WHERE w.state = 'waiting') AS queued_ms,
           sum(w.wait_ms) FILTER (WHERE w.state = 'preempted') AS resume_wait_ms,
           sum(w.wait_ms) FILTER (WHERE w.state = 'swapped') AS swapped_wait_ms,
           first(m.cause) FILTER (WHERE w.state = 'waiting') AS queued_cause,
           first(m.cause) FILTER (WHERE w.state = 'preempted') AS resume_wait_cause,
           first(m.cause) FILTER (WHERE w.state = 'swapped') AS swapped_wait_cause,
           first(m.share) FILTER (WHERE w.state = 'waiting') AS queued_cause_share,
           first(m.share) FILTER (WHERE w.state = 'preempted') AS resume_wait_cause_share,
           first(m.share) FILTER (WHERE w.state = 'swapped') AS swapped_wait_cause_share
    FROM waits w LEFT JOIN main_cause m USING (run_id, req_id, sample, state)
    GROUP BY ALL
),
preempts AS (
    SELECT p.run_id, p.req_id, p.sample, count(*) AS preemptions,
           list(DISTINCT p.victim_reason ORDER BY p.victim_reason)
               FILTER (WHERE p.victim_reason IS NOT NULL) AS victim_reasons,
           sum(coalesce(p.positions_lost, 0)) AS positions_lost,
           sum(p.cached_tokens) AS cached_tokens,
           sum(p.recomputed_tokens) AS recomputed_tokens,
           sum(coalesce(p.recompute_ms_est, 0)) AS recompute_ms_est,
           sum(p.tier_tokens) AS tier_tokens, sum(p.tier_load_ms) AS tier_load_ms,
           arg_min(p.tier, p.preemption_no) AS tier
    FROM _preemptions p JOIN seqs USING (run_id, req_id, sample)
    GROUP BY ALL
),
requesters AS (
    SELECT run_id, req_id, sample,
           list({'req_id': requester_req_id, 'sample': requester_sample, 'preemptions': n}
                ORDER BY n DESC, requester_req_id, requester_sample) AS requesters
    FROM (SELECT p.run_id, p.req_id, p.sample, p.requester_req_id, p.requester_sample, count(*) AS n
          FROM _preemptions p JOIN seqs USING (run_id, req_id, sample)
          GROUP BY ALL)
    GROUP BY ALL
),
lookahead AS (
    SELECT l.run_id, l.req_id, l.sample,
           list({'step': l.step, 'requester_req_id': l.requester_req_id, 'requester_sample': l.requester_sample,
                 'draft_tokens': l.draft_tokens, 'lookahead_slots': l.lookahead_slots} ORDER BY l.seq)
               AS lookahead_preemptions
    FROM _lookahead_preemptions l JOIN seqs USING (run_id, req_id, sample)
    WHERE l.caused_by_lookahead
    GROUP BY ALL
),
gaps AS (
    SELECT g.run_id, g.req_id, g.sample, count(*) AS gaps,
           max(g.gap_ms) AS longest_gap_ms, arg_max(g.cause, g.gap_ms) AS longest_gap_cause
    FROM _itl_cliffs(0, 0) g JOIN seqs USING (run_id, req_id, sample)
    WHERE g.cause IS NOT NULL
    GROUP BY ALL
)
SELECT s.run_id, s.req_id, s.sample, s.ttft_ms, s.e2el_ms,
       coalesce(b.queued_ms, 0) AS queued_ms, coalesce(b.resume_wait_ms, 0) AS resume_wait_ms,
       coalesce(b.swapped_wait_ms, 0) AS swapped_wait_ms,
       b.queued_cause, b.resume_wait_cause, b.swapped_wait_cause,
       b.queued_cause_share, b.resume_wait_cause_share, b.swapped_wait_cause_share,
       coalesce(p.preemptions, 0) AS preemptions, coalesce(r.requesters, []) AS requesters,
       coalesce(p.victim_reasons, []) AS victim_reasons,
       coalesce(p.positions_lost, 0)::BIGINT AS positions_lost,
       coalesce(p.cached_tokens, 0)::BIGINT AS cached_tokens,
       coalesce(p.recomputed_tokens, 0)::BIGINT AS recomputed_tokens,
       coalesce(p.recompute_ms_est, 0) AS recompute_ms_est,
       coalesce(p.tier_tokens, 0)::BIGINT AS tier_tokens, p.tier_load_ms, p.tier,
       coalesce(g.gaps, 0) AS gaps, g.longest_gap_ms, g.longest_gap_cause,
       q.draft_tokens, q.accepted_tokens, coalesce(la.lookahead_preemptions, []) AS lookahead_preemptions
FROM seqs s
LEFT JOIN requests q USING (run_id, req_id, sample)
LEFT JOIN by_state b USING (run_id, req_id, sample)
LEFT JOIN preempts p USING (run_id, req_id, sample)
LEFT JOIN requesters r USING (run_id, req_id, sample)
LEFT JOIN gaps g USING (run_id, req_id, sample)
LEFT JOIN lookahead la USING (run_id, req_id, sample)
ORDER BY s.run_id, s.req_id, s.sample;
