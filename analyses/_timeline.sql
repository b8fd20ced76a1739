-- Helper: a run laid out as timeline tracks, the rows `kvtrace export perfetto` turns into packets
-- (kvtrace/export/perfetto.py). Times are integer nanoseconds on the run's clock, round(s * 1e9).
-- Every view has run_id; the exporter selects one run at a time and orders the rows. A run joined from
-- several servers' captures (schema 4's `server`) is not laid out: one engine track per run (the
-- exporter refuses it, db.one_server_each).
--
-- _ns(s): seconds as integer nanoseconds.
--
-- _timeline_sequences: one row per sequence of `requests` (finished ones: a running run's
-- sequences in flight have no row yet), the data of its track:
--   rank              0-based position by arrival in its run (ties: req_id, sample)
--   name              req_id, or req_id#sample when the request asked for n > 1 samples
--   arrival_ns, finish_ns
--   prompt_tokens, output_tokens, preemptions, swaps, recomputed_tokens, prefix_hit_tokens,
--   finish_reason     as in `requests`
--
-- _timeline_phases: the states of each sequence, from _sequence_states (the report's Gantt reads
-- the same view), one row per interval:
--   req_id, sample, state, start_ns, end_ns
--   start_s           the start in seconds, unrounded: it orders a sequence's states where two
--                     round to the same nanosecond
--   flow_id           set when the interval began with a preemption (preempted, swapped) or a
--                     resumption (reprefill; after a swap-in the decode or prefill that follows):
--                     (runs.ordinal + 1) * 2^40 + kv_events.seq, unique among many runs
--   flow_step         the step that preempted or resumed it, where the flow starts
--   requester_flow_id a preempted or swapped interval whose preemption another sequence needed
--                     (schema 3's requester): the flow from that requester's track, 2^39 above
--                     flow_id's (same kv_events.seq)
--
-- _timeline_requester_flows: one row per preemption by another sequence (schema 3), the instant
-- on the requester's track where its flow to the victim starts:
--   req_id, sample (the requester), ts_ns, victim (track name), victim_reason, flow_id
--
-- _timeline_flows: the flows starting at each step that starts one: step, flow_ids (ascending)
--
-- _timeline_steps: one row per step, the engine track's slices:
--   step, start_ns, end_ns, name (prefill | decode | prefill+decode | empty, with " +recompute"
--   when it recomputed positions), device_ms, prefill_tokens, decode_tokens, recompute_tokens,
--   preemptions, flow_ids (the flows starting at it, ascending; empty list when none)
--
-- _timeline_instants: the engine track's instant events: one per preempt, swap_out and swap_in
-- event, and one per step for its evictions (cached blocks reclaimed):
--   step, ts_ns, seq (the first event's), kind (preempt | swap_out | swap_in | evict),
--   sequence (track name of the sequence concerned; null for evict), blocks (physical block ids,
--   space-separated; a step's evicted blocks in ascending order), num_blocks, num_tokens, kv_bytes (num_blocks x bytes per block, for preempt
--   and evict), bytes_copied (swap_out / swap_in), duration_ms (copy duration), reason
--
-- _timeline_engine: _timeline_steps and _timeline_instants as one stream for the engine track, to
-- be read in order of (step, part, ts_ns, seq): a step's row (part 0: ts_ns = its start, end_ns,
-- the step's columns) comes before its instants (part 1: the instant's columns). A filter on step
-- reaches the tables' scans, so the stream can be read a window of steps at a time
--
-- _step_counters: one row per step, the counters after its scheduling, at its start:
--   step, ts_ns, free_blocks, used_blocks, cached_blocks, kv_tokens, running, waiting, swapped
--   (as in `steps`), preemptions_total, recomputed_tokens_total (running sums of `steps`),
--   swap_out_bytes_total, swap_in_bytes_total (running sums of the swap events' bytes)
-- _timeline_counters: _step_counters as one row per counter and change (a value equal to the
-- counter's previous one is left out): counter (a column name of _step_counters), step, ts_ns, value
--
-- _timeline_kv_groups: the KV-cache groups of a run of several (a hybrid model's: meta.json's
-- kv_pool.kv_cache_groups; a run of one group, every older trace, has no row), one row per group:
--   kv_group          its index (kv_events.kv_group)
--   name              full attention | sliding window <n> tok | chunked local <n> tok | mamba, and
--                     " (group <kv_group>)" where two groups of the run would read the same
--
-- _timeline_kv_group_counters: the pool of a run of several groups, group by group, as one row per
-- counter and change, like _timeline_counters: kv_group, step, ts_ns, value.
--   kv_group          a group: its blocks held after the step's scheduling, at its start (the moment
--                     of `steps.used_blocks`, which the groups' add up to): the blocks that some
--                     sequence holds. A sequence holds a block from its `alloc` or `prefix_hit` (a
--                     hit's block in the group of its last `alloc`) until its window lets it go (a
--                     `free` of reason window or state naming it) or the sequence is released (its
--                     first `free` of another reason, `preempt` or `finish`: a `free` of reason finish
--                     names only the blocks whose count fell to zero, so the sequence, not the event's
--                     blocks, ends the holds). A release stamped after its step's start (done after
--                     the forward) counts from the next step, or under async scheduling from the one
--                     after (done once the next step is scheduled), unless the step scheduled after it
--                     preempted the sequence. An eviction changes nothing (the block was free already).
--   null              the run's blocks dropped by windows, cumulative: `free` blocks of reason window
--                     (or state: a Mamba layer's), mid-request, every group's
-- Exact with prefix caching on or off (tests/analysis/test_export_perfetto.py checks the groups' sum
-- against `used_blocks` at every step). A run cut from live traffic starts from zero: blocks taken
-- before its first event are not counted.
CREATE OR REPLACE MACRO _ns(s) AS CAST(round(s * 1e9) AS BIGINT);

CREATE OR REPLACE MACRO _sequence_name(req_id, sample, n) AS
    CASE WHEN sample > 0 OR coalesce(n, 1) > 1 THEN req_id || '#' || sample ELSE req_id END;

CREATE OR REPLACE VIEW _timeline_sequences AS
SELECT run_id, req_id, sample,
       row_number() OVER (PARTITION BY run_id ORDER BY arrival_s, req_id, sample) - 1 AS rank,
       _sequence_name(req_id, sample, n) AS name,
       _ns(arrival_s) AS arrival_ns, _ns(finish_s) AS finish_ns,
       prompt_tokens, output_tokens, preemptions, swaps, recomputed_tokens, prefix_hit_tokens, finish_reason
FROM requests;

CREATE OR REPLACE VIEW _timeline_phases AS
WITH marked AS (
    SELECT st.run_id, st.req_id, st.sample, st.state, st.start_s, st.end_s, e.seq, e.step,
           coalesce(e.kind = 'preempt' OR (e.kind = 'admit' AND e.reason LIKE 'resume-%'), false) AS has_flow,
           coalesce(e.kind = 'preempt' AND e.requester_req_id IS NOT NULL
                    AND (e.requester_req_id, e.requester_sample) <> (e.req_id, e.sample), false) AS has_requester
    FROM _sequence_states st
    LEFT JOIN (SELECT run_id, seq, step, kind, reason, req_id, sample, requester_req_id, requester_sample
               FROM kv_events WHERE kind IN ('preempt', 'admit')) e
           ON e.run_id = st.run_id AND e.seq = st.start_seq
)
SELECT m.run_id, m.req_id, m.sample, m.state, _ns(m.start_s) AS start_ns, _ns(m.end_s) AS end_ns, m.start_s,
       CASE WHEN m.has_flow THEN (r.ordinal + 1)::BIGINT * 1099511627776 + m.seq END AS flow_id,
       CASE WHEN m.has_flow THEN m.step END AS flow_step,
       CASE WHEN m.has_requester THEN (r.ordinal + 1)::BIGINT * 1099511627776 + 549755813888 + m.seq
       END AS requester_flow_id
FROM marked m JOIN runs r USING (run_id);

CREATE OR REPLACE VIEW _timeline_flows AS
SELECT run_id, flow_step AS step, list(flow_id ORDER BY flow_id) AS flow_ids
FROM _timeline_phases
WHERE flow_id IS NOT NULL
GROUP BY run_id, flow_step;

CREATE OR REPLACE VIEW _timeline_requester_flows AS
SELECT e.run_id, e.requester_req_id AS req_id, e.requester_sample AS sample, _ns(e.ts_s) AS ts_ns,
       _sequence_name(e.req_id, e.sample, q.n) AS victim, e.victim_reason,
       (r.ordinal + 1)::BIGINT * 1099511627776 + 549755813888 + e.seq AS flow_id
FROM kv_events e
JOIN runs r USING (run_id)
LEFT JOIN requests q USING (run_id, req_id, sample)
WHERE e.kind = 'preempt' AND e.requester_req_id IS NOT NULL
  AND (e.requester_req_id, e.requester_sample) <> (e.req_id, e.sample)
  -- both ends on a track: the victim's interval from this preemption exists (not zero-length)
  AND EXISTS (SELECT 1 FROM _sequence_states st WHERE st.run_id = e.run_id AND st.start_seq = e.seq)
  AND EXISTS (SELECT 1 FROM requests rq WHERE rq.run_id = e.run_id AND rq.req_id = e.requester_req_id
                                          AND rq.sample = e.requester_sample);

CREATE OR REPLACE VIEW _timeline_steps AS
SELECT s.run_id, s.step, _ns(s.start_s) AS start_ns, _ns(s.end_s) AS end_ns,
       CASE WHEN s.prefill_tokens > 0 AND s.decode_tokens > 0 THEN 'prefill+decode'
            WHEN s.prefill_tokens > 0 THEN 'prefill'
            WHEN s.decode_tokens > 0 THEN 'decode'
            ELSE 'empty' END
       || CASE WHEN s.recompute_tokens > 0 THEN ' +recompute' ELSE '' END AS name,
       s.device_ms, s.prefill_tokens, s.decode_tokens, s.recompute_tokens, s.preemptions,
       coalesce(f.flow_ids, []::BIGINT[]) AS flow_ids
FROM steps s LEFT JOIN _timeline_flows f USING (run_id, step);

CREATE OR REPLACE VIEW _timeline_instants AS
SELECT e.run_id, e.step, _ns(e.ts_s) AS ts_ns, e.seq, e.kind,
       _sequence_name(e.req_id, e.sample, q.n) AS sequence,
       array_to_string(e.blocks, ' ') AS blocks, e.num_blocks, e.num_tokens,
       CASE WHEN e.kind = 'preempt' THEN (e.num_blocks * r.bytes_per_block)::BIGINT END AS kv_bytes,
       CASE WHEN e.kind IN ('swap_out', 'swap_in') THEN e.bytes END AS bytes_copied,
       e.duration_ms, e.reason
FROM kv_events e
JOIN runs r USING (run_id)
LEFT JOIN requests q USING (run_id, req_id, sample)
WHERE e.kind IN ('preempt', 'swap_out', 'swap_in')
UNION ALL
SELECT e.run_id, e.step, _ns(min(e.ts_s)), min(e.seq), 'evict', NULL,
       array_to_string(list_sort(flatten(list(e.blocks))), ' '),
       sum(e.num_blocks)::INTEGER, NULL, (sum(e.num_blocks) * any_value(r.bytes_per_block))::BIGINT,
       NULL, NULL, NULL
FROM kv_events e
JOIN runs r USING (run_id)
WHERE e.kind = 'evict'
GROUP BY e.run_id, e.step;

CREATE OR REPLACE VIEW _timeline_engine AS
SELECT run_id, step, 0 AS part, start_ns AS ts_ns, NULL::BIGINT AS seq, end_ns, name,
       device_ms, prefill_tokens, decode_tokens, recompute_tokens, preemptions, flow_ids,
       NULL::VARCHAR AS sequence, NULL::VARCHAR AS blocks, NULL::INTEGER AS num_blocks, NULL::INTEGER AS num_tokens,
       NULL::BIGINT AS kv_bytes, NULL::BIGINT AS bytes_copied, NULL::DOUBLE AS duration_ms, NULL::VARCHAR AS reason
FROM _timeline_steps
UNION ALL
SELECT run_id, step, 1, ts_ns, seq, NULL, kind,
       NULL, NULL, NULL, NULL, NULL, NULL,
       sequence, blocks, num_blocks, num_tokens, kv_bytes, bytes_copied, duration_ms, reason
FROM _timeline_instants;

CREATE OR REPLACE VIEW _step_counters AS
WITH swaps AS (
    SELECT run_id, step,
           coalesce(sum(bytes) FILTER (WHERE kind = 'swap_out'), 0) AS swap_out_bytes,
           coalesce(sum(bytes) FILTER (WHERE kind = 'swap_in'), 0) AS swap_in_bytes
    FROM kv_events
    WHERE kind IN ('swap_out', 'swap_in')
    GROUP BY run_id, step
)
SELECT s.run_id, s.step, _ns(s.start_s) AS ts_ns,
       s.free_blocks, s.used_blocks, s.cached_blocks, s.kv_tokens, s.running, s.waiting, s.swapped,
       (sum(s.preemptions) OVER running_sum)::BIGINT AS preemptions_total,
       (sum(s.recompute_tokens) OVER running_sum)::BIGINT AS recomputed_tokens_total,
       (sum(coalesce(w.swap_out_bytes, 0)) OVER running_sum)::BIGINT AS swap_out_bytes_total,
       (sum(coalesce(w.swap_in_bytes, 0)) OVER running_sum)::BIGINT AS swap_in_bytes_total
FROM steps s LEFT JOIN swaps w USING (run_id, step)
WINDOW running_sum AS (PARTITION BY s.run_id ORDER BY s.step ROWS UNBOUNDED PRECEDING);

CREATE OR REPLACE VIEW _timeline_counters AS
WITH long AS (
    UNPIVOT (
        SELECT run_id, step, ts_ns,
               free_blocks::BIGINT AS free_blocks, used_blocks::BIGINT AS used_blocks,
               cached_blocks::BIGINT AS cached_blocks, kv_tokens::BIGINT AS kv_tokens,
               running::BIGINT AS running, waiting::BIGINT AS waiting, swapped::BIGINT AS swapped,
               preemptions_total, recomputed_tokens_total, swap_out_bytes_total, swap_in_bytes_total
        FROM _step_counters
    )
    ON free_blocks, used_blocks, cached_blocks, kv_tokens, running, waiting, swapped, preemptions_total,
       recomputed_tokens_total, swap_out_bytes_total, swap_in_bytes_total
    INTO NAME counter VALUE value
)
SELECT run_id, counter, step, ts_ns, value
FROM long
QUALIFY value IS DISTINCT FROM lag(value) OVER (PARTITION BY run_id, counter ORDER BY step);

CREATE OR REPLACE VIEW _timeline_kv_groups AS
WITH listed AS (
    SELECT run_id, i::INTEGER AS kv_group, json_extract(groups, '$[' || i || ']') AS g
    FROM (SELECT run_id, json_extract(meta_json, '$.kv_pool.kv_cache_groups') AS groups FROM runs),
         range(coalesce(json_array_length(groups), 0)::BIGINT) t(i)
    WHERE json_array_length(groups) > 1
),
named AS (
    SELECT run_id, kv_group,
           CASE coalesce(g ->> '$.kind', 'full_attention')
               WHEN 'full_attention' THEN 'full attention'
               WHEN 'sliding_window' THEN 'sliding window ' || (g ->> '$.sliding_window') || ' tok'
               WHEN 'chunked_local' THEN 'chunked local ' || (g ->> '$.attention_chunk_size') || ' tok'
               ELSE replace(g ->> '$.kind', '_', ' ') END AS name
    FROM listed
)
SELECT run_id, kv_group,
       name || CASE WHEN count(*) OVER (PARTITION BY run_id, name) > 1 THEN ' (group ' || kv_group || ')' ELSE '' END
           AS name
FROM named;

CREATE OR REPLACE VIEW _timeline_kv_group_counters AS
WITH hybrid AS (
    -- the steps after which a step's frees of finished sequences are in `used_blocks`
    SELECT run_id, 1 + coalesce(TRY_CAST(meta_json ->> '$.engine_config.async_scheduling' AS BOOLEAN),
                                TRY_CAST(meta_json ->> '$.vllm.async_scheduling' AS BOOLEAN), false)::INTEGER
                   AS finish_lag
    FROM runs
    WHERE run_id IN (SELECT run_id FROM _timeline_kv_groups)
),
takes AS (   -- a block a sequence took: allocated, or found by a prefix hit (in its last alloc's group)
    SELECT run_id, req_id, sample, seq, step, ts_s, kv_group, unnest(blocks) AS block
    FROM kv_events
    WHERE kind = 'alloc' AND run_id IN (SELECT run_id FROM hybrid)
),
held_blocks AS (
    SELECT run_id, req_id, sample, seq, step, ts_s, kv_group, block FROM takes
    UNION ALL
    SELECT h.run_id, h.req_id, h.sample, h.seq, h.step, h.ts_s, a.kv_group, h.block
    FROM (SELECT run_id, req_id, sample, seq, step, ts_s, unnest(blocks) AS block
          FROM kv_events
          WHERE kind = 'prefix_hit' AND run_id IN (SELECT run_id FROM hybrid)) h
    ASOF JOIN takes a ON a.run_id = h.run_id AND a.block = h.block AND h.seq > a.seq
),
let_go AS (   -- a block a sequence's window (or a Mamba layer's state) let go mid-request
    SELECT run_id, req_id, sample, seq, step, unnest(blocks) AS block
    FROM kv_events
    WHERE kind = 'free' AND reason IN ('window', 'state') AND run_id IN (SELECT run_id FROM hybrid)
),
releases AS (   -- a sequence letting go of every block it holds: finished or preempted (its first such event),
                -- from the step its blocks count free: a finish stamped after the step's start from a later
                -- one, unless the step scheduled after it preempted the sequence (its last token in flight)
    SELECT run_id, req_id, sample, seq,
           min(step) OVER (PARTITION BY run_id, req_id, sample ORDER BY seq ROWS BETWEEN CURRENT ROW AND 2 FOLLOWING)
               AS step
    FROM (SELECT e.run_id, e.req_id, e.sample, e.seq,
                 e.step + CASE WHEN e.ts_s > s.start_s THEN h.finish_lag ELSE 0 END AS step
          FROM kv_events e
          JOIN steps s USING (run_id, step)
          JOIN hybrid h USING (run_id)
          WHERE e.kind = 'free' AND coalesce(e.reason, '') NOT IN ('window', 'state') OR e.kind IN ('preempt', 'finish'))
),
holds AS (   -- each block a sequence held, from its take to its window's letting go or the sequence's release
    SELECT t.run_id, t.kv_group, t.block, t.seq AS start_seq, t.step AS start_step,
           CASE WHEN r.seq IS NULL OR d.seq < r.seq THEN d.seq ELSE r.seq END AS end_seq,
           CASE WHEN r.seq IS NULL OR d.seq < r.seq THEN d.step ELSE r.step END AS end_step
    FROM held_blocks t
    ASOF LEFT JOIN let_go d
      ON d.run_id = t.run_id AND d.req_id = t.req_id AND d.sample = t.sample AND d.block = t.block AND d.seq > t.seq
    ASOF LEFT JOIN releases r
      ON r.run_id = t.run_id AND r.req_id = t.req_id AND r.sample = t.sample AND r.seq > t.seq
    WHERE t.kv_group IS NOT NULL
),
marks AS (
    SELECT run_id, kv_group, block, start_seq AS seq, start_step AS step, 1 AS d FROM holds
    UNION ALL
    SELECT run_id, kv_group, block, end_seq, end_step, -1 FROM holds WHERE end_seq IS NOT NULL
),
deltas AS (   -- a block counts in its group while some sequence holds it
    SELECT run_id, kv_group, step,
           CASE WHEN d = 1 AND holders = 1 THEN 1 WHEN d = -1 AND holders = 0 THEN -1 ELSE 0 END AS held,
           0 AS dropped
    FROM (SELECT *, sum(d) OVER (PARTITION BY run_id, block ORDER BY seq, d ROWS UNBOUNDED PRECEDING) AS holders
          FROM marks)
    UNION ALL   -- the blocks windows dropped mid-request
    SELECT run_id, NULL, step, 0, count(*) FROM let_go GROUP BY run_id, step
),
changes AS (
    SELECT run_id, kv_group, step, held AS change FROM deltas WHERE kv_group IS NOT NULL AND held <> 0
    UNION ALL
    SELECT run_id, NULL, step, dropped FROM deltas WHERE dropped > 0
    UNION ALL   -- every counter from the run's first step
    SELECT c.run_id, c.kv_group, f.step, 0
    FROM (SELECT run_id, kv_group FROM _timeline_kv_groups UNION ALL SELECT run_id, NULL FROM hybrid) c
    JOIN (SELECT run_id, min(step) AS step FROM steps WHERE run_id IN (SELECT run_id FROM hybrid) GROUP BY run_id) f
      USING (run_id)
),
summed AS (
    SELECT run_id, kv_group, step,
           sum(sum(change)) OVER (PARTITION BY run_id, kv_group ORDER BY step ROWS UNBOUNDED PRECEDING) AS value
    FROM changes
    GROUP BY run_id, kv_group, step
)
SELECT m.run_id, m.kv_group, m.step, _ns(s.start_s) AS ts_ns, m.value::BIGINT AS value
FROM summed m JOIN steps s USING (run_id, step)
QUALIFY m.value IS DISTINCT FROM lag(m.value) OVER (PARTITION BY m.run_id, m.kv_group ORDER BY m.step);
