"""A sequence: one sample of a request, with its token history and KV state."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class SequenceStatus(Enum):
    WAITING = auto()    # never admitted, or preempted by recompute (no KV)
    RUNNING = auto()
    SWAPPED = auto()    # preempted by swap: KV lives in host blocks
    LOADING = auto()    # its blocks held, waiting for a load from the host KV tier (vLLM's WAITING_FOR_REMOTE_KVS)
    FINISHED = auto()


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None      # sample i of a request draws from a generator seeded seed + i
    ignore_eos: bool = False
    n: int = 1
    output_tokens: int | None = None  # stop here (reason stop): the length a recorded request really had

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.output_tokens is not None and not 1 <= self.output_tokens <= self.max_tokens:
            raise ValueError(f"output_tokens must be in [1, max_tokens={self.max_tokens}], got {self.output_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sequence:
    """Token history plus where its KV lives.

    token_ids = prompt + every delivered output token. The last delivered token has no KV yet:
    it is the next step's input. KV layout for block size 4, prompt p0..p6, outputs x0, x1:

        positions   0  1  2  3 | 4  5  6  7 | 8
        tokens     p0 p1 p2 p3 | p4 p5 p6 x0 | x1   <- x1 not yet computed
        block_table[0]           block_table[1]   (block_table[2] is needed to compute x1)
    """

    def __init__(self, req_id: str, sample: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_s: float, priority: int, admit_order: int, *, keep_list: bool = False) -> None:
        """`keep_list`: the prompt's list is handed over and becomes token_ids (else a copy does)."""
        self.req_id = req_id
        self.sample = sample
        self.token_ids = prompt_token_ids if keep_list else list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_s = arrival_s
        self.priority = priority
        self.arrival_order = admit_order        # tie-break: order of add_request
        self.admitted_order = -1                # when last admitted (for the newest policy)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # a model of several KV-cache groups (ModelConfig.kv_cache_groups): the tables of groups 1, 2, ...
        # (block_table is group 0's). In a windowed group's table the null block (0) stands where the
        # window dropped a block, as in vLLM's
        self.group_tables: list[list[int]] = []
        self.host_block_table: list[int] = []   # while swapped
        self.block_hashes: list[int] = []       # chained hashes of the full blocks in block_table
        self.token_block_hashes: list[int] = []  # chained hashes of full blocks of token_ids (a memo)
        self.num_computed_tokens = 0            # positions whose KV is in the block table
        self.num_undelivered = 0                # --async-scheduling: sampled tokens (last of token_ids)
                                                # whose output the engine has not processed yet
        self.num_in_flight_tokens = 0           # --async-scheduling: positions computed in the step whose
                                                # output is not processed yet (a window keeps their blocks)
        self.num_ever_computed = 0              # high-water mark of positions that had KV
        self.num_reserved_tokens = 0            # --kv-reserve: positions held from admission (0: on demand)
        # speculative decoding: drafts proposed for its next step (V1's spec_token_ids, their count); whether
        # its last step was a prefill chunk that sampled nothing (V1's is_prefill_chunk: no drafts then)
        self.num_drafts = 0
        self.draft_token_ids: list[int] = []   # the real engine's: the proposals themselves (n-gram)
        self.is_prefill_chunk = False
        # --async-scheduling: the drafts of its step in flight, counted as computed until their output
        # says how many were accepted (V1's output placeholders beyond the sampled token)
        self.num_draft_placeholders = 0
        self._generator: torch.Generator | None = None   # made on first use (see `generator`)
        # resume bookkeeping
        self.protected = False                  # resumed and not yet progressed: not a victim
        self.reprefill_target = 0               # >0 while re-prefilling after recompute
        self.reprefill_cached = 0
        self.reprefill_recomputed = 0
        self.num_pending_forks = 0               # n > 1: samples to fork when the prompt is done
        # the host KV tier (engine/offload.py): blocks offered to it so far (vLLM's next_stored_chunk_idx),
        # the load it waits for (None: none; a TierCopy), and whether that load has finished
        self.num_offered_blocks = 0
        self.load = None
        self.load_done = False
        self.num_tier_copies = 0                # its stores and loads in flight (a lookup waits for none)
        self.num_connector_blocks = 0           # blocks of its table the connector has seen (vLLM's block_ids)
        # stats
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_recomputed_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_tier_hit_tokens = 0            # positions loaded from the host KV tier instead of computed
        self.num_draft_tokens = 0               # speculative decoding: draft positions verified for it,
        self.num_accepted_tokens = 0            # and of them those accepted
        self.finish_reason: str | None = None
        # no length rule stops it before it holds this many tokens (the engine lowers it to the max
        # model length): the stop checks look closer only from here on, or at a stop token
        self.stop_num_tokens = self.num_prompt_tokens + (params.output_tokens or params.max_tokens)

    def __repr__(self) -> str:
        return (f"Sequence({self.req_id}#{self.sample} {self.status.name} tokens={len(self.token_ids)} "
                f"computed={self.num_computed_tokens} blocks={self.block_table})")

    @property
    def generator(self) -> torch.Generator | None:
        """A sampled sequence's random numbers (seeded seed + sample index); None when greedy. Made
        when first drawn from, which the simulated engine never does: it imports no torch."""
        if self._generator is None and not self.params.greedy:
            import torch

            self._generator = torch.Generator()
            self._generator.manual_seed((self.params.seed if self.params.seed is not None else 0) + self.sample)
        return self._generator

    def table(self, group: int) -> list[int]:
        """The block table of KV-cache group `group` (0: block_table)."""
        return self.group_tables[group - 1] if group else self.block_table

    def tables(self) -> list[list[int]]:
        """Every KV-cache group's block table, group 0 first."""
        return [self.block_table, *self.group_tables]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token lacks KV: prompt or history still to prefill."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0

    @property
    def stop_length(self) -> int:
        """Output tokens at which it stops for good (max_tokens, or where a recorded request stopped)."""
        return self.params.output_tokens or self.params.max_tokens
