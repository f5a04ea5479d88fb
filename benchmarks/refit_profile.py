"""Where the trainer side of a merged refit goes: export, the merge, the object store, vs memcpy.

One trainer as a plain object in this process (workers.trainer.actor.MegatronTrainer, TP=1,
LoRA dim 16 on all linears, float32) and a local Ray for the object store. The process gets the
trainer actors' environment (workers.process_env: transparent huge pages for PyTorch's CPU
allocations) unless --no-actor-env. Each part is timed on its own (median of --repeats, after one
warm call), on the merged mode's full payload:

  base export        drain the Bridge's export_hf_weights(merge_adapter_weights=False): the
                     base weights under HF names (QKV split, conversion tasks built once)
  LoRA factors       trainer.adapter_state() + workers.lora.layout.hf_lora_groups: the factors,
                     TP-gathered, in HF layout
  merge              workers.lora.layout.merge_lora_weight of every wrapped weight into buffers
                     of a pool (workers.refit.buffers): B @ A written once, scaled and added in place
  export_merged      the three above as a refit runs them (trainer.export_merged into the pool)
  Bridge's merge     export_hf_weights(merge_adapter_weights=True): the Bridge's merged export,
                     what export_merged() was before (three fresh full-size tensors per weight)
  ray.put            the merged tensors' bytes into the object store, one list per bucket (the
                     store's copy: what the Ray transport does)
  payload (total)    trainer.refit_payload("merged", bucket_mb): what a refit calls on rank 0
  memcpy             one copy of the same bytes into memory already touched: the floor

    OMP_NUM_THREADS=1 python benchmarks/refit_profile.py [--model llama_100m] [--repeats 5] [--alpha 32]
        [--no-actor-env] [--cprofile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--no-actor-env" not in sys.argv:  # before torch is imported: PyTorch reads it once
    from workers.process_env import ACTOR_ENV

    os.environ.update(ACTOR_ENV)


def median_time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama_100m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--alpha", type=float, default=32, help="LoRA alpha (dim 16): 32 is the one-pass merge, 40 not")
    p.add_argument("--no-actor-env", action="store_true", help="without workers.process_env's environment")
    p.add_argument("--cprofile", action="store_true", help="also print the top functions of export_merged")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "refit_bench_models"))
    a = p.parse_args(argv)

    import ray
    import torch

    from launcher.cluster.ray_node import free_port
    from workers import tiny_models
    from workers.lora import layout as lora_layout
    from workers.refit import wire
    from workers.refit.buffers import BufferPool
    from workers.trainer.actor import MegatronTrainer, TrainerConfig

    torch.set_num_threads(1)
    model_dir = tiny_models.build(Path(a.cache) / a.model, a.model)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1536 * 2**20, log_to_driver=False)
    peft = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "dim": 16, "alpha": a.alpha, "lora_B_init_method": "xavier"}
    cfg = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=peft,
                                      optim={"lr": 1e-4, "min_lr": 1e-4}, seed=1)
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
    pairs = [(n, t.clone()) for n, t in trainer.export_merged()]
    bridge = [(n, t.clone()) for n, t in trainer._export_hf(merge_adapters=True)]
    assert [n for n, _ in pairs] == [n for n, _ in bridge] and all(torch.equal(x, y) for (_, x), (_, y) in
                                                                     zip(pairs, bridge)), "not the Bridge's bits"
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    buckets = wire.plan_buckets([t.numel() * t.element_size() for _, t in pairs], int(a.bucket_mb * 2**20))

    base = [(n, t.clone()) for n, t in trainer._bridge_export(merge_adapters=False)]
    layout = lora_layout.ModelLayout.from_facts(trainer.cfg.facts)
    groups = lora_layout.hf_lora_groups(layout, trainer.adapter_state())
    factors = {m: (g.lora_a, b) for g in groups for m, b in zip(g.hf_modules, g.lora_b)}
    wrapped = [(n.replace(".base_layer", "")[: -len(".weight")], t) for n, t in base if ".base_layer" in n]
    pool = BufferPool()

    def merge():
        for module, t in wrapped:
            a_, b_ = factors[module]
            out = pool.take(t.shape, t.dtype, t.device)
            lora_layout.merge_lora_weight(t, b_, a_, a.alpha, 16, out=out)
            pool.give_back([out])

    def export_merged():
        for _, t in trainer.export_merged(buffers=pool):
            pool.give_back([t])

    per_bucket, i = [], 0
    for b in buckets:
        n = len(b.offsets)
        per_bucket.append([t.contiguous().reshape(-1).view(torch.uint8).numpy() for _, t in pairs[i:i + n]])
        i += n
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    parts = {
        "base export (Bridge, merge_adapter_weights=False)": lambda: [None for _ in trainer._bridge_export(False)],
        "LoRA factors (adapter_state, HF layout)": lambda: lora_layout.hf_lora_groups(layout, trainer.adapter_state()),
        f"merge ({len(wrapped)} weights, into the pool)": merge,
        "export_merged (the three above, as a refit runs them)": export_merged,
        "Bridge's merged export (what export_merged was)": lambda: [None for _ in trainer._export_hf(True)],
        "ray.put of the merged tensors (one list per bucket)": lambda: [ray.put(x) for x in per_bucket],
        "payload (total, what a refit calls)": lambda: trainer.refit_payload("merged", a.bucket_mb),
        "memcpy of the same bytes (floor)": lambda: dst.copy_(src),
    }
    rows = {k: median_time(fn, a.repeats) for k, fn in parts.items()}
    floor = rows["memcpy of the same bytes (floor)"]
    env = "none" if a.no_actor_env else " ".join(f"{k}={v}" for k, v in ACTOR_ENV.items())
    print(f"\n{a.model}: merged payload {nbytes / 2**20:.1f} MiB in {len(pairs)} tensors, {len(buckets)} bucket(s); "
          f"alpha/dim {a.alpha / 16:g}; actor environment: {env}; load average {os.getloadavg()[0]:.1f}\n")
    print("| part | s (median) | x memcpy |\n|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.3f} | {v / floor:.1f}x |")
    if a.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        export_merged()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    ray.shutdown()


if __name__ == "__main__":
    main()
