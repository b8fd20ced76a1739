-- Helper: each preemption of a drafting run, and whether its requester needed the blocks only for its
-- drafts and lookahead slots.
--
-- A speculative step schedules a decoding request its next token (the "verified" one: its KV is what
-- the request must have to go on) and the drafts after it, and vLLM's allocate_slots reserves the
-- server's lookahead slots past them (vllm: allocate_slots(request, 1 + drafts, num_lookahead_tokens)).
-- The allocation fails, and the scheduler preempts for the request (its requester), only when it needs
-- more blocks than are free: if its verified token fits the blocks it holds, what needed the new block
-- was its drafts and lookahead alone. Such a preemption is "caused by lookahead".
--
-- What it reads, all of the trace:
--   the requester's positions before the step (vLLM's num_computed_tokens when the step was scheduled):
--     a decoding request has computed every token it has but its last, and, under async scheduling,
--     the positions of its step still in flight (its next token and its drafts: counted until their
--     output says how many were accepted). So they are its prompt_tokens, plus the idx of its last token
--     whose output was processed by the time the step's scheduling began (tokens.ts_s <= steps.start_s:
--     exact however many tokens a step emitted, and kept by a capture's window that cut its first
--     tokens), plus 1 + its drafts (spec_decode) for each earlier step whose tokens came after that.
--     It is decoding if it emitted a token after its last preemption (a resumed request emits its next
--     token when its re-prefill is done); otherwise (first prefill, re-prefill) the positions are null:
--     the trace does not say how many of its tokens the step scheduled;
--   the blocks it holds: its `alloc` and `prefix_hit` blocks since its last preemption, before this
--     event, per full-attention KV-cache group (meta.json's kv_pool.kv_cache_groups; none listed: one
--     group of runs.block_size). vLLM fills a table's blocks in order, so a group holds
--     blocks x its block_size positions. Sliding-window, local-attention and Mamba groups are left out:
--     their need does not follow the positions;
--   its drafts: spec_decode's draft_tokens at the step. A requester whose allocation was served in the
--     end (it was scheduled) and has no spec_decode row drafted 0; one that preempted itself was not
--     scheduled and its drafts are not recorded (null). Its lookahead slots: spec_decode's, else the
--     server's num_lookahead_tokens (meta.json's engine_config: every allocation of a running request
--     reserves them).
--
-- _lookahead_preemptions: one row per preempt event of a run with spec_decode rows (none in a run that
-- drafts nothing).
--   run_id, req_id, sample   the victim
--   seq, step                the preempt event
--   requester_req_id, requester_sample   whose allocation could not be served (kv_events)
--   requester_scheduled      its allocation was served in the step, after the preemptions (false: it
--                            preempted itself in the end)
--   requester_positions      KV positions it had computed before the step (null if not decoding)
--   requester_blocks         blocks it held, over its full-attention groups
--   requester_free_slots     positions its held blocks had room for past its computed ones (the fewest
--                            over its full-attention groups; null with requester_positions)
--   draft_tokens             drafts scheduled for it in the step (null: not recorded, see above)
--   lookahead_slots          slots its allocation reserved past its tokens
--   caused_by_lookahead      its verified token fitted its blocks (requester_free_slots >= 1) and its
--                            tokens with drafts and lookahead did not (free slots < 1 + draft_tokens
--                            + lookahead_slots, capped at the model's length where meta.json says it);
--                            with its drafts not recorded, true on its verified token fitting alone (the
--                            allocation failed, and only drafts and lookahead needed a block); false
--                            where the verified token needed a block; null where the positions are
--                            unknown
CREATE OR REPLACE VIEW _lookahead_preemptions AS
WITH drafting AS (
    SELECT DISTINCT run_id FROM spec_decode
),
settings AS (
    SELECT r.run_id, r.block_size,
           (r.meta_json::JSON ->> '$.engine_config.num_lookahead_tokens')::BIGINT AS lookahead_setting,
           (r.meta_json::JSON ->> '$.engine_config.max_model_len')::BIGINT AS max_model_len,
           json_extract(r.meta_json, '$.kv_pool.kv_cache_groups') AS groups
    FROM runs r JOIN drafting USING (run_id)
),
full_groups AS (
    SELECT run_id, kv_group, block_size
    FROM (SELECT s.run_id, i::INTEGER AS kv_group,
                 coalesce(json_extract(s.groups, '$[' || i || ']') ->> '$.kind', 'full_attention') AS kind,
                 coalesce((json_extract(s.groups, '$[' || i || ']') ->> '$.block_size')::BIGINT,
                          s.block_size) AS block_size
          FROM settings s, range(coalesce(nullif(json_array_length(s.groups), 0), 1)::BIGINT) t(i))
    WHERE kind = 'full_attention'
),
preempts AS (
    SELECT e.run_id, e.server, e.seq, e.step, e.req_id, e.sample, e.requester_req_id, e.requester_sample
    FROM kv_events e JOIN drafting USING (run_id)
    WHERE e.kind = 'preempt'
),
-- the requester's own preemptions: its last before this event (its blocks and tokens count from there),
-- and whether it preempted itself in this step (then it was not scheduled)
requester_preempts AS (
    SELECT p.run_id, p.seq,
           max(v.seq) FILTER (WHERE v.seq < p.seq) AS since_seq,
           max(v.step) FILTER (WHERE v.seq < p.seq) AS since_step,
           coalesce(bool_or(v.step = p.step AND v.seq >= p.seq), false) AS yielded
    FROM preempts p
    LEFT JOIN kv_events v ON v.run_id = p.run_id AND v.kind = 'preempt' AND v.req_id = p.requester_req_id
                             AND v.sample = p.requester_sample
    GROUP BY p.run_id, p.seq
),
held AS (
    SELECT p.run_id, p.seq, g.kv_group, g.block_size,
           coalesce(sum(CASE WHEN a.kind = 'alloc' AND coalesce(a.kv_group, 0) = g.kv_group THEN a.num_blocks
                             WHEN a.kind = 'prefix_hit'
                                 THEN coalesce(a.kv_group_blocks[g.kv_group + 1], a.num_blocks) END), 0) AS blocks
    FROM preempts p
    JOIN requester_preempts r USING (run_id, seq)
    JOIN full_groups g ON g.run_id = p.run_id
    LEFT JOIN kv_events a ON a.run_id = p.run_id AND a.req_id = p.requester_req_id
                             AND a.sample = p.requester_sample AND a.kind IN ('alloc', 'prefix_hit')
                             AND a.seq < p.seq AND a.seq > coalesce(r.since_seq, -1)
    GROUP BY ALL
),
-- its tokens before the step: those whose output was processed before the step's scheduling began, and
-- those of steps still in flight then (async scheduling)
delivered AS (
    SELECT p.run_id, p.seq,
           max(t.idx) FILTER (WHERE t.ts_s <= st.start_s) AS last_idx,
           max(t.step) AS last_token_step
    FROM preempts p
    JOIN steps st ON st.run_id = p.run_id AND st.server = p.server AND st.step = p.step
    JOIN tokens t ON t.run_id = p.run_id AND t.req_id = p.requester_req_id AND t.sample = p.requester_sample
                     AND t.step < p.step
    GROUP BY ALL
),
in_flight AS (
    SELECT f.run_id, f.seq, sum(1 + coalesce(sd.draft_tokens, 0)) AS positions
    FROM (SELECT DISTINCT p.run_id, p.seq, p.requester_req_id, p.requester_sample, t.step
          FROM preempts p
          JOIN steps st ON st.run_id = p.run_id AND st.server = p.server AND st.step = p.step
          JOIN tokens t ON t.run_id = p.run_id AND t.req_id = p.requester_req_id
                           AND t.sample = p.requester_sample AND t.step < p.step AND t.ts_s > st.start_s) f
    LEFT JOIN spec_decode sd ON sd.run_id = f.run_id AND sd.req_id = f.requester_req_id
                                AND sd.sample = f.requester_sample AND sd.step = f.step
    GROUP BY ALL
),
figures AS (
    SELECT p.run_id, p.req_id, p.sample, p.seq, p.step, p.requester_req_id, p.requester_sample,
           CASE WHEN p.requester_req_id IS NOT NULL THEN NOT r.yielded END AS requester_scheduled,
           CASE WHEN d.last_token_step > coalesce(r.since_step, -1)
                THEN q.prompt_tokens + coalesce(d.last_idx, -1) + coalesce(i.positions, 0) END AS requester_positions,
           CASE WHEN sd.draft_tokens IS NOT NULL THEN sd.draft_tokens
                WHEN p.requester_req_id IS NOT NULL AND NOT r.yielded THEN 0 END AS draft_tokens,
           CASE WHEN p.requester_req_id IS NOT NULL
                THEN coalesce(sd.lookahead_slots, s.lookahead_setting, 0) END AS lookahead_slots,
           s.max_model_len
    FROM preempts p
    JOIN settings s USING (run_id)
    JOIN requester_preempts r USING (run_id, seq)
    LEFT JOIN delivered d USING (run_id, seq)
    LEFT JOIN in_flight i USING (run_id, seq)
    LEFT JOIN requests q ON q.run_id = p.run_id AND q.req_id = p.requester_req_id AND q.sample = p.requester_sample
    LEFT JOIN spec_decode sd ON sd.run_id = p.run_id AND sd.req_id = p.requester_req_id
                                AND sd.sample = p.requester_sample AND sd.step = p.step
),
room AS (
    SELECT f.run_id, f.seq, sum(h.blocks) AS blocks,
           min(h.blocks * h.block_size) - any_value(f.requester_positions) AS free_slots
    FROM figures f JOIN held h USING (run_id, seq)
    GROUP BY f.run_id, f.seq
)
SELECT f.run_id, f.req_id, f.sample, f.seq, f.step, f.requester_req_id, f.requester_sample,
       f.requester_scheduled, f.requester_positions::BIGINT AS requester_positions,
       CASE WHEN f.requester_req_id IS NOT NULL THEN m.blocks END::BIGINT AS requester_blocks,
       m.free_slots::BIGINT AS requester_free_slots,
       f.draft_tokens::BIGINT AS draft_tokens, f.lookahead_slots::BIGINT AS lookahead_slots,
       CASE WHEN m.free_slots IS NULL THEN NULL
            WHEN m.free_slots < 1 THEN false
            WHEN f.draft_tokens IS NULL THEN true
            ELSE m.free_slots < least(1 + f.draft_tokens + f.lookahead_slots,
                                      coalesce(f.max_model_len - f.requester_positions, 1 + f.draft_tokens
                                                                                         + f.lookahead_slots))
       END AS caused_by_lookahead
FROM figures f
LEFT JOIN room m USING (run_id, seq);
