-- Helper: every inter-token gap of every sequence (the ITL samples, pooled by the analyses).
--
-- _itl: one row per token after a sequence's first.
--   run_id, req_id, sample
--   idx         the later token's position in the output (>= 1)
--   step        the step that produced the later token
--   prev_step   the step that produced the earlier one
--   start_s     when the earlier token became available (s)
--   end_s       when the later token became available (s)
--   gap_ms      end_s - start_s (ms)
CREATE OR REPLACE VIEW _itl AS
SELECT run_id, req_id, sample, idx, step, prev_step, start_s, end_s, (end_s - start_s) * 1000 AS gap_ms
FROM (
    SELECT run_id, req_id, sample, idx, step, ts_s AS end_s,
           lag(step) OVER seq AS prev_step,
           lag(ts_s) OVER seq AS start_s
    FROM tokens
    WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY idx)
)
WHERE start_s IS NOT NULL;
