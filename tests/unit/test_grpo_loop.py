"""The GRPO loop (launcher.driver.grpo.GrpoRun) on fakes of its three Ray-backed parts, no Ray:
which weights generate which step, when each refit reaches the generators, what a checkpoint
holds and that a resumed run is the uninterrupted one, with the pipeline off and on.

The fakes implement workers.contracts' Protocols (test_contracts.py checks the real classes
against the same ones). A weights version is the number of train() calls. The fake generator
answers from the request's seed, and reports as the logprob of token t under version v a number
that differs between versions, as the fake trainer scores it: so gen_kl_error is 0 exactly when
the trainers scored a rollout with the weights that generated it. Everything else is real: the
composed config, the data and its tokenizer, advantages, checkpoints, the metrics files. The
reward is the built-in say_number, called in this process (the reward pool has its own tests).
Every fake call sleeps a random time (seeded per run): the schedule must not depend on it.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from launcher.cluster.context import JobContext
from launcher.config.compose import compose, to_yaml
from launcher.config.schema import typed
from launcher.config.validate import validate
from launcher.driver import rewards
from launcher.driver.grpo import GrpoRun
from launcher.driver.pipeline import version_for
from launcher.paths import ROLLOUTS
from launcher.driver.start import read_data
from workers import contracts
from workers.refit.wire import RefitReport


def logprob(version: int | None, token: int) -> float:
    """What version `version` of the fake policy gives token `token` (versions differ)."""
    return -0.5 - 0.01 * ((int(token) * 7 + 13 * (version or 0)) % 23)


class Clock:
    """Random short sleeps, seeded: two runs with other seeds interleave their threads differently."""

    def __init__(self, seed: int):
        self.rng, self.lock = random.Random(seed), threading.Lock()

    def nap(self) -> None:
        with self.lock:
            s = self.rng.random() * 0.004
        time.sleep(s)


class FakeTrainers:
    def __init__(self, clock: Clock, events: list, on_train=None):
        self.clock, self.events, self.on_train = clock, events, on_train
        self.version = 0
        self.peft_statistics = "fake trainer"
        self.infos = [contracts.TrainerInfo(rank=0, world_size=1, node_ip="127.0.0.1", hostname="fake", pid=1,
                                            device="cpu", dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, pp_rank=0,
                                            pp_size=1, is_output_rank=True, peft_statistics="fake",
                                            num_parameters=contracts.NumParameters(total=10, trainable=2), step=0,
                                            startup=[])]

    def logprobs(self, batch, adapters=True):
        self.clock.nap()
        ids = batch["input_ids"]
        return torch.tensor([[logprob(self.version, t) for t in row] for row in ids.tolist()])

    def train(self, batch):
        self.clock.nap()
        self.events.append(("train", self.version, int(batch["input_ids"].sum())))
        w = torch.exp(batch["prev_logprobs"] - batch["generation_logprobs"]) * batch["loss_mask"]
        self.version += 1
        if self.on_train:
            self.on_train(self.version)
        return {"loss": float((batch["advantages"] ** 2).mean()), "grad_norm": 1.0, "lr": 0.1, "step": self.version,
                "is_weight_mean": float(w.sum() / batch["loss_mask"].sum())}

    def save_state(self, directory: str) -> None:
        """A trainer state as the trainers write it (the checkpoint's commit verifies it): its step
        is the fake's weights version."""
        from tests.helpers.checkpoints import trainer_state

        trainer_state(Path(directory), self.version)

    def load_state(self, directory: str) -> dict:
        from workers.trainer.state import saved_trainer_info

        self.version = saved_trainer_info(directory)["step"]
        return {"step": self.version}

    def shutdown(self) -> None:
        pass


class FakeGenerators:
    def __init__(self, clock: Clock, events: list):
        self.clock, self.events = clock, events
        self.version: int | None = 0   # a fresh engine loaded model.path: the trainers' W_0 (pipeline.engines_hold_w0)
        self.busy = False
        self.infos = [contracts.GeneratorInfo(pid=2, hostname="fake", start_seconds=0.0, startup=[], model="fake",
                                              device="cpu", enable_lora=False, adapter_id=0)]

    def generate(self, prompt_token_ids, temperature=1.0, top_p=1.0, max_tokens=16, seeds=None, ignore_eos=False):
        assert not self.busy, "two generate calls at once"
        self.busy, version = True, self.version
        self.clock.nap()
        outs = []
        for s in seeds:
            tokens = [4 + s % 40, 4 + (s // 40) % 40][: 1 + s % 2]
            outs.append(contracts.Generation(tokens, f"{40 + s % 12} {s % 50}", [logprob(version, t) for t in tokens],
                                             "stop"))
        self.clock.nap()
        assert self.version == version, "the weights changed during a generate call"
        self.busy = False
        self.events.append(("generate", version, "greedy" if temperature == 0 else "sample", seeds[0]))
        return outs

    def load(self, version: int) -> None:
        assert not self.busy, "a refit reached the generators during a generate call"
        self.clock.nap()
        self.version = version
        self.events.append(("refit", version))

    def shutdown(self) -> None:
        pass


class FakeRefit:
    """workers.contracts.WeightSync: `deferrable` as the object store, or not, as a broadcast group."""

    transport = "fake"

    def __init__(self, trainers: FakeTrainers, generators: FakeGenerators, deferrable: bool):
        self.trainers, self.generators, self.deferrable = trainers, generators, deferrable
        self.generators_version: int | None = None

    def connect(self) -> None:
        pass

    def close(self) -> None:
        pass

    def is_stale(self, version: int) -> bool:
        return self.generators_version != version

    def take(self, version: int) -> int:
        assert self.deferrable
        assert self.trainers.version == version, (self.trainers.version, version)
        return version

    def deliver(self, snapshot: int) -> RefitReport:
        self.generators.load(snapshot)
        self.generators_version = snapshot
        return RefitReport("merged", "fake", 100, 2, 1, 0.0, 0.0, 0.001)

    def push(self, version: int) -> RefitReport:
        assert self.trainers.version == version, (self.trainers.version, version)
        return self.deliver(version)


class InProcessRewards:
    def score(self, texts, examples):
        return [rewards.say_number(t, ex.target) for t, ex in zip(texts, examples)], 0


def config(tmp_path: Path, *overrides: str):
    """(the typed config, its YAML) as the launcher composes them."""
    raw = compose([f"run.root={tmp_path}", "logging.tensorboard=false", "grpo.num_prompts_per_step=2",
                   "grpo.num_generations_per_prompt=2", "grpo.max_new_tokens=2", "checkpointing.keep_top_k=null",
                   *overrides])
    return typed(raw), to_yaml(raw)


class Run:
    """One GrpoRun on fakes in RUN_ROOT/<name>; `events`: everything the fakes saw, in order."""

    def __init__(self, tmp_path: Path, name: str, *overrides: str, seed: int = 0, deferrable: bool = True,
                 stop_after: int | None = None, resume: str | None = None, stopped_at_start: bool = False):
        self.cfg, yaml = config(tmp_path, f"run.name={name}", *overrides)
        self.cfg.resume = resume
        self.dir = tmp_path / name
        self.dir.mkdir(exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml)
        self.events: list = []
        self.stop = threading.Event()
        if stopped_at_start:  # Ctrl-C or a preemption during the start-up: before the loop's first step
            self.stop.set()
        clock = Clock(seed)
        on_train = (lambda v: v == stop_after and self.stop.set()) if stop_after else None
        self.trainers = FakeTrainers(clock, self.events, on_train)
        self.generators = FakeGenerators(clock, self.events)
        self.refit = FakeRefit(self.trainers, self.generators, deferrable)
        for part, proto in ((self.trainers, contracts.Trainers), (self.generators, contracts.Generators),
                            (self.refit, contracts.WeightSync)):
            assert isinstance(part, proto)
        from workers.tiny_models import make_tokenizer

        data = read_data(self.cfg, make_tokenizer())
        self.result = GrpoRun(self.cfg, JobContext.local(self.dir), self.trainers, self.generators, self.refit, data,
                              InProcessRewards(), stop=self.stop).run()

    def rows(self) -> list[dict]:
        return [json.loads(x) for x in (self.dir / "metrics.jsonl").read_text().splitlines()]

    def generated(self) -> dict[int, int]:
        """step -> the version that generated it, from what the generators saw (the seeds name the step)."""
        return {r["step"]: r["pipeline/generated_with"] for r in self.rows() if "pipeline/generated_with" in r}

    def engine_log(self) -> list[tuple]:
        return [e for e in self.events if e[0] in ("generate", "refit")]


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing/")}


# ---------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_which_weights_generate_which_step(lag):
    assert [version_for(n, lag) for n in range(1, 7)] == [max(0, n - 1 - lag) for n in range(1, 7)]
    assert [version_for(n, lag, restart=3) for n in range(4, 8)] == [max(3, n - 1 - lag) for n in range(4, 8)]


def test_sync_loop_refits_then_generates_each_step_with_the_last_weights(tmp_path):
    run = Run(tmp_path, "sync", "grpo.max_num_steps=4", "checkpointing.enabled=false")
    # per step: the weights of the step before reach the generators, then the step is generated and trained;
    # before step 1 none: the engines loaded W_0 (model.path, LoRA's B zero)
    expected = [("generate", 0, "sample")]
    for step in range(2, 5):
        expected += [("refit", step - 1), ("generate", step - 1, "sample")]
    assert [e[:3] for e in run.engine_log()] == expected
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["train/gen_kl_error"] == 0.0 and r["train/token_mult_prob_error"] == 1.0
        assert r["refit/bytes"] == (0 if r["step"] == 1 else 100) and not any(k.startswith("pipeline/") for k in r)
        assert "timing/exposed_generation" not in r
    assert "refits                             3 of 4 steps" in (run.dir / "summary.txt").read_text()


@pytest.mark.parametrize("overrides, first_refit", [
    ((), None),                                             # LoRA, B = 0: merged W_0 is model.path bitwise
    (("refit=merged_delta",), None),
    (("peft=none",), None),                                 # full fine-tuning starts from model.path
    (("peft.lora_A_init_method=zero", "peft.lora_B_init_method=xavier"), None),
    (("peft.lora_B_init_method=xavier",), 0),               # W_0 = W + (alpha/r) B A is not model.path
    (("refit=adapter",), 0),                                # the engines serve no adapter until a refit sends one
])
def test_no_refit_before_step_1_when_the_engines_loaded_the_trainers_starting_weights(tmp_path, overrides, first_refit):
    """Issue 44: the reference recipe's first merged refit would move 1.1 TB of unchanged weights."""
    run = Run(tmp_path, "w0", "grpo.max_num_steps=2", "checkpointing.enabled=false", *overrides)
    first = run.engine_log()[0]
    assert first == (("refit", 0) if first_refit == 0 else ("generate", 0, "sample", first[3]))
    assert [e[1] for e in run.engine_log() if e[0] == "refit"] == ([0, 1] if first_refit == 0 else [1])


@pytest.mark.parametrize("lag, deferrable", [(1, True), (2, False)])
def test_pipelined_schedule_is_a_function_of_the_step_never_of_timing(tmp_path, lag, deferrable):
    over = ["grpo.max_num_steps=6", "checkpointing.enabled=false", "grpo.pipeline.enabled=true",
            f"grpo.pipeline.max_lag={lag}"]
    a = Run(tmp_path, "a", *over, seed=1, deferrable=deferrable)
    b = Run(tmp_path, "b", *over, seed=2, deferrable=deferrable)
    # the rollout of step N comes from the weights after step N-1-lag (never before the first)
    assert a.generated() == {n: max(0, n - 1 - lag) for n in range(1, 7)}
    samples = [e for e in a.engine_log() if e[0] == "generate"]
    assert [e[1] for e in samples] == [max(0, n - 1 - lag) for n in range(1, 7)]
    # a refit reaches the generators only between rollouts, each version once, in order (the fakes
    # also refuse a refit or a second request during a generate call)
    assert [e[1] for e in a.engine_log() if e[0] == "refit"] == list(range(1, 6 - lag))  # W_0: loaded
    # the same calls in the same order and the same rows, whatever the timing
    assert a.engine_log() == b.engine_log()
    assert [deterministic(r) for r in a.rows()] == [deterministic(r) for r in b.rows()]
    for r in a.rows():
        assert r["pipeline/lag"] == min(r["step"] - 1, lag)
        assert r["timing/exposed_generation"] >= 0 and r["timing/idle_generation"] >= 0
        if r["pipeline/lag"] == 0:  # scored with the weights that generated it: the two sides agree
            assert r["train/gen_kl_error"] == 0.0 and r["pipeline/off_policy_kl"] == 0.0
        else:  # gen_kl_error keeps its meaning: absent; the gap the importance weight corrects is logged
            assert "train/gen_kl_error" not in r and r["pipeline/off_policy_kl"] > 0
            assert r["train/is_weight_mean"] != 1.0
    assert "max gen_kl_error" in (a.dir / "summary.txt").read_text()


def test_validation_uses_the_weights_of_the_step_it_names(tmp_path):
    run = Run(tmp_path, "val", "grpo.max_num_steps=4", "checkpointing.enabled=false", "grpo.pipeline.enabled=true",
              "data.validation=say_number", "grpo.val_period=2", "grpo.val_at_start=true", "grpo.val_max_examples=2")
    greedy = [e[1] for e in run.engine_log() if e[0] == "generate" and e[2] == "greedy"]
    assert greedy == [0, 2, 4]
    rows = {r["step"]: r for r in run.rows()}
    assert "val/reward_at_start" in rows[1] and "val/reward" in rows[2] and "val/reward" in rows[4]
    assert run.generated() == {1: 0, 2: 0, 3: 1, 4: 2}  # validation changes nothing of the schedule


def test_dynamic_sampling_rounds_run_on_the_generation_thread_and_keep_the_data_position(tmp_path):
    over = ["grpo.max_num_steps=4", "checkpointing.enabled=false", "grpo.dynamic_sampling.enabled=true",
            "grpo.dynamic_sampling.max_gen_batches=3"]
    sync, piped = Run(tmp_path, "s", *over), Run(tmp_path, "p", *over, "grpo.pipeline.enabled=true")
    for a, b in zip(sync.rows(), piped.rows()):  # the same prompts, rounds and samples per step
        assert a["dynamic_sampling/gen_batches"] == b["dynamic_sampling/gen_batches"]
        assert a["dynamic_sampling/generated_samples"] == b["dynamic_sampling/generated_samples"]
    seeds = lambda run: [e[3] for e in run.engine_log() if e[0] == "generate"]  # noqa: E731
    assert seeds(sync) == seeds(piped)


# ---------------------------------------------------------------------------- checkpoints and resume
@pytest.mark.parametrize("deferrable", [True, False])
def test_a_resume_while_a_rollout_was_in_flight_equals_the_uninterrupted_run(tmp_path, deferrable):
    over = ["grpo.max_num_steps=6", "checkpointing.save_period=100", "grpo.pipeline.enabled=true"]
    straight = Run(tmp_path, "straight", *over, seed=3, deferrable=deferrable)
    # stop (Ctrl-C, a preemption) during step 3: the rollout of step 4 is in flight
    first = Run(tmp_path, "parts", *over, seed=4, deferrable=deferrable, stop_after=3)
    assert first.result == {"step": 3, "stopped": True, "checkpoint": 3, "saved": True}
    ckpt = first.dir / "checkpoints" / "step_3"
    info = json.loads((ckpt / "training_info.json").read_text())
    assert info["pipeline"] == {"max_lag": 1, "ahead": [4]}
    kept = json.loads((ckpt / ROLLOUTS).read_text())["rollouts"]
    assert [(r["step"], r["version"]) for r in kept] == [(4, 2)]
    assert info["consumed_prompts"] == 3 * 2 and kept[0]["position"] == 4 * 2
    second = Run(tmp_path, "parts", *over, seed=5, deferrable=deferrable, resume="latest")
    assert second.result == {"step": 6, "stopped": False, "checkpoint": 6, "saved": True}
    assert [deterministic(r) for r in second.rows()] == [deterministic(r) for r in straight.rows()]
    assert second.trainers.version == straight.trainers.version == 6
    # what the engines did after the resume is the tail of the uninterrupted run: step 4 was not generated again
    tail = second.engine_log()
    assert tail[0] == ("refit", 3) and tail == straight.engine_log()[-len(tail):]
    trained = lambda run: [e for e in run.events if e[0] == "train"]  # noqa: E731
    assert trained(first) + trained(second) == trained(straight)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_stop_before_the_first_step_saves_nothing_and_says_so(tmp_path, lag):
    """A Ctrl-C or a preemption during the start-up: no step runs and no checkpoint is written; the
    outcome says none continues the run (the launcher's closing line then says the same command
    starts it again, not +resume=latest), or, resumed, that the one it resumed from still does."""
    over = ["grpo.max_num_steps=4", "checkpointing.save_period=2", f"grpo.pipeline.enabled={str(bool(lag)).lower()}"]
    fresh = Run(tmp_path, "fresh", *over, stopped_at_start=True)
    assert fresh.result == {"step": 0, "stopped": True, "checkpoint": None, "saved": False}
    assert not list((fresh.dir / "checkpoints").glob("step_*")) and fresh.trainers.version == 0
    Run(tmp_path, "resumed", *over, stop_after=2)
    again = Run(tmp_path, "resumed", *over, resume="latest", stopped_at_start=True)
    assert again.result == {"step": 2, "stopped": True, "checkpoint": 2, "saved": False}
    assert [p.name for p in sorted((again.dir / "checkpoints").glob("step_*"))] == ["step_2"]


def test_a_checkpoint_without_the_rollouts_ahead_restarts_the_schedule_at_its_step(tmp_path):
    sync = Run(tmp_path, "r", "grpo.max_num_steps=2", "checkpointing.save_period=2")
    assert not (sync.dir / "checkpoints" / "step_2" / ROLLOUTS).exists()
    piped = Run(tmp_path, "r", "grpo.max_num_steps=5", "checkpointing.save_period=100", "grpo.pipeline.enabled=true",
                "optim.override_opt_param_scheduler=true", resume="step_2")
    assert piped.generated() == {3: 2, 4: 2, 5: 3}


def test_the_pipeline_refuses_to_run_without_the_importance_weight():
    cfg = typed(compose(["grpo.pipeline.enabled=true", "grpo.loss.truncated_importance_sampling_ratio=null"]))
    errors = [str(e) for e in validate(cfg, submitting=False)]
    assert errors == ["grpo.pipeline.enabled: needs grpo.loss.truncated_importance_sampling_ratio (e.g. 5.0): the "
                      "truncated importance weight corrects for samples generated with older weights"]


class BrokenGenerators(FakeGenerators):
    """Fails its second generate call, as a dead engine's call would."""

    def generate(self, *args, **kwargs):
        if sum(1 for e in self.events if e[0] == "generate") == 1:
            raise RuntimeError("engine lost")
        return super().generate(*args, **kwargs)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_failing_generation_names_its_own_phase_and_step(tmp_path, lag):
    """A rollout that fails on the generation thread is reported when the loop waits for it, under
    the phase and step of the job that failed (what the driver's one-line error names)."""
    from launcher.driver.pipeline import Pipeline
    from workers.tiny_models import make_tokenizer

    cfg, _ = config(tmp_path, "grpo.max_num_steps=4", "grpo.pipeline.enabled=true")
    events: list = []
    trainers, generators = FakeTrainers(Clock(0), events), BrokenGenerators(Clock(0), events)
    progress: dict = {}
    refit = FakeRefit(trainers, generators, deferrable=True)
    pipe = Pipeline(cfg, generators, refit, read_data(cfg, make_tokenizer()).prompts, InProcessRewards(), lag,
                    step=0, position=0, progress=progress)
    pipe.launch(through=1 + lag, trainer_version=0)
    assert pipe.get(1).step == 1
    trainers.version = 1
    progress.update(step=2, phase="training")
    with pytest.raises(RuntimeError, match="engine lost"):
        pipe.launch(through=2 + lag, trainer_version=1)
        pipe.get(2)
    assert progress == {"step": 2, "phase": "generation"}
    pipe.close()
