"""Vidur's driver for `sim-speed`: runs in Vidur 0.0.26's own venv (scripts/vidur_env.sh), never imports kvtrace.

    python vidur_driver.py '{"trace": ..., "profiles": {"mlp": ..., "attention": ...}, "cache_dir": ..., ...}'

Runs Vidur's simulator once, on its trace-replay request generator, with one replica of
meta-llama/Llama-3-8B on one A100 (TP = PP = 1) under its vLLM replica scheduler, and prints one JSON
line: requests, batches, simulated seconds, the KV blocks Vidur sized, and its own timings.

Vidur 0.0.26 downloads its profiles (and cached predictions) from Hugging Face datasets, which cannot
be reached here; two methods of its predictor are replaced so that it reads the local profiles named on
the command line instead, written in the columns its loaders expect. Everything else, training its
random forests (cached in `cache_dir`), predicting, scheduling and metrics, is Vidur's own code.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time

T_START = time.perf_counter()

# Llama-3-8B's shape as Vidur's loaders filter the profiles on it (vidur/config/model_config.py)
MODEL = {"n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336, "use_gated_mlp": True,
         "vocab_size": 128256}
MLP_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def write_vidur_profiles(profiles: dict[str, str], out_dir: str, block_size: int) -> tuple[str, str]:
    """The trimmed tables of benchmarks/data/vidur/ in the columns of Vidur's own mlp.csv and attention.csv."""
    os.makedirs(out_dir, exist_ok=True)
    mlp_path, attention_path = os.path.join(out_dir, "mlp.csv"), os.path.join(out_dir, "attention.csv")
    with open(profiles["mlp"]) as f_in, open(mlp_path, "w", newline="") as f_out:
        writer = csv.writer(f_out, lineterminator="\n")
        writer.writerow(["num_tokens", *(f"time_stats.{op}.median" for op in MLP_OPS), *MODEL,
                         "num_tensor_parallel_workers"])
        for row in csv.DictReader(f_in):
            writer.writerow([row["num_tokens"], *(row[op] for op in MLP_OPS), *MODEL.values(), 1])
    with open(profiles["attention"]) as f_in, open(attention_path, "w", newline="") as f_out:
        writer = csv.writer(f_out, lineterminator="\n")
        writer.writerow(["n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers",
                         "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill",
                         "time_stats.attn_prefill.median", "time_stats.attn_decode.median",
                         "time_stats.attn_kv_cache_save.median"])
        for row in csv.DictReader(f_in):
            prefill = row["is_prefill"] == "True"
            attn = row["attn_median_ms"]
            writer.writerow([MODEL["n_embd"], MODEL["n_head"], MODEL["n_kv_head"], block_size, 1,
                             row["batch_size"], row["prefill_chunk_size"], row["kv_cache_size"], prefill,
                             attn if prefill else 0, 0 if prefill else attn, row["attn_kv_cache_save_median_ms"]])
    return mlp_path, attention_path


def main(args: dict) -> dict:
    import vidur
    from vidur.config import (
        CacheConfig,
        ClusterConfig,
        MetricsConfig,
        RandomForrestExecutionTimePredictorConfig,
        ReplicaConfig,
        RoundRobinGlobalSchedulerConfig,
        SimulationConfig,
        TraceRequestGeneratorConfig,
        VllmSchedulerConfig,
    )
    from vidur.execution_time_predictor.sklearn_execution_time_predictor import (
        SklearnExecutionTimePredictor,
    )
    from vidur.scheduler.replica_scheduler.vllm_replica_scheduler import (
        VLLMReplicaScheduler,
    )
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    t_imported = time.perf_counter()
    mlp_path, attention_path = write_vidur_profiles(args["profiles"], os.path.join(args["cache_dir"], "profiles"),
                                                    args["block_size"])

    def local_input_files(self):   # in place of the Hugging Face download: (mlp, attention, all-reduce, send-recv)
        return mlp_path, attention_path, mlp_path, mlp_path   # TP = PP = 1: the last two are never read

    def no_hub_predictions(self):
        raise RuntimeError("no Hugging Face hub here: predictions come from the local profiles")

    SklearnExecutionTimePredictor._get_input_files = local_input_files
    SklearnExecutionTimePredictor._load_predictions_from_hf = no_hub_predictions

    config = SimulationConfig(
        seed=args["seed"],
        log_level="warning",
        cluster_config=ClusterConfig(
            num_replicas=1,
            replica_config=ReplicaConfig(model_name="meta-llama/Llama-3-8B", device="a100", network_device="a100_dgx",
                                         tensor_parallel_size=1, num_pipeline_stages=1,
                                         gpu_memory_utilization=args["gpu_memory_utilization"]),
            cache_config=CacheConfig(block_size=args["block_size"]),
            global_scheduler_config=RoundRobinGlobalSchedulerConfig(),
            replica_scheduler_config=VllmSchedulerConfig(batch_size_cap=args["batch_size_cap"],
                                                         max_tokens_in_batch=args["max_tokens_in_batch"])),
        request_generator_config=TraceRequestGeneratorConfig(
            trace_file=args["trace"], prefill_scale_factor=1, decode_scale_factor=1, time_scale_factor=1,
            max_tokens=args["max_tokens"]),
        # Vidur's grid search (3 x 3 x 3 forests, 10-fold) would take hours on 2 cores; one point of its grid
        execution_time_predictor_config=RandomForrestExecutionTimePredictorConfig(
            cache_dir=args["cache_dir"], num_estimators=[250], max_depth=[16], min_samples_split=[2],
            prediction_max_prefill_chunk_size=args["max_tokens_in_batch"],
            prediction_max_tokens_per_request=args["max_tokens"], num_training_job_threads=1),
        # its plots need kaleido's Chrome, which cannot be fetched here; the rest of its outputs as it writes them
        metrics_config=MetricsConfig(output_dir=args["output_dir"], store_plots=False,
                                     write_metrics=args["write_outputs"], enable_chrome_trace=args["write_outputs"]),
    )
    counts = {"batches": 0, "batch_requests": 0}
    on_batch_end = VLLMReplicaScheduler.on_batch_end

    def counting_on_batch_end(self, batch):   # batches and requests per batch, to set beside kvtrace's steps
        counts["batches"] += 1
        counts["batch_requests"] += len(batch.requests)
        on_batch_end(self, batch)

    VLLMReplicaScheduler.on_batch_end = counting_on_batch_end
    set_seeds(config.seed)
    t_config = time.perf_counter()
    simulator = Simulator(config)   # builds the predictor: trains or loads its cached forests
    t_built = time.perf_counter()
    simulator.run()                 # the simulation and Vidur's metrics output
    t_done = time.perf_counter()
    return {
        "vidur_version": vidur.__version__,
        "requests": len(simulator._request_generator.trace_df),
        "batches": counts["batches"],
        "sequence_steps": counts["batch_requests"],
        "num_blocks": int(config.cluster_config.cache_config.num_blocks),
        "simulated_s": simulator._time,
        "import_s": round(t_imported - T_START, 3),
        "predictor_s": round(t_built - t_config, 3),
        "simulate_s": round(t_done - t_built, 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
