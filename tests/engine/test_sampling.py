"""sample() (engine/executor/model_runner.py): what the host reads from the device to pick a step's
tokens, and that the seeded draws are those of sampling row by row."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.executor.model_runner import sample
from engine.sequence import SamplingParams

READS = {"cpu", "tolist", "item", "numpy", "__int__", "__float__", "to"}


class CountingLogits(torch.Tensor):
    """Logits that stand for a device's: each time the host reads them or a tensor computed from them
    counts (on CUDA a copy to the host and a wait for the device); what a read returns is the host's."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if getattr(func, "__name__", "") in READS:
            CountingLogits.reads += 1
            if isinstance(result, CountingLogits):
                result = result.as_subclass(torch.Tensor)
        return result


def seqs_for(params: list[SamplingParams]) -> list[SimpleNamespace]:
    return [SimpleNamespace(params=p, generator=torch.Generator().manual_seed(10 + i)) for i, p in enumerate(params)]


PARAMS = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
          SamplingParams(), SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=1.3)]


def row_by_row(logits: torch.Tensor, seqs) -> list[int]:
    """The former sample(): one copy to the host per non-greedy row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            continue
        probs = torch.softmax(logits[row].float().cpu() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens


def test_the_host_reads_the_logits_twice_at_most_however_many_rows_sample():
    logits = torch.randn(len(PARAMS), 300, generator=torch.Generator().manual_seed(0))
    for params in (PARAMS, [p for p in PARAMS if not p.greedy], [SamplingParams()] * 3):
        rows = logits[:len(params)].as_subclass(CountingLogits)
        CountingLogits.reads = 0
        sample(rows, seqs_for(params))
        assert CountingLogits.reads <= 2, (len(params), CountingLogits.reads)


def test_the_draws_are_those_of_sampling_row_by_row():
    logits = torch.randn(len(PARAMS), 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for params in (PARAMS, [p for p in PARAMS if not p.greedy]):
        n = len(params)
        assert sample(logits[:n], seqs_for(params)) == row_by_row(logits[:n], seqs_for(params))
