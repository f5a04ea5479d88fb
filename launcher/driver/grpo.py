"""The GRPO loop, run by the driver on node 0 once the Ray cluster has formed.

`run` brings the run up (launcher.driver.start: data, trainer ranks, vLLM engines, the refit
object) and hands the parts to `GrpoRun`, which sees them only through workers.contracts
(Trainers, Generators, WeightSync): the loop starts no actor and names no transport, and
tests/unit/test_grpo_loop.py runs it on fakes without Ray.

Per step N: the rollout of step N (launcher.driver.pipeline: n seeded generations per prompt and
their rewards, with DAPO dynamic sampling more rounds until enough informative groups; generated
with the weights after step N-1, or with grpo.pipeline.enabled after step N-1-max_lag while the
trainers train) -> group advantages -> the policy's logprobs of the samples (and the reference's,
adapters disabled, when a KL penalty is on) -> one optimizer step -> every grpo.val_period steps:
greedy validation with the weights this step produced -> checkpoint when due -> metrics. A stop
request (preemption signal, Ctrl-C, launcher.stop) ends the loop at a step boundary after a
checkpoint, so no step is lost or repeated; with the pipeline the checkpoint keeps the rollouts
generated ahead, so a resumed run is the uninterrupted one (pipeline.py).
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import TYPE_CHECKING

from launcher import files, logs, paths, progress
from launcher import metric_names as names
from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config.schema import Config, ConfigError
from launcher.driver import advantages, pipeline, rewards as rewards_mod
from launcher.driver.checkpoints import CheckpointManager, size_of
from launcher.driver.failures import StepFailed, describe
from launcher.driver.metrics import MetricsLogger, plot, read, summary
from launcher.driver.rollout import build_batch
from launcher.driver.start import RunData, Workers, start
from launcher.driver.startup import Startup, step_parts, summary_text
from launcher.paths import checkpoint_dirs
from workers.contracts import Generators, Trainers, WeightSync

if TYPE_CHECKING:
    from launcher.driver.environments import Environments

log = logs.get(__name__).info


def named_failures(ctx: JobContext, plan, parts, fn, *args):
    """fn(*args), with a failure (a dead actor, a lost node) said in one line as a StepFailed: a
    ClusterError, so retry.max_restarts restarts the run after start-up or resume failures too.
    A user's mistake (ConfigError) stays what it is. `parts`: whose `trainers` and `generators`
    (as they are when it fails) name the actors."""
    try:
        return fn(*args)
    except (StepFailed, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - named and re-raised
        raise StepFailed(describe(e, ctx, plan, parts.trainers, parts.generators)) from e


def add_refit(row: dict, refit: dict) -> None:
    """A refit's metrics into a step's row: seconds add up, bytes and tensors are the last refit's."""
    if refit:
        row.update({**refit, names.REFIT_TIME: row.get(names.REFIT_TIME, 0.0) + refit[names.REFIT_TIME]})


