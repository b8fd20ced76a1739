-- Helper: the span of each run, the denominator of every rate in the library.
--
-- _run_span: one row per run in `runs`.
--   run_id      the run
--   start_s     the first request's arrival or the first step's start, whichever is earlier (s)
--   end_s       the end of the last step or the last finish, whichever is later (s)
--   duration_s  end_s - start_s (s); null for a run with neither steps nor requests yet, or of zero
--               length (a single rejected request): rates over it are null, never NaN or infinite
CREATE OR REPLACE VIEW _run_span AS
WITH bounds AS (
    SELECT run_id, min(start_s) AS start_s, max(end_s) AS end_s FROM steps GROUP BY run_id
    UNION ALL
    SELECT run_id, min(arrival_s), max(finish_s) FROM requests GROUP BY run_id
)
SELECT runs.run_id,
       min(bounds.start_s) AS start_s,
       max(bounds.end_s) AS end_s,
       nullif(max(bounds.end_s) - min(bounds.start_s), 0) AS duration_s
FROM runs LEFT JOIN bounds USING (run_id)
GROUP BY runs.run_id;
