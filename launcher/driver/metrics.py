"""Per-step metrics: JSONL (the record), TensorBoard, wandb when configured, a terminal line per
step, and at the end a reward/agreement plot and a summary table in the run directory.

On resume, lines of steps after the resumed checkpoint (written by the interrupted run after its
last checkpoint) are dropped, so metrics.jsonl has exactly one line per step.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from launcher import files, logs, paths, progress
from launcher import metric_names as names
from launcher.config.schema import Logging

_log = logs.get(__name__)


def read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Logging, total_steps: int, resumed_step: int = 0):
        self.path = run_dir / paths.METRICS
        self.run_dir = run_dir
        self.total = total_steps
        self.t0 = time.time()
        kept = [r for r in read(self.path) if r["step"] <= resumed_step]
        files.write(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resumed_step + 1)
        self.wandb = None
        if cfg.wandb_project:
            import wandb  # installed by the user who configures it

            self.wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=run_dir.name,
                                    dir=str(run_dir), resume="allow", id=run_dir.name)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        files.append_line(self.path, row)
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                if self.tb is not None:
                    self.tb.add_scalar(k, v, step)
        if self.tb is not None:
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        self._progress(step, row)

    def _progress(self, step: int, row: dict) -> None:
        _log.info(progress.step_line(step, self.total, row), extra=logs.PLAIN)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def summary(rows: list[dict]) -> str:
    """The table printed at the end of a run."""
    if not rows:
        return "no steps recorded"
    first, last = rows[0], rows[-1]
    k = max(1, min(3, len(rows) // 3))
    start = sum(r[names.REWARD] for r in rows[:k]) / k
    end = sum(r[names.REWARD] for r in rows[-k:]) / k
    mean = lambda key, of=rows: sum(float(r.get(key, 0.0)) for r in of) / max(1, len(of))  # noqa: E731
    refits = [r for r in rows if r.get(names.REFIT_BYTES)]  # steps the engines were refit before (not all)
    lines = [
        f"{'steps':<34} {first['step']} -> {last['step']}",
        f"{'reward (first -> last ' + str(k) + ' steps)':<34} {start:.3f} -> {end:.3f}",
        f"{'max gen_kl_error':<34} {_max(rows, names.GEN_KL_ERROR, '.3e')}",
        f"{'max token_mult_prob_error':<34} {_max(rows, names.TOKEN_MULT_PROB_ERROR, '.6f')}",
        f"{'seconds per step (mean)':<34} {mean(names.STEP_TIME):.2f}",
        f"{'refits':<34} {len(refits)} of {len(rows)} steps",
        f"{'seconds per refit (mean)':<34} {mean(names.REFIT_TIME, refits):.3f}",
        f"{'bytes per refit':<34} {int(mean(names.REFIT_BYTES, refits)):,}",
    ]
    val = validation_points(rows)
    if val:
        lines.insert(2, f"{'validation reward (first -> last)':<34} {val[0][1]:.3f} -> {val[-1][1]:.3f} "
                        f"(accuracy {val[0][2]:.3f} -> {val[-1][2]:.3f}, {len(val)} evaluations)")
    for key, label in ((names.REWARD_ERRORS, "reward errors (total)"), (names.DROPPED_PROMPTS, "prompts skipped (too long)")):
        total = sum(int(r.get(key, 0)) for r in rows)
        if total:
            lines.append(f"{label:<34} {total}")
    return "\n".join(lines)


def _max(rows: list[dict], key: str, fmt: str) -> str:
    """The largest value of `key`; a pipelined run logs the agreement only on the steps generated
    with the weights the trainers scored them with (launcher.driver.grpo.GrpoRun.learn)."""
    values = [float(r[key]) for r in rows if key in r]
    return f"{max(values):{fmt}}" if values else "- (no step generated with the trained weights)"


def validation_points(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, val/reward, val/accuracy) of every validation, the one at start as step 0."""
    out = []
    for r in rows:
        if names.VAL_REWARD + names.AT_START in r:
            out.append((0, float(r[names.VAL_REWARD + names.AT_START]), float(r[names.VAL_ACCURACY + names.AT_START])))
        if names.VAL_REWARD in r:
            out.append((r["step"], float(r[names.VAL_REWARD]), float(r[names.VAL_ACCURACY])))
    return out


def plot(rows: list[dict], out: Path) -> Path | None:
    """reward and train-vs-generation agreement per step, as a PNG."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r[names.REWARD] for r in rows], marker="o", label="train")
    val = validation_points(rows)
    if val:
        a.plot([v[0] for v in val], [v[1] for v in val], marker="s", label="validation (greedy)")
        a.legend()
    a.set(xlabel="step", ylabel="mean reward", title="reward")
    a.grid(alpha=0.3)
    agree = [r for r in rows if names.GEN_KL_ERROR in r]
    b.semilogy([r["step"] for r in agree], [max(float(r[names.GEN_KL_ERROR]), 1e-18) for r in agree], marker="o",
               label="gen_kl_error")
    b.semilogy([r["step"] for r in agree], [max(float(r[names.TOKEN_MULT_PROB_ERROR]) - 1.0, 1e-18) for r in agree],
               marker="x", label="token_mult_prob_error - 1")
    lagged = [r for r in rows if names.OFF_POLICY_KL in r and names.GEN_KL_ERROR not in r]
    if lagged:
        b.semilogy([r["step"] for r in lagged], [max(float(r[names.OFF_POLICY_KL]), 1e-18) for r in lagged],
                   marker=".", linestyle=":", label="off_policy_kl (pipelined steps)")
    b.set(xlabel="step", title="train vs generation logprobs")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    import io

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    files.write(out, png.getvalue())
    return out
