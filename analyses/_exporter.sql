-- Helper: what the Prometheus exporter (`kvtrace capture metrics`, kvtrace/vllm/metrics.py) reads
-- from the trace of a running server. Its counters add up rows it has not seen before, so each row
-- here has an identity within its run; the exporter keeps the last minutes of the trace in memory
-- (and, of the sequences still in flight, everything), so the same row is seen at every poll until
-- it leaves the window.
--
-- _exporter_counts: one row per trace row that adds to a counter.
--   run_id
--   metric   preemptions | recomputed_tokens | reprefill_cached_tokens | steps | requests_finished | itl
--   label    preemptions: the preempt's reason (recompute | swap | swap-full-fallback);
--            requests_finished: finish_reason; itl: the gap's cause (_itl_causes); else ''
--   key      the row's identity in its run: e<kv_events.seq>, s<step>, r<req_id>/<sample>,
--            t<req_id>/<sample>/<idx>
--   value    what it adds: 1 per preemption, step or request; tokens (recomputed_tokens and
--            reprefill_cached_tokens: a reprefill's num_recomputed_tokens / num_cached_tokens, as in
--            _recompute); the gap in seconds (itl)
CREATE OR REPLACE VIEW _exporter_counts AS
SELECT run_id, 'preemptions' AS metric, coalesce(reason, '') AS label, 'e' || seq AS key, 1.0::DOUBLE AS value
FROM kv_events WHERE kind = 'preempt'
UNION ALL
SELECT run_id, 'recomputed_tokens', '', 'e' || seq, coalesce(num_recomputed_tokens, 0)
FROM kv_events WHERE kind = 'reprefill'
UNION ALL
SELECT run_id, 'reprefill_cached_tokens', '', 'e' || seq, coalesce(num_cached_tokens, 0)
FROM kv_events WHERE kind = 'reprefill'
UNION ALL
SELECT run_id, 'steps', '', 's' || step, 1 FROM steps
UNION ALL
SELECT run_id, 'requests_finished', coalesce(finish_reason, ''), 'r' || req_id || '/' || sample, 1 FROM requests
UNION ALL
SELECT run_id, 'itl', cause, 't' || req_id || '/' || sample || '/' || idx, gap_ms / 1000 FROM _itl_causes;

-- _exporter_pool: the KV pool after each run's last step (the exporter's gauges).
--   run_id, step, end_s (s)
--   used_blocks, cached_blocks, free_blocks, total_blocks   as in steps (free includes cached)
CREATE OR REPLACE VIEW _exporter_pool AS
SELECT run_id, step, end_s, used_blocks, cached_blocks, free_blocks, total_blocks
FROM steps
QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY end_s DESC, step DESC) = 1;
