"""The GRPO loop, run by the driver on node 0 once the Ray cluster has formed.

Per step: refit if the generators' weights are stale -> generate n samples per prompt (each
request seeded from (run seed, step, prompt, sample), so sampling does not depend on engine
history) -> rewards (with DAPO dynamic sampling: more rounds until enough informative groups)
-> group advantages -> the policy's logprobs of the samples (and the reference's, adapters
disabled, when a KL penalty is on) -> one optimizer step -> every grpo.val_period steps: refit and
greedy validation -> checkpoint when due -> metrics. A stop request (preemption signal, Ctrl-C)
ends the loop at a step boundary after a checkpoint, so no step is lost or repeated.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from omegaconf import OmegaConf

from launcher import files, logs, paths, progress
from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config.schema import Config, ConfigError
from launcher.driver import advantages, data, metric_names as names, models, rewards
from launcher.driver.checkpoints import CheckpointManager, check_compatible, size_of
from launcher.driver.failures import StepFailed, describe
from launcher.driver.metrics import MetricsLogger, plot, read, summary
from launcher.driver.rollout import build_batch, collect, validation
from launcher.driver.startup import Startup, actor_parts, start_together, step_parts, summary_text, warmed_up
from launcher.paths import checkpoint_dirs

log = logs.get(__name__).info


class GrpoRun:
    def __init__(self, cfg: Config, plan: plan_mod.Plan, ctx: JobContext, stop: threading.Event | None = None):
        self.cfg, self.plan, self.ctx = cfg, plan, ctx
        self.stop = stop or threading.Event()
        self.run_dir = ctx.run_dir
        self.ckpts = CheckpointManager(checkpoint_dirs(cfg, self.run_dir), cfg.checkpointing)
        self.rewards = rewards.Rewards(cfg.reward, cfg.data.answer_key, self.run_dir)
        self.trainers = None
        self.generators = None
        self.startup = Startup.since_process_start(ctx.startup)  # phases end to end, see driver.startup

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        from transformers import AutoTokenizer

        from workers.refit import control as refit
        from workers.generator.actor import GeneratorConfig
        from workers.generator.group import GeneratorGroup
        from workers.trainer.config import TrainerConfig
        from workers.trainer.group import TrainerGroup

        cfg, plan = self.cfg, self.plan
        self.startup.mark("driver imports (torch, transformers, workers)")
        t0 = time.time()
        self.model_dir = models.ensure(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.prompts_from(self.tokenizer)
        self.startup.mark("model files ready (+ tokenizer)")
        plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        log(f"model {cfg.model.name} at {self.model_dir}; starting {plan.train_world} trainer rank(s) and "
            f"{plan.engines} vLLM engine(s)")
        train_cfg = TrainerConfig.from_run_config(plain, str(self.model_dir))
        gen_cfg = GeneratorConfig.from_sections(
            str(self.model_dir), plain["vllm"], {"tensor_parallel": plan.generation_tp},
            device=cfg.topology.device, refit_mode=cfg.refit.mode, seed=cfg.run.seed)
        # logprobs of the distribution tokens are sampled from (after grpo.temperature), what the trainer computes
        gen_cfg = dataclasses.replace(gen_cfg, logprobs_mode="processed_logprobs")
        requested, took = time.time(), []
        self.trainers, self.generators = start_together(  # trainer ranks and vLLM engines start at once
            lambda: TrainerGroup(train_cfg, [plan_mod.trainer_options(plan, r) for r in range(plan.train_world)]),
            lambda: warmed_up(GeneratorGroup(gen_cfg, [plan_mod.generator_options(plan, e) for e in range(plan.engines)],
                                             bundles=[plan_mod.engine_bundles(plan, e) for e in range(plan.engines)]),
                              cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt), seconds=took)
        self.startup.mark("actors up (trainer ranks + vLLM engines)")
        self.startup.parts("actors up (trainer ranks + vLLM engines)",
                           [("trainer ranks: process start, imports, Megatron build", took[0]),
                            ("vLLM engines: process start, engine up, warm-up generate", took[1])]
                           + actor_parts(requested, self.trainers.infos, "trainer rank")
                           + actor_parts(requested, self.generators.infos, "vLLM engine"), concurrent=True)
        transport = refit.connect(self.trainers, self.generators, cfg.refit.transport, cfg.topology.device,
                                  timeout_s=cfg.refit.timeout_s)
        self.startup.mark("refit transport set up")
        log(f"actors up in {time.time() - t0:.1f}s; refit {cfg.refit.mode} over {transport}")
        log(self.trainers.peft_statistics, extra=logs.PLAIN)
        self._print_actor_logs()

    def _print_actor_logs(self) -> None:
        d = self.run_dir / paths.ACTOR_LOGS
        lines = [f"  trainer rank {i['rank']}: {paths.actor_log(d, i['pid'], i['hostname'])}"
                 for i in self.trainers.infos]
        lines += [f"  vLLM engine {e}: {paths.actor_log(d, i['pid'], i.get('hostname'))}"
                  for e, i in enumerate(self.generators.infos)]
        log("actor logs:\n" + "\n".join(lines))

    def prompts_from(self, tokenizer) -> None:
        """The prompt sets, encoded with the model's tokenizer (its chat template when it has one)."""
        try:
            self._read_prompts(tokenizer)
        except ConfigError as e:  # a file changed since submission, messages without a template, ...
            raise StepFailed(f"data: {e}") from None

    def _read_prompts(self, tokenizer) -> None:
        cfg = self.cfg
        self.dataset = data.PromptDataset(cfg.data.train, cfg.data.seed, cfg.data)
        validating = cfg.data.validation is not None and (cfg.grpo.val_period or cfg.grpo.val_at_start)
        self.val_set = data.PromptDataset(cfg.data.validation, cfg.data.seed, cfg.data, "data.validation") \
            if validating else None
        encoder = data.PromptEncoder(tokenizer, cfg.data)
        limit = data.max_prompt_tokens(cfg.data, cfg.grpo.max_total_sequence_length, cfg.grpo.max_new_tokens)
        self.prompts = data.Prompts(self.dataset, encoder, limit)
        log(f"data: {len(self.dataset)} training records from {cfg.data.train}"
            + (" through the tokenizer's chat template" if encoder.template else " as plain text")
            + f"; prompts over {limit} tokens are skipped")
        self.val = None
        if self.val_set is not None:
            examples, ids, skipped = data.Prompts(self.val_set, encoder, limit).all(cfg.grpo.val_max_examples)
            self.val = (examples, ids)
            log(f"validation: {len(examples)} records from {cfg.data.validation}"
                + (f" ({skipped} longer than {limit} tokens dropped)" if skipped else ""))

    def shutdown(self) -> None:
        self.rewards.close()
        for group in (self.generators, self.trainers):
            if group is not None:
                try:
                    group.shutdown()
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log(f"shutdown: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ one step
    def phase(self, name: str) -> None:
        self.ctx.progress["phase"] = name

    def refit(self) -> dict:
        from workers.refit import control as refit

        self.phase(progress.REFIT)
        actors = self.trainers.actors
        report = refit.run_refit(lambda: [a.refit_payload.remote(self.cfg.refit.mode, self.cfg.refit.bucket_mb)
                                          for a in actors], self.generators, self.cfg.refit.mode)
        return {names.REFIT_TIME: report.transfer_and_update_weights_s,
                names.REFIT_BYTES: report.bytes, names.REFIT_TENSORS: report.tensors}

    def validate(self, step: int) -> dict:
        self.phase(progress.VALIDATION)
        t = time.perf_counter()
        m = validation(self.cfg, self.generators, self.val, self.rewards, step)
        m[names.VALIDATION_TIME] = time.perf_counter() - t
        log(f"validation after step {step}: reward {m[names.VAL_REWARD]:.3f}  accuracy {m[names.VAL_ACCURACY]:.3f}"
            + (f"  ({m[names.VAL_REWARD_ERRORS]} reward errors)" if m[names.VAL_REWARD_ERRORS] else ""))
        return m

    def train_step(self, step: int, position: int) -> tuple[dict, int]:
        """One step from data position `position`: (metrics, the position after it)."""
        from launcher.driver.agreement import agreement_metrics

        g = self.cfg.grpo
        t = time.perf_counter()
        self.phase(progress.GENERATION)
        rollout, position, m = collect(self.cfg, self.generators, self.prompts, self.rewards, step, position)
        m[names.GENERATION_TIME] = time.perf_counter() - t
        if m[names.DROPPED_PROMPTS]:
            log(f"step {step}: skipped {m[names.DROPPED_PROMPTS]} prompt(s) longer than {self.prompts.max_tokens} "
                f"tokens (data.max_prompt_tokens)")
        adv = advantages.compute(rollout.rewards, g,
                                 advantages.overlong_penalty([len(x) for x in rollout.response_ids], g))
        batch = build_batch(rollout, adv, self.tokenizer.pad_token_id or 0)
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
        m.update({names.REWARD: sum(rollout.rewards) / len(rollout.rewards),
                  names.TOKEN_MULT_PROB_ERROR: agree["token_mult_prob_error"],
                  names.GEN_KL_ERROR: agree["gen_kl_error"],
                  names.MEAN_RESPONSE_TOKENS: float(batch["loss_mask"].sum()) / len(rollout.rewards)})
        m.update({f"{names.TRAIN}{k}": v for k, v in train.items() if isinstance(v, (int, float)) or hasattr(v, "item")})
        m[names.SAMPLE] = rollout.texts[0]
        return m, position

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg = self.cfg
        g = cfg.grpo
        step, position = 0, 0
        if cfg.resume:
            ckpt = self.ckpts.resolve(cfg.resume)
            check_compatible(ckpt.path, cfg)
            info = ckpt.info()
            self.phase(progress.RESUME)
            restored = self.named_failures(self.trainers.load_state, str(ckpt.path / "trainer"))
            step, position = int(info["step"]), int(info["consumed_prompts"])
            log(f"resumed from {ckpt.path} (step {step}, {position} prompts consumed; trainer {restored})")
        metrics = MetricsLogger(self.run_dir, cfg.logging, g.max_num_steps, resumed_step=step)
        self.startup.mark(("resume + " if cfg.resume else "") + "metrics writers (TensorBoard)")
        first_step = step + 1
        stale, last_saved = True, step
        config_yaml = (self.run_dir / paths.CONFIG).read_text()
        try:
            while step < g.max_num_steps and not self.stop.is_set():
                step += 1
                self.ctx.progress["step"] = step
                t0 = time.perf_counter()
                row: dict = {names.REFIT_TIME: 0.0, names.REFIT_BYTES: 0}
                try:
                    if stale:  # the trainer changed since the last push (always true after a train step)
                        row.update(self.refit())
                    if step == 1 and g.val_at_start and self.val is not None:
                        row.update({f"{k}{names.AT_START}": v for k, v in self.validate(0).items()})
                    m, position = self.train_step(step, position)
                    row.update(m)
                    stale = True
                    if self.val is not None and g.val_period and (step % g.val_period == 0):
                        pushed = self.refit()  # validate the weights this step produced
                        key = names.REFIT_TIME
                        row.update({**pushed, key: row[key] + pushed[key]})
                        stale = False
                        row.update(self.validate(step))
                    row[names.STEP_TIME] = time.perf_counter() - t0
                    if self.ckpts.due(step, g.max_num_steps, stopping=self.stop.is_set()):
                        self.save(step, position, row, config_yaml)
                        last_saved = step
                except StepFailed:
                    raise
                except Exception as e:  # noqa: BLE001 - named and re-raised
                    raise StepFailed(describe(e, self.ctx, self.plan, self.trainers, self.generators)) from e
                metrics.log(step, row)
                if step == first_step:
                    self.startup_done(row)
            if step != last_saved and self.cfg.checkpointing.enabled:
                self.save(step, position, {}, config_yaml)
        finally:
            metrics.close()
        rows = read(self.run_dir / paths.METRICS)
        plot(rows, self.run_dir / "reward.png")
        table = summary(rows)
        table += "\n" + summary_text(self.startup, [r for r in rows if r["step"] >= first_step])
        files.write(self.run_dir / paths.SUMMARY, table + "\n")
        stopped = self.stop.is_set() and step < g.max_num_steps
        log(("stopped" if stopped else "finished") + f" at step {step}/{g.max_num_steps}\n" + table)
        return {"step": step, "stopped": stopped}

    def named_failures(self, fn, *args):
        """fn(*args), with a failure (a dead actor, a lost node) said in one line as a StepFailed: a
        ClusterError, so retry.max_restarts restarts the run after start-up or resume failures too.
        A user's mistake (ConfigError) stays what it is."""
        try:
            return fn(*args)
        except (StepFailed, ConfigError):
            raise
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise StepFailed(describe(e, self.ctx, self.plan, self.trainers, self.generators)) from e

    def startup_done(self, row: dict) -> None:
        name = f"step {self.ctx.progress['step']} (this run's first)"
        self.startup.mark(name)
        self.startup.parts(name, step_parts(row), concurrent=False)
        self.startup.write(self.run_dir / paths.STARTUP)
        log(self.startup.format())

    def check_disk(self, step: int) -> None:
        """Refuse to start a save that cannot fit: estimated from the last checkpoint's size (or the
        trainable parameters: weights + two Adam moments in float32)."""
        import shutil

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
        self.phase(progress.CHECKPOINT)
        self.check_disk(step)
        t = time.perf_counter()
        tmp = self.ckpts.begin(step)
        self.trainers.save_state(str(tmp / "trainer"))
        metrics = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        ckpt = self.ckpts.commit(tmp, step, {"consumed_prompts": position, "metrics": metrics}, config_yaml)
        row[names.CHECKPOINT_TIME] = time.perf_counter() - t
        log(f"checkpoint {ckpt.path} ({row[names.CHECKPOINT_TIME]:.1f}s)")


def run(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, stop: threading.Event | None = None) -> dict:
    grpo = GrpoRun(cfg, plan, ctx, stop)
    try:
        ctx.progress["phase"] = progress.START_UP
        grpo.named_failures(grpo.start)
        return grpo.run()
    finally:
        grpo.shutdown()