class GrpoRun:
    def __init__(self, cfg: Config, ctx: JobContext, trainers: Trainers, generators: Generators, refit: WeightSync,
                 data: RunData, rewards: rewards_mod.Rewards | Environments, stop: threading.Event | None = None,
                 plan: plan_mod.Plan | None = None, startup: Startup | None = None):
        """rewards: launcher.driver.rewards.Rewards (score(texts, examples) -> (scores, errors)), or with
        env.fn launcher.driver.environments.Environments (the episodes' environments)."""
        self.cfg, self.ctx, self.plan = cfg, ctx, plan
        self.trainers, self.generators, self.refit = trainers, generators, refit
        self.data, self.rewards = data, rewards
        if cfg.env.fn is not None:  # the episodes render the environments' messages with its chat template
            rewards.tokenizer = data.prompts.encoder.tokenizer
        self.stop = stop or threading.Event()
        self.run_dir = ctx.run_dir
        self.ckpts = CheckpointManager(checkpoint_dirs(cfg, self.run_dir), cfg.checkpointing)
        self.startup = startup or Startup.since_process_start(ctx.startup)
        p = cfg.grpo.pipeline
        self.lag = p.max_lag if p.enabled else 0
        self.pipeline: pipeline.Pipeline | None = None

    def phase(self, name: str) -> None:
        self.ctx.progress["phase"] = name

    def named_failures(self, fn, *args):
        return named_failures(self.ctx, self.plan, self, fn, *args)

    # ------------------------------------------------------------------ one step
    def validate(self, step: int, row: dict, at_start: bool = False) -> None:
        """Greedy validation with the weights of `step` (the trainers hold them now)."""
        self.phase(progress.VALIDATION)
        refit, m = self.pipeline.validate(step, self.data.val, step)
        add_refit(row, refit)
        log(f"validation after step {step}: reward {m[names.VAL_REWARD]:.3f}  accuracy {m[names.VAL_ACCURACY]:.3f}"
            + (f"  ({m[names.VAL_REWARD_ERRORS]} reward errors)" if m[names.VAL_REWARD_ERRORS] else ""))
        row.update({f"{k}{names.AT_START}": v for k, v in m.items()} if at_start else m)

    def rollout(self, step: int, row: dict) -> pipeline.RolloutResult:
        """Launch what the schedule launches now and wait for the rollout of `step`."""
        self.pipeline.launch(through=step + self.lag, trainer_version=step - 1)
        self.phase(progress.GENERATION)
        got = self.pipeline.get(step)
        add_refit(row, got.refit)
        row.update(got.metrics)
        if got.metrics[names.DROPPED_PROMPTS]:
            log(f"step {step}: skipped {got.metrics[names.DROPPED_PROMPTS]} prompt(s) longer than "
                f"{self.data.prompts.max_tokens} tokens (data.max_prompt_tokens)")
        return got

    def learn(self, step: int, got: pipeline.RolloutResult) -> dict:
        """Advantages, logprobs and one optimizer step on a rollout: the row's train/* metrics."""
        from launcher.driver.agreement import agreement_metrics

        g, rollout = self.cfg.grpo, got.rollout
        adv = advantages.compute(rollout.rewards, g,
                                 advantages.overlong_penalty([len(x) for x in rollout.response_ids], g))
        batch = build_batch(rollout, adv, self.data.pad_id)
        m: dict = {}
        t = time.perf_counter()
        self.phase(progress.LOGPROBS)
        batch["prev_logprobs"] = self.trainers.logprobs(batch)
        if g.loss.reference_policy_kl_penalty > 0:
            batch["reference_logprobs"] = self.trainers.logprobs(batch, adapters=False)
        m[names.LOGPROBS_TIME] = time.perf_counter() - t
        agree = agreement_metrics(batch["generation_logprobs"], batch["prev_logprobs"], batch["loss_mask"])
        t = time.perf_counter()
        self.phase(progress.TRAINING)
        train = self.trainers.train(batch)
        m[names.TRAINING_TIME] = time.perf_counter() - t
        m[names.REWARD] = sum(rollout.rewards) / len(rollout.rewards)
        lag = (step - 1) - got.version
        if lag == 0:  # generated with the weights the trainers scored it with: engine vs trainer alone
            m.update({names.TOKEN_MULT_PROB_ERROR: agree["token_mult_prob_error"],
                      names.GEN_KL_ERROR: agree["gen_kl_error"]})
        if self.lag:
            # generation vs the trainers' weights, `lag` steps newer: what the importance weight corrects
            m.update({names.LAG: lag, names.GENERATED_WITH: got.version, names.OFF_POLICY_KL: agree["gen_kl_error"]})
        m[names.MEAN_RESPONSE_TOKENS] = float(batch["loss_mask"].sum()) / len(rollout.rewards)
        m.update({f"{names.TRAIN}{k}": v for k, v in train.items()
                  if isinstance(v, (int, float)) or hasattr(v, "item")})
        m[names.SAMPLE] = rollout.texts[0]
        return m

    # ------------------------------------------------------------------ the loop
    def resume(self) -> tuple[int, int, list[pipeline.RolloutResult]]:
        """Load the checkpoint `+resume` names: (its step, the data position, the rollouts it holds)."""
        from launcher.driver import start_check

        # what the launcher and the job's start checked (a retry of a finished run runs no step)
        _, ckpt = start_check.resume(self.cfg, self.run_dir, finished_ok=True)
        info = ckpt.info()
        self.phase(progress.RESUME)
        restored = self.named_failures(self.trainers.load_state, str(ckpt.path / "trainer"))
        step, position = int(info["step"]), int(info["consumed_prompts"])
        log(f"resumed from {ckpt.path} (step {step}, {position} prompts consumed; trainer {restored})")
        ahead, why = pipeline.restore(ckpt.path, info, self.cfg, self.lag)
        if ahead:
            log(f"pipeline: the rollouts of step(s) {', '.join(str(r.step) for r in ahead)} come from the "
                f"checkpoint (generated with the weights of step(s) {', '.join(str(r.version) for r in ahead)})")
        elif why:
            log(f"pipeline: restarts at step {step} ({why}): the next {self.lag + 1} rollout(s) are generated "
                f"with the weights of step {step}")
        return step, position, ahead

    def run(self) -> dict:
        cfg = self.cfg
        g = cfg.grpo
        step, position, ahead = self.resume() if cfg.resume else (0, 0, [])
        why = pipeline.engines_hold_w0(cfg)
        if why and self.refit.generators_version is None:
            self.refit.generators_version = 0
            log(f"no refit before step 1: {why}")
        self.pipeline = pipeline.Pipeline(cfg, self.generators, self.refit, self.data.prompts, self.rewards,
                                          self.lag, step, position, ahead, progress=self.ctx.progress)
        metrics = MetricsLogger(self.run_dir, cfg.logging, g.max_num_steps, resumed_step=step)
        self.startup.mark(("resume + " if cfg.resume else "") + "metrics writers (TensorBoard)")
        first_step, last_saved = step + 1, step
        saved = False                              # a checkpoint written by this run
        config_yaml = (self.run_dir / paths.CONFIG).read_text()
        try:
            while step < g.max_num_steps and not self.stop.is_set():
                step += 1
                self.ctx.progress["step"] = step
                t0 = time.perf_counter()
                row: dict = {names.REFIT_TIME: 0.0, names.REFIT_BYTES: 0}
                try:
                    if step == 1 and g.val_at_start and self.data.val is not None:
                        self.validate(0, row, at_start=True)
                    got = self.rollout(step, row)
                    position = got.position
                    row.update(self.learn(step, got))
                    if self.data.val is not None and g.val_period and (step % g.val_period == 0):
                        self.validate(step, row)
                    if self.lag:
                        row.update(self.pipeline.timings())
                    row[names.STEP_TIME] = time.perf_counter() - t0
                    if self.ckpts.due(step, g.max_num_steps, stopping=self.stop.is_set()):
                        self.save(step, position, row, config_yaml)
                        last_saved, saved = step, True
                except StepFailed:
                    raise
                except Exception as e:  # noqa: BLE001 - named and re-raised
                    raise StepFailed(describe(e, self.ctx, self.plan, self.trainers, self.generators)) from e
                metrics.log(step, row)
                if step == first_step:
                    self.startup_done(row)
            if step != last_saved and self.cfg.checkpointing.enabled:
                self.save(step, position, {}, config_yaml)
                last_saved, saved = step, True
        finally:
            metrics.close()
            self.pipeline.close()
        rows = read(self.run_dir / paths.METRICS)
        plot(rows, self.run_dir / "reward.png")
        table = summary(rows)
        table += "\n" + summary_text(self.startup, [r for r in rows if r["step"] >= first_step])
        files.write(self.run_dir / paths.SUMMARY, table + "\n")
        stopped = self.stop.is_set() and step < g.max_num_steps
        log(("stopped" if stopped else "finished") + f" at step {step}/{g.max_num_steps}\n" + table)
        return outcome(step, stopped, last_saved if saved or cfg.resume else None, saved)

    def startup_done(self, row: dict) -> None:
        name = f"step {self.ctx.progress['step']} (this run's first)"
        self.startup.mark(name)
        self.startup.parts(name, step_parts(row), concurrent=False)
        self.startup.write(self.run_dir / paths.STARTUP)
        log(self.startup.format())

    def check_disk(self, step: int) -> None:
        """Refuse to start a save that cannot fit: estimated from the last checkpoint's size (or the
        trainable parameters: weights + two Adam moments in float32)."""
        done = self.ckpts.complete()
        trainable = self.trainers.infos[0]["num_parameters"]["trainable"]
        need = size_of(done[-1].path) if done else 12 * trainable + (1 << 20)
        files.make_dir(self.ckpts.root)
        free = shutil.disk_usage(self.ckpts.root).free
        if free < 1.2 * need:
            raise StepFailed(f"checkpoint step_{step} needs about {need / 2**20:.1f} MiB but only "
                             f"{free / 2**20:.1f} MiB are free in {self.ckpts.root}; nothing was written "
                             f"(free space or set checkpointing.dir)")

    def save(self, step: int, position: int, row: dict, config_yaml: str) -> None:
        """The trainers' state and, with the pipeline, the rollouts already launched for the steps
        after `step` (waited for: the engines keep generating while the trainers write)."""
        self.phase(progress.CHECKPOINT)
        self.check_disk(step)
        t = time.perf_counter()
        tmp = self.ckpts.begin(step)
        self.trainers.save_state(str(tmp / "trainer"))
        info = {"consumed_prompts": position, "metrics": {k: v for k, v in row.items() if isinstance(v, (int, float))}}
        ahead = self.pipeline.ahead(step)
        if ahead:
            info["pipeline"] = pipeline.save(tmp, ahead, self.cfg, self.lag)
        ckpt = self.ckpts.commit(tmp, step, info, config_yaml)
        row[names.CHECKPOINT_TIME] = time.perf_counter() - t
        log(f"checkpoint {ckpt.path} ({row[names.CHECKPOINT_TIME]:.1f}s"
            + (f"; with the rollouts of step(s) {', '.join(str(r.step) for r in ahead)}" if ahead else "") + ")")


