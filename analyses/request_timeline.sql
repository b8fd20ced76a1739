-- What did one request go through? Its states as intervals, the data behind a Gantt view.
-- param: req_id = ''  the request; '' = the most preempted sequences of each run
-- param: top = 1      with req_id = '': how many of each run's most preempted sequences
--
-- States (see _sequence_states.sql for how they are read from the trace):
--   waiting    arrived, not yet admitted
--   prefill    computing its prompt (chunked prefill spans several steps)
--   decode     producing tokens
--   preempted  preempted by recompute: blocks dropped, waiting for readmission
--   swapped    preempted by swap: KV on the host, waiting for swap-in
--   reprefill  readmitted after recompute, computing its history again
--
-- Columns, one row per interval, in time order: run_id, req_id, sample, rank (1 = most preempted in
-- its run, as most_preempted.sql ranks; null when req_id is given), state, start_s, end_s (s since the
-- run started), duration_ms (ms).
WITH chosen AS (
    SELECT run_id, req_id, sample, rank FROM _most_preempted WHERE $req_id = '' AND rank <= $top
    UNION
    SELECT DISTINCT run_id, req_id, sample, NULL::BIGINT FROM requests WHERE req_id = $req_id
    UNION
    SELECT DISTINCT run_id, req_id, sample, NULL::BIGINT FROM kv_events WHERE req_id = $req_id AND $req_id <> ''
)
SELECT s.run_id, s.req_id, s.sample, chosen.rank, s.state, s.start_s, s.end_s,
       (s.end_s - s.start_s) * 1000 AS duration_ms
FROM _sequence_states s JOIN chosen USING (run_id, req_id, sample)
ORDER BY s.run_id, s.req_id, s.sample, s.start_s;
