-- How fast were blocks handed out and taken back, and how full were the blocks held? Per run,
-- over consecutive intervals of `interval_s` seconds of the run clock.
-- param: interval_s = 1  interval length (s)
--
-- Events count in the interval of their ts_s, steps in the interval of their end_s. Rates divide by
-- the full interval length (the last interval of a run may be shorter).
--
-- Columns, one row per run and interval with events or steps:
--   run_id, start_s, end_s (s)
--   alloc_blocks, free_blocks, evicted_blocks   blocks allocated, freed (count fell to 0), and
--                                               cached blocks reclaimed (evict)
--   alloc_blocks_per_s, free_blocks_per_s       the same per second
--   steps                 steps ending in the interval
--   avg_used_blocks       mean used_blocks over those steps
--   avg_tokens_per_block  KV positions per used block: sum(kv_tokens) / sum(used_blocks)
--   block_fill            avg_tokens_per_block / block_size (1 = no space lost inside blocks)
-- The last two need the steps column kv_tokens and are null in traces without it.
WITH events AS (
    SELECT run_id, floor(ts_s / $interval_s)::BIGINT AS interval_index,
           coalesce(sum(num_blocks) FILTER (WHERE kind = 'alloc'), 0)::BIGINT AS alloc_blocks,
           coalesce(sum(num_blocks) FILTER (WHERE kind = 'free'), 0)::BIGINT AS free_blocks,
           coalesce(sum(num_blocks) FILTER (WHERE kind = 'evict'), 0)::BIGINT AS evicted_blocks
    FROM kv_events
    WHERE kind IN ('alloc', 'free', 'evict')
    GROUP BY run_id, interval_index
),
occupancy AS (
    SELECT run_id, floor(end_s / $interval_s)::BIGINT AS interval_index,
           count(*) AS steps,
           avg(used_blocks) AS avg_used_blocks,
           sum(kv_tokens) / nullif(sum(used_blocks), 0) AS avg_tokens_per_block
    FROM steps
    GROUP BY run_id, interval_index
)
SELECT run_id,
       (interval_index * $interval_s)::DOUBLE AS start_s,
       ((interval_index + 1) * $interval_s)::DOUBLE AS end_s,
       coalesce(e.alloc_blocks, 0) AS alloc_blocks,
       coalesce(e.free_blocks, 0) AS free_blocks,
       coalesce(e.evicted_blocks, 0) AS evicted_blocks,
       coalesce(e.alloc_blocks, 0) / $interval_s AS alloc_blocks_per_s,
       coalesce(e.free_blocks, 0) / $interval_s AS free_blocks_per_s,
       coalesce(o.steps, 0) AS steps,
       o.avg_used_blocks,
       o.avg_tokens_per_block,
       o.avg_tokens_per_block / runs.block_size AS block_fill
FROM events e
FULL JOIN occupancy o USING (run_id, interval_index)
JOIN runs USING (run_id)
ORDER BY run_id, interval_index;