def outcome(step: int, stopped: bool, checkpoint: int | None, saved: bool) -> dict:
    """What the driver returns: the step it ended at, whether a stop ended it before max_num_steps,
    the step of the newest checkpoint that continues it (the one it saved last, else the one it
    resumed from; None: no checkpoint, the run starts again from step 1) and whether it saved one."""
    return {"step": step, "stopped": stopped, "checkpoint": checkpoint, "saved": saved}


def stopped_before_start(cfg: Config, ctx: JobContext) -> dict:
    """A stop (Ctrl-C, a preemption) during the start-up before the driver: no actor is started,
    nothing is saved; the run is where its +resume checkpoint left it, or at step 0."""
    from launcher.driver import start_check

    step = start_check.resume(cfg, ctx.run_dir, finished_ok=True)[1].step if cfg.resume else 0
    log(f"stopped before step {step + 1}, during the start-up: no actor started, nothing saved")
    return outcome(step, True, step if cfg.resume else None, False)


def run(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, stop: threading.Event | None = None) -> dict:
    if stop is not None and stop.is_set():
        return stopped_before_start(cfg, ctx)
    startup = Startup.since_process_start(ctx.startup)  # phases end to end, see driver.startup
    if cfg.env.fn is not None:  # multi-turn episodes: the environments score them (driver.episodes)
        from launcher.driver.environments import Environments

        rewards = Environments(cfg, ctx.run_dir)
    else:
        rewards = rewards_mod.Rewards(cfg.reward, cfg.data.answer_key, ctx.run_dir)
    parts = Workers()
    try:
        ctx.progress["phase"] = progress.START_UP
        named_failures(ctx, plan, parts, start, cfg, plan, ctx, startup, parts)
        grpo = GrpoRun(cfg, ctx, parts.trainers, parts.generators, parts.refit, parts.data, rewards, stop, plan,
                       startup)
        return grpo.run()
    finally:
        rewards.close()
        parts.shutdown()
