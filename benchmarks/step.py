"""GRPO step benchmark: where a step's time goes, per refit mode, and the orchestration overhead.

For each refit mode it runs the embedded default (`python -m launcher`: this machine, one local
Ray node, tiny_llama, 2 trainer ranks TP=2, one vLLM engine, 8 prompts x 8 samples x 8 new
tokens) for `--steps` steps in a temporary run root, with `refit.mode=<mode>` and checkpointing
off (a save happens after `timing/total_step` is taken, so it would not change the breakdown;
off, the runs are shorter). Modes run one after the other, alternating their order between
repeats. From the run's metrics.jsonl it takes the mean over the steps after the first (the first
step's generation includes vLLM's warm-up and the first refit's layout) of:

  generation (rollout: prompts -> vLLM -> rewards), logprobs, training, refit
  (timing/transfer_and_update_weights), total (timing/total_step)

and the orchestration overhead = total - (generation + logprobs + training + refit): what the
driver does between the timed phases inside a step (advantages, building the batch tensors, the
train/generation agreement metrics, dict bookkeeping). It also timestamps the launcher's per-step
progress lines as they arrive: "loop s" is the mean interval between two steps' lines, and
"outside step" = loop - total: what each iteration costs outside `timing/total_step`
(metrics.jsonl + TensorBoard write and flush, the progress line).

    python benchmarks/step.py [--modes merged merged_delta adapter] [--steps 12] [--repeats 1]

A mode whose run fails is reported (the error's last lines) and the others still run.
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

from launcher.config.schema import REFIT_MODES as MODES

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PHASES = [("generation", "timing/generation"), ("logprobs", "timing/logprobs"), ("training", "timing/training"),
          ("refit", "timing/transfer_and_update_weights")]
PROGRESS = re.compile(r"\] step (\d+)/(\d+) ")


def run_mode(mode: str, steps: int, root: Path, rep: int, extra: list[str], timeout: float) -> dict:
    name = f"step-{mode}-{rep}"
    cmd = [PY, "-m", "launcher", f"grpo.max_num_steps={steps}", f"refit.mode={mode}", f"run.root={root}",
           f"run.name={name}", "checkpointing.enabled=false", *extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen: dict[int, float] = {}
    tail: list[str] = []
    deadline = t0 + timeout
    for line in proc.stdout:  # the launcher flushes every line
        now = time.time()
        m = PROGRESS.search(line)
        if m:
            seen[int(m.group(1))] = now
        tail = (tail + [line.rstrip()])[-25:]
        if now > deadline:
            proc.kill()
            tail.append(f"(killed after {timeout:.0f}s)")
            break
    rc = proc.wait()
    out = {"mode": mode, "rep": rep, "rc": rc, "wall_s": time.time() - t0, "tail": tail}
    rows = [json.loads(ln) for ln in (root / name / "metrics.jsonl").read_text().splitlines() if ln.strip()] \
        if (root / name / "metrics.jsonl").is_file() else []
    out["rows"] = rows
    out["loop_s"] = [seen[k] - seen[k - 1] for k in sorted(seen) if k - 1 in seen and k >= 2]
    return out


def summarize(runs: list[dict]) -> dict | None:
    """Mean per phase over steps >= 2 of every successful run of one mode."""
    rows = [r for run in runs if run["rc"] == 0 for r in run["rows"] if r["step"] >= 2]
    if not rows:
        return None
    mean = lambda key: statistics.fmean(float(r.get(key, 0.0)) for r in rows)  # noqa: E731
    s = {label: mean(key) for label, key in PHASES}
    s["total"] = mean("timing/total_step")
    s["overhead"] = s["total"] - sum(s[label] for label, _ in PHASES)
    s["overhead_values"] = [float(r["timing/total_step"]) - sum(float(r.get(k, 0.0)) for _, k in PHASES) for r in rows]
    loops = [x for run in runs if run["rc"] == 0 for x in run["loop_s"]]
    s["loop"] = statistics.fmean(loops) if loops else None
    s["steps"] = len(rows)
    s["refit_mib"] = statistics.fmean(float(r.get("refit/bytes", 0)) for r in rows) / 2**20
    s["startup"] = statistics.fmean(run["wall_s"] - sum(float(r["timing/total_step"]) for r in run["rows"])
                                    for run in runs if run["rc"] == 0)
    return s


def table(results: dict[str, dict | None], failures: dict[str, list[str]]) -> str:
    lines = ["Per step, mean of the steps after the first (seconds; share of the step in parentheses)", "",
             "| refit mode | steps | generation | logprobs | training | refit | refit MiB | total_step | "
             "orchestration overhead | overhead per step min..max | loop s | outside step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in results.items():
        if s is None:
            lines.append(f"| {mode} | failed | | | | | | | | | | |")
            continue
        pct = lambda x: f"{x:.3f} ({100 * x / s['total']:.0f}%)"  # noqa: E731
        ov = s["overhead_values"]
        loop = f"{s['loop']:.3f}" if s["loop"] is not None else ""
        outside = f"{s['loop'] - s['total']:.3f}" if s["loop"] is not None else ""
        lines.append(f"| {mode} | {s['steps']} | {pct(s['generation'])} | {pct(s['logprobs'])} | "
                     f"{pct(s['training'])} | "
                     f"{pct(s['refit'])} | {s['refit_mib']:.2f} | {s['total']:.3f} | "
                     f"{s['overhead'] * 1000:.1f} ms ({100 * s['overhead'] / s['total']:.1f}%) | "
                     f"{min(ov) * 1000:.1f}..{max(ov) * 1000:.1f} ms | {loop} | {outside} |")
    for mode, tail in failures.items():
        lines += ["", f"{mode} failed; last lines:", *[f"    {t}" for t in tail[-12:]]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=12, help="GRPO steps per run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (fresh run each)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("overrides", nargs="*", help="extra launcher overrides (key=value), e.g. model=llama_100m")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not counted)")
    root = Path(tempfile.mkdtemp(prefix="bench-step-"))
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    t_all = time.time()
    try:
        for rep in range(args.repeats):
            for mode in (args.modes if rep % 2 == 0 else args.modes[::-1]):
                load = os.getloadavg()[0]
                r = run_mode(mode, args.steps, root, rep, args.overrides, args.timeout)
                runs[mode].append(r)
                status = "ok" if r["rc"] == 0 else f"FAILED rc={r['rc']}"
                print(f"{mode:<13} rep {rep}: {status}, {len(r['rows'])} steps, {r['wall_s']:.0f}s wall "
                      f"(load {load:.1f} at start)", flush=True)
                if r["rc"] != 0:
                    print("    " + "\n    ".join(r["tail"][-8:]), flush=True)
    finally:
        if args.keep:
            print(f"run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    results = {m: summarize(rs) for m, rs in runs.items()}
    failures = {m: rs[-1]["tail"] for m, rs in runs.items() if all(r["rc"] != 0 for r in rs)}
    print()
    print(table(results, failures))
    ok = [s for s in results.values() if s]
    if ok:
        print("\nstartup + shutdown per run (wall minus its steps: Ray, model, actors, summary): "
              + ", ".join(f"{m} {s['startup']:.0f}s" for m, s in results.items() if s))
    print(f"{sum(len(rs) for rs in runs.values())} runs in {time.time() - t_all:.0f}s on {os.cpu_count()} CPUs")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
