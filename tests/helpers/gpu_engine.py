"""A vLLM engine in a process of its own, for tests/gpu/test_trainer_refit_cuda.py: one TP1 engine (the
project's VllmGenerator with the recording refit extension, "uni" executor, on the GPU) joins the
trainer's refit group as rank 1, receives each refit mode asked for, and writes what its loader
got (per mode), the peak GPU memory each refit added, and greedy generations with the engine's
logprobs (before any refit too), whether the engine runs CUDA graphs, and the model's tensors that
the refits moved (tests.helpers.refit: none may move while graphs replay their captured addresses).

    python -m tests.helpers.gpu_engine '{"model": DIR, "device": "cuda", "dtype": "bfloat16", "port": P,
                                         "backend": "gloo", "modes": ["merged", "merged_delta"],
                                         "prompts": [[...], ...], "out": DIR, "enforce_eager": "auto"}'

gloo, not NCCL: one GPU cannot hold two ranks of one NCCL communicator (the trainer is rank 0 on
the same GPU); the buckets then cross through host memory, the loader and the merges run on the GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    from safetensors.torch import save_file

    from tests.helpers.generator import RecordingGenerator, recording_config
    from workers.refit.transports import BroadcastTransport

    args = json.loads(argv[0])
    out = Path(args["out"])
    cuda = args["device"] == "cuda"
    config = recording_config(model=args["model"], device=args["device"], dtype=args["dtype"], max_model_len=256,
                              gpu_memory_utilization=args.get("gpu_memory_utilization", 0.25),
                              kv_cache_memory_bytes=32 * 2**20, seed=0,
                              enforce_eager=args.get("enforce_eager", "auto"))
    t0 = time.time()
    engine = RecordingGenerator(config)
    mode_of_graphs = engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    report = {"engine_start_s": round(time.time() - t0, 1), "executor": config.executor_class(), "modes": {},
              "eager": config.eager(), "cudagraph_mode": mode_of_graphs.name,
              "storage": engine.llm.collective_rpc("refit_storage_mark")[0]["with_data"],
              "base": [[g.token_ids, g.logprobs]
                       for g in engine.generate(args["prompts"], temperature=0.0, max_tokens=8, ignore_eos=True)]}
    engine.open_refit_group("127.0.0.1", args["port"], world_size=2, rank_offset=1, backend=args["backend"],
                            timeout_s=args.get("timeout_s", 600))
    for mode in args["modes"]:
        engine.refit_record(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        result = engine.apply_refit(BroadcastTransport.expect(mode))
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        save_file({n: t.contiguous() for n, t in engine.refit_recorded().items()}, str(out / f"{mode}.safetensors"))
        engine.refit_record(False)
        gens = engine.generate(args["prompts"], temperature=0.0, max_tokens=8, ignore_eos=True)
        report["modes"][mode] = {"peak_bytes": peak, "buckets": result["buckets"], "bytes": result["bytes"],
                                 "seconds": round(result["seconds"], 3),
                                 "generations": [[g.token_ids, g.logprobs] for g in gens]}
    report["moved"] = engine.llm.collective_rpc("refit_storage_moved")[0]
    (out / "report.json").write_text(json.dumps(report))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
