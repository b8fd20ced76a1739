-- What did each step move between the device and its KV tiers? Per step: the bytes stored to a tier and
-- loaded from one, and the time those copies took.
--
-- The steps table's own columns (docs/trace-format.md, "KV tiers"): a step's offload and load events'
-- bytes and durations, filed with the step in which each copy finished. A run without a tier (every run
-- before schema 6) has no row.
--
-- Columns, one row per step of a run with a tier:
--   run_id, server, step
--   start_s           when the step started (s)
--   offload_bytes     bytes stored device -> tier
--   load_bytes        bytes loaded tier -> device
--   tier_transfer_ms  the step's tier copies' durations added up (ms; null where the source does not know them)
SELECT run_id, server, step, start_s, offload_bytes, load_bytes, tier_transfer_ms
FROM steps
WHERE offload_bytes IS NOT NULL OR load_bytes IS NOT NULL OR tier_transfer_ms IS NOT NULL
ORDER BY run_id, server, step;
