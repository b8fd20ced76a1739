-- How much did speculative decoding draft, and throw away? Per run: the draft positions scheduled,
-- those accepted and those rolled back, beside the positions recomputed after preemptions.
--
-- A step that drafts computes each request's draft positions with its next token; the outputs accept
-- some and the scheduler rolls back the rest (computed, never kept). Draft positions and lookahead slots
-- (reserved for the drafter past a request's tokens) take blocks too, and so cause preemptions of their
-- own: those whose requester's verified token fitted its blocks (lookahead_preemptions.sql). A capture
-- of a vLLM server that drafts records them, and kvtrace's simulator with --speculative-method (the real
-- engine drafts nothing): `drafting` says whether the run has them.
--
-- Columns, one row per run:
--   run_id
--   drafting              whether the run records drafts (false: no figure below is known)
--   steps_with_drafts     steps that scheduled draft positions
--   draft_tokens          draft positions scheduled (tokens)
--   accepted_tokens       of them accepted (steps whose output was processed)
--   acceptance            accepted_tokens / draft_tokens of those steps
--   rolled_back_tokens    draft positions computed and rolled back (tokens)
--   recomputed_tokens     positions computed again after preemptions (recompute.sql), for scale
--   wasted_tokens         rolled_back_tokens + recomputed_tokens: positions computed and not kept
--   mean_accepted         tokens accepted per request and step with drafts (spec_decode rows)
--   acceptance_rate       the chance a draft is accepted when the drafts before it were: accepted drafts
--                         / (accepted drafts + verifications that rejected one), the maximum-likelihood
--                         fit of the simulator's acceptance model (what `kvtrace calibrate` reports and
--                         `--spec-acceptance-rate` takes; a sweep of the run's traffic uses it)
--   verifications         request-steps whose drafts were verified (spec_decode rows with an output)
--   lookahead_slots       KV slots reserved a request past its tokens (the server's setting)
--   lookahead_preemptions preemptions caused by drafts and lookahead: the requester's verified token
--                         fitted the blocks it held, its drafts and lookahead slots did not
--                         (lookahead_preemptions.sql; those it cannot tell are not counted)
WITH per_step AS (
    SELECT run_id,
           count(draft_tokens) > 0 AS drafting,
           count(*) FILTER (WHERE draft_tokens > 0) AS steps_with_drafts,
           coalesce(sum(draft_tokens), 0) AS draft_tokens,
           coalesce(sum(accepted_tokens), 0) AS accepted_tokens,
           coalesce(sum(draft_tokens) FILTER (WHERE accepted_tokens IS NOT NULL), 0) AS checked_tokens,
           coalesce(sum(recompute_tokens), 0) AS recomputed_tokens
    FROM steps GROUP BY run_id
),
per_request AS (
    SELECT run_id, avg(accepted_tokens) AS mean_accepted, max(lookahead_slots) AS lookahead_slots,
           sum(accepted_tokens) / nullif(sum(accepted_tokens) + count(*) FILTER (WHERE accepted_tokens < draft_tokens), 0)
               AS acceptance_rate,
           count(accepted_tokens) AS verifications
    FROM spec_decode GROUP BY run_id
),
lookahead AS (
    SELECT run_id, count(*) FILTER (WHERE caused_by_lookahead) AS lookahead_preemptions
    FROM _lookahead_preemptions GROUP BY run_id
)
SELECT r.run_id,
       coalesce(s.drafting, false) AS drafting,
       coalesce(s.steps_with_drafts, 0)::BIGINT AS steps_with_drafts,
       coalesce(s.draft_tokens, 0)::BIGINT AS draft_tokens,
       coalesce(s.accepted_tokens, 0)::BIGINT AS accepted_tokens,
       s.accepted_tokens / nullif(s.checked_tokens, 0) AS acceptance,
       coalesce(s.checked_tokens - s.accepted_tokens, 0)::BIGINT AS rolled_back_tokens,
       coalesce(s.recomputed_tokens, 0)::BIGINT AS recomputed_tokens,
       coalesce(s.checked_tokens - s.accepted_tokens + s.recomputed_tokens, 0)::BIGINT AS wasted_tokens,
       p.mean_accepted,
       p.acceptance_rate,
       coalesce(p.verifications, 0)::BIGINT AS verifications,
       p.lookahead_slots,
       coalesce(l.lookahead_preemptions, 0)::BIGINT AS lookahead_preemptions
FROM runs r LEFT JOIN per_step s USING (run_id) LEFT JOIN per_request p USING (run_id)
LEFT JOIN lookahead l USING (run_id)
ORDER BY r.run_id;
