-- How full was the KV pool over the run, and when did preemption, recompute and swap strike? Each
-- run's span (see _run_span) cut into `buckets` equal intervals: pool.sql and the preempt and swap
-- events downsampled for timelines, so that a long run stays a few hundred rows. A run of several
-- servers has a timeline per server (each has its own pool), on the run's span.
-- param: buckets = 120  intervals per run
-- param: full_pool_frac = 0.95  a step's pool is full when used_blocks / total_blocks >= this
--
-- Steps count in the interval of their end_s, events in the interval of their ts_s (the end of
-- the span falls in the last interval). An interval in which no step ended has null occupancy.
-- Rates divide by the interval's length.
--
-- Columns, one row per run, server and interval (all `buckets` of them, in time order):
--   run_id
--   bucket              0 .. buckets - 1
--   start_s, end_s      the interval (s)
--   steps               steps that ended in it
--   mean_used_frac      mean of those steps' used_blocks / total_blocks
--   max_used_frac       the highest of them
--   full_pool_steps     of those steps, the ones that ran with a full pool
--   preemptions         preempt events (any mode)
--   swap_preemptions    of those, by swap
--   processed_tokens    positions computed, prefill + decode (tokens)
--   recomputed_tokens   of those, positions computed again after recompute preemption (tokens)
--   recomputed_tok_s    recomputed_tokens / interval length (tokens/s)
--   swap_out_bytes, swap_in_bytes      bytes copied device -> host and host -> device
--   swap_out_bytes_s, swap_in_bytes_s  the same per second of the interval (bytes/s)
--   server              the server ('' but in a run of several servers)
WITH span AS (
    SELECT run_id, start_s, duration_s / $buckets AS width_s
    FROM _run_span
    WHERE duration_s > 0
),
intervals AS (
    SELECT span.run_id, sv.server, r.bucket, span.start_s + r.bucket * span.width_s AS start_s,
           span.start_s + (r.bucket + 1) * span.width_s AS end_s, span.width_s
    FROM span JOIN _servers sv USING (run_id), range($buckets) r(bucket)
),
step_rows AS (
    SELECT s.run_id, s.server,
           least(floor((s.end_s - span.start_s) / span.width_s), $buckets - 1)::BIGINT AS bucket,
           s.used_blocks / nullif(s.total_blocks, 0) AS used_frac,
           coalesce(s.used_blocks >= $full_pool_frac * s.total_blocks, false) AS full_pool,
           s.prefill_tokens + s.decode_tokens AS processed_tokens,
           s.recompute_tokens
    FROM steps s JOIN span USING (run_id)
),
per_step AS (
    SELECT run_id, server, bucket, count(*) AS steps,
           avg(used_frac) AS mean_used_frac, max(used_frac) AS max_used_frac,
           count(*) FILTER (WHERE full_pool) AS full_pool_steps,
           sum(processed_tokens)::BIGINT AS processed_tokens,
           sum(recompute_tokens)::BIGINT AS recomputed_tokens
    FROM step_rows
    GROUP BY run_id, server, bucket
),
per_event AS (
    SELECT e.run_id, e.server,
           least(floor((e.ts_s - span.start_s) / span.width_s), $buckets - 1)::BIGINT AS bucket,
           count(*) FILTER (WHERE e.kind = 'preempt') AS preemptions,
           count(*) FILTER (WHERE e.kind = 'preempt' AND e.reason = 'swap') AS swap_preemptions,
           coalesce(sum(e.bytes) FILTER (WHERE e.kind = 'swap_out'), 0)::BIGINT AS swap_out_bytes,
           coalesce(sum(e.bytes) FILTER (WHERE e.kind = 'swap_in'), 0)::BIGINT AS swap_in_bytes
    FROM kv_events e JOIN span USING (run_id)
    WHERE e.kind IN ('preempt', 'swap_out', 'swap_in')
    GROUP BY e.run_id, e.server, bucket
)
SELECT i.run_id, i.bucket, i.start_s, i.end_s,
       coalesce(s.steps, 0) AS steps,
       s.mean_used_frac, s.max_used_frac,
       coalesce(s.full_pool_steps, 0) AS full_pool_steps,
       coalesce(e.preemptions, 0) AS preemptions,
       coalesce(e.swap_preemptions, 0) AS swap_preemptions,
       coalesce(s.processed_tokens, 0) AS processed_tokens,
       coalesce(s.recomputed_tokens, 0) AS recomputed_tokens,
       coalesce(s.recomputed_tokens, 0) / i.width_s AS recomputed_tok_s,
       coalesce(e.swap_out_bytes, 0) AS swap_out_bytes,
       coalesce(e.swap_in_bytes, 0) AS swap_in_bytes,
       coalesce(e.swap_out_bytes, 0) / i.width_s AS swap_out_bytes_s,
       coalesce(e.swap_in_bytes, 0) / i.width_s AS swap_in_bytes_s,
       i.server
FROM intervals i
LEFT JOIN per_step s USING (run_id, server, bucket)
LEFT JOIN per_event e USING (run_id, server, bucket)
ORDER BY i.run_id, i.server, i.bucket;
