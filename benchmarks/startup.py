"""Start-up benchmark: the launcher's time to the end of step 1 next to its parts started alone.

In one run, one after the other (order alternated between repeats), each a fresh process timed
from its start (Popen) to a marker it prints:

  launcher     `python -m launcher` (embedded default: one local Ray node, tiny_llama, LoRA on
               attention, one vLLM engine; checkpointing off) until its `step 1/2` progress line.
               Run with 1 trainer rank (the same work as the parts below) and with the default
               topology (2 ranks, TP=2). Its own start-up breakdown (RUN/startup.json) gives the
               phase table.
  ray          `import ray; ray.init()` (a local head: GCS, raylet, the Python helper processes)
  vllm         `from vllm import LLM; LLM(...)` with the generator's engine settings (float32,
               enforce_eager, uni executor, in-process engine core, 64 MiB KV cache) + one generate
  trainer      the trainer as a plain object in one process, no Ray: Megatron-Bridge build from the
               HF directory, LoRA, optimizer (workers.trainer.actor.MegatronTrainer, 1 rank, TP=1)
               + one train step on a small batch

The goal: launcher <= 1.3 x (ray + the slower of vllm and trainer): the two parts can start at
the same time once Ray is up.

    python benchmarks/startup.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
DONE = re.compile(r"^DONE (\{.*\})$")
STEP1 = re.compile(r"\] step 1/")

RAY = """
import time, json
t = time.time()
import ray
imported = time.time()
ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
print("DONE " + json.dumps({"import ray": imported - t, "ray.init": time.time() - imported}), flush=True)
ray.shutdown()
"""

VLLM = """
import os, time, json, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
t = time.time()
from vllm import LLM, SamplingParams
imported = time.time()
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
          distributed_executor_backend="uni", kv_cache_memory_bytes=64 * 2**20)
up = time.time()
llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=8), use_tqdm=False)
print("DONE " + json.dumps({"import vllm": imported - t, "LLM()": up - imported,
                            "first generate": time.time() - up}), flush=True)
"""

TRAINER = """
import time, json, sys
t = time.time()
import torch
from workers.trainer.actor import MegatronTrainer, TrainerConfig
from launcher.cluster.ray_node import free_port
imported = time.time()
peft = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj"], "dim": 8, "alpha": 16}
cfg = TrainerConfig.from_sections(sys.argv[1], parallel={"tensor_parallel": 1}, peft=peft,
                                  optim={"lr": 1e-3, "min_lr": 1e-3}, seed=1)
trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
built = time.time()
B, T = 8, 24
ids = torch.randint(4, 100, (B, T))
mask = torch.zeros(B, T); mask[:, 12:] = 1.0
batch = {"input_ids": ids, "loss_mask": mask, "generation_logprobs": torch.zeros(B, T),
         "advantages": torch.linspace(-1, 1, B)}
batch["prev_logprobs"] = trainer.logprobs(batch)
trainer.train(batch)
print("DONE " + json.dumps({"imports": imported - t, "build (Bridge, LoRA, optimizer)": built - imported,
                            "logprobs + one train step": time.time() - built}), flush=True)
"""


def timed(cmd: list[str], marker: re.Pattern, timeout: float, cwd: Path = REPO) -> dict:
    """Seconds from Popen to the first line matching `marker`; the DONE json's parts if printed."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(cwd)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    seconds, parts, tail = None, {}, []
    try:
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-30:]
            if seconds is None and marker.search(line):
                seconds = time.time() - t0
                m = DONE.match(line.strip())
                if m:
                    parts = json.loads(m.group(1))
            if time.time() - t0 > timeout:
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if seconds is None:
        raise RuntimeError(f"{cmd[:3]} gave no marker (exit {proc.returncode}):\n" + "\n".join(tail))
    return {"s": seconds, "parts": parts}


def run_launcher(root: Path, name: str, extra: list[str], timeout: float, repo: Path = REPO) -> dict:
    cmd = [PY, "-m", "launcher", f"run.root={root}", f"run.name={name}", "grpo.max_num_steps=2",
           "checkpointing.enabled=false", *extra]
    out = timed(cmd, STEP1, timeout, cwd=repo)
    path = root / name / "startup.json"
    out["startup"] = json.loads(path.read_text()) if path.exists() else None
    return out


