-- Helper: what each run got done per second (see throughput.sql for the columns).
CREATE OR REPLACE VIEW _throughput AS
WITH per_request AS (
    SELECT run_id, req_id, bool_and(completed) AS completed, max(prompt_tokens) AS prompt_tokens
    FROM _sequences
    GROUP BY run_id, req_id
),
requests_done AS (
    SELECT run_id, count(*) FILTER (WHERE completed) AS completed_requests,
           sum(prompt_tokens)::BIGINT AS prompt_tokens
    FROM per_request
    GROUP BY run_id
),
per_second AS (
    SELECT run_id, floor(ts_s) AS second, count(*) AS output_tokens
    FROM tokens
    GROUP BY run_id, second
),
output AS (
    SELECT run_id, sum(output_tokens)::BIGINT AS output_tokens, max(output_tokens) AS peak_output_tok_s
    FROM per_second
    GROUP BY run_id
),
steps_run AS (
    SELECT run_id, count(*) AS steps FROM steps GROUP BY run_id
)
SELECT span.run_id, span.duration_s,
       coalesce(r.completed_requests, 0) AS completed_requests,
       coalesce(r.prompt_tokens, 0) AS prompt_tokens,
       coalesce(o.output_tokens, 0) AS output_tokens,
       coalesce(o.output_tokens, 0) / span.duration_s AS output_tok_s,
       coalesce(o.peak_output_tok_s, 0) AS peak_output_tok_s,
       coalesce(w.steps, 0) AS steps,
       -- processed tokens are defined once, in _recompute
       rc.prefill_tokens,
       rc.processed_tokens - rc.prefill_tokens AS decode_tokens,
       rc.processed_tokens,
       rc.processed_tokens / span.duration_s AS processed_tok_s,
       coalesce(r.completed_requests, 0) / span.duration_s AS request_throughput
FROM _run_span span
LEFT JOIN requests_done r USING (run_id)
LEFT JOIN output o USING (run_id)
LEFT JOIN steps_run w USING (run_id)
JOIN _recompute rc USING (run_id);
