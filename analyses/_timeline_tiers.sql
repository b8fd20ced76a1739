-- Helper: a run's KV tiers (schema 6) laid out as timeline tracks, the rows `kvtrace export perfetto`
-- turns into each tier's track, its flows and its counters (kvtrace/export/perfetto.py); the rest of the
-- run's tracks are _timeline.sql's. Times are integer nanoseconds on the run's clock; every view has
-- run_id. A run without a tier (every run before schema 6) has no row in any of them.
--
-- _timeline_tier_flows: one row per offload or load copy whose sequence has a state to link it to (a
-- finished sequence's), the flow between the copy and that state:
--   seq, kind         the copy's kv_events row
--   req_id, sample, phase_start_s   the state (_timeline_phases' row, its start_s unrounded)
--   flow_id           (runs.ordinal + 1) * 2^40 + 2^38 + kv_events.seq: beside _timeline_phases' flows
--                     (seq) and the requesters' (2^39 + seq), unique among many runs
--   phase_first       the flow starts at the state, ends at the copy (the state began first); else it
--                     starts at the copy: a flow is followed forwards in time, and at a tie the copy's
--                     track, written first, begins it
--   The state of an offload: the one its sequence was in when the copy began (the phase that computed
--   the blocks, or the one after, where the copy waited for the link). Of a load: the first state of its
--   sequence that ends after the copy and is not a wait (waiting, preempted, swapped): the phase it
--   resumes or starts in once its blocks are back, or the one it was already in where the source marked
--   its admission before the copy finished.
--
-- _timeline_tier_events: one row per offload, load and tier_evict event, the tier track's events:
--   tier, seq, step, kind
--   start_ns, end_ns  a copy's start (ts_s less duration_ms) and end (ts_s: an offload or load is filed
--                     at the end of its copy); the same where the copy is untimed, and for a tier_evict
--   name              'load v · 8 tok · 2.0 kB', 'offload r3 · 2 blocks · 2.0 kB' (the bytes where known;
--                     ' · failed' after a failed copy's), 'evicts 2 blocks'
--   sequence          the sequence's track name (null for tier_evict)
--   blocks            device block ids, space-separated (null for tier_evict)
--   num_blocks, num_tokens, bytes, duration_ms, reason   as in kv_events
--   flow_id, phase_first   the copy's flow (_timeline_tier_flows), null where none
--
-- _timeline_tier_counters: each tier's bytes copied each way, cumulative, failed copies included (as
-- steps.offload_bytes and load_bytes count them), from 0 at the run's first step's start and after each
-- copy's end: tier, direction (offload | load), ts_ns, value. A value equal to the previous is left out.
CREATE OR REPLACE VIEW _timeline_tier_flows AS
WITH copies AS (
    SELECT e.run_id, e.seq, e.kind, e.req_id, e.sample, _ns(e.ts_s) AS end_ns,
           _ns(e.ts_s) - coalesce(CAST(round(e.duration_ms * 1e6) AS BIGINT), 0) AS start_ns,
           (r.ordinal + 1)::BIGINT * 1099511627776 + 274877906944 + e.seq AS flow_id
    FROM kv_events e JOIN runs r USING (run_id)
    WHERE e.kind IN ('offload', 'load')
),
linked AS (
    SELECT c.run_id, c.seq, c.kind, c.req_id, c.sample, c.start_ns, c.flow_id,
           CASE WHEN c.kind = 'offload'
                THEN arg_max(p.start_s, p.start_s) FILTER (WHERE p.start_ns <= c.start_ns)
                ELSE arg_min(p.start_s, p.start_s) FILTER (WHERE p.end_ns > c.end_ns
                                                           AND p.state NOT IN ('waiting', 'preempted', 'swapped'))
           END AS phase_start_s
    FROM copies c JOIN _timeline_phases p USING (run_id, req_id, sample)
    GROUP BY c.run_id, c.seq, c.kind, c.req_id, c.sample, c.start_ns, c.end_ns, c.flow_id
)
SELECT run_id, seq, kind, req_id, sample, phase_start_s, flow_id, _ns(phase_start_s) < start_ns AS phase_first
FROM linked
WHERE phase_start_s IS NOT NULL;

CREATE OR REPLACE VIEW _timeline_tier_events AS
SELECT e.run_id, e.tier, e.seq, e.step, e.kind,
       _ns(e.ts_s) - coalesce(CAST(round(e.duration_ms * 1e6) AS BIGINT), 0) AS start_ns, _ns(e.ts_s) AS end_ns,
       CASE WHEN e.kind = 'tier_evict' THEN 'evicts ' || e.num_blocks || ' blocks'
            ELSE e.kind || ' ' || _sequence_name(e.req_id, e.sample, q.n) || ' · '
                 || CASE WHEN e.kind = 'load' THEN e.num_tokens || ' tok'
                         ELSE e.num_blocks || CASE WHEN e.num_blocks = 1 THEN ' block' ELSE ' blocks' END END
                 || CASE WHEN e.bytes > 0 THEN ' · ' || formatReadableDecimalSize(e.bytes) ELSE '' END
                 || CASE WHEN e.reason = 'failed' THEN ' · failed' ELSE '' END
       END AS name,
       CASE WHEN e.kind <> 'tier_evict' THEN _sequence_name(e.req_id, e.sample, q.n) END AS sequence,
       array_to_string(e.blocks, ' ') AS blocks, e.num_blocks, e.num_tokens, e.bytes, e.duration_ms, e.reason,
       f.flow_id, f.phase_first
FROM kv_events e
LEFT JOIN requests q USING (run_id, req_id, sample)
LEFT JOIN _timeline_tier_flows f USING (run_id, seq)
WHERE e.kind IN ('offload', 'load', 'tier_evict');

CREATE OR REPLACE VIEW _timeline_tier_counters AS
WITH copies AS (
    SELECT run_id, tier, kind AS direction, _ns(ts_s) AS ts_ns,
           sum(bytes) OVER (PARTITION BY run_id, tier, kind ORDER BY ts_s, seq ROWS UNBOUNDED PRECEDING) AS value
    FROM kv_events
    WHERE kind IN ('offload', 'load')
),
firsts AS (   -- both directions of every tier that copied, from 0 at the run's first step
    SELECT t.run_id, t.tier, d.direction, _ns(min(s.start_s)) AS ts_ns, 0::HUGEINT AS value
    FROM (SELECT DISTINCT run_id, tier FROM copies) t
    CROSS JOIN (VALUES ('offload'), ('load')) d(direction)
    JOIN steps s USING (run_id)
    GROUP BY ALL
),
points AS (
    SELECT run_id, tier, direction, ts_ns, max(value) AS value FROM copies GROUP BY ALL
    UNION ALL
    SELECT * FROM firsts
)
SELECT run_id, tier, direction, ts_ns, value::BIGINT AS value
FROM points
QUALIFY value IS DISTINCT FROM lag(value) OVER (PARTITION BY run_id, tier, direction ORDER BY ts_ns, value);
