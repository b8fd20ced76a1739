-- How much of what the requests needed did each KV tier hold? Per run and tier: the prefixes looked up
-- at admission, the positions found on the device, in the tier and nowhere, and the tier's hit rate.
--
-- With a KV tier (host memory or storage behind the device pool: vLLM's KV offloading, kvtrace's engine
-- or simulator with a tier), a sequence admitted is looked up first on the device's prefix cache, then
-- in the tier; what neither holds is computed (`lookup` events, docs/trace-format.md, "KV tiers"). The
-- tier's hit rate is the share it held of what it was asked for: tier_hit_tokens / (tier_hit_tokens +
-- computed_tokens). A run without a tier (every run before schema 6) has no row.
--
-- Columns, one row per run and tier that an event names:
--   run_id
--   tier               the tier's name (meta.json's kv_tiers)
--   lookups            prefixes looked up in it (lookup events)
--   resumed_lookups    of them, those of sequences resumed after a recompute preemption
--   lookup_tokens      positions looked up (tokens)
--   device_hit_tokens  of them, found on the device's prefix cache (and in the tiers consulted before)
--   tier_hit_tokens    found in this tier beyond those (tokens)
--   computed_tokens    found nowhere, so computed: lookup_tokens - device_hit_tokens - tier_hit_tokens
--   tier_hit_rate      tier_hit_tokens / (tier_hit_tokens + computed_tokens); null where the device held all
--   evicted_blocks     tier blocks it dropped to make room (tier_evict events)
WITH per_tier AS (
    SELECT run_id, tier,
           count(*) FILTER (WHERE kind = 'lookup') AS lookups,
           count(*) FILTER (WHERE kind = 'lookup' AND reason = 'resume-recompute') AS resumed_lookups,
           coalesce(sum(num_tokens) FILTER (WHERE kind = 'lookup'), 0) AS lookup_tokens,
           coalesce(sum(num_cached_tokens) FILTER (WHERE kind = 'lookup'), 0) AS device_hit_tokens,
           coalesce(sum(tier_tokens) FILTER (WHERE kind = 'lookup'), 0) AS tier_hit_tokens,
           coalesce(sum(num_blocks) FILTER (WHERE kind = 'tier_evict'), 0) AS evicted_blocks
    FROM kv_events
    WHERE kind IN ('lookup', 'offload', 'load', 'tier_evict')
    GROUP BY run_id, tier
)
SELECT run_id, tier, lookups, resumed_lookups,
       lookup_tokens::BIGINT AS lookup_tokens,
       device_hit_tokens::BIGINT AS device_hit_tokens,
       tier_hit_tokens::BIGINT AS tier_hit_tokens,
       (lookup_tokens - device_hit_tokens - tier_hit_tokens)::BIGINT AS computed_tokens,
       tier_hit_tokens / nullif(lookup_tokens - device_hit_tokens, 0) AS tier_hit_rate,
       evicted_blocks::BIGINT AS evicted_blocks
FROM per_tier
ORDER BY run_id, tier;
