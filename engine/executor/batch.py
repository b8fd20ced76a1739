"""A scheduled batch flattened into token rows: what every forward path of the model runner reads.

The runner turns this into tensors in one of two ways (model_runner.py): one tensor per list (the
CPU path), or every integer in one copy (CUDA and Triton, step_inputs.py); a decode-only batch on
CUDA replays a graph from the same rows (cuda_graphs.py). Rows are laid out decodes first, then
prefill chunks (see AttentionMetadata):

    rows:  [ d0 d1 ... d(D-1) | chunk 0: positions start0 .. end0-1 | chunk 1 ... ]
           a decode computes one token, at position num_computed_tokens

A model of several KV-cache groups (ModelConfig.kv_cache_groups) has a block table per group and
sequence (Sequence.table(g)): the rows are the same for every group, but where their K and V go
(slots) and the tables attention reads through are one per group; each layer uses its group's.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass(slots=True)
class FlatBatch:
    decodes: list[Sequence]          # [D] sequences that compute one token, in batch order
    input_ids: list[int]             # [T] the token each row computes
    positions: list[int]             # [T] its position in its sequence
    slots: list[list[int]]           # [G][T] per KV-cache group, where its K and V go: table[pos // bs] * bs + pos % bs
    sample_seqs: list[Sequence]      # sequences whose last row gets logits: every decode, each finished prefill
    logit_rows: list[int]            # [R] those rows
    chunk_rows: list[int]            # [P] each prefill chunk's first row
    chunk_lens: list[int]            # [P] its number of tokens
    chunk_starts: list[int]          # [P] its first position (0: nothing before it in the cache)
    prefill_tables: list[list[list[int]]]  # [G][P] per group, the block ids that cover positions 0 .. the chunk's end
    # speculative decoding: (sequence, index in logit_rows of its first draft's row, its drafts) of each
    # sequence verifying drafts: its tokens and drafts laid out as a prefill chunk's rows, its drafts'
    # logit rows after every sampling row
    verify: list[tuple[Sequence, int, int]] = ()

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.input_ids) - len(self.decodes)

    def decode_tables(self, group: int) -> list[list[int]]:
        """Each decode's block table of KV-cache group `group`."""
        if group == 0:
            return [s.block_table for s in self.decodes]
        return [s.group_tables[group - 1] for s in self.decodes]


def flatten(out: SchedulerOutput, block_size: int, num_groups: int = 1) -> FlatBatch:
    """The step's tokens as rows, decodes first, then prefill chunks; slots and prefill tables for
    each of the model's `num_groups` KV-cache groups."""
    bs = block_size
    drafting = {id(s): n for s, n in zip(out.seqs, out.num_drafts) if n} if out.num_drafts else {}
    decodes = [s for s in out.seqs if not s.is_prefilling and id(s) not in drafting]
    prefills = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens) if s.is_prefilling or id(s) in drafting]
    positions = [s.num_computed_tokens for s in decodes]
    input_ids = [s.token_ids[p] for s, p in zip(decodes, positions)]
    slots = [[s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions)]]
    for g in range(1, num_groups):   # a decode's position is never in a block its window dropped
        slots.append([s.group_tables[g - 1][p // bs] * bs + p % bs for s, p in zip(decodes, positions)])
    sample_seqs = list(decodes)
    logit_rows = list(range(len(decodes)))
    chunk_rows, chunk_lens, chunk_starts = [], [], []
    prefill_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    verify, verify_rows = [], []
    for seq, num_new in prefills:
        row, start = len(input_ids), seq.num_computed_tokens
        end = start + num_new
        input_ids.extend(seq.token_ids[start:end])
        num_drafts = drafting.get(id(seq), 0)
        if num_drafts:   # its drafts after its tokens (placeholders past its proposals: never accepted)
            proposals = seq.draft_token_ids[:num_drafts]
            input_ids.extend(proposals + [seq.token_ids[-1]] * (num_drafts - len(proposals)))
            last = row + num_new - num_drafts - 1   # its last token's row: the sampled token's logits
            sample_seqs.append(seq)
            logit_rows.append(last)
            verify.append((seq, len(verify_rows), num_drafts))
            verify_rows.extend(range(last + 1, last + 1 + num_drafts))
        positions.extend(range(start, end))
        for g in range(num_groups):
            table = seq.table(g)
            slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            prefill_tables[g].append(table[:-(-end // bs)])
        chunk_rows.append(row)
        chunk_lens.append(num_new)
        chunk_starts.append(start)
        if end == seq.num_tokens and not num_drafts:
            sample_seqs.append(seq)
            logit_rows.append(row + num_new - 1)
    if verify:   # the drafts' rows after every sampling row (sampling reads the first len(sample_seqs))
        verify = [(seq, len(logit_rows) + at, n) for seq, at, n in verify]
        logit_rows.extend(verify_rows)
    return FlatBatch(decodes=decodes, input_ids=input_ids, positions=positions, slots=slots,
                     sample_seqs=sample_seqs, logit_rows=logit_rows, chunk_rows=chunk_rows, chunk_lens=chunk_lens,
                     chunk_starts=chunk_starts, prefill_tables=prefill_tables, verify=verify)