def run(repeats: int, timeout: float, baseline: Path | None = None) -> dict[str, list[dict]]:
    from workers import tiny_models

    work = Path(tempfile.mkdtemp(prefix="startup_bench_"))
    # where the launcher looks for its built-in model (run.root/models/<recipe>): built once here,
    # so every launcher run finds it cached and the parts load the same files
    model = tiny_models.build(work / "models" / "tiny_llama", "tiny_llama")
    one_rank = ["topology.train.ranks_per_node=1", "topology.train.tensor_parallel=1"]
    jobs = {
        "launcher (1 trainer rank)": lambda i: run_launcher(work, f"one-{i}", one_rank, timeout),
        "launcher (default: 2 ranks, TP=2)": lambda i: run_launcher(work, f"default-{i}", [], timeout),
        **({f"launcher at {_rev(baseline)} (1 trainer rank)":
            lambda i: run_launcher(work, f"base-{i}", one_rank, timeout, repo=baseline)} if baseline else {}),
        "ray": lambda i: timed([PY, "-c", RAY], DONE, timeout),
        "vllm": lambda i: timed([PY, "-c", VLLM, str(model)], DONE, timeout),
        "trainer": lambda i: timed([PY, "-c", textwrap.dedent(TRAINER), str(model)], DONE, timeout),
    }
    results: dict[str, list[dict]] = {k: [] for k in jobs}
    for i in range(repeats):
        order = list(jobs) if i % 2 == 0 else list(reversed(jobs))
        for name in order:
            r = jobs[name](i)
            results[name].append(r)
            print(f"  repeat {i}: {name:36s} {r['s']:6.1f} s  {json.dumps(r['parts'])}", flush=True)
    return results


def _rev(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or str(repo)


def med(rs: list[dict]) -> float:
    return statistics.median(r["s"] for r in rs)


def tables(results: dict[str, list[dict]]) -> str:
    ray, vllm, trainer = med(results["ray"]), med(results["vllm"]), med(results["trainer"])
    floor = ray + max(vllm, trainer)
    lines = ["| what | seconds to its marker (median) | range | of which (median) |", "|---|---|---|---|"]
    for name, rs in results.items():
        keys = list(rs[0]["parts"]) if rs[0]["parts"] else []
        parts = ", ".join(f"{k} {statistics.median(r['parts'][k] for r in rs):.1f}" for k in keys)
        lines.append(f"| {name} | {med(rs):.1f} | {min(r['s'] for r in rs):.1f}-{max(r['s'] for r in rs):.1f} | "
                     f"{parts} |")
    lines += ["", f"ray + max(vllm, trainer) = {ray:.1f} + {max(vllm, trainer):.1f} = {floor:.1f} s", ""]
    lines += ["| launcher | to end of step 1 s | / (ray + slower part) | goal 1.3x |", "|---|---|---|---|"]
    for name in results:
        if name.startswith("launcher"):
            ratio = med(results[name]) / floor
            lines.append(f"| {name} | {med(results[name]):.1f} | {ratio:.2f}x | {'met' if ratio <= 1.3 else 'not met'} |")
    for name in results:
        if not name.startswith("launcher") or not results[name][0]["startup"]:
            continue
        runs = [r["startup"] for r in results[name] if r["startup"]]
        lines += ["", f"{name}: its own start-up breakdown (median seconds; concurrent parts not added)", "",
                  "| phase | s | parts |", "|---|---|---|"]
        for j, phase in enumerate(runs[0]["phases"]):
            s = statistics.median(run["phases"][j]["seconds"] for run in runs)
            parts = "; ".join(f"{p['name']} {statistics.median(run['phases'][j]['parts'][k]['seconds'] for run in runs):.1f}"
                              for k, p in enumerate(phase["parts"]))
            lines.append(f"| {phase['name']} | {s:.1f} | {parts} |")
        lines.append(f"| total (process start -> end of step 1) | {statistics.median(r['total_s'] for r in runs):.1f} | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout (git worktree) whose launcher runs too, e.g. before a change")
    a = p.parse_args(argv)
    results = run(a.repeats, a.timeout, a.baseline)
    print()
    print(tables(results))


if __name__ == "__main__":
    main()
