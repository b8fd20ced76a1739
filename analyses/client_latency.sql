-- How did the client see the latency the engine recorded? One row per run with client timings.
--
-- For runs recorded against a server (`kvtrace record --endpoint`, docs/vllm.md), the client stamped
-- every streamed token as it arrived (`client_tokens`), beside the engine's own stamp (`tokens`, when
-- vLLM's engine handed the token over). TTFT is measured from the request's arrival on the replay
-- clock; an ITL gap is between consecutive tokens of one sequence. The difference is the serving
-- path: HTTP, the API server's detokenising and streaming, and the network. Runs without client
-- timings give no row. Exact quantiles (these runs are small: one client's replay).
--
-- Columns: run_id, sequences, tokens, engine_ttft_p50_ms, client_ttft_p50_ms, engine_ttft_p99_ms,
--   client_ttft_p99_ms, engine_itl_p50_ms, client_itl_p50_ms, engine_itl_p99_ms, client_itl_p99_ms,
--   delivery_p50_ms, delivery_p99_ms (client stamp - engine stamp, per token)
WITH firsts AS (
    SELECT r.run_id, r.req_id, r.sample, r.arrival_s,
           (SELECT min(t.ts_s) FROM tokens t WHERE t.run_id = r.run_id AND t.req_id = r.req_id
                AND t.sample = r.sample) AS engine_first,
           (SELECT min(c.ts_s) FROM client_tokens c WHERE c.run_id = r.run_id AND c.req_id = r.req_id
                AND c.sample = r.sample) AS client_first
    FROM requests r
    WHERE r.run_id IN (SELECT DISTINCT run_id FROM client_tokens)
),
gaps AS (   -- the engine's gaps are _itl's (the one definition of ITL); the client's the same pairs
    SELECT run_id, 'engine' AS side, gap_ms / 1e3 AS gap
    FROM _itl WHERE run_id IN (SELECT DISTINCT run_id FROM client_tokens)
    UNION ALL
    SELECT run_id, 'client', ts_s - lag(ts_s) OVER (PARTITION BY run_id, req_id, sample ORDER BY idx)
    FROM client_tokens
),
delivery AS (
    SELECT c.run_id, c.ts_s - t.ts_s AS late
    FROM client_tokens c JOIN tokens t USING (run_id, req_id, sample, idx)
)
SELECT f.run_id,
       count(*) AS sequences,
       (SELECT count(*) FROM client_tokens c WHERE c.run_id = f.run_id) AS tokens,
       1e3 * quantile_cont(engine_first - arrival_s, 0.5) AS engine_ttft_p50_ms,
       1e3 * quantile_cont(client_first - arrival_s, 0.5) AS client_ttft_p50_ms,
       1e3 * quantile_cont(engine_first - arrival_s, 0.99) AS engine_ttft_p99_ms,
       1e3 * quantile_cont(client_first - arrival_s, 0.99) AS client_ttft_p99_ms,
       (SELECT 1e3 * quantile_cont(gap, 0.5) FROM gaps g WHERE g.run_id = f.run_id AND side = 'engine') AS engine_itl_p50_ms,
       (SELECT 1e3 * quantile_cont(gap, 0.5) FROM gaps g WHERE g.run_id = f.run_id AND side = 'client') AS client_itl_p50_ms,
       (SELECT 1e3 * quantile_cont(gap, 0.99) FROM gaps g WHERE g.run_id = f.run_id AND side = 'engine') AS engine_itl_p99_ms,
       (SELECT 1e3 * quantile_cont(gap, 0.99) FROM gaps g WHERE g.run_id = f.run_id AND side = 'client') AS client_itl_p99_ms,
       (SELECT 1e3 * quantile_cont(late, 0.5) FROM delivery d WHERE d.run_id = f.run_id) AS delivery_p50_ms,
       (SELECT 1e3 * quantile_cont(late, 0.99) FROM delivery d WHERE d.run_id = f.run_id) AS delivery_p99_ms
FROM firsts f
GROUP BY f.run_id
ORDER BY f.run_id
