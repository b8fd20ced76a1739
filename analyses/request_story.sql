-- What happened to a request, phase by phase, from arrival to finish?
--
-- A sequence's life (one sample of a request) as consecutive phases, from _sequence_states:
--   waiting     queued from arrival until first admitted (wait_causes.sql says why)
--   prefill     computing its prompt, in chunks (num_steps: the steps it spans)
--   decode      generating, from its first token
--   preempted   preempted by recompute: its KV dropped, waiting to resume (preemptions.sql)
--   swapped     preempted by swap: its KV on the host, waiting to be swapped in
--   reprefill   resumed, computing its history again
--   finished    the end (a point: start_s = end_s = finish_s), with its finish_reason
-- param: req_id = ''  the request (workload id); '' = every request
-- param: sample = -1  the sample (0..n-1); < 0 = every sample
--
-- Columns, one row per phase, in order within each sequence:
--   run_id, req_id, sample
--   phase_no       1, 2, ... within the sequence
--   phase          as above
--   start_s, end_s (s), duration_ms (ms)
--   first_step     the first step of its server starting within the phase (null if none)
--   num_steps      steps of its server starting within the phase
--   preemption_no  preempted and swapped phases: the preemption that began it (preemptions.sql)
--   finish_reason  the finished phase: stop | length | rejected | capacity | aborted
WITH phases AS (
    SELECT run_id, req_id, sample, state AS phase, start_s, end_s, start_seq, NULL::VARCHAR AS finish_reason, server
    FROM _sequence_states
    WHERE ($req_id = '' OR req_id = $req_id) AND ($sample < 0 OR sample = $sample)
    UNION ALL
    SELECT run_id, req_id, sample, 'finished', finish_s, finish_s, NULL, finish_reason, server
    FROM requests
    WHERE finish_s IS NOT NULL AND ($req_id = '' OR req_id = $req_id) AND ($sample < 0 OR sample = $sample)
),
stepped AS (
    SELECT p.run_id, p.req_id, p.sample, p.phase, p.start_s, p.start_seq,
           min(st.step) AS first_step, count(st.step) AS num_steps
    FROM phases p
    LEFT JOIN steps st ON st.run_id = p.run_id AND st.server = p.server AND st.start_s >= p.start_s
                          AND st.start_s < p.end_s
    GROUP BY ALL
)
SELECT p.run_id, p.req_id, p.sample,
       row_number() OVER (PARTITION BY p.run_id, p.req_id, p.sample
                          ORDER BY p.start_s, p.phase = 'finished') AS phase_no,
       p.phase, p.start_s, p.end_s, (p.end_s - p.start_s) * 1000 AS duration_ms,
       s.first_step, coalesce(s.num_steps, 0) AS num_steps,
       pr.preemption_no, p.finish_reason
FROM phases p
LEFT JOIN stepped s USING (run_id, req_id, sample, phase, start_s)
LEFT JOIN _preemptions pr ON pr.run_id = p.run_id AND pr.seq = p.start_seq AND p.phase IN ('preempted', 'swapped')
ORDER BY p.run_id, p.req_id, p.sample, phase_no;
