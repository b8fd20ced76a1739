-- What was the KV pool doing while one request lived? The sequence's life, from its arrival to its
-- finish (or the run's end), cut into `buckets` equal intervals: the state it was in and how full
-- the pool was in each, the data of a timeline of one request against the pool's occupancy. The
-- pool and the preemptions are those of the request's server (a run of several servers).
-- param: req_id = ''  the request
-- param: sample = -1  its sample (0..n-1); < 0 = every sample, each on its own life
-- param: buckets = 120  intervals of its life
--
-- The state of an interval is the one the sequence was in at the interval's middle (see
-- _sequence_states.sql for the states); after its finish, `finished`. The pool's occupancy is the
-- mean used_blocks / total_blocks of the steps that ended in the interval; where none did, that
-- of the step running at its middle (the next to end), so that a short life is not left blank.
--
-- Columns, one row per run holding the sequence, sample and interval (all `buckets` of them, in
-- time order):
--   run_id, req_id, sample
--   bucket          0 .. buckets - 1
--   start_s, end_s  the interval (s on the run's clock)
--   state           waiting | prefill | decode | preempted | swapped | reprefill | finished
--   used_frac       the pool's occupancy over the interval (null only where no step ran after it)
--   steps           steps that ended in the interval
--   preemptions     preempt events of the whole run in it (any sequence of its server)
--   own_preemptions of those, the sequence's own
WITH life AS (
    SELECT r.run_id, r.req_id, r.sample, r.server, r.arrival_s AS start_s,
           greatest(coalesce(r.finish_s, span.end_s), r.arrival_s) AS end_s
    FROM requests r JOIN _run_span span USING (run_id)
    WHERE r.req_id = $req_id AND ($sample < 0 OR r.sample = $sample)
),
intervals AS (
    SELECT life.run_id, life.req_id, life.sample, life.server, b.bucket,
           life.start_s + b.bucket * (life.end_s - life.start_s) / $buckets AS start_s,
           life.start_s + (b.bucket + 1) * (life.end_s - life.start_s) / $buckets AS end_s,
           life.start_s + (b.bucket + 0.5) * (life.end_s - life.start_s) / $buckets AS mid_s
    FROM life, range($buckets) b(bucket)
),
ended AS (
    SELECT i.run_id, i.sample, i.bucket, count(st.step) AS steps,
           avg(st.used_blocks / nullif(st.total_blocks, 0)) AS mean_used_frac
    FROM intervals i
    LEFT JOIN steps st ON st.run_id = i.run_id AND st.server = i.server AND st.end_s >= i.start_s
        AND (st.end_s < i.end_s OR (i.bucket = $buckets - 1 AND st.end_s = i.end_s))
    GROUP BY i.run_id, i.sample, i.bucket
),
running AS (
    SELECT i.run_id, i.sample, i.bucket, st.used_blocks / nullif(st.total_blocks, 0) AS used_frac
    FROM intervals i ASOF LEFT JOIN steps st ON st.run_id = i.run_id AND st.server = i.server AND st.end_s >= i.mid_s
),
preempts AS (
    SELECT i.run_id, i.sample, i.bucket, count(e.seq) AS preemptions,
           count(e.seq) FILTER (WHERE e.req_id = i.req_id AND e.sample = i.sample) AS own_preemptions
    FROM intervals i
    LEFT JOIN kv_events e ON e.run_id = i.run_id AND e.server = i.server AND e.kind = 'preempt' AND e.ts_s >= i.start_s
        AND (e.ts_s < i.end_s OR (i.bucket = $buckets - 1 AND e.ts_s = i.end_s))
    GROUP BY i.run_id, i.sample, i.bucket
),
states AS (
    SELECT i.run_id, i.sample, i.bucket, coalesce(first(s.state ORDER BY s.start_s DESC), 'finished') AS state
    FROM intervals i
    LEFT JOIN _sequence_states s ON s.run_id = i.run_id AND s.req_id = i.req_id AND s.sample = i.sample
        AND s.start_s <= i.mid_s AND s.end_s > i.mid_s
    GROUP BY i.run_id, i.sample, i.bucket
)
SELECT i.run_id, i.req_id, i.sample, i.bucket, i.start_s, i.end_s, s.state,
       coalesce(e.mean_used_frac, r.used_frac) AS used_frac,
       e.steps, p.preemptions, p.own_preemptions
FROM intervals i
JOIN ended e USING (run_id, sample, bucket)
JOIN running r USING (run_id, sample, bucket)
JOIN preempts p USING (run_id, sample, bucket)
JOIN states s USING (run_id, sample, bucket)
ORDER BY i.run_id, i.sample, i.bucket;
