-- Helper: every inter-token gap of every sequence (the ITL samples, pooled by the analyses).
--
-- A gap is between consecutive tokens of one sequence (one run_id, req_id, sample): token idx and
-- token idx - 1, whatever happened between them (a preemption, a swap, a re-prefill). Tokens a step
-- delivers together (a speculative step's accepted drafts after its token) are one delivery: only the
-- first of them has a gap, from the sequence's previous step, as vLLM counts inter-token latency (one
-- sample a request a step, its metrics' inter_token_latency; a streamed chunk, its benchmark's ITL),
-- so a run that drafts has no zero gaps, and its ITL percentiles are the waits a client sees. Traces of
-- schema 2 carry each token's predecessor (tokens.prev_step, prev_ts_s), so the gaps are a scan;
-- older runs (runs.token_gaps_recorded false) get the same columns from a window over each
-- sequence's tokens, which must regroup every token of the run.
--
-- _itl: one row per token after a sequence's first.
--   run_id, req_id, sample
--   idx         the later token's position in the output (>= 1)
--   step        the step that produced the later token
--   prev_step   the step that produced the earlier one
--   start_s     when the earlier token became available (s)
--   end_s       when the later token became available (s)
--   gap_ms      end_s - start_s (ms)
--   server      the sequence's server ('' but in a run of several servers: its steps are that server's)
CREATE OR REPLACE VIEW _itl AS
WITH pairs AS (
    SELECT run_id, req_id, sample, idx, step, prev_step, prev_ts_s AS start_s, ts_s AS end_s, server
    FROM tokens
    WHERE prev_ts_s IS NOT NULL
    UNION ALL
    SELECT * FROM (
        SELECT run_id, req_id, sample, idx, step,
               lag(step) OVER seq AS prev_step,
               lag(ts_s) OVER seq AS start_s,
               ts_s AS end_s, server
        FROM tokens
        WHERE run_id IN (SELECT run_id FROM runs WHERE NOT token_gaps_recorded)
        WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY idx))
    WHERE start_s IS NOT NULL
)
SELECT run_id, req_id, sample, idx, step, prev_step, start_s, end_s, (end_s - start_s) * 1000 AS gap_ms, server
FROM pairs
WHERE step IS DISTINCT FROM prev_step;   -- (a step's later tokens: the same delivery)
