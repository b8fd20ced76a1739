-- Why did a request wait: for a seat, for the token budget, for blocks, behind a preemption?
--
-- Every wait of a sequence (queued before its first admission, preempted until readmitted,
-- swapped out until swapped in), its time split by why the engine admitted nothing more in the
-- steps it spanned (steps.admission_stop, schema 3; the causes are listed in _waits.sql: seats,
-- budget, blocks, watermark, preemption, nothing-waiting, other, unknown, idle).
-- param: req_id = ''  the request (workload id); '' = every request
-- param: sample = -1  the sample (0..n-1); < 0 = every sample
--
-- Columns, one row per wait and cause, the largest share first within each wait:
--   run_id, req_id, sample
--   state          waiting | preempted | swapped
--   start_s, end_s the wait (s)
--   wait_ms        end_s - start_s (ms)
--   cause
--   cause_ms       the part of the wait put down to it (ms)
--   share          cause_ms / wait_ms
SELECT c.run_id, c.req_id, c.sample, c.state, c.start_s, w.end_s, w.wait_ms, c.cause, c.cause_ms, c.share
FROM _wait_causes c
JOIN _waits w USING (run_id, req_id, sample, state, start_s)
WHERE ($req_id = '' OR c.req_id = $req_id) AND ($sample < 0 OR c.sample = $sample)
ORDER BY c.run_id, c.req_id, c.sample, c.start_s, c.cause_ms DESC, c.cause;
