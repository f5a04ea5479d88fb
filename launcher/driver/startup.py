"""Start-up breakdown: where the time from the process start to the end of step 1 goes.

One clock (`time.time()` on the driver's node), consecutive phases: each `mark(name)` ends the
phase that began at the previous mark (the first begins when this process started), so the
phases add up to the total by construction. Work that runs at the same time inside one phase
(trainer ranks and vLLM engines starting together) is listed under it as parts marked
`concurrent`, never added to the sum: their seconds may exceed the phase's. Parts that nest
inside a phase one after the other (the first step's refit, generation, training) are listed
the same way, marked `of which`.

Actors report their own marks (`info()["startup"]`: [(name, time.time() at its end), ...]); the
first part of an actor begins when the driver asked Ray for it, so "process start" is Ray
scheduling + the worker process + importing the actor's module. On another node the actor's
clock is that node's; NTP keeps that to milliseconds, far below the phases shown.

The run log shows the breakdown after step 1; `summary.txt` repeats it with the first step's
warm-up (step 1 against the median of the later steps) and `startup.json` holds the numbers.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher import metric_names as names


def process_start_time(pid: int | None = None) -> float:
    """When a process started (wall clock, ~10 ms resolution), from /proc through psutil."""
    import psutil

    return psutil.Process(pid or os.getpid()).create_time()


def consecutive(start: float, marks: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """(name, seconds) of consecutive phases: each ends at its mark, begins at the previous one."""
    out, prev = [], start
    for name, end in marks:
        out.append((name, max(0.0, end - prev)))
        prev = max(prev, end)
    return out


@dataclass
class Phase:
    name: str
    seconds: float
    parts: list[tuple[str, float]] = field(default_factory=list)
    concurrent: bool = False


class Startup:
    """Recorder of the start-up phases (see the module docstring)."""

    def __init__(self, t0: float, marks: list[tuple[str, float]] | None = None, clock=time.time):
        self.t0 = t0
        self.clock = clock
        self._marks: list[tuple[str, float]] = list(marks or [])
        self._parts: dict[str, tuple[list[tuple[str, float]], bool]] = {}

    @classmethod
    def since_process_start(cls, marks: list[tuple[str, float]] | None = None) -> "Startup":
        return cls(process_start_time(), marks)

    def mark(self, name: str, at: float | None = None) -> float:
        """End the current phase, named `name`, now (or at `at`); its seconds."""
        end = self.clock() if at is None else at
        begin = self._marks[-1][1] if self._marks else self.t0
        self._marks.append((name, end))
        return end - begin

    def parts(self, phase: str, parts: list[tuple[str, float]], concurrent: bool) -> None:
        """Details of `phase` (shown under it, not summed): concurrent, or nested one after another."""
        self._parts[phase] = (list(parts), concurrent)

    @property
    def phases(self) -> list[Phase]:
        return [Phase(name, s, *self._parts.get(name, ([], False)))
                for name, s in consecutive(self.t0, self._marks)]

    @property
    def total(self) -> float:
        return (self._marks[-1][1] - self.t0) if self._marks else 0.0

    def lines(self) -> list[str]:
        total = self.total or 1.0
        out = []
        for p in self.phases:
            out.append(f"  {p.name:<46} {p.seconds:7.1f} s {100 * p.seconds / total:4.0f}%")
            label = "concurrent" if p.concurrent else "of which"
            for name, s in p.parts:
                out.append(f"      {label + ': ' + name:<42} {s:7.1f} s")
        out.append(f"  {'total (process start -> end of step 1)':<46} {self.total:7.1f} s")
        return out

    def format(self) -> str:
        return "start-up breakdown:\n" + "\n".join(self.lines())

    def to_json(self) -> dict:
        return {"t0": self.t0, "total_s": self.total,
                "phases": [{"name": p.name, "seconds": p.seconds, "concurrent": p.concurrent,
                            "parts": [{"name": n, "seconds": s} for n, s in p.parts]} for p in self.phases]}

    def write(self, path: Path) -> None:
        from launcher import files

        files.write_json(path, self.to_json())


# ------------------------------------------------------------------ what the driver adds
def actor_parts(requested_at: float, infos: list[dict], label: str) -> list[tuple[str, float]]:
    """One part per actor phase, `<label> <i>: <phase>`, from each actor's own marks
    (info["startup"]). Actors without marks give one part: `fallback_s` when they report it."""
    out = []
    for i, info in enumerate(infos):
        marks = info.get("startup")
        if marks:
            out += [(f"{label} {i}: {name}", s) for name, s in consecutive(requested_at, [tuple(m) for m in marks])]
        elif info.get("start_seconds") is not None:
            out.append((f"{label} {i}: engine up (import vllm + LLM())", float(info["start_seconds"])))
    return out


def step_parts(row: dict) -> list[tuple[str, float]]:
    """The first step's timed phases, in order, from its metrics row."""
    keys = (("refit (first: sends the layout)", names.REFIT_TIME),
            ("generation (first: vLLM warm-up)", names.GENERATION_TIME), ("logprobs", names.LOGPROBS_TIME),
            ("training (first: optimizer state)", names.TRAINING_TIME), ("checkpoint", names.CHECKPOINT_TIME))
    return [(name, float(row[k])) for name, k in keys if row.get(k)]


