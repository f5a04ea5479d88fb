"""How progress reads, in one place: the driver's line per step, `python -m launcher.status`, and the
"still ..." lines every few seconds while something long runs (nodes joining, the model loading,
a checkpoint being written).

Torch-free (the status view and the dry run import it). The phases' names are here, the metrics'
in launcher.metric_names: the driver sets and writes them, this reads them.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from launcher import metric_names as names

HEARTBEAT_S = 5.0   # a long wait says what it waits for at least this often
# the driver's phases (ctx.progress["phase"], set by launcher.driver.grpo), each once
START_UP = "start-up"
RESUME = "resume"
REFIT = "refit"
GENERATION = "generation"
LOGPROBS = "logprobs"
TRAINING = "training"
VALIDATION = "validation"
CHECKPOINT = "checkpoint"
PHASES = {          # each phase -> what the user reads
    START_UP: "starting: loading the model, starting trainer and vLLM actors",
    RESUME: "loading the checkpoint to resume from",
    REFIT: "refitting the generators' weights",
    GENERATION: "generating",
    LOGPROBS: "computing logprobs",
    TRAINING: "training",
    VALIDATION: "validating",
    CHECKPOINT: "writing a checkpoint",
}


def duration(seconds: float | None) -> str:
    """12s, 3m05s, 2h04m; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def bar(step: int, total: int, width: int = 24) -> str:
    filled = max(0, min(width, int(width * step / max(total, 1))))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def seconds_per_step(rows: list[dict], last: int = 5) -> float | None:
    """Mean step time over the last `last` metrics rows (timing/total_step), None without any."""
    times = [float(r[names.STEP_TIME]) for r in rows[-last:] if _number(r.get(names.STEP_TIME))]
    return sum(times) / len(times) if times else None


def eta(step: int, total: int, s_per_step: float | None) -> float | None:
    return None if s_per_step is None else max(0, total - step) * s_per_step


def val_reward(row: dict):
    """The validation reward of a metrics row: after its step, else before the first step."""
    for k in (names.VAL_REWARD, names.VAL_REWARD + names.AT_START):
        if _number(row.get(k)):
            return row[k]
    return None


def step_line(step: int, total: int, row: dict, s_per_step: float | None = None, running: bool = True) -> str:
    """`[####....] step 3/10  reward 0.412  loss +0.0123  gen_kl_error 1.2e-05  3.4 s/step  refit 0.12s  ETA 24s`
    (the fields the row has: `turns 2.50` after the reward for multi-turn episodes). `s_per_step` defaults to this row's own step time; no ETA unless `running`."""
    sps = s_per_step if s_per_step is not None else _get(row, names.STEP_TIME)
    parts = [f"{bar(step, total)} step {step}/{total}"]
    for label, key, fmt in (("reward", names.REWARD, ".3f"), ("turns", names.EPISODE_TURNS, ".2f"),
                            ("loss", names.LOSS, "+.4f"), ("gen_kl_error", names.GEN_KL_ERROR, ".2e")):
        if _number(row.get(key)):
            parts.append(f"{label} {float(row[key]):{fmt}}")
    val = val_reward(row)
    if val is not None:
        parts.append(f"val_reward {float(val):.3f}")
    if sps is not None:
        parts.append(f"{sps:.1f} s/step")
    if _number(row.get(names.REFIT_TIME)):
        parts.append(f"refit {float(row[names.REFIT_TIME]):.2f}s")
    if running and step < total and sps is not None:
        parts.append(f"ETA {duration(eta(step, total, sps))}")
    return "  ".join(parts)


def phase_text(progress: dict) -> str:
    """What the driver does now, from its ctx.progress {"phase", "step"}."""
    phase = progress.get("phase") or START_UP
    text = PHASES.get(phase, phase)
    return f"{text} (step {progress['step']})" if progress.get("step") and phase != START_UP else text


class Heartbeat:
    """`tick(what)` often; says `still <what> (<elapsed>)` once `what` has not changed for
    `every` seconds, and again every `every` seconds while it stays."""

    def __init__(self, say: Callable[[str], None], every: float = HEARTBEAT_S):
        self.say, self.every = say, every
        self.what: str | None = None
        self.since = self.last = time.monotonic()

    def tick(self, what: str) -> None:
        now = time.monotonic()
        if what != self.what:
            self.what, self.since, self.last = what, now, now
        elif now - self.last >= self.every:
            self.last = now
            self.say(f"still {what} ({duration(now - self.since)})")


@contextmanager
def waiting(what: str, say: Callable[[str], None], every: float = HEARTBEAT_S) -> Iterator[None]:
    """Around a blocking call: `still <what> (<elapsed>)` every `every` seconds until it returns."""
    done = threading.Event()
    beat = Heartbeat(say, every)

    def loop():
        while not done.wait(min(1.0, every)):
            beat.tick(what)

    beat.tick(what)
    thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(2.0)


def _get(row: dict, key: str) -> float | None:
    return float(row[key]) if _number(row.get(key)) else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
