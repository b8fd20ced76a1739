-- Which preemptions did speculative decoding's drafts and lookahead slots cause? Per preemption of a
-- run that drafts: the requester (the sequence whose allocation could not be served), the positions it
-- had computed, the blocks it held and their room left, the drafts and lookahead slots its step
-- scheduled, and whether its verified token alone would have fitted the blocks it held (then only its
-- drafts and lookahead needed the block that cost the victim its KV).
--
-- vLLM reserves `num_lookahead_tokens` slots past each request's scheduled tokens and schedules a
-- decoding request 1 + drafts tokens a step; both take blocks. How each figure is read from the trace
-- (and where it is not known: a requester that was not decoding, async scheduling, drafts of a
-- requester that preempted itself) is said in analyses/_lookahead_preemptions.sql. A run that drafts
-- nothing (kvtrace's engine and simulator, a server without speculative decoding) has no row.
--
-- With lookahead slots (EAGLE, MTP, a draft model reserve as many as they draft) a decoding request's
-- verified token always lies in the slots its previous step reserved (it reserved 1 + drafts + lookahead
-- past its positions, and at most 1 + drafts were kept): every preemption a decoding requester makes is
-- then caused by lookahead. Without them (n-gram) one whose drafts were all accepted can need a block for
-- its verified token.
--
-- Columns, one row per preempt event of a drafting run, in event order:
--   run_id, req_id, sample   the victim
--   seq, step                the preempt event (kv_events.seq) and its step
--   requester_req_id, requester_sample   the sequence it was preempted for
--   requester_scheduled      whether the requester was scheduled in the step (false: it preempted
--                            itself in the end)
--   requester_positions      KV positions the requester had computed before the step (null: it was not
--                            decoding, or the run schedules asynchronously)
--   requester_blocks         blocks it held (its full-attention groups')
--   requester_free_slots     positions its held blocks had room for past its computed ones (fewest
--                            over its full-attention groups)
--   draft_tokens             drafts scheduled for it in the step (null: it was not scheduled, its
--                            drafts are not recorded)
--   lookahead_slots          slots its allocation reserved past its tokens
--   caused_by_lookahead      its verified token fitted its blocks and its drafts and lookahead did not:
--                            the preemption came from speculative decoding (null: not known)
SELECT run_id, req_id, sample, seq, step, requester_req_id, requester_sample, requester_scheduled,
       requester_positions, requester_blocks, requester_free_slots, draft_tokens, lookahead_slots,
       caused_by_lookahead
FROM _lookahead_preemptions
ORDER BY run_id, seq;
