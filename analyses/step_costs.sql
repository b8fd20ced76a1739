-- What did each step cost, and what was it made of? The rows `kvtrace calibrate` fits the
-- simulator's cost model to (engine/sim/cost_model.py), and the rows a prediction is checked against.
--
-- Columns, one row per step, in step order:
--   run_id, step
--   prefill_tokens, decode_tokens   tokens the step computed (as in steps)
--   kv_tokens       KV positions held after the step (as in steps): what its attention read, near enough
--   swap_bytes      bytes the step swapped out and in (0 without swaps)
--   swap_ms         the copies' measured time (null without swaps)
--   duration_ms     end_s - start_s: the step as the engine timed it
--   period_ms       from this step's start to the next one's: the step's whole cost to the engine loop,
--                   host work between steps included; null for the last step and for a step after
--                   which the engine had nothing running, waiting or swapped (it went idle)
--   server          the server whose step it is ('' but in a run of several servers: each has its steps)
WITH swaps AS (
    SELECT run_id, server, step, sum(bytes)::BIGINT AS swap_bytes, sum(duration_ms) AS swap_ms
    FROM kv_events
    WHERE kind IN ('swap_out', 'swap_in')
    GROUP BY run_id, server, step
)
SELECT s.run_id, s.step, s.prefill_tokens, s.decode_tokens, s.kv_tokens,
       coalesce(w.swap_bytes, 0) AS swap_bytes, w.swap_ms,
       (s.end_s - s.start_s) * 1000 AS duration_ms,
       CASE WHEN s.running + s.waiting + s.swapped > 0
            THEN (lead(s.start_s) OVER (PARTITION BY s.run_id, s.server ORDER BY s.step) - s.start_s) * 1000
       END AS period_ms,
       s.server
FROM steps s
LEFT JOIN swaps w USING (run_id, server, step)
ORDER BY s.run_id, s.server, s.step;
