"""Time to reward: wall-clock and steps until a run's reward reaches a target, sync vs pipelined.

What a user of `grpo.pipeline` wants to know is not the step time (benchmarks/pipeline.py) but how
soon a run reaches a reward: a pipelined step is shorter, but its samples come from weights
`max_lag` steps older than the ones it trains, which can cost learning per step. Each run here is
`python -m launcher` (the embedded default: tiny_llama, 2 trainer ranks TP=2, one vLLM engine, the
say_number demo) for `--steps` steps, checkpointing off, with the trainer ranks and the vLLM engine
pinned to separate cores as on a cluster (benchmarks/pipeline.py's pinning: the first half of this
process's CPUs for the trainers, the second half for the engine). Per workload, variant and seed,
the modes run one after the other (sync, pipelined max_lag 1, pipelined max_lag 2; the order turns
with the seed).

Reaching the target: the first step at which the mean `train/reward` of the last `--window` steps
is at least the target. Seconds to it: the sum of `timing/total_step` up to that step (start-up,
the same for every mode, is left out). A pipelined step's reward is that of samples from weights
`max_lag` steps older, so the pipelined runs show a reward up to `max_lag` steps later than their
weights earned it: counted against them here, as a user sees it in the log.

Workloads: `demo` (the embedded default: 8 new tokens) and `balanced` (`grpo.max_new_tokens=32`,
benchmarks/pipeline.py's: generation and logprobs + training + refit take similar time, where the
pipeline can overlap the most). Variants change the learning setup for every mode, e.g. to see
what makes the pipeline win: `--variant lr2e-3=optim.lr=2e-3,optim.min_lr=2e-3`.

    python benchmarks/time_to_reward.py [--workloads demo balanced] [--seeds 1234 1 2] [--steps 50]
        [--target demo=0.6 --target balanced=0.4] [--window 5] [--modes sync lag1 lag2]
        [--variant NAME=key=value,key=value ...]

Timings on a shared machine are noisy: the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import ACTOR_LINE, cpus, pin  # noqa: E402  (benchmarks/ is a directory of scripts)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WORKLOADS = {"demo": [], "balanced": ["grpo.max_new_tokens=32"]}
TARGETS = {"demo": 0.6, "balanced": 0.4}
MODES = {"sync": [], "lag1": ["grpo.pipeline.enabled=true", "grpo.pipeline.max_lag=1"],
         "lag2": ["grpo.pipeline.enabled=true", "grpo.pipeline.max_lag=2"]}


def run(overrides: list[str], steps: int, root: Path, name: str, cores: dict[str, set[int]], timeout: float) -> dict:
    cmd = [PY, "-m", "launcher", f"grpo.max_num_steps={steps}", f"run.root={root}", f"run.name={name}",
           "checkpointing.enabled=false", "logging.tensorboard=false", *overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: list[str] = []
    for line in proc.stdout:
        m = ACTOR_LINE.match(line)
        if m:
            pin(int(m.group(2)), cores["train" if m.group(1).startswith("trainer") else "generation"])
        tail = (tail + [line.rstrip()])[-25:]
        if time.time() - t0 > timeout:
            proc.kill()
            tail.append(f"(killed after {timeout:.0f}s)")
            break
    rc = proc.wait()
    metrics = root / name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return {"rc": rc, "rows": [r for r in rows if "train/reward" in r], "tail": tail, "wall_s": time.time() - t0}


def reached(rows: list[dict], target: float, window: int) -> dict:
    """Steps and seconds (sum of timing/total_step) until the windowed mean reward >= target."""
    rewards = [float(r["train/reward"]) for r in rows]
    seconds = 0.0
    best = float("-inf")
    for i, r in enumerate(rows):
        seconds += float(r["timing/total_step"])
        if i + 1 >= window:
            avg = statistics.fmean(rewards[i + 1 - window:i + 1])
            best = max(best, avg)
            if avg >= target:
                return {"steps": int(r["step"]), "seconds": seconds, "best": avg}
    return {"steps": None, "seconds": None, "best": best if rows else None}


def mean_of(rows: list[dict], key: str, first: int | None = None) -> float | None:
    values = [float(r[key]) for r in rows[:first] if key in r and r[key] is not None]
    return statistics.fmean(values) if values else None


def summary(rows: list[dict], target: float, window: int) -> dict:
    r = reached(rows, target, window)
    return {**r, "step_s": mean_of(rows[3:], "timing/total_step"), "last": mean_of(rows[-window:], "train/reward"),
            "off_policy_kl": mean_of(rows, "pipeline/off_policy_kl", 20),
            "is_weight": mean_of(rows, "train/is_weight_mean", 20),
            "clip_low": mean_of(rows, "train/clip_fraction_low", 20),
            "clip_high": mean_of(rows, "train/clip_fraction_high", 20),
            "n": len(rows)}


def fmt(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


def table(results: list[dict], steps: int) -> str:
    out = ["| workload | variant | mode | target | reached (seeds) | steps to target (median) | s to target (median) | "
           "vs sync | step s | reward, last window (mean) | off-policy KL, first 20 steps | IS weight, first 20 | "
           "clip low / high, first 20 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["variant"], r["mode"]), []).append(r)
    aggs: dict[tuple, dict] = {}
    for key, rs in groups.items():
        hit = [r["s"] for r in rs if r["s"]["steps"] is not None]
        agg = {k: (statistics.fmean(r["s"][k] for r in rs if r["s"][k] is not None)
                   if any(r["s"][k] is not None for r in rs) else None)
               for k in ("step_s", "last", "off_policy_kl", "is_weight", "clip_low", "clip_high")}
        agg.update(hit=len(hit), runs=len(rs), target=rs[0]["target"],
                   steps=statistics.median(x["steps"] for x in hit) if hit else None,
                   seconds=statistics.median(x["seconds"] for x in hit) if hit else None)
        aggs[key] = agg
    for (w, v, m), a in aggs.items():
        base = aggs.get((w, v, "sync"), {}).get("seconds")
        ratio = f"{a['seconds'] / base:.2f}x" if a["seconds"] is not None and base else ""
        never = f"> {steps}"
        out.append(f"| {w} | {v} | {m} | {a['target']:g} | {a['hit']}/{a['runs']} | {fmt(a['steps'], '.0f', never)} | "
                   f"{fmt(a['seconds'], '.1f', 'not reached')} | {ratio} | {fmt(a['step_s'])} | {fmt(a['last'])} | "
                   f"{fmt(a['off_policy_kl'], '.4f')} | {fmt(a['is_weight'])} | "
                   f"{fmt(a['clip_low'])} / {fmt(a['clip_high'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1234, 1, 2], help="run.seed of each repeat")
    ap.add_argument("--steps", type=int, default=50, help="GRPO steps per run (the target may not be reached)")
    ap.add_argument("--window", type=int, default=5, help="steps in the moving mean of the reward")
    ap.add_argument("--target", action="append", default=[], help="WORKLOAD=REWARD (demo=0.6, balanced=0.4)")
    ap.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value: overrides of every "
                                                                    "mode (default: one variant, 'as shipped')")
    ap.add_argument("--train-cores", default=None, help="CPU list for the trainer ranks, e.g. 0 or 0-3")
    ap.add_argument("--generation-cores", default=None, help="CPU list for the vLLM engine, e.g. 1 or 4-7")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--json", default=None, help="also write every run's summary here")
    args = ap.parse_args(argv)
    targets = dict(TARGETS)
    for t in args.target:
        w, _, value = t.partition("=")
        targets[w] = float(value)
    variants = {"as shipped": []}
    if args.variant:
        variants = {}
        for v in args.variant:
            name, _, overrides = v.partition("=")
            variants[name] = [o for o in overrides.split(",") if o]
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2 and not (args.train_cores and args.generation_cores):
        ap.error("needs at least 2 CPUs to pin the two halves apart")
    cores = {"train": cpus(args.train_cores) or set(mine[: len(mine) // 2]),
             "generation": cpus(args.generation_cores) or set(mine[len(mine) // 2:])}
    print(f"trainer ranks on CPUs {sorted(cores['train'])}, vLLM engine on CPUs {sorted(cores['generation'])}",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-ttr-"))
    results = []
    try:
        for workload in args.workloads:
            for variant, extra in variants.items():
                for i, seed in enumerate(args.seeds):
                    order = args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]
                    for mode in order:
                        name = f"{workload}-{len(results)}-{mode}-s{seed}"
                        load = os.getloadavg()
                        r = run(WORKLOADS[workload] + extra + MODES[mode] + [f"run.seed={seed}"], args.steps, root,
                                name, cores, args.timeout)
                        s = summary(r["rows"], targets[workload], args.window) if r["rc"] == 0 else None
                        print(f"{workload:<8} {variant:<12} {mode:<5} seed {seed:<5}: "
                              + (f"target {targets[workload]:g} at step {fmt(s['steps'], '.0f', 'never')} "
                                 f"({fmt(s['seconds'], '.1f', '-')} s), {fmt(s['step_s'])} s/step, last reward "
                                 f"{fmt(s['last'])}" if s else f"FAILED rc={r['rc']}")
                              + f"; {r['wall_s']:.0f}s wall, load {load[0]:.1f} at start", flush=True)
                        if s is None:
                            print("    " + "\n    ".join(r["tail"][-10:]), flush=True)
                            continue
                        results.append({"workload": workload, "variant": variant, "mode": mode, "seed": seed,
                                        "target": targets[workload], "s": s,
                                        "rewards": [float(x["train/reward"]) for x in r["rows"]]})
                        shutil.rmtree(root / name, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    print(f"Reward reached: the mean train/reward of {args.window} consecutive steps; seconds: sum of "
          f"timing/total_step (start-up left out); {args.steps} steps per run")
    print(table(results, args.steps))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
