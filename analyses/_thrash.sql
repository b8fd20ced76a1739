-- Helper: the thrash evidence of every step, over the window of window_s seconds that ends with the step.
-- Each server is judged on its own steps and pool (a run of several servers: the `server` column).
--
-- _thrash_steps(window_s, full_pool_frac, min_preempt_per_s, min_recompute_share,
--               min_full_pool_share): one row per step.
--   run_id, server, step, end_s
--   full_pool             used_blocks / total_blocks >= full_pool_frac after scheduling
--   window_steps          steps that ended in [end_s - window_s, end_s]
--   window_preemptions    preemptions decided in those steps
--   preempt_per_s         window_preemptions / window_s
--   recompute_share       recompute_tokens / (prefill_tokens + decode_tokens) in the window
--   full_pool_share       share of the window's steps with a full pool
--   thrashing             preempt_per_s >= min_preempt_per_s AND (recompute_share >=
--                         min_recompute_share OR full_pool_share >= min_full_pool_share)
-- The window is ordered by end_s / window_s so that window_s can be a bound parameter. Its sums
-- are running sums (one sort of the steps, no sliding frame): a step's window is everything up to
-- its key (its peers included) minus everything before its key - 1, the running sums of the last
-- step whose key is below key - 1 (an ASOF join; as exact: the counts are integers).
CREATE OR REPLACE MACRO _thrash_steps(window_s, full_pool_frac, min_preempt_per_s,
                                      min_recompute_share, min_full_pool_share) AS TABLE
WITH running AS (
    SELECT run_id, server, step, end_s, end_s / window_s AS k, end_s / window_s - 1 AS k_from,
           coalesce(used_blocks >= full_pool_frac * total_blocks, false) AS full_pool,
           count(*) OVER upto AS steps,
           sum(preemptions) OVER upto AS preemptions,
           sum(recompute_tokens) OVER upto AS recompute_tokens,
           sum(prefill_tokens + decode_tokens) OVER upto AS processed_tokens,
           sum(coalesce(used_blocks >= full_pool_frac * total_blocks, false)::INTEGER) OVER upto AS full_pool_steps
    FROM steps
    WINDOW upto AS (PARTITION BY run_id, server ORDER BY end_s / window_s RANGE UNBOUNDED PRECEDING)
),
windowed AS (
    SELECT hi.run_id, hi.server, hi.step, hi.end_s, hi.full_pool,
           (hi.steps - coalesce(lo.steps, 0))::BIGINT AS window_steps,
           hi.preemptions - coalesce(lo.preemptions, 0) AS window_preemptions,
           hi.recompute_tokens - coalesce(lo.recompute_tokens, 0) AS window_recompute_tokens,
           hi.processed_tokens - coalesce(lo.processed_tokens, 0) AS window_processed_tokens,
           hi.full_pool_steps - coalesce(lo.full_pool_steps, 0) AS window_full_pool_steps
    FROM running hi
    ASOF LEFT JOIN running lo ON lo.run_id = hi.run_id AND lo.server = hi.server AND hi.k_from > lo.k
),
evidence AS (
    SELECT run_id, server, step, end_s, full_pool, window_steps,
           window_preemptions::BIGINT AS window_preemptions,
           window_preemptions / window_s AS preempt_per_s,
           coalesce(window_recompute_tokens / nullif(window_processed_tokens, 0), 0) AS recompute_share,
           window_full_pool_steps / window_steps AS full_pool_share
    FROM windowed
)
SELECT *,
       preempt_per_s >= min_preempt_per_s
       AND (recompute_share >= min_recompute_share OR full_pool_share >= min_full_pool_share) AS thrashing
FROM evidence;

