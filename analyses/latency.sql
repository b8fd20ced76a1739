-- How long did requests wait for their tokens? TTFT, TPOT, ITL, E2E latency and queueing time
-- per run, as `vllm bench serve` reports them.
--
-- Metrics (per sequence, i.e. one sample of a request):
--   ttft      time to first token: first token - arrival
--   tpot      time per output token: (last token - first token) / (output tokens - 1), for
--             sequences with at least 2 tokens
--   itl       inter-token latency: every gap between consecutive tokens of a sequence, pooled
--   e2el      end-to-end latency: finish - arrival, completed sequences (stop / length) only
--   queueing  arrival -> first scheduled
-- ttft, tpot and itl count every sequence that delivered tokens (aborted ones too).
--
-- Columns: run_id, metric, num_values (sequences, or gaps for itl), mean_ms, p50_ms, p90_ms,
-- p95_ms, p99_ms, p999_ms (p99.9), max_ms. All in milliseconds; percentiles interpolate
-- linearly. One row per run and metric; a metric with no value is left out.
-- How close: the percentiles are read from histograms so that memory does not grow with the
-- trace, each within 0.1% of the exact value (see _latency_hist); num_values, mean_ms and max_ms
-- are exact.
SELECT run_id, metric, num_values, mean_ms, p50_ms, p90_ms, p95_ms, p99_ms, p999_ms, max_ms
FROM _latency_stats
ORDER BY run_id, metric_order;
