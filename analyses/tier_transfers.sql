-- How much KV moved between the device and each tier, and how fast? Per run, tier and direction:
-- offload (device -> tier) and load (tier -> device) copies, their bytes, failures and durations.
--
-- A copy is one offload or load event (docs/trace-format.md, "KV tiers"). A failed copy counts in
-- the copies, blocks and bytes (what the link carried or tried to) and in `failed`: a failed store
-- leaves the tier without the blocks, a failed load's positions are computed instead. Durations are
-- those the source knows (null for the others, which count everywhere but in the durations). A run
-- without a tier (every run before schema 6) has no row.
--
-- Columns, one row per run, tier and direction that copied:
--   run_id
--   tier          the tier's name (meta.json's kv_tiers)
--   direction     offload (device -> tier) or load (tier -> device)
--   copies        offload or load events
--   failed        of them, those that failed (reason failed)
--   blocks        device blocks copied
--   tokens        positions copied (tokens)
--   bytes         bytes copied
--   timed_copies  copies whose duration is known
--   total_ms      their durations added up (ms)
--   p50_ms        the median copy's duration (ms)
--   p99_ms        the 99th percentile of a copy's duration (ms)
SELECT run_id, tier, kind AS direction,
       count(*) AS copies,
       count(*) FILTER (WHERE reason = 'failed') AS failed,
       coalesce(sum(num_blocks), 0)::BIGINT AS blocks,
       coalesce(sum(num_tokens), 0)::BIGINT AS tokens,
       coalesce(sum(bytes), 0)::BIGINT AS bytes,
       count(duration_ms) AS timed_copies,
       sum(duration_ms) AS total_ms,
       quantile_cont(duration_ms, 0.5) AS p50_ms,
       quantile_cont(duration_ms, 0.99) AS p99_ms
FROM kv_events
WHERE kind IN ('offload', 'load')
GROUP BY run_id, tier, kind
ORDER BY run_id, tier, list_position(['offload', 'load'], direction);
