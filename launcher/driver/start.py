"""Start-up of a GRPO run: the model files and tokenizer, the prompt sets, the trainer ranks and the
vLLM engines (together), the refit object connected. The loop (launcher.driver.grpo.GrpoRun) gets
what this builds as arguments and never starts an actor or names a transport itself.

The prompt files are read before any actor starts, so a file that changed since submission fails
in seconds; `Workers` is filled as things come up, so a failure half-way still shuts down what
did start.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from launcher import logs, paths
from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config.schema import Config, ConfigError
from launcher.driver import data, models
from launcher.driver.failures import StepFailed
from launcher.driver.startup import Startup, actor_parts, start_together, warmed_up
from workers.contracts import Generators, Trainers, WeightSync

log = logs.get(__name__).info


@dataclass
class RunData:
    """The prompt sets, encoded with the model's tokenizer."""

    pad_id: int
    prompts: data.Prompts
    val: tuple | None = None     # (examples, ids) of the validation set, when validating


@dataclass
class Workers:
    trainers: Trainers | None = None
    generators: Generators | None = None
    refit: WeightSync | None = None
    data: RunData | None = None

    def shutdown(self) -> None:
        for group in (self.generators, self.trainers):
            if group is not None:
                try:
                    group.shutdown()
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log(f"shutdown: {type(e).__name__}: {e}")


def read_data(cfg: Config, tokenizer) -> RunData:
    """The prompt sets through the tokenizer (its chat template when it has one); a file that
    changed since submission, messages without a template, ...: a StepFailed naming it."""
    try:
        return _read_data(cfg, tokenizer)
    except ConfigError as e:
        raise StepFailed(f"data: {e}") from None


def _read_data(cfg: Config, tokenizer) -> RunData:
    dataset = data.PromptDataset(cfg.data.train, cfg.data.seed, cfg.data)
    validating = cfg.data.validation is not None and (cfg.grpo.val_period or cfg.grpo.val_at_start)
    val_set = data.PromptDataset(cfg.data.validation, cfg.data.seed, cfg.data, "data.validation") \
        if validating else None
    encoder = data.PromptEncoder(tokenizer, cfg.data)
    limit = data.max_prompt_tokens(cfg.data, cfg.grpo.max_total_sequence_length, cfg.grpo.max_new_tokens)
    env = cfg.env.fn is not None  # an environment writes each episode's first messages (driver.episodes)
    prompts = data.Prompts(dataset, encoder, limit, encode=not env)
    log(f"data: {len(dataset)} training records from {cfg.data.train}"
        + (f"; episodes with env.fn={cfg.env.fn}, up to {cfg.grpo.max_turns} model turns" if env else
           (" through the tokenizer's chat template" if encoder.template else " as plain text")
           + f"; prompts over {limit} tokens are skipped"))
    val = None
    if val_set is not None:
        examples, ids, skipped = data.Prompts(val_set, encoder, limit, encode=not env).all(cfg.grpo.val_max_examples)
        val = (examples, ids)
        log(f"validation: {len(examples)} records from {cfg.data.validation}"
            + (f" ({skipped} longer than {limit} tokens dropped)" if skipped else ""))
    return RunData(tokenizer.pad_token_id or 0, prompts, val)


def start(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, startup: Startup, into: Workers) -> Workers:
    """Bring everything up, filling `into` as it goes; returns it."""
    from transformers import AutoTokenizer

    from workers.generator.actor import GeneratorConfig
    from workers.generator.group import GeneratorGroup
    from workers.refit.control import make_refit
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    startup.mark("driver imports (torch, transformers, workers)")
    t0 = time.time()
    try:
        model_dir = models.ensure(cfg)
    except ConfigError as e:  # the checkpoint changed since submission
        raise StepFailed(str(e)) from None
    into.data = read_data(cfg, AutoTokenizer.from_pretrained(str(model_dir)))
    startup.mark("model files ready (+ tokenizer)")
    # the typed config as plain data, not through OmegaConf: a value's `${` text (resolved at submission,
    # launcher.config.compose.resolve) would be read as an interpolation again
    plain = dataclasses.asdict(cfg)
    log(f"model {cfg.model.name} at {model_dir}; starting {plan.train_world} trainer rank(s) and "
        f"{plan.engines} vLLM engine(s)")
    train_cfg = TrainerConfig.from_run_config(plain, str(model_dir))
    gen_cfg = GeneratorConfig.from_run_config(plain, str(model_dir), plan.generation_tp)
    # logprobs of the distribution tokens are sampled from (after grpo.temperature), what the trainer computes
    gen_cfg = dataclasses.replace(gen_cfg, logprobs_mode="processed_logprobs")
    requested, took = time.time(), []
    into.trainers, into.generators = start_together(  # trainer ranks and vLLM engines start at once
        lambda: TrainerGroup(train_cfg, [plan_mod.trainer_options(plan, r) for r in range(plan.train_world)]),
        lambda: warmed_up(GeneratorGroup(gen_cfg, [plan_mod.generator_options(plan, e) for e in range(plan.engines)],
                                         bundles=[plan_mod.engine_bundles(plan, e) for e in range(plan.engines)]),
                          cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt), seconds=took)
    name = "actors up (trainer ranks + vLLM engines)"
    startup.mark(name)
    startup.parts(name, [("trainer ranks: process start, imports, Megatron build", took[0]),
                         ("vLLM engines: process start, engine up, warm-up generate", took[1])]
                  + actor_parts(requested, into.trainers.infos, "trainer rank")
                  + actor_parts(requested, into.generators.infos, "vLLM engine"), concurrent=True)
    into.refit = make_refit(into.trainers, into.generators, cfg.refit.transport, cfg.topology.device, cfg.refit.mode,
                            cfg.refit.bucket_mb, timeout_s=cfg.refit.timeout_s)
    into.refit.connect()
    startup.mark("refit transport set up")
    log(f"actors up in {time.time() - t0:.1f}s; refit {cfg.refit.mode} over {into.refit.transport}")
    log(into.trainers.peft_statistics, extra=logs.PLAIN)
    print_actor_logs(ctx, into.trainers, into.generators)
    return into


def print_actor_logs(ctx: JobContext, trainers: Trainers, generators: Generators) -> None:
    d = ctx.run_dir / paths.ACTOR_LOGS
    lines = [f"  trainer rank {i['rank']}: {paths.actor_log(d, i['pid'], i['hostname'])}"
             for i in trainers.infos]
    lines += [f"  vLLM engine {e}: {paths.actor_log(d, i['pid'], i.get('hostname'))}"
              for e, i in enumerate(generators.infos)]
    log("actor logs:\n" + "\n".join(lines))
