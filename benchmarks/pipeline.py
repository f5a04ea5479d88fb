"""Pipelined vs sync GRPO: step time side by side, against the bound of a perfect overlap.

On a real cluster the trainer ranks and the vLLM engines live on different nodes; here they share
one machine, so the benchmark pins them to separate cores (by default the first half of this
process's CPUs for the trainer ranks, the second half for the vLLM engine): it reads the actors'
pids from the launcher's "actor logs" lines and sets the CPU affinity of every thread of those
processes (and their children) as soon as they are printed, before step 1. Nothing in the product
pins anything. The driver, Ray's own processes and the reward workers run where the OS puts them.

Each mode runs `python -m launcher` (the embedded default: tiny_llama, 2 trainer ranks TP=2, one
vLLM engine) with the same workload, `--steps` steps, checkpointing off, one after the other
(alternating the order between repeats). The default workload has longer responses than the
demo (`grpo.max_new_tokens=32`), so that generation and training take similar time. From each
run's metrics.jsonl, over the steps after the first `--skip` (start-up warm-up; the pipeline's
ramp):

  step       timing/total_step (mean)
  parts      generation, logprobs, training, refit (timing/transfer_and_update_weights)
  bound      max(generation, logprobs + training + refit) per step, mean: the step of a perfect
             overlap, measured in the same run
  exposed    timing/exposed_generation: the loop waited for a rollout (pipelined)
  idle       timing/idle_generation: the engine waited for weights (pipelined)

and reports pipelined step / bound (goal: within 1.15), the speedup sync step / pipelined step,
and beside it the ideal speedup (sum of parts / bound, from the pipelined run).

    python benchmarks/pipeline.py [--steps 24] [--repeats 1] [--skip 3] [overrides ...]

Timings on a shared machine are noisy: the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WORKLOAD = ["grpo.max_new_tokens=32"]
MODES = {"sync": [], "pipelined": ["grpo.pipeline.enabled=true"]}
ACTOR_LINE = re.compile(r"^\s+(trainer rank \d+|vLLM engine \d+): .*-pid(\d+)\.log\s*$")
PARTS = [("generation", "timing/generation"), ("logprobs", "timing/logprobs"), ("training", "timing/training"),
         ("refit", "timing/transfer_and_update_weights")]


def pin(pid: int, cores: set[int]) -> int:
    """Every thread of `pid` and of its children onto `cores`; how many threads were pinned."""
    import psutil

    n = 0
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        for tid in os.listdir(f"/proc/{proc.pid}/task") if os.path.isdir(f"/proc/{proc.pid}/task") else []:
            try:
                os.sched_setaffinity(int(tid), cores)
                n += 1
            except (ProcessLookupError, PermissionError, OSError):
                pass
    return n


def run_mode(mode: str, steps: int, root: Path, rep: int, overrides: list[str], cores: dict[str, set[int]],
             timeout: float) -> dict:
    name = f"pipeline-{mode}-{rep}"
    cmd = [PY, "-m", "launcher", f"grpo.max_num_steps={steps}", f"run.root={root}", f"run.name={name}",
           "checkpointing.enabled=false", "logging.tensorboard=false", *WORKLOAD, *MODES[mode], *overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: list[str] = []
    pinned = []
    for line in proc.stdout:
        m = ACTOR_LINE.match(line)
        if m:
            role = "train" if m.group(1).startswith("trainer") else "generation"
            pinned.append((m.group(1), int(m.group(2)), pin(int(m.group(2)), cores[role])))
        tail = (tail + [line.rstrip()])[-25:]
        if time.time() - t0 > timeout:
            proc.kill()
            tail.append(f"(killed after {timeout:.0f}s)")
            break
    rc = proc.wait()
    metrics = root / name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return {"mode": mode, "rc": rc, "rows": rows, "tail": tail, "pinned": pinned, "wall_s": time.time() - t0}


def summarize(runs: list[dict], skip: int) -> dict | None:
    rows = [r for run in runs if run["rc"] == 0 for r in run["rows"] if r["step"] > skip]
    if not rows:
        return None
    mean = lambda f: statistics.fmean(f(r) for r in rows)  # noqa: E731
    s = {label: mean(lambda r, k=key: float(r.get(k, 0.0))) for label, key in PARTS}
    s["step"] = mean(lambda r: float(r["timing/total_step"]))
    s["bound"] = mean(lambda r: max(float(r["timing/generation"]), sum(float(r.get(k, 0.0)) for _, k in PARTS[1:])))
    s["sum"] = sum(s[label] for label, _ in PARTS)
    s["exposed"] = mean(lambda r: float(r.get("timing/exposed_generation", r["timing/generation"])))
    s["idle"] = mean(lambda r: float(r.get("timing/idle_generation", 0.0)))
    s["steps"] = len(rows)
    s["reward_last"] = statistics.fmean(float(r["train/reward"]) for r in runs[0]["rows"][-5:])
    return s


def table(results: dict[str, dict | None]) -> str:
    lines = ["| mode | steps | step s | generation | logprobs | training | refit | sum of parts | bound | "
             "step / bound | exposed gen. | idle gen. | reward (last 5) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in results.items():
        if s is None:
            lines.append(f"| {mode} | failed |" + " |" * 11)
            continue
        lines.append(f"| {mode} | {s['steps']} | {s['step']:.3f} | {s['generation']:.3f} | {s['logprobs']:.3f} | "
                     f"{s['training']:.3f} | {s['refit']:.3f} | {s['sum']:.3f} | {s['bound']:.3f} | "
                     f"{s['step'] / s['bound']:.2f} | {s['exposed']:.3f} | {s['idle']:.3f} | {s['reward_last']:.3f} |")
    sync, piped = results.get("sync"), results.get("pipelined")
    if sync and piped:
        lines += ["", f"speedup sync / pipelined: {sync['step'] / piped['step']:.2f}x; ideal (sum of parts / bound): "
                      f"{piped['sum'] / piped['bound']:.2f}x with the pipelined run's parts, "
                      f"{sync['sum'] / sync['bound']:.2f}x with the sync run's; pipelined step / its bound: "
                      f"{piped['step'] / piped['bound']:.2f} (goal <= 1.15)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="GRPO steps per run")
    ap.add_argument("--skip", type=int, default=3, help="first steps not counted (warm-up, the pipeline's ramp)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (fresh run each)")
    ap.add_argument("--train-cores", default=None, help="CPU list for the trainer ranks, e.g. 0 or 0-3")
    ap.add_argument("--generation-cores", default=None, help="CPU list for the vLLM engine, e.g. 1 or 4-7")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("overrides", nargs="*", help="extra launcher overrides (key=value)")
    args = ap.parse_args(argv)
    if args.steps <= args.skip:
        ap.error("--steps must exceed --skip")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2 and not (args.train_cores and args.generation_cores):
        ap.error("needs at least 2 CPUs to pin the two halves apart")
    cores = {"train": cpus(args.train_cores) or set(mine[: len(mine) // 2]),
             "generation": cpus(args.generation_cores) or set(mine[len(mine) // 2:])}
    print(f"trainer ranks on CPUs {sorted(cores['train'])}, vLLM engine on CPUs {sorted(cores['generation'])}; "
          f"workload {' '.join(WORKLOAD + args.overrides)}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for rep in range(args.repeats):
            for mode in (list(MODES) if rep % 2 == 0 else list(MODES)[::-1]):
                load = os.getloadavg()
                r = run_mode(mode, args.steps, root, rep, args.overrides, cores, args.timeout)
                runs[mode].append(r)
                print(f"{mode:<10} rep {rep}: {'ok' if r['rc'] == 0 else 'FAILED rc=%d' % r['rc']}, {len(r['rows'])} "
                      f"steps, {r['wall_s']:.0f}s wall, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start; "
                      f"pinned {', '.join(f'{who} ({n} threads)' for who, _, n in r['pinned'])}", flush=True)
                if r["rc"] != 0:
                    print("    " + "\n    ".join(r["tail"][-10:]), flush=True)
    finally:
        if args.keep:
            print(f"run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    results = {m: summarize(rs, args.skip) for m, rs in runs.items()}
    print()
    print(f"Per step, mean over steps {args.skip + 1}..{args.steps} (seconds)")
    print(table(results))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0 if all(results.values()) else 1


def cpus(spec: str | None) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}."""
    out: set[int] = set()
    for part in (spec or "").split(","):
        if part.strip():
            lo, _, hi = part.partition("-")
            out |= set(range(int(lo), int(hi or lo) + 1))
    return out


if __name__ == "__main__":
    sys.exit(main())
