"""Refit benchmark: bytes moved and seconds per refit, per mode, next to the memory-copy limit.

For each model (tiny_llama, llama_100m) and LoRA target set (attention only, all linears) it
starts the real TrainerGroup (Megatron-Bridge LoRA, TP=1) and two vLLM engines (plain for the
merged modes, LoRA-enabled for `adapter`) on a local Ray, then times refits exactly as the
GRPO driver does them (`ObjectStoreRefit.push`, over the Ray object store). Per mode: one cold refit
(layout, merged_delta's base tensors, adapter load), then `--repeats` warm refits; the table
shows the warm median. `memcpy` is one single-threaded copy of the merged mode's bytes on this
machine, into memory already touched, timed after each warm refit (the median): the floor for
any refit that moves those bytes once, under the same load as the refits. The last column times one greedy
batch after the refits (adapter mode pays LoRA kernels in every decoding step).

    OMP_NUM_THREADS=1 python benchmarks/refit.py [--models tiny_llama llama_100m] [--repeats 5]
        [--modes merged merged_delta adapter] [--targets attention 'all linears']
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from launcher.config.schema import GENERATION_SLOT, REFIT_MODES, TRAIN_SLOT

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGETS = {"attention": ["linear_qkv", "linear_proj"],
           "all linears": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def generate_seconds(generators, prompts: int = 16, tokens: int = 32) -> float:
    """What the mode costs afterwards: one greedy batch (adapter mode runs LoRA kernels in every step)."""
    batch = [[4 + (7 * i + j) % 240 for j in range(24)] for i in range(prompts)]
    generators.generate(batch[:2], temperature=0.0, max_tokens=4, ignore_eos=True)  # warm
    t = time.perf_counter()
    generators.generate(batch, temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return time.perf_counter() - t


def trainer_group(model_dir: Path, targets: list[str], dim: int, alpha: float):
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    peft = {"enabled": True, "target_modules": targets, "dim": dim, "alpha": alpha, "dropout": 0.0,
            "dropout_position": "post", "lora_A_init_method": "xavier", "lora_B_init_method": "xavier",
            "lora_dtype": None, "freeze_moe_router": False}
    config = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=peft,
                                         optim={"lr": 1e-4, "min_lr": 1e-4}, seed=1)
    return TrainerGroup(config, num_ranks=1)


def time_mode(trainers, generators, mode: str, bucket_mb: float, repeats: int) -> dict:
    from workers.refit import control as refit

    sync = refit.ObjectStoreRefit(trainers, generators, mode, bucket_mb)

    def once():
        return sync.push(0)

    cold = once()
    warm, floor = [], []
    for _ in range(repeats):  # the memcpy floor between the refits: the same load as they see
        warm.append(once())
        floor.append(memcpy_seconds(cold.bytes, repeats=1))
    return {"generate_s": generate_seconds(generators), "bytes": cold.bytes, "tensors": cold.tensors,
            "buckets": cold.buckets, "copy_s": statistics.median(floor),
            "cold_s": cold.transfer_and_update_weights_s,
            "s": statistics.median(r.transfer_and_update_weights_s for r in warm),
            "sender_s": statistics.median(r.sender_s for r in warm),
            "receiver_s": statistics.median(r.receiver_s for r in warm)}


def run(models: list[str], repeats: int, bucket_mb: float, dim: int, alpha: float, cache: Path,
        modes: list[str] = list(REFIT_MODES), targets: list[str] = list(TARGETS)) -> list[dict]:
    import ray

    from workers import cpu_shim, tiny_models
    from workers.generator.actor import GeneratorConfig
    from workers.generator.group import GeneratorGroup

    cpu_shim.apply("cpu")  # payload objects come from a megatron process (see docs/benchmarks.md)
    ray.init(num_cpus=4, resources={TRAIN_SLOT: 1, GENERATION_SLOT: 2}, include_dashboard=False,
             object_store_memory=1536 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    rows = []
    try:
        for model in models:
            model_dir = tiny_models.build(cache / model, model)
            slot = [{"resources": {GENERATION_SLOT: 1}, "num_cpus": 1}]
            plain = GeneratorGroup(GeneratorConfig(model=str(model_dir)), slot, ready_timeout_s=600)
            lora = GeneratorGroup(GeneratorConfig(model=str(model_dir), enable_lora=True, max_lora_rank=dim),
                                  slot, ready_timeout_s=600)
            try:
                for label in targets:
                    trainers = trainer_group(model_dir, TARGETS[label], dim, alpha)
                    try:
                        for mode in modes:
                            result = time_mode(trainers, lora if mode == "adapter" else plain, mode, bucket_mb, repeats)
                            rows.append({"model": model, "targets": label, "mode": mode, **result})
                            print(f"  {model:11s} {label:11s} {mode:12s} {result['bytes'] / 2**20:9.2f} MiB "
                                  f"{result['s']:.3f} s (cold {result['cold_s']:.3f} s)", flush=True)
                    finally:
                        trainers.shutdown()
            finally:
                plain.shutdown()
                lora.shutdown()
    finally:
        ray.shutdown()
    for row in rows:
        merged = next((r for r in rows if (r["model"], r["targets"], r["mode"]) == (row["model"], row["targets"], "merged")),
                      row)
        row["bytes_vs_merged"] = row["bytes"] / merged["bytes"]
        row["s_vs_merged"] = row["s"] / merged["s"]
        row["memcpy_s"] = row["copy_s"] if row["mode"] == "merged" else None
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | LoRA on | mode | MiB moved | vs merged | s / refit (warm median) | vs merged "
            "| trainer side s | generator side s | cold s | memcpy of merged bytes s | merged / memcpy "
            "| generate 16x32 tok s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        memcpy = f"{r['memcpy_s']:.4f}" if r["memcpy_s"] is not None else ""
        over = f"{r['s'] / r['memcpy_s']:.0f}x" if r["memcpy_s"] else ""
        lines.append(f"| {r['model']} | {r['targets']} | {r['mode']} | {r['bytes'] / 2**20:.2f} | "
                     f"{r['bytes_vs_merged']:.3f} | {r['s']:.3f} | {r['s_vs_merged']:.2f} | {r['sender_s']:.3f} | "
                     f"{r['receiver_s']:.3f} | {r['cold_s']:.3f} | {memcpy} | {over} | {r['generate_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny_llama", "llama_100m"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--modes", nargs="+", default=list(REFIT_MODES), choices=REFIT_MODES)
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "refit_bench_models"))
    a = p.parse_args(argv)
    rows = run(a.models, a.repeats, a.bucket_mb, a.dim, a.alpha, Path(a.cache), a.modes, a.targets)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
