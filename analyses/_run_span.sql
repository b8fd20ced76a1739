-- Helper: the span of each run, the denominator of every rate in the library.
--
-- _run_span: one row per run in `runs`.
--   run_id      the run
--   start_s     the first request's arrival or the first step's start, whichever is earlier (s)
--   end_s       the end of the last step or the last finish, whichever is later (s)
--   duration_s  end_s - start_s (s); null for a run with neither steps nor requests yet, or of zero
--               length (a single rejected request): rates over it are null, never NaN or infinite
-- _server_spans: the same per run and server (a run joined from several servers' captures: each
--   server's own steps and requests, the denominator of a server's rates; any other run has one row,
--   server '', its _run_span).
--   run_id, server, start_s, end_s, duration_s
-- _servers: one row per run and server whose steps it holds (a run of several servers' captures has
--   one per server, each with a pool of its own; any other run one, server '', as has a run without steps).
--   run_id, server
CREATE OR REPLACE VIEW _server_spans AS
WITH bounds AS (
    SELECT run_id, server, min(start_s) AS start_s, max(end_s) AS end_s FROM steps GROUP BY run_id, server
    UNION ALL
    SELECT run_id, server, min(arrival_s), max(finish_s) FROM requests GROUP BY run_id, server
)
SELECT runs.run_id,
       coalesce(bounds.server, '') AS server,
       min(bounds.start_s) AS start_s,
       max(bounds.end_s) AS end_s,
       nullif(max(bounds.end_s) - min(bounds.start_s), 0) AS duration_s
FROM runs LEFT JOIN bounds USING (run_id)
GROUP BY runs.run_id, bounds.server;

CREATE OR REPLACE VIEW _run_span AS
SELECT run_id,
       min(start_s) AS start_s,
       max(end_s) AS end_s,
       nullif(max(end_s) - min(start_s), 0) AS duration_s
FROM _server_spans
GROUP BY run_id;

CREATE OR REPLACE VIEW _servers AS
SELECT runs.run_id, coalesce(s.server, '') AS server
FROM runs LEFT JOIN (SELECT DISTINCT run_id, server FROM steps) s USING (run_id);
