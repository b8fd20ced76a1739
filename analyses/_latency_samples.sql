-- Helper: every latency value of every run, the samples the latency distributions are made of (ms).
--
-- _latency_samples: one row per sequence and metric (ttft, tpot, e2el, queueing; see
-- _sequence_latency) and one per inter-token gap (itl; see _itl).
--   run_id
--   metric   ttft | tpot | itl | e2el | queueing
--   ms       the value (ms); sequences without a value of a metric have no row for it
CREATE OR REPLACE VIEW _latency_samples AS
WITH per_sequence AS (
    UNPIVOT (SELECT run_id, ttft_ms AS ttft, tpot_ms AS tpot, e2el_ms AS e2el, queueing_ms AS queueing
             FROM _sequence_latency)
    ON ttft, tpot, e2el, queueing INTO NAME metric VALUE ms
)
SELECT run_id, metric, ms FROM per_sequence WHERE ms IS NOT NULL
UNION ALL
SELECT run_id, 'itl', gap_ms FROM _itl;
