-- Helper: what each sequence was doing, as consecutive intervals (the data of a Gantt view).
--
-- A state starts at a mark and lasts until the next one:
--   arrival                                -> waiting
--   admit, reason new                      -> prefill
--   first token                            -> decode
--   preempt, reason recompute or
--     swap-full-fallback                   -> preempted (blocks dropped, waiting for readmission)
--   preempt, reason swap                   -> swapped (KV on the host, waiting for swap-in)
--   admit, reason resume-recompute         -> reprefill (computing its history again)
--   reprefill done; admit resume-swap      -> decode (prefill if it had no token yet)
--   finish                                 -> (the end)
-- An admit or preempt is marked at the time the scheduler decided it. A vLLM capture stamps a step's
-- events at the step's end (the time of the tokens it gave), so an event stamped at or after its
-- step's end is marked at the step's start, when vLLM scheduled it: a request admitted in a step is
-- in prefill for that step, a victim stalls from it. An admit at or after the first token starts
-- decode, like the end of a reprefill.
-- A reprefill is done at the end of the step it completed in. Marks at the same time are ordered
-- arrival, first token, then events by seq; intervals of zero length are dropped. A reprefill
-- cut short (reason interrupted) is not a mark: the preempt that cut it is.
--
-- _sequence_spans: run_id, req_id, sample, state, start_s, end_s (s), start_seq, server; one row per
--                  mark, so two neighbours can be in the same state (sums over a state need no merging).
--                  start_seq is kv_events.seq of the event whose mark began the interval (the
--                  preempt, the admit, the reprefill), null when it began at arrival or first token.
--                  server: the sequence's (its step's; '' but in a run of several servers).
-- _stall_spans:    the rows of _sequence_spans in state preempted, swapped or reprefill (what the
--                  cliffs and the most preempted read), computed without the window over every
--                  mark: a stall starts at an event (a preempt, an admit resume-recompute) and
--                  ends at the next mark, whose time is the least of the next event's (a window
--                  over the events only) and of the sequence's arrival, first token and finish
--                  where they sort after it (later, or the finish at the same time).
-- _sequence_states: the same with neighbours in the same state merged (for display); start_seq is
--                  the first merged interval's
CREATE OR REPLACE VIEW _sequence_spans AS
WITH marks AS (
    SELECT run_id, req_id, sample, arrival_s AS ts_s, 0 AS tie, -1::BIGINT AS seq, 'waiting' AS state, server
    FROM requests
    UNION ALL
    SELECT run_id, req_id, sample, first_token_s, 1, -1, 'decode', server
    FROM requests WHERE first_token_s IS NOT NULL
    UNION ALL
    SELECT run_id, req_id, sample, finish_s, 3, -1, 'finished', server
    FROM requests WHERE finish_s IS NOT NULL
    UNION ALL
    -- the events, read in one pass: a re-prefill is done when the step it completed in ends (its
    -- row carries the step's scheduling time)
    SELECT run_id, req_id, sample, ts_s, 2, seq,
           CASE
               WHEN kind = 'admit' AND reason = 'resume-recompute' THEN 'reprefill'
               WHEN kind IN ('admit', 'reprefill') AND (first_token_s IS NULL OR ts_s < first_token_s) THEN 'prefill'
               WHEN kind IN ('admit', 'reprefill') THEN 'decode'
               WHEN reason = 'swap' THEN 'swapped'
               ELSE 'preempted'
           END,
           server
    FROM (SELECT e.run_id, e.req_id, e.sample, e.seq, e.kind, e.reason, e.server, r.first_token_s,
                 CASE WHEN e.kind = 'reprefill' THEN coalesce(st.end_s, e.ts_s)
                      WHEN e.ts_s >= st.end_s THEN st.start_s   -- stamped at its step's end: decided at its start
                      ELSE e.ts_s END AS ts_s
          FROM kv_events e
          LEFT JOIN requests r USING (run_id, req_id, sample)
          LEFT JOIN steps st ON st.run_id = e.run_id AND st.server = e.server AND st.step = e.step
          WHERE e.kind IN ('admit', 'preempt')
             OR (e.kind = 'reprefill' AND e.reason IS DISTINCT FROM 'interrupted'))
),
spans AS (
    SELECT run_id, req_id, sample, state, ts_s AS start_s,
           lead(ts_s) OVER seq AS end_s,
           CASE WHEN seq >= 0 THEN seq END AS start_seq, server
    FROM marks
    WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY ts_s, tie, seq)
)
SELECT run_id, req_id, sample, state, start_s, end_s, start_seq, server
FROM spans
WHERE state <> 'finished' AND end_s > start_s;

CREATE OR REPLACE VIEW _stall_spans AS
WITH events AS (
    SELECT e.run_id, e.req_id, e.sample, e.seq, e.server,
           CASE WHEN e.kind = 'reprefill' THEN coalesce(st.end_s, e.ts_s)
                WHEN e.ts_s >= st.end_s THEN st.start_s
                ELSE e.ts_s END AS ts_s,
           CASE WHEN e.kind = 'admit' AND e.reason = 'resume-recompute' THEN 'reprefill'
                WHEN e.kind = 'preempt' AND e.reason = 'swap' THEN 'swapped'
                WHEN e.kind = 'preempt' THEN 'preempted' END AS state
    FROM kv_events e
    LEFT JOIN steps st USING (run_id, server, step)
    WHERE e.kind IN ('admit', 'preempt')
       OR (e.kind = 'reprefill' AND e.reason IS DISTINCT FROM 'interrupted')
),
starts AS (
    -- marks at the same time are ordered by seq among the events, as in _sequence_spans
    SELECT run_id, req_id, sample, seq, ts_s, state, server,
           lead(ts_s) OVER (PARTITION BY run_id, req_id, sample ORDER BY ts_s, seq) AS next_event_s
    FROM events
    QUALIFY state IS NOT NULL
),
spans AS (
    SELECT s.run_id, s.req_id, s.sample, s.state, s.ts_s AS start_s,
           -- the next mark's time: arrival and first token sort before an event of their time,
           -- the finish after it (least ignores nulls)
           least(s.next_event_s,
                 CASE WHEN r.arrival_s > s.ts_s THEN r.arrival_s END,
                 CASE WHEN r.first_token_s > s.ts_s THEN r.first_token_s END,
                 CASE WHEN r.finish_s >= s.ts_s THEN r.finish_s END) AS end_s,
           s.seq AS start_seq, s.server
    FROM starts s
    LEFT JOIN requests r USING (run_id, req_id, sample)
)
SELECT run_id, req_id, sample, state, start_s, end_s, start_seq, server
FROM spans
WHERE end_s > start_s;

CREATE OR REPLACE VIEW _sequence_states AS
WITH flagged AS (
    SELECT *,
           CASE WHEN state IS DISTINCT FROM lag(state) OVER seq THEN 1 ELSE 0 END AS starts_island
    FROM _sequence_spans
    WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY start_s)
),
islands AS (
    SELECT *, sum(starts_island) OVER (PARTITION BY run_id, req_id, sample ORDER BY start_s) AS island
    FROM flagged
)
SELECT run_id, req_id, sample, state, min(start_s) AS start_s, max(end_s) AS end_s,
       first(start_seq ORDER BY start_s) AS start_seq, server
FROM islands
GROUP BY run_id, server, req_id, sample, island, state;