-- _thrash_windows(...same params...): the thrash windows, the periods in which thrashing holds, one
-- row per run of consecutive thrashing steps of a server.
--   run_id
--   start_s, end_s        from the window start of the first thrashing step (not before 0, nor
--                         before the previous thrash window's end) to the end of the last one (s)
--   duration_s            end_s - start_s (s)
--   thrashing_steps       steps whose window qualified
--   peak_preempt_per_s    highest windowed preemption rate in the thrash window (1/s)
--   peak_recompute_share  highest windowed recompute share
--   peak_full_pool_share  highest windowed share of full-pool steps
--   server                the server whose steps thrashed ('' but in a run of several servers)
CREATE OR REPLACE MACRO _thrash_windows(window_s, full_pool_frac, min_preempt_per_s,
                                        min_recompute_share, min_full_pool_share) AS TABLE
WITH marked AS (
    SELECT *,
           row_number() OVER (PARTITION BY run_id, server ORDER BY end_s, step)
           - row_number() OVER (PARTITION BY run_id, server, thrashing ORDER BY end_s, step) AS thrash_window
    FROM _thrash_steps(window_s, full_pool_frac, min_preempt_per_s, min_recompute_share, min_full_pool_share)
),
thrash_windows AS (
    SELECT run_id, server,
           greatest(min(end_s) - window_s, 0) AS window_start_s,
           max(end_s) AS end_s,
           count(*) AS thrashing_steps,
           max(preempt_per_s) AS peak_preempt_per_s,
           max(recompute_share) AS peak_recompute_share,
           max(full_pool_share) AS peak_full_pool_share
    FROM marked
    WHERE thrashing
    GROUP BY run_id, server, thrash_window
),
-- a thrash window's first step's window can reach back into the previous thrash window: start
-- where that one ended, so that they never overlap and their durations add up to at most the run's length
disjoint AS (
    SELECT *,
           greatest(window_start_s,
                    coalesce(lag(end_s) OVER (PARTITION BY run_id, server ORDER BY end_s), 0)) AS start_s
    FROM thrash_windows
)
SELECT run_id, start_s, end_s, end_s - start_s AS duration_s, thrashing_steps,
       peak_preempt_per_s, peak_recompute_share, peak_full_pool_share, server
FROM disjoint;

-- _thrash_servers(...same params...): the verdict per run and server, with its evidence: thrash.sql's
-- columns (server after run_id), each server judged on its own steps, pool and KV events, its rates over
-- its own span (_server_spans); and, for _thrash, the server's steps and steps with a full pool. A run of one server
-- (or with nothing recorded yet) has one row, server ''.
CREATE OR REPLACE MACRO _thrash_servers(window_s, full_pool_frac, min_preempt_per_s,
                                        min_recompute_share, min_full_pool_share) AS TABLE
WITH per_server AS (
    SELECT run_id, server,
           max(preempt_per_s) AS peak_preempt_per_s,
           count(*) AS steps,
           count(*) FILTER (WHERE full_pool) AS full_pool_steps
    FROM _thrash_steps(window_s, full_pool_frac, min_preempt_per_s, min_recompute_share, min_full_pool_share)
    GROUP BY run_id, server
),
per_server_windows AS (
    SELECT run_id, server, count(*) AS thrash_windows, sum(duration_s) AS thrash_s
    FROM _thrash_windows(window_s, full_pool_frac, min_preempt_per_s, min_recompute_share, min_full_pool_share)
    GROUP BY run_id, server
),
preempted AS (
    SELECT run_id, server, count(*) AS preempted_sequences,
           count(*) FILTER (WHERE preemptions > 1) AS repreempted_sequences
    FROM (SELECT run_id, server, req_id, sample, count(*) AS preemptions
          FROM kv_events WHERE kind = 'preempt' GROUP BY run_id, server, req_id, sample)
    GROUP BY run_id, server
)
SELECT rc.run_id, rc.server,
       CASE WHEN coalesce(rc.preemptions, 0) = 0 THEN 'none'
            WHEN coalesce(st.thrash_windows, 0) > 0 THEN 'sustained'
            ELSE 'occasional' END AS verdict,
       rc.preemptions,
       coalesce(pr.peak_preempt_per_s, 0) AS peak_preempt_per_s,
       coalesce(st.thrash_windows, 0) AS thrash_windows,
       coalesce(st.thrash_s, 0) AS thrash_s,
       coalesce(p.preempted_sequences, 0) AS preempted_sequences,
       coalesce(p.repreempted_sequences, 0) AS repreempted_sequences,
       pr.full_pool_steps / pr.steps AS full_pool_step_share,
       rc.recompute_share_of_processed AS recompute_share,
       rc.processed_tokens,
       rc.processed_tokens - rc.recomputed_tokens AS useful_tokens,
       rc.processed_tokens / span.duration_s AS processed_tok_s,
       (rc.processed_tokens - rc.recomputed_tokens) / span.duration_s AS useful_tok_s,
       coalesce(pr.steps, 0) AS steps,
       coalesce(pr.full_pool_steps, 0) AS full_pool_steps
FROM _recompute_servers rc
LEFT JOIN _server_spans span USING (run_id, server)
LEFT JOIN per_server pr USING (run_id, server)
LEFT JOIN per_server_windows st USING (run_id, server)
LEFT JOIN preempted p USING (run_id, server);

-- _thrash(...same params...): the verdict per run with its evidence (see thrash.sql): its servers'
-- added up (preemptions, thrash windows and their seconds, sequences, tokens), the peak rate the
-- highest of theirs; sustained if any server's is.
CREATE OR REPLACE MACRO _thrash(window_s, full_pool_frac, min_preempt_per_s,
                                min_recompute_share, min_full_pool_share) AS TABLE
WITH sums AS (
    SELECT s.run_id,
           sum(s.preemptions)::BIGINT AS preemptions,
           max(s.peak_preempt_per_s) AS peak_preempt_per_s,
           sum(s.thrash_windows)::BIGINT AS thrash_windows,
           sum(s.thrash_s) AS thrash_s,
           sum(s.preempted_sequences)::BIGINT AS preempted_sequences,
           sum(s.repreempted_sequences)::BIGINT AS repreempted_sequences,
           sum(s.full_pool_steps) / nullif(sum(s.steps), 0) AS full_pool_step_share,
           sum(s.processed_tokens - s.useful_tokens)::BIGINT AS recomputed_tokens,
           sum(s.processed_tokens)::BIGINT AS processed_tokens
    FROM _thrash_servers(window_s, full_pool_frac, min_preempt_per_s, min_recompute_share, min_full_pool_share) s
    GROUP BY s.run_id
)
SELECT s.run_id,
       CASE WHEN s.preemptions = 0 THEN 'none'
            WHEN s.thrash_windows > 0 THEN 'sustained'
            ELSE 'occasional' END AS verdict,
       s.preemptions, s.peak_preempt_per_s, s.thrash_windows, s.thrash_s,
       s.preempted_sequences, s.repreempted_sequences, s.full_pool_step_share,
       s.recomputed_tokens / nullif(s.processed_tokens, 0) AS recompute_share,
       s.processed_tokens,
       s.processed_tokens - s.recomputed_tokens AS useful_tokens,
       s.processed_tokens / span.duration_s AS processed_tok_s,
       (s.processed_tokens - s.recomputed_tokens) / span.duration_s AS useful_tok_s
FROM sums s
JOIN _run_span span USING (run_id);
