-- Helper: why each wait lasted: every wait of every sequence, its time split by the reason the
-- engine stopped admitting (steps.admission_stop, schema 3).
--
-- A wait is a state of _sequence_states in which the sequence holds no seat: waiting (from
-- arrival to its first admission), preempted (recompute: until readmitted) or swapped (until
-- swapped in). Each step stands for the time from its start to the next step's start (the last
-- one: to its end); a wait's time within a step is put down to that step's admission_stop:
--   seats        max_num_seqs sequences were running
--   budget       the step's token budget was spent
--   blocks       too few free blocks for the next sequence's whole prompt (or its swap-in)
--   watermark    it would fit, but not above the free-block watermark
--   preemption   a preemption earlier in the step (V1 admits nothing then)
--   nothing-waiting  admission had emptied the queue: the sequence arrived (or was preempted)
--                while the step ran, and waited for the next step to be scheduled
--   other        the vLLM capture: vLLM held it back for a reason of its own
--   unknown      the trace predates schema 3 (no admission_stop)
--   idle         no step ran (a gap between steps longer than the steps say)
--
-- A wait is put down to its own server's steps (a run of several servers: the `server` column).
--
-- _waits: one row per wait.
--   run_id, req_id, sample, state (waiting | preempted | swapped), start_s, end_s, wait_ms, server
-- _wait_causes: one row per wait and cause.
--   run_id, req_id, sample, state, start_s (the wait's), cause, cause_ms, share (of the wait)
CREATE OR REPLACE VIEW _waits AS
SELECT run_id, req_id, sample, state, start_s, end_s, (end_s - start_s) * 1000 AS wait_ms, server
FROM _sequence_states
WHERE state IN ('waiting', 'preempted', 'swapped');

CREATE OR REPLACE VIEW _wait_causes AS
WITH spans AS (
    SELECT run_id, server, start_s,
           coalesce(lead(start_s) OVER (PARTITION BY run_id, server ORDER BY step), end_s) AS end_s,
           coalesce(admission_stop, 'unknown') AS cause
    FROM steps
),
covered AS (
    SELECT w.run_id, w.req_id, w.sample, w.state, w.start_s, s.cause,
           sum(least(s.end_s, w.end_s) - greatest(s.start_s, w.start_s)) * 1000 AS cause_ms
    FROM _waits w
    JOIN spans s ON s.run_id = w.run_id AND s.server = w.server AND s.start_s < w.end_s AND s.end_s > w.start_s
    GROUP BY ALL
),
idle AS (
    SELECT w.run_id, w.req_id, w.sample, w.state, w.start_s, 'idle' AS cause,
           w.wait_ms - coalesce(sum(c.cause_ms), 0) AS cause_ms
    FROM _waits w
    LEFT JOIN covered c USING (run_id, req_id, sample, state, start_s)
    GROUP BY w.run_id, w.req_id, w.sample, w.state, w.start_s, w.wait_ms
    HAVING w.wait_ms - coalesce(sum(c.cause_ms), 0) > 1e-6
)
SELECT c.run_id, c.req_id, c.sample, c.state, c.start_s, c.cause, c.cause_ms,
       c.cause_ms / nullif(w.wait_ms, 0) AS share
FROM (SELECT * FROM covered UNION ALL SELECT * FROM idle) c
JOIN _waits w USING (run_id, req_id, sample, state, start_s);
