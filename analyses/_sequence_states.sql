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
-- A reprefill is done at the end of the step it completed in. Marks at the same time are ordered
-- arrival, first token, then events by seq; intervals of zero length are dropped. A reprefill
-- cut short (reason interrupted) is not a mark: the preempt that cut it is.
--
-- _sequence_spans: run_id, req_id, sample, state, start_s, end_s (s), start_seq; one row per mark,
--                  so two neighbours can be in the same state (sums over a state need no merging).
--                  start_seq is kv_events.seq of the event whose mark began the interval (the
--                  preempt, the admit, the reprefill), null when it began at arrival or first token.
-- _sequence_states: the same with neighbours in the same state merged (for display); start_seq is
--                  the first merged interval's
CREATE OR REPLACE VIEW _sequence_spans AS
WITH marks AS (
    SELECT run_id, req_id, sample, arrival_s AS ts_s, 0 AS tie, -1::BIGINT AS seq, 'waiting' AS state
    FROM requests
    UNION ALL
    SELECT run_id, req_id, sample, first_token_s, 1, -1, 'decode'
    FROM requests WHERE first_token_s IS NOT NULL
    UNION ALL
    SELECT run_id, req_id, sample, finish_s, 3, -1, 'finished'
    FROM requests WHERE finish_s IS NOT NULL
    UNION ALL
    -- the events, read in one pass: a re-prefill is done when the step it completed in ends (its
    -- row carries the step's scheduling time)
    SELECT run_id, req_id, sample, ts_s, 2, seq,
           CASE
               WHEN kind = 'admit' AND reason = 'new' THEN 'prefill'
               WHEN kind = 'admit' AND reason = 'resume-recompute' THEN 'reprefill'
               WHEN kind IN ('admit', 'reprefill') AND (first_token_s IS NULL OR ts_s < first_token_s) THEN 'prefill'
               WHEN kind IN ('admit', 'reprefill') THEN 'decode'
               WHEN reason = 'swap' THEN 'swapped'
               ELSE 'preempted'
           END
    FROM (SELECT e.run_id, e.req_id, e.sample, e.seq, e.kind, e.reason, r.first_token_s,
                 CASE WHEN e.kind = 'reprefill' THEN coalesce(st.end_s, e.ts_s) ELSE e.ts_s END AS ts_s
          FROM kv_events e
          LEFT JOIN requests r USING (run_id, req_id, sample)
          LEFT JOIN steps st USING (run_id, step)
          WHERE e.kind IN ('admit', 'preempt')
             OR (e.kind = 'reprefill' AND e.reason IS DISTINCT FROM 'interrupted'))
),
spans AS (
    SELECT run_id, req_id, sample, state, ts_s AS start_s,
           lead(ts_s) OVER seq AS end_s,
           CASE WHEN seq >= 0 THEN seq END AS start_seq
    FROM marks
    WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY ts_s, tie, seq)
)
SELECT run_id, req_id, sample, state, start_s, end_s, start_seq
FROM spans
WHERE state <> 'finished' AND end_s > start_s;

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
       first(start_seq ORDER BY start_s) AS start_seq
FROM islands
GROUP BY run_id, req_id, sample, island, state;
