-- Helper: _goodput(slo_ttft_ms, slo_tpot_ms, slo_e2el_ms), a table per run of the completed
-- requests that met every SLO (see goodput.sql for the columns). An SLO <= 0 is not applied.
CREATE OR REPLACE MACRO _goodput(slo_ttft_ms, slo_tpot_ms, slo_e2el_ms) AS TABLE
WITH per_request AS (
    SELECT run_id, req_id,
           bool_and(completed) AS completed,
           bool_and(completed
                    AND (slo_ttft_ms <= 0 OR ttft_ms <= slo_ttft_ms)
                    AND (slo_tpot_ms <= 0 OR tpot_ms IS NULL OR tpot_ms <= slo_tpot_ms)
                    AND (slo_e2el_ms <= 0 OR e2el_ms <= slo_e2el_ms)) AS good
    FROM _sequence_latency
    GROUP BY run_id, req_id
),
counts AS (
    SELECT span.run_id, span.duration_s,
           count(*) FILTER (WHERE completed) AS completed_requests,
           count(*) FILTER (WHERE good) AS good_requests
    FROM _run_span span LEFT JOIN per_request USING (run_id)
    GROUP BY span.run_id, span.duration_s
)
SELECT run_id,
       slo_ttft_ms::DOUBLE AS ttft_slo_ms, slo_tpot_ms::DOUBLE AS tpot_slo_ms, slo_e2el_ms::DOUBLE AS e2el_slo_ms,
       completed_requests, good_requests,
       good_requests / nullif(completed_requests, 0) AS good_share,
       good_requests / duration_s AS goodput_req_s,
       duration_s
FROM counts;
