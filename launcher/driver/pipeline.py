"""Rollouts and the weights that generate them: the sync loop and the pipelined one as one schedule.

Schedule. A weights version is the number of optimizer steps the weights have taken (W_0 before
the first). With lag k (`grpo.pipeline.max_lag` with `grpo.pipeline.enabled`, else 0) the rollout
of step N is generated with W_v, v = max(r, N-1-k) (`version_for`), r the step the schedule
started at: 0, or the step of a resume whose checkpoint does not hold the rollouts generated
ahead. k = 0 is the sync loop (refit, generate step N, train it); with k = 1 the engines generate
step N+1 with W_{N-1} while the trainers train step N. Which weights generate which step is a
function of the step, never of timing: the loop decides every launch and every refit in step
order, and the engines run them in that order.

Mechanism. Every piece of generator work (a refit's engine side, a rollout, a validation) goes
through one GeneratorQueue: with the pipeline one thread of its own that runs jobs in submission
order, so the engines never see two jobs at once and a refit reaches them between rollouts
(no request sees two weight versions); without it, each job runs at once in the caller. At step
N the loop launches the rollouts up to step N+k; each needs W_{N-1}, what the trainers hold at
that moment. When the engines will not hold that version by the time the job runs, the refit
object takes the weights now (its trainer side; over the Ray object store the copy stays there
while the trainers train on) and the job delivers them before it generates. A transport that
cannot defer (a broadcast group: sender and receivers in one collective) waits for the queue to
empty and pushes from the loop. The loop then waits for rollout N: `timing/exposed_generation`.
`timing/idle_generation` is the time the engines waited for work (for weights), measured when
the next job arrives.

Checkpoints. A checkpoint at step N holds the trainers' state (W_N) and, with the pipeline, the
rollouts already launched for steps N+1..N+k, waited for (the save drains the queue), in
`rollouts.json` with the data position after them: they were generated with W_{N-k}..W_{N-1},
which the checkpoint does not hold, and keeping the rollouts (a few MiB of token ids and floats)
is cheaper and simpler than keeping k adapters and regenerating. A resume takes them as they are
and launches N+k+1 with W_N, as the uninterrupted run does, so it logs the same rows bitwise
(everything the engines produce is a function of the weights, the step and the data position:
every request is seeded). A checkpoint without them (written with the pipeline off, another
max_lag or other sampling settings; or a run continued past its max_num_steps, which generated
nothing ahead) restarts the schedule at N: rollouts N+1..N+1+k come from W_N, and the log says so.

Step 1. A fresh run's engines come up holding W_0 (`engines_hold_w0`): the first refit is the one
before the rollout that needs W_1.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from launcher import files, paths, progress, records
from launcher import metric_names as names
from launcher.config.schema import Config
from launcher.driver.rollout import Rollout, collect, validation

if TYPE_CHECKING:
    from launcher.driver.data import Prompts
    from launcher.driver.environments import Environments
    from launcher.driver.rewards import Rewards
    from workers.contracts import Generators, WeightSync

def version_for(step: int, lag: int, restart: int = 0) -> int:
    """The weights version that generates the rollout of `step` (module docstring)."""
    return max(restart, step - 1 - lag)


def engines_hold_w0(cfg: Config) -> str | None:
    """Why the engines already hold W_0 when they come up, so no refit precedes step 1 (a merged refit
    of the reference recipe moves 1.1 TB); None when they do not. They loaded model.path, which the
    trainers start from, and merged weights at version 0 are those weights bitwise: full fine-tuning,
    or LoRA with a zero factor (B = 0, the default), whose delta W + (alpha/r) B A adds zeros. Not on
    a resume (the trainers hold W_step), nor in refit.mode=adapter (the engines serve no adapter until
    the first refit registers one)."""
    if cfg.resume or cfg.refit.mode == "adapter":
        return None
    if not cfg.peft.enabled:
        return "full fine-tuning starts from model.path, which the engines loaded"
    for key in ("lora_B_init_method", "lora_A_init_method"):
        if getattr(cfg.peft, key) == "zero":
            return f"the engines loaded model.path and LoRA adds nothing yet (peft.{key}=zero)"
    return None


def refit_metrics(report) -> dict:
    """A RefitReport as the metrics row has it."""
    return {names.REFIT_TIME: report.transfer_and_update_weights_s, names.REFIT_BYTES: report.bytes,
            names.REFIT_TENSORS: report.tensors}


@dataclass
class RolloutResult:
    """One step's rollout as the engines produced it, with what the row logs about it."""

    step: int
    version: int                 # the weights version that generated it
    rollout: Rollout
    position: int                # the data position after it
    metrics: dict                # data/*, reward/*, response/*, dynamic_sampling/*, timing/generation
    refit: dict = field(default_factory=dict)   # the refit that preceded it on the engines ({}: none)

    def to_plain(self) -> dict:
        return {"step": self.step, "version": self.version, "position": self.position, "metrics": self.metrics,
                "refit": self.refit, "rollout": asdict(self.rollout)}

    @classmethod
    def from_plain(cls, d: dict) -> "RolloutResult":
        return cls(int(d["step"]), int(d["version"]), Rollout(**d["rollout"]), int(d["position"]), dict(d["metrics"]),
                   dict(d["refit"]))


