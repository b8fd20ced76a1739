-- Helper: the latencies of each sequence, named as `vllm bench serve` names them (ms).
--
-- _sequence_latency: one row per sequence in `requests`.
--   run_id, req_id, sample, completed (see _sequences)
--   output_tokens  tokens recorded in `tokens` for the sequence
--   ttft_ms        first token - arrival; null without a token
--   tpot_ms        (last token - first token) / (output tokens - 1); null under 2 tokens
--   e2el_ms        finish - arrival, completed sequences only (null otherwise)
--   queueing_ms    first scheduled - arrival; null if never scheduled
CREATE OR REPLACE VIEW _sequence_latency AS
WITH emitted AS (
    SELECT run_id, req_id, sample, count(*) AS num_tokens,
           min(ts_s) AS first_token_s, max(ts_s) AS last_token_s
    FROM tokens
    GROUP BY run_id, req_id, sample
)
SELECT s.run_id, s.req_id, s.sample, s.completed,
       coalesce(e.num_tokens, 0) AS output_tokens,
       (s.first_token_s - s.arrival_s) * 1000 AS ttft_ms,
       CASE WHEN e.num_tokens >= 2
            THEN (e.last_token_s - e.first_token_s) * 1000 / (e.num_tokens - 1) END AS tpot_ms,
       CASE WHEN s.completed THEN (s.finish_s - s.arrival_s) * 1000 END AS e2el_ms,
       (s.first_scheduled_s - s.arrival_s) * 1000 AS queueing_ms
FROM _sequences s LEFT JOIN emitted e USING (run_id, req_id, sample);
