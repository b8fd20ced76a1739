"""A production-like workload generator: log-normal lengths, Poisson or bursty arrivals,
shared system prompts and multi-turn conversations.

Defaults follow public chat traces (Azure LLM inference 2023, conversation): prompts median about
1,000 tokens, outputs median about 130, both roughly log-normal. `scale` shrinks every length by the
same factor, which keeps the distributions' shape (a log-normal scaled is a log-normal with the same
sigma), so that a CPU replay of the same shape takes a minute instead of an hour.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtrace.workload.format import WorkloadRequest, synthetic_ids

# Presets: settings over SynthConfig's defaults. Sized for a CPU replay with scale 0.2 (about 50
# requests over 25 s); on a GPU raise rate and num_requests and drop the scale.
PRESETS: dict[str, dict] = {
    "chat": {"rate": 2.0, "cv": 1.0, "num_requests": 50},
    "bursty": {"rate": 2.0, "cv": 3.0, "num_requests": 50},
    "shared-prefix": {"rate": 2.0, "cv": 1.0, "num_requests": 50, "prefix_groups": 4,
                      "prefix_tokens": 1024, "prompt_median": 300.0},
    "long-context": {"rate": 0.5, "cv": 1.0, "num_requests": 20, "prompt_median": 6000.0,
                     "prompt_sigma": 0.4, "output_median": 200.0, "output_sigma": 0.6},
    # one assistant's traffic: every request opens with the same system prompt, user messages are
    # short, arrivals come in bursts, and answers have a long tail (a few run to the output cap)
    "assistant": {"rate": 3.0, "cv": 4.0, "num_requests": 70, "prefix_groups": 1, "prefix_tokens": 800,
                  "prompt_median": 100.0, "prompt_sigma": 0.5, "output_median": 250.0, "output_sigma": 1.3},
}


@dataclass
class SynthConfig:
    """Everything `generate` needs; lengths are in tokens before `scale` is applied."""

    num_requests: int | None = None      # stop after this many requests
    duration_s: float | None = None      # or: no (first-turn) arrival at or after this time
    rate: float = 1.0                    # requests (conversations, with turns) per second
    cv: float = 1.0                      # coefficient of variation of inter-arrival gaps; 1 = Poisson
    backlog: bool = False                # everything arrives at t = 0
    prompt_median: float = 1000.0        # log-normal prompt length (the request's own part)
    prompt_sigma: float = 1.0
    output_median: float = 130.0         # log-normal output length (max_tokens)
    output_sigma: float = 0.9
    prompt_len: int | None = None        # fixed prompt length instead of the log-normal
    output_len: int | None = None        # fixed output length instead of the log-normal
    lengths_from: list[tuple[int, int]] | None = None  # (prompt, output) pairs to resample instead
    max_model_len: int = 8192            # prompt + output must fit: the prompt cap is this minus output
    output_cap: int = 2048
    prefix_groups: int = 0               # K shared system prompts; each request belongs to one
    prefix_tokens: int = 0               # length of each shared system prompt
    turns: int = 1                       # turns per conversation (ids made explicit so the cache hits)
    think_time_s: float = 10.0           # mean gap between a conversation's turns (exponential)
    scale: float = 1.0                   # multiplies every length
    seed: int = 0
    vocab_size: int = 32000              # explicit ids (multi-turn) are drawn below this

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration (or a --preset)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_s}")
        if self.backlog and self.num_requests is None:
            raise ValueError("--backlog needs --num-requests (everything arrives at t = 0)")
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if not self.cv >= 0:
            raise ValueError(f"--cv must be >= 0, got {self.cv}")
        for name in ("prompt_median", "output_median", "scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("prompt_sigma", "output_sigma", "think_time_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_s', '').replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("prompt_len", "output_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lengths_from is not None and not self.lengths_from:
            raise ValueError("--lengths-from holds no requests with a token count")
        if self.turns < 1:
            raise ValueError(f"--turns must be at least 1, got {self.turns}")
        if self.prefix_groups < 0 or (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError("--prefix-groups and --prefix-tokens go together, both > 0")
        if self.output_cap < 1 or self.vocab_size < 2:
            raise ValueError("--output-cap must be at least 1 and --vocab-size at least 2")
        if self.scaled(self.prefix_tokens) + self.scaled(self.output_cap) >= self.scaled(self.max_model_len):
            raise ValueError(f"--max-model-len {self.max_model_len} leaves no room for a prompt after "
                             f"--prefix-tokens {self.prefix_tokens} and --output-cap {self.output_cap}")

    def scaled(self, num_tokens: float) -> int:
        """A length after `scale`, at least 1 (0 stays 0)."""
        return 0 if num_tokens == 0 else max(1, round(num_tokens * self.scale))


def next_gap(rng: np.random.Generator, rate: float, cv: float) -> float:
    """One inter-arrival gap: gamma with mean 1/rate and the given CV (shape 1/cv^2; cv 1 = Poisson)."""
    if cv == 0:
        return 1.0 / rate
    shape = 1.0 / cv**2
    return float(rng.gamma(shape, 1.0 / (rate * shape)))


def _arrivals(cfg: SynthConfig, rng: np.random.Generator) -> Iterator[float]:
    """First-turn arrival times: the first at 0, then gaps, up to `duration_s` if set."""
    t = 0.0
    while cfg.duration_s is None or t < cfg.duration_s:
        yield t
        if not cfg.backlog:
            t += next_gap(rng, cfg.rate, cfg.cv)


def _lengths(cfg: SynthConfig, rng: np.random.Generator) -> tuple[int, int]:
    """(own prompt tokens, output tokens) of one request, scaled, output capped."""
    if cfg.lengths_from is not None:
        prompt, output = cfg.lengths_from[int(rng.integers(len(cfg.lengths_from)))]
    else:
        prompt = cfg.prompt_len or rng.lognormal(math.log(cfg.prompt_median), cfg.prompt_sigma)
        output = cfg.output_len or rng.lognormal(math.log(cfg.output_median), cfg.output_sigma)
    return cfg.scaled(prompt), min(cfg.scaled(output), cfg.scaled(cfg.output_cap))


def generate(cfg: SynthConfig) -> list[WorkloadRequest]:
    """The workload `cfg` describes, sorted by arrival; the same config gives the same requests."""
    rng = np.random.default_rng(cfg.seed)
    max_len = cfg.scaled(cfg.max_model_len)
    prefix_tokens = cfg.scaled(cfg.prefix_tokens)
    requests: list[WorkloadRequest] = []
    for conversation, start_s in enumerate(_arrivals(cfg, rng), start=1):
        if cfg.num_requests is not None and len(requests) >= cfg.num_requests:
            break
        group = int(rng.integers(cfg.prefix_groups)) if cfg.prefix_groups else None
        if cfg.turns == 1:
            own, output = _lengths(cfg, rng)
            prompt = min(prefix_tokens + own, max_len - output)
            requests.append(WorkloadRequest(
                id=str(conversation), arrival_s=start_s, prompt_tokens=prompt, max_tokens=output,
                ignore_eos=True, prefix_group=None if group is None else f"sys-{group}",
                prefix_tokens=prefix_tokens if group is not None else None))
            continue
        budget = None if cfg.num_requests is None else cfg.num_requests - len(requests)
        requests += _conversation(cfg, rng, conversation, start_s, group, budget)
    requests.sort(key=lambda req: req.arrival_s)
    return requests


def _conversation(cfg: SynthConfig, rng: np.random.Generator, conversation: int, start_s: float,
                  group: int | None, budget: int | None) -> list[WorkloadRequest]:
    """The turns of one conversation, as explicit ids so that each turn's prompt starts with the last.

      turn 1 prompt: [system prompt][user 1]
      turn 2 prompt: [system prompt][user 1][answer 1][user 2]
    The answers are stand-ins (the model's real answers are not known here), so the prefix cache
    hits the previous turn's prompt, not its answer. A conversation ends early when a later turn
    would not fit `max_model_len`. Turn k+1 arrives a think time after turn k arrived.
    """
    max_len = cfg.scaled(cfg.max_model_len)

    def ids(key: str, num_tokens: int) -> list[int]:
        return synthetic_ids(key, num_tokens, vocab_size=cfg.vocab_size, seed=cfg.seed)

    history = ids(f"prefix:sys-{group}", cfg.scaled(cfg.prefix_tokens)) if group is not None else []
    turns = []
    arrival_s = start_s
    for turn in range(1, cfg.turns + 1):
        own, output = _lengths(cfg, rng)
        if turn == 1:  # like a single-turn request, the first prompt is clipped to fit
            own = min(own, max_len - output - len(history))
        if len(history) + own + output > max_len or (budget is not None and len(turns) >= budget):
            break
        history = history + ids(f"user:{conversation}:{turn}", own)
        turns.append(WorkloadRequest(id=f"c{conversation}-t{turn}", arrival_s=arrival_s,
                                     prompt_token_ids=history, max_tokens=output, ignore_eos=True))
        history = history + ids(f"answer:{conversation}:{turn}", output)
        arrival_s += float(rng.exponential(cfg.think_time_s)) if cfg.think_time_s else 0.0
    return turns
