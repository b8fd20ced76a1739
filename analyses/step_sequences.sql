-- What ran in one step? The sequences the step computed, the ones it admitted, preempted or
-- finished, and what each one's KV did in it: the data of a step view (kvtrace explore).
-- param: step = 0  the step (steps.step)
-- param: server = ''  in a run of several servers, the server whose step it is (its label); '' = each
--                   server's step of that number
--
-- A sequence is listed when it was running during the step (in prefill, re-prefill or decode at
-- the step's start, after scheduling: see _sequence_states.sql), got a token from it, or has an
-- event in it (its admission, preemption, blocks, finish).
--
-- Columns, one row per sequence and run holding the step, in order of first event then req_id:
--   run_id, req_id, sample
--   server           the server of the step ('' but in a run of several servers)
--   state            its state once the step was scheduled (waiting, prefill, decode, preempted,
--                    swapped, reprefill; null if it had finished)
--   tokens           tokens the step gave it
--   blocks_allocated device blocks it was given (alloc events)
--   blocks_freed     device blocks it gave back (free events)
--   events           its events in the step, in order: kind, with the reason after a colon
--   preempted_for    a preemption in the step: the sequence whose allocation it served (req_id,
--                    /sample after the first; null in traces before schema 3)
--   victim_reason    and why the policy chose this sequence (newest, lowest-priority, ...)
--   first_seq        kv_events.seq of its first event in the step (null without one)
WITH step AS (
    SELECT run_id, server, step, start_s, end_s FROM steps WHERE step = $step AND ($server = '' OR server = $server)
),
events AS (
    SELECT e.run_id, e.server, e.req_id, e.sample,
           string_agg(e.kind || coalesce(':' || e.reason, ''), ' ' ORDER BY e.seq) AS events,
           min(e.seq) AS first_seq,
           first(e.requester_req_id || CASE WHEN e.requester_sample > 0 THEN '/' || e.requester_sample ELSE '' END
                 ORDER BY e.seq) FILTER (WHERE e.kind = 'preempt') AS preempted_for,
           first(e.victim_reason ORDER BY e.seq) FILTER (WHERE e.kind = 'preempt') AS victim_reason,
           coalesce(sum(e.num_blocks) FILTER (WHERE e.kind = 'alloc'), 0)::BIGINT AS blocks_allocated,
           coalesce(sum(e.num_blocks) FILTER (WHERE e.kind = 'free'), 0)::BIGINT AS blocks_freed
    FROM kv_events e JOIN step USING (run_id, server, step)
    WHERE e.req_id <> ''
    GROUP BY ALL
),
emitted AS (
    SELECT t.run_id, t.server, t.req_id, t.sample, count(*) AS tokens
    FROM tokens t JOIN step USING (run_id, server, step)
    GROUP BY ALL
),
states AS (
    SELECT s.run_id, s.server, s.req_id, s.sample, first(s.state ORDER BY s.start_s DESC) AS state
    FROM _sequence_states s JOIN step USING (run_id, server)
    WHERE s.start_s <= step.start_s AND s.end_s > step.start_s
    GROUP BY ALL
),
listed AS (
    SELECT run_id, server, req_id, sample FROM events
    UNION SELECT run_id, server, req_id, sample FROM emitted
    UNION SELECT run_id, server, req_id, sample FROM states WHERE state IN ('prefill', 'reprefill', 'decode')
)
SELECT l.run_id, l.req_id, l.sample, l.server, st.state,
       coalesce(t.tokens, 0) AS tokens,
       coalesce(e.blocks_allocated, 0) AS blocks_allocated,
       coalesce(e.blocks_freed, 0) AS blocks_freed,
       e.events, e.preempted_for, e.victim_reason, e.first_seq
FROM listed l
LEFT JOIN states st USING (run_id, server, req_id, sample)
LEFT JOIN emitted t USING (run_id, server, req_id, sample)
LEFT JOIN events e USING (run_id, server, req_id, sample)
ORDER BY l.run_id, l.server, e.first_seq NULLS LAST, l.req_id, l.sample;
