"""kvtrace's engine on a benchmark workload: a fresh engine per run, with the Parquet tracer or none."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.run_result import RunResult
from benchmarks.workload import Request
from engine.build import build_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_weights
from engine.sequence import SamplingParams
from kvtrace.record.recorder import TraceWriter

MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Outside the repository: the exported weights are 538 MB."""
    return Path(os.environ.get("KVTRACE_BENCH_CACHE") or Path.home() / ".cache" / "kvtrace-bench")


def ensure_weights(folder: Path | None = None) -> Path:
    """The SmolLM2-135M fp32 HF folder every engine loads; exported once (`kvtrace model export`)."""
    folder = folder or cache_dir() / f"{MODEL}-hf"
    if not (folder / "model.safetensors").is_file():
        from engine.model.export import export_hf_folder

        print(f"exporting {MODEL} to {folder} (once)", flush=True)
        export_hf_folder(MODEL, folder)
    return folder


class KvtraceRunner:
    """Loads the weights once; every run gets a new engine so no run sees another's prefix cache."""

    def __init__(self, weights_dir: Path, *, block_size: int, num_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int | None = None,
                 loaded: LoadedModel | None = None) -> None:
        self.weights_dir = weights_dir
        self.loaded = loaded or load_weights(str(weights_dir))
        self.config = EngineConfig(model=str(weights_dir), block_size=block_size, num_gpu_blocks=num_blocks,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, preemption_mode="recompute")
        self._warm = False

    def engine(self, tracer=None) -> LLMEngine:
        return build_engine(self.config, tracer=tracer, loaded=self.loaded)

    def warm_up(self, requests: list[Request]) -> None:
        """One short untimed generation, so the first timed run does not pay for first calls."""
        engine = self.engine()
        for r in requests[:2]:
            engine.add_request(r.id, r.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
        while engine.has_unfinished():
            engine.step()
        self._warm = True

    def run(self, requests: list[Request], *, traced: bool) -> RunResult:
        """All requests at t=0; tokens stamped when `step()` returns them. Traced: the trace is
        closed (every chunk on disk) inside the timed span."""
        if not self._warm:
            self.warm_up(requests)
        trace_dir = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
        try:
            writer = TraceWriter(trace_dir, "bench") if traced else None
            engine = self.engine(writer)
            tokens: dict[str, list[int]] = {r.id: [] for r in requests}
            times: dict[str, list[float]] = {r.id: [] for r in requests}
            t0 = time.perf_counter()
            engine.time_origin = t0
            for r in requests:
                engine.add_request(r.id, r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                   arrival_s=0.0)
            while engine.has_unfinished():
                emitted = engine.step()
                now = time.perf_counter() - t0
                for seq, token in emitted:
                    tokens[seq.req_id].append(token)
                    times[seq.req_id].append(now)
            engine.flush()
            if writer is not None:
                writer.close()
            duration = time.perf_counter() - t0
            hits = sum(s.num_prefix_hit_tokens for s in engine.outputs.values())
            return RunResult(duration, tokens, times, engine.num_preemptions, hits)
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
