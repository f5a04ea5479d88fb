"""Where the trainer side of a merged refit goes: export, packing, the object store, vs memcpy.

One trainer as a plain object in this process (workers.trainer.actor.MegatronTrainer, TP=1,
LoRA dim 16 on all linears, float32) and a local Ray for the object store. Each part is timed on
its own (median of --repeats, after one warm call), on the merged mode's full payload:

  export            drain trainer.export_merged(): Megatron-Bridge's export_hf_weights with the
                    LoRA merge, HF names, the refit guard (tensors already on CPU)
  pack              plan the buckets and copy every tensor into one buffer per bucket
                    (workers.refit.wire.pack_bucket: the broadcast transport's staging copy; the
                    Ray transport puts each tensor's bytes directly since 2026-12-01)
  ray.put           the tensors' bytes into the object store, one list per bucket (one copy,
                    into shared memory): what the Ray transport does
  payload (total)   trainer.refit_payload("merged", bucket_mb): what a refit calls on rank 0
  memcpy            one copy of the same bytes: the floor

    OMP_NUM_THREADS=1 python benchmarks/refit_profile.py [--model llama_100m] [--repeats 3] [--cprofile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--cprofile", action="store_true", help="also print the export's top functions")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "refit_bench_models"))
    a = p.parse_args(argv)

    import ray
    import torch

    from launcher.cluster.ray_node import free_port
    from workers import tiny_models
    from workers.refit import wire
    from workers.trainer.actor import MegatronTrainer, TrainerConfig

    torch.set_num_threads(1)
    model_dir = tiny_models.build(Path(a.cache) / a.model, a.model)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1536 * 2**20, log_to_driver=False)
    peft = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "dim": 16, "alpha": 32, "lora_B_init_method": "xavier"}
    cfg = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=peft,
                                      optim={"lr": 1e-4, "min_lr": 1e-4}, seed=1)
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
    pairs = list(trainer.export_merged())
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    bucket_bytes = int(a.bucket_mb * 2**20)
    sizes = [t.numel() * t.element_size() for _, t in pairs]
    buckets = wire.plan_buckets(sizes, bucket_bytes)

    def pack():
        out, i = [], 0
        for b in buckets:
            n = len(b.offsets)
            out.append(wire.pack_bucket([t for _, t in pairs[i:i + n]], b))
            i += n
        return out

    per_bucket, i = [], 0
    for b in buckets:
        n = len(b.offsets)
        per_bucket.append([t.contiguous().reshape(-1).view(torch.uint8).numpy() for _, t in pairs[i:i + n]])
        i += n
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    rows = {
        "export (Bridge export_hf_weights + merge)": median_time(lambda: [None for _ in trainer.export_merged()], a.repeats),
        "pack (one buffer per bucket: broadcast only)": median_time(pack, a.repeats),
        "ray.put of the tensors (one list per bucket)": median_time(lambda: [ray.put(x) for x in per_bucket],
                                                                    a.repeats),
        "payload (total, what a refit calls)": median_time(lambda: trainer.refit_payload("merged", a.bucket_mb),
                                                           a.repeats),
        "memcpy of the same bytes (floor)": median_time(lambda: dst.copy_(src), a.repeats),
    }
    floor = rows["memcpy of the same bytes (floor)"]
    print(f"\n{a.model}: merged payload {nbytes / 2**20:.1f} MiB in {len(pairs)} tensors, {len(buckets)} bucket(s)\n")
    print("| part | s (median) | x memcpy |\n|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.3f} | {v / floor:.1f}x |")
    if a.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in trainer.export_merged():
            pass
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    ray.shutdown()


if __name__ == "__main__":
    main()
