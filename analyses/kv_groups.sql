-- How does each KV-cache group of a hybrid model use the pool? Per run and group: its kind, the
-- blocks given to its tables, and those its window dropped while the requests ran.
--
-- A hybrid model (full attention beside sliding-window, chunked local or Mamba layers) keeps a block
-- table per group over one pool (docs/trace-format.md, "KV-cache groups"); a window's group frees
-- blocks mid-request (`free` events with reason `window`, `state` for a Mamba state), so it holds a
-- few blocks a request however long the request grows, while a full-attention group holds them all.
-- A run without meta.json's kv_pool.kv_cache_groups (kvtrace's engine and simulator, older captures)
-- has one group of full attention.
--
-- Columns, one row per run and KV-cache group:
--   run_id
--   kv_group             the group's index (kv_events.kv_group; 0 in a run of one group)
--   kind                 full_attention, sliding_window, chunked_local or mamba
--   window_tokens        a sliding window's or a local-attention chunk's size (tokens); null otherwise
--   layers               the model's layers in the group (null where unknown)
--   alloc_blocks         blocks allocated to the group's tables (alloc events)
--   window_freed_blocks  blocks the group dropped mid-request (out of a window, Mamba states)
--   alloc_share          alloc_blocks / every group's alloc_blocks of the run
WITH declared AS (
    SELECT run_id, json_extract(meta_json, '$.kv_pool.kv_cache_groups') AS groups FROM runs
),
listed AS (
    SELECT run_id, i::INTEGER AS kv_group, json_extract(groups, '$[' || i || ']') AS g
    FROM declared, range(coalesce(json_array_length(groups), 1)::BIGINT) t(i)
),
used AS (
    SELECT run_id, coalesce(kv_group, 0) AS kv_group,
           sum(num_blocks) FILTER (WHERE kind = 'alloc') AS alloc_blocks,
           sum(num_blocks) FILTER (WHERE kind = 'free' AND reason IN ('window', 'state')) AS window_freed_blocks
    FROM kv_events
    WHERE kind IN ('alloc', 'free')
    GROUP BY ALL
)
SELECT l.run_id, l.kv_group,
       coalesce(l.g ->> '$.kind', 'full_attention') AS kind,
       coalesce(l.g ->> '$.sliding_window', l.g ->> '$.attention_chunk_size')::BIGINT AS window_tokens,
       (l.g ->> '$.layers')::INTEGER AS layers,
       coalesce(u.alloc_blocks, 0)::BIGINT AS alloc_blocks,
       coalesce(u.window_freed_blocks, 0)::BIGINT AS window_freed_blocks,
       coalesce(u.alloc_blocks, 0) / nullif(sum(coalesce(u.alloc_blocks, 0)) OVER (PARTITION BY l.run_id), 0)
           AS alloc_share
FROM listed l LEFT JOIN used u USING (run_id, kv_group)
ORDER BY l.run_id, l.kv_group;
