-- How much KV did swapping move, and how fast? Per run: swap-out (device -> host), swap-in
-- (host -> device) and both together.
--
-- A copy is one swap_out or swap_in event. Rates are achieved rates, bytes / copy duration as
-- measured (CUDA events on CUDA); copies without a measured duration count in bytes and blocks
-- but not in the rates. GB = 1e9 bytes.
--
-- Columns, one row per run and direction (swap_out, swap_in, both), for runs that swapped:
--   run_id, direction
--   copies                  copies made
--   blocks, tokens, bytes   blocks, KV positions and bytes moved
--   p50_copy_ms, max_copy_ms, total_copy_ms   copy durations (ms)
--   p50_copy_gb_s           median of the copies' own rates (GB/s)
--   min_copy_gb_s           slowest copy's rate (GB/s)
--   gb_s                    overall: bytes / total copy time (GB/s)
SELECT * FROM _swap
ORDER BY run_id, list_position(['swap_out', 'swap_in', 'both'], direction);