def warmup(rows: list[dict]) -> tuple[float, float] | None:
    """(step 1's total_step, the median of the later steps'), when there are later steps."""
    steps = [float(r[names.STEP_TIME]) for r in rows if names.STEP_TIME in r]
    if len(steps) < 2:
        return None
    return steps[0], statistics.median(steps[1:])


def summary_text(startup: Startup | None, rows: list[dict]) -> str:
    """The start-up part of summary.txt."""
    if startup is None or not startup.total:
        return ""
    text = startup.format()
    w = warmup(rows)
    if w:
        text += (f"\n  first step's warm-up: step 1 took {w[0]:.2f} s, later steps {w[1]:.2f} s (median): "
                 f"+{w[0] - w[1]:.2f} s")
    return text


def start_together(*factories, seconds: list | None = None):
    """Call the factories at the same time (each builds a group of actors and waits for it); their
    results in order, and each one's wall time appended to `seconds`. If one fails, the groups that
    did come up are shut down and its error raised."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(factory):
        t = time.time()
        try:
            return factory()
        finally:
            took[factory] = time.time() - t

    took: dict = {}
    with ThreadPoolExecutor(len(factories), thread_name_prefix="startup") as pool:
        futures = [pool.submit(timed, f) for f in factories]
        errors = [f.exception() for f in futures]  # waits for all
    if seconds is not None:
        seconds += [took[f] for f in factories]
    failed = next((e for e in errors if e is not None), None)
    if failed is None:
        return [f.result() for f in futures]
    for f, e in zip(futures, errors):
        if e is None:
            try:
                f.result().shutdown()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
    raise failed


def warm_imports():
    """Import what the GRPO driver needs (ray, torch, transformers, the worker groups: seconds of CPU)
    in a background thread, called while the Ray head starts, when this process only waits. An
    import that fails here fails again, with its message, where the driver imports it. Returns the
    thread: the driver starts only once it is through (join it), because two threads importing
    transformers' lazy modules at once can meet in importlib's deadlock guard, which hands one of
    them a half-initialised module ("cannot import name 'AutoTokenizer' from 'transformers'": seen
    on a loaded machine)."""
    import threading

    def target():
        try:
            import ray  # noqa: F401  - first: the driver connects as soon as the head answers
            import torch  # noqa: F401
            from transformers import AutoTokenizer  # noqa: F401

            from workers.generator import group as _generators  # noqa: F401
            from workers.trainer import group as _trainers  # noqa: F401
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    thread = threading.Thread(target=target, name="warm-imports", daemon=True)
    thread.start()
    return thread


def warmed_up(generators, requests: int, tokens: int = 2):
    """One short generate of a step's batch size on fresh engines: vLLM's first generate pays
    one-time costs (about 3 s for the tiny model on CPU) that would otherwise land in step 1.
    Called while the trainers still build, it is off the critical path. The group, for chaining."""
    generators.generate([[5, 6, 7, 8]] * max(1, requests), temperature=1.0, max_tokens=tokens,
                        seeds=list(range(max(1, requests))), ignore_eos=True)
    return generators
