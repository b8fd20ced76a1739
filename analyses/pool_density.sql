-- How densely did each run's pool hold real KV, and what did that density cost? One row per run:
-- the table of paged-kv-memory.txt (allocation policies on one pool), measured from a trace.
--
-- Columns, one row per run:
--   run_id, block_size
--   kv_reserve        none (on-demand paging) | max-model-len | max-tokens (from meta.json)
--   steps             engine steps
--   avg_running       running sequences per step, averaged over steps
--   held_kv_share     KV positions stored / token slots of the blocks held, both summed over steps
--                     (steps.kv_tokens / (steps.used_blocks * block_size)): 1 means no slot held empty
--   preemptions       preemptions decided over the run
SELECT s.run_id,
       any_value(r.block_size) AS block_size,
       coalesce(any_value(r.meta_json::JSON ->> '$.kv_pool.kv_reserve'), 'none') AS kv_reserve,
       count(*) AS steps,
       avg(s.running) AS avg_running,
       sum(s.kv_tokens) / nullif(sum(s.used_blocks::DOUBLE * r.block_size), 0) AS held_kv_share,
       sum(s.preemptions) AS preemptions
FROM steps s
JOIN runs r USING (run_id)
GROUP BY s.run_id
ORDER BY any_value(r.ordinal);