class GeneratorQueue:
    """Generator work in submission order: on one daemon thread (threaded) or at once in the caller."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self.idle_s = 0.0                 # time the queue sat empty before a job arrived (threaded)
        self._lock = threading.Lock()
        self._busy = 0
        self._last_end: float | None = None
        self._futures: list[Future] = []
        if threaded:
            self._jobs: queue.Queue = queue.Queue()
            threading.Thread(target=self._work, name="generation", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        f: Future = Future()
        now = time.perf_counter()
        with self._lock:
            if self.threaded and self._busy == 0 and self._last_end is not None:
                self.idle_s += now - self._last_end
            self._busy += 1
        self._futures = [x for x in self._futures if not x.done()] + [f]
        if self.threaded:
            self._jobs.put((fn, f))
        else:
            self._run(fn, f)
        return f

    def _run(self, fn: Callable[[], Any], f: Future) -> None:
        try:
            f.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            f.set_exception(e)
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0:
                    self._last_end = time.perf_counter()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(*job)

    def drain(self) -> None:
        """Until every job submitted so far has ended (their errors stay with their futures)."""
        for f in list(self._futures):
            f.exception()
        self._futures = []

    def close(self) -> None:
        if self.threaded:
            self._jobs.put(None)


class Pipeline:
    """The rollouts of a run: which weights generate which step, launched ahead by `lag` steps."""

    def __init__(self, cfg: Config, generators: Generators, refit: WeightSync, prompts: Prompts,
                 rewards: Rewards | Environments, lag: int, step: int, position: int,
                 ahead: list[RolloutResult] | None = None, progress: dict | None = None):
        """step, position: where the run starts (0, 0; or a resumed checkpoint's); `ahead`: the
        checkpoint's rollouts for the steps after it (restore()); `progress`: the driver's
        {"step", "phase"} for failure messages (a job that fails names its own phase and step)."""
        self.cfg, self.generators, self.refit, self.prompts, self.rewards = cfg, generators, refit, prompts, rewards
        self.progress = progress if progress is not None else {}
        self.lag, self.restart = lag, step
        self.queue = GeneratorQueue(threaded=lag > 0)
        self.results: dict[int, Future] = {}
        for r in ahead or []:
            done: Future = Future()
            done.set_result(r)
            self.results[r.step] = done
        self.next_launch = step + 1 + len(ahead or [])
        self._position = ahead[-1].position if ahead else position   # where the next launch starts
        self.queued_version = refit.generators_version   # what the engines hold once the queue is done
        self.waited_s = 0.0     # time the loop waited for generator work (exposed generation)

    def version_for(self, step: int) -> int:
        return version_for(step, self.lag, self.restart)

    # ----------------------------------------------------------------- launching
    def launch(self, through: int, trainer_version: int) -> None:
        """Launch the rollouts up to step `through` (at most grpo.max_num_steps); the trainers hold
        W_trainer_version, which is what each of them needs (the schedule guarantees it)."""
        while self.next_launch <= min(through, self.cfg.grpo.max_num_steps):
            step, version = self.next_launch, self.version_for(self.next_launch)
            if version != trainer_version:
                raise RuntimeError(f"pipeline: step {step} needs the weights of step {version}, the trainers hold "
                                   f"those of step {trainer_version}")
            before = self._engines_at(version)
            self.results[step] = self.queue.submit(lambda s=step, v=version, b=before: self._rollout(s, v, b))
            self.next_launch += 1

    def _engines_at(self, version: int) -> Callable[[], dict] | None:
        """What a job must run first so that the engines hold W_version: None when they will anyway,
        else a callable that returns the refit's metrics."""
        if self.queued_version == version:
            return None
        self.queued_version = version
        if self.refit.deferrable:
            self.progress["phase"] = progress.REFIT
            snapshot = self.refit.take(version)
            return lambda: refit_metrics(self.refit.deliver(snapshot))
        t = time.perf_counter()
        self.queue.drain()   # the engines' last job done: sender and receivers meet in the group
        self.waited_s += time.perf_counter() - t
        self.progress["phase"] = progress.REFIT
        pushed = refit_metrics(self.refit.push(version))
        return lambda: pushed

    def _doing(self, phase: str, step: int, fn: Callable[[], Any]) -> Any:
        """fn() as part of a job: inline, the driver's phase is the job's; on the generation thread
        the job's phase and step travel with its error, for the loop to report (_result)."""
        if not self.queue.threaded:
            self.progress["phase"] = phase
        try:
            return fn()
        except Exception as e:
            try:
                e.pipeline_phase = (phase, step)  # type: ignore[attr-defined]
            except AttributeError:  # an exception type without a __dict__: the loop's phase stays
                pass
            raise

    def _result(self, f: Future):
        try:
            return f.result()
        except Exception as e:
            phase, step = getattr(e, "pipeline_phase", (None, None))
            if phase:
                self.progress.update(phase=phase, step=step)
            raise

    def _rollout(self, step: int, version: int, before: Callable[[], dict] | None) -> RolloutResult:
        refit = self._doing(progress.REFIT, step, before) if before is not None else {}
        t = time.perf_counter()
        rollout, position, m = self._doing(progress.GENERATION, step, lambda: collect(
            self.cfg, self.generators, self.prompts, self.rewards, step, self._position))
        m[names.GENERATION_TIME] = time.perf_counter() - t
        self._position = position
        return RolloutResult(step, version, rollout, position, m, refit)

    # ----------------------------------------------------------------- results
    def get(self, step: int) -> RolloutResult:
        """The rollout of `step` (launched before), waited for."""
        t = time.perf_counter()
        result = self._result(self.results.pop(step))
        self.waited_s += time.perf_counter() - t
        return result

    def validate(self, version: int, val, step: int) -> tuple[dict, dict]:
        """Greedy validation with W_version after whatever is queued: (refit metrics, val metrics
        with timing/validation)."""
        before = self._engines_at(version)
        self.progress["phase"] = progress.VALIDATION

        def job():
            refit = self._doing(progress.REFIT, step, before) if before is not None else {}
            t = time.perf_counter()
            m = self._doing(progress.VALIDATION, step,
                            lambda: validation(self.cfg, self.generators, val, self.rewards, step))
            m[names.VALIDATION_TIME] = time.perf_counter() - t
            return refit, m

        t = time.perf_counter()
        refit, m = self._result(self.queue.submit(job))
        self.waited_s += max(0.0, time.perf_counter() - t - m[names.VALIDATION_TIME])
        return refit, m

    def ahead(self, step: int) -> list[RolloutResult]:
        """The rollouts launched for the steps after `step`, waited for (a checkpoint keeps them)."""
        return [self._result(self.results[s]) for s in sorted(self.results) if s > step]

    def timings(self) -> dict:
        """This step's exposed and idle generation (then reset)."""
        out = {names.EXPOSED_GENERATION_TIME: self.waited_s, names.IDLE_GENERATION_TIME: self.queue.idle_s}
        self.waited_s, self.queue.idle_s = 0.0, 0.0
        return out

    def close(self) -> None:
        self.queue.close()


# --------------------------------------------------------------------- checkpoints
def sampling_settings(cfg: Config) -> dict:
    """What the rollouts of a step depend on besides the weights, the step and the data position."""
    g = cfg.grpo
    return {"grpo": {"num_prompts_per_step": g.num_prompts_per_step,
                     "num_generations_per_prompt": g.num_generations_per_prompt, "max_new_tokens": g.max_new_tokens,
                     "temperature": g.temperature, "top_p": g.top_p, "dynamic_sampling": asdict(g.dynamic_sampling)},
            "data": asdict(cfg.data), "reward": {"fn": cfg.reward.fn, "on_error": cfg.reward.on_error},
            # multi-turn only (a single-turn run's checkpoints read as they did before env existed)
            **({"env": {"fn": cfg.env.fn, "tools": list(cfg.env.tools), "max_turns": g.max_turns}} if cfg.env.fn else {}),
            "run": {"seed": cfg.run.seed}}


def save(directory: Path, results: list[RolloutResult], cfg: Config, lag: int) -> dict:
    """Write the rollouts generated ahead into a checkpoint being written; its training_info entry."""
    body = {"max_lag": lag, "sampling": sampling_settings(cfg), "rollouts": [r.to_plain() for r in results]}
    files.write_json(Path(directory) / paths.ROLLOUTS, body, indent=None)
    return {"max_lag": lag, "ahead": [r.step for r in results]}


def restore(ckpt: Path, info: dict, cfg: Config, lag: int) -> tuple[list[RolloutResult], str]:
    """The checkpoint's rollouts generated ahead, when this run's schedule can use them; else
    ([], why the schedule restarts at the checkpoint's step ('' when nothing was ahead))."""
    saved = info.get("pipeline") or {}
    if not saved.get("ahead"):
        return [], ("the checkpoint holds no rollouts generated ahead (written with the pipeline off, or at "
                    "the last step)" if lag else "")
    body = records.load(Path(ckpt) / paths.ROLLOUTS, records.ROLLOUTS)  # checked with the checkpoint (verify)
    if not lag:
        return [], "the pipeline is off: its rollouts generated ahead are dropped"
    if body["max_lag"] != lag:
        return [], f"it was written with grpo.pipeline.max_lag={body['max_lag']}, this run has {lag}"
    now = sampling_settings(cfg)
    if body["sampling"] != json.loads(json.dumps(now)):
        changed = next(f"{section}.{k}" for section in now for k in now[section]
                       if body["sampling"].get(section, {}).get(k) != json.loads(json.dumps(now[section][k])))
        return [], f"{changed} differs from the run that wrote it"
    return [RolloutResult.from_plain(r) for r in body["rollouts"]], ""
