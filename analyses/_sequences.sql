-- Helper: every sequence (one sample of a request) with its outcome.
--
-- _sequences: the `requests` table plus
--   completed   finish_reason is stop or length (the sequence ran to its end); rejected, capacity
--               and aborted sequences are not completed
CREATE OR REPLACE VIEW _sequences AS
SELECT *, coalesce(finish_reason IN ('stop', 'length'), false) AS completed
FROM requests;
