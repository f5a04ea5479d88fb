"""The allowed range or set of every field of the schema, in one table (FIELDS).

Each leaf key of launcher.config.schema.Config has one entry: a Range (numbers, optionally
nullable), a OneOf (a fixed set), a Text (a single line of free text: labels, Slurm names), Free
(any value is meaningful, with the reason), or Elsewhere (a rule that needs other fields or files, written in validate.py / plan.py / paths.py /
job/sbatch.py; the entry names a value that rule must refuse). Booleans need no entry: their type
is the set. tests/unit/test_schema_ranges.py walks the whole schema: a field without an entry, or
an entry whose bad value is accepted, fails it. `check(cfg)` runs the Range/OneOf/Text entries
and the cross-field rules below them; every float must also be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.config.schema import Config, ConfigError
from launcher.driver import metric_names as names


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    nullable: bool = False
    also_bad: tuple = ()      # values a rule elsewhere refuses (e.g. plan.check's `at least 1`)

    def error(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must be set"
        low = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if low and high:
            return None
        null = " or null" if self.nullable else ""
        if self.lo is None:
            return f"must be {'under' if self.hi_open else 'at most'} {self.hi:g}{null}, got {value}"
        if self.hi is None:
            return f"must be {'more than' if self.lo_open else 'at least'} {self.lo:g}{null}, got {value}"
        span = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        return f"must be in {span}{null}, got {value}"

    def bad_values(self) -> list:
        out = list(self.also_bad)
        if self.lo is not None:
            out.append(self.lo if self.lo_open else self.lo - 1)
        if self.hi is not None:
            out.append(self.hi + (0 if self.hi_open else 1))
        return out


@dataclass(frozen=True)
class OneOf:
    choices: tuple
    nullable: bool = False

    def error(self, value: Any) -> str | None:
        if (value is None and self.nullable) or value in self.choices:
            return None
        return f"must be one of {', '.join(map(str, self.choices))}{' or null' if self.nullable else ''}, got {value!r}"

    def bad_values(self) -> list:
        return ["no-such-choice"]


@dataclass(frozen=True)
class Text:
    """A single line of text (a label, a Slurm partition): no newline or NUL, at most 256 characters."""
    nullable: bool = True

    def error(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must be set"
        text = str(value)
        if any(ch in text for ch in "\n\r\0") or len(text) > 256 or not text:
            return f"must be one non-empty line of at most 256 characters, got {text[:40]!r}"
        return None

    def bad_values(self) -> list:
        return ["a\nb"]


@dataclass(frozen=True)
class Elsewhere:
    """Checked by a rule that needs more than the value; `bad` must be refused, naming `reported_as`."""
    where: str
    bad: tuple
    reported_as: str | None = None

    def error(self, value: Any) -> None:
        return None

    def bad_values(self) -> list:
        return list(self.bad)


@dataclass(frozen=True)
class Free:
    """Any value of the declared type is meaningful (free text such as a system prompt); `why` says so."""
    why: str

    def error(self, value: Any) -> None:
        return None

    def bad_values(self) -> list:
        return []


COUNT = dict(lo=None, hi=4096, also_bad=(0,))       # plan.check refuses < 1, here the size bound
PARALLEL = dict(lo=None, hi=1024, also_bad=(0,))
PORT = Range(1024, 65535)
# the step metrics the driver logs that retention may rank by
METRICS = names.RANKABLE

FIELDS: dict[str, Range | OneOf | Text | Elsewhere | Free] = {
    "topology.name": Text(nullable=False),
    "topology.executor": Elsewhere("plan.check", ("pbs",)),
    "topology.device": Elsewhere("plan.check", ("tpu",)),
    "topology.nodes": Range(**COUNT),
    "topology.gpus_per_node": Range(0, 1024),
    "topology.cpus_per_node": Range(1, 65536, nullable=True),
    "topology.gpu_memory_gib": Range(1, None),
    "topology.train.nodes": Range(**COUNT),
    "topology.train.ranks_per_node": Range(**PARALLEL),
    "topology.train.tensor_parallel": Range(**PARALLEL),
    "topology.train.pipeline_parallel": Range(**PARALLEL),
    "topology.train.context_parallel": Range(**PARALLEL),
    "topology.train.expert_parallel": Range(**PARALLEL),
    "topology.train.expert_tensor_parallel": Range(**PARALLEL),
    "topology.train.micro_batch_size": Range(0, 1 << 16),
    "topology.generation.nodes": Range(**COUNT),
    "topology.generation.ranks_per_node": Range(**PARALLEL),
    "topology.generation.engines": Range(**COUNT),
    "topology.generation.tensor_parallel": Range(**PARALLEL),
    "model.name": Text(nullable=False),
    "model.path": Elsewhere("paths.path_error / validate._model_dir", ("/no/such/model%j",)),
    "model.builtin": Elsewhere("validate._model", ("no_such_recipe",)),
    "model.family": Elsewhere("validate._model", ("gpt9",)),
    "model.dtype": Elsewhere("validate._model", ("fp4",)),
    # the facts (launcher.config.model_facts): null where a dry run could not read the checkpoint
    "model.num_layers": Range(1, 100_000, nullable=True),
    "model.hidden_size": Range(1, 1_000_000, nullable=True),
    "model.num_attention_heads": Range(1, 100_000, nullable=True),
    "model.num_query_groups": Range(1, 100_000, nullable=True),
    "model.head_dim": Range(1, 100_000, nullable=True, also_bad=(24,)),   # 24: model_rules (vLLM CPU)
    "model.num_experts": Range(0, 100_000, nullable=True),
    "model.moe_router_topk": Range(0, 100_000, nullable=True),
    "model.ffn_hidden_size": Range(0, 10_000_000, nullable=True),
    "model.moe_ffn_hidden_size": Range(0, 10_000_000, nullable=True),
    "model.tie_word_embeddings": OneOf((True, False), nullable=True),
    "model.qkv_bias": OneOf((True, False), nullable=True),
    "model.qk_norm": OneOf((True, False), nullable=True),
    "model.rope_theta": Range(0, None, lo_open=True, nullable=True),
    "model.rope_scaling": Elsewhere("model_rules.errors", ({"rope_type": "dynamic", "factor": 2.0},)),
    "model.max_position_embeddings": Range(1, None, nullable=True),
    "model.family_facts": Elsewhere("model_rules.errors", ({"use_sliding_window": True},)),
    "model.facts_from": Free("where the facts came from, written by launcher.config.model_facts"),
    "model.size.parameters": Range(1, None, nullable=True),
    "model.size.expert_parameters": Range(0, None, nullable=True),
    "model.size.moe_layers": Range(1, 100_000, nullable=True),
    "model.size.attention_layers": Range(0, 100_000, nullable=True),
    "peft.target_modules": Elsewhere("validate._peft", ([],)),
    "peft.dim": Elsewhere("validate._peft", (0,)),
    "peft.alpha": Elsewhere("validate._peft", (0.0,)),
    "peft.dropout": Elsewhere("validate._peft", (1.0,)),
    "peft.dropout_position": Elsewhere("validate._peft", ("middle",)),
    "peft.lora_A_init_method": Elsewhere("validate._peft", ("ones",)),
    "peft.lora_B_init_method": Elsewhere("validate._peft", ("ones",)),
    "peft.lora_dtype": Elsewhere("validate._peft", ("fp4",)),
    "grpo.max_num_steps": Elsewhere("validate._grpo", (0,)),
    "grpo.num_prompts_per_step": Elsewhere("validate._grpo", (0,)),
    # one generation per prompt: every group's advantage is 0 and nothing is learnt
    "grpo.num_generations_per_prompt": Range(2, None),
    "grpo.max_new_tokens": Elsewhere("validate._grpo", (0,)),
    "grpo.max_total_sequence_length": Elsewhere("validate._refit_and_vllm", (1,)),
    "grpo.temperature": Elsewhere("validate._grpo", (0.0,)),
    "grpo.top_p": Elsewhere("validate._grpo", (0.0,)),
    "grpo.advantage_clip": Range(0, None, lo_open=True, nullable=True),
    "grpo.reward_scaling.source_min": Elsewhere("ranges._cross", (5.0,), reported_as="grpo.reward_scaling.source_max"),
    "grpo.reward_scaling.source_max": Elsewhere("ranges._cross", (-5.0,)),
    "grpo.reward_scaling.target_min": Elsewhere("ranges._cross", (5.0,), reported_as="grpo.reward_scaling.target_max"),
    "grpo.reward_scaling.target_max": Elsewhere("ranges._cross", (-5.0,)),
    "grpo.loss.ratio_clip_min": Elsewhere("schema.loss_errors", (-1.0,)),
    "grpo.loss.ratio_clip_max": Elsewhere("schema.loss_errors", (-1.0,), reported_as="grpo.loss.ratio_clip_min"),
    "grpo.loss.ratio_clip_c": Elsewhere("schema.loss_errors", (0.5,)),
    "grpo.loss.reference_policy_kl_penalty": Range(0, None),
    "grpo.loss.truncated_importance_sampling_ratio": Elsewhere("schema.loss_errors", (0.0,)),
    "grpo.loss.kl_input_clamp_value": Elsewhere("schema.loss_errors", (0.0,)),
    "grpo.loss.kl_output_clamp_value": Elsewhere("schema.loss_errors", (-1.0,)),
    "grpo.val_period": Elsewhere("validate._grpo_sampling", (-1,)),
    "grpo.val_max_examples": Elsewhere("validate._grpo_sampling", (0,)),
    "grpo.dynamic_sampling.max_gen_batches": Elsewhere("validate._grpo_sampling", (0,)),
    "grpo.dynamic_sampling.metric": OneOf(("reward", "accuracy")),
    "grpo.overlong_penalty.buffer_tokens": Elsewhere("validate._grpo_sampling", (0,)),
    "grpo.overlong_penalty.max_penalty": Elsewhere("validate._grpo_sampling", (-1.0,)),
    # each version between generation and training keeps one copy of the weights in flight (0: set enabled=false)
    "grpo.pipeline.max_lag": Range(1, 16),
    "data.train": Elsewhere("driver.data.check", ("/no/such/prompts.jsonl",)),
    "data.validation": Elsewhere("driver.data.check", ("/no/such/val.jsonl",)),
    "data.prompt_key": Text(nullable=False),
    "data.answer_key": Text(nullable=False),
    "data.messages_key": Text(),
    "data.system_prompt": Free("any text, several lines allowed: it is sent to the model, never to a shell"),
    "data.max_prompt_tokens": Range(1, None, nullable=True),
    "data.chat_template": Text(nullable=False),
    "data.seed": Range(0, 2**32 - 1),
    "reward.fn": Elsewhere("driver.rewards.check", ("no_such_module:fn",)),
    "reward.timeout_s": Range(0, 86400, lo_open=True),
    "reward.workers": Range(1, 1024),
    "reward.on_error": Elsewhere("driver.rewards.check", ("explode",)),
    "optim.optimizer": OneOf(("adam", "sgd")),
    "optim.lr": Range(0, None, lo_open=True),
    "optim.min_lr": Range(0, None),
    "optim.weight_decay": Range(0, None),
    "optim.adam_beta1": Range(0, 1, hi_open=True),
    "optim.adam_beta2": Range(0, 1, hi_open=True),
    "optim.adam_eps": Range(0, None, lo_open=True),
    "optim.clip_grad": Range(0, None),
    "optim.lr_warmup_iters": Range(0, None),
    "optim.lr_decay_style": OneOf(("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    "optim.lr_decay_iters": Range(1, None, nullable=True),
    "optim.use_distributed_optimizer": OneOf(("auto", True, False)),
    "refit.mode": Elsewhere("validate._refit_and_vllm", ("full",)),
    "refit.bucket_mb": Elsewhere("validate._refit_and_vllm", (0,)),
    "refit.transport": Elsewhere("validate._refit_and_vllm", ("tcp",)),
    "refit.timeout_s": Range(1, None),
    "checkpointing.dir": Elsewhere("paths.path_error", ("ck%j",)),
    "checkpointing.save_period": Elsewhere("validate._checkpointing_and_slurm", (0,)),
    "checkpointing.keep_top_k": Elsewhere("validate._checkpointing_and_slurm", (0,)),
    "checkpointing.metric_name": OneOf(METRICS),
    "slurm.partition": Text(),
    "slurm.account": Text(),
    "slurm.qos": Text(),
    "slurm.time_min": Elsewhere("validate._checkpointing_and_slurm", (0,)),
    "slurm.signal_delay_s": Elsewhere("validate._checkpointing_and_slurm", (-1,)),
    "slurm.max_num_timeout": Range(0, 1000),
    "slurm.setup": Elsewhere("job.sbatch.job_spec", (["echo 'a"],)),
    "slurm.container_image": Text(),
    "slurm.container_mounts": Text(),
    "slurm.extra_sbatch": Elsewhere("job.sbatch.job_spec", ({"time": 5},)),
    "slurm.python": Text(),
    "run.name": Elsewhere("paths.run_name_error", ("../conf",)),
    "run.root": Elsewhere("paths.path_error", ("/tmp/%u",)),
    "run.seed": Range(0, 2**32 - 1),
    "run.job": Elsewhere("validate.validate", ("train",)),
    "vllm.dtype": Elsewhere("validate._refit_and_vllm", ("fp4",)),
    "vllm.max_model_len": Range(1, None),
    "vllm.gpu_memory_utilization": Range(0, 1, lo_open=True),
    "vllm.kv_cache_memory_bytes": Range(2**20, None),
    "vllm.max_lora_rank": Elsewhere("validate._refit_and_vllm", (12,)),
    "ray.port": PORT,
    "ray.node_manager_port": PORT,
    "ray.object_manager_port": PORT,
    "ray.min_worker_port": PORT,
    "ray.max_worker_port": PORT,
    "ray.object_store_mb": Range(75, None),   # Ray refuses an object store under 75 MiB
    "ray.register_timeout_s": Range(0, None, lo_open=True),
    "ray.join_retries": Range(1, 100),
    "ray.join_jitter_s": Range(0, 600),
    "logging.wandb_project": Text(),
    "logging.wandb_entity": Text(),
    "retry.max_restarts": Range(None, 100, also_bad=(-1,)),
    "resume": Elsewhere("paths.path_error / run_dir.prepare", ("ck%j",)),
}


def _get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check(cfg: Config) -> list[ConfigError]:
    """Every per-field range/set of FIELDS, every float finite, then the cross-field rules."""
    errs = []
    for key, rule in FIELDS.items():
        try:
            value = _get(cfg, key)
        except AttributeError:   # a field another change removed: the walking test reports it
            continue
        if isinstance(value, float) and not math.isfinite(value):
            errs.append(ConfigError(key, f"must be a finite number, got {value}"))
            continue
        message = rule.error(value)
        if message:
            errs.append(ConfigError(key, message))
    return errs or _cross(cfg)  # the cross-field rules assume each field in range


def _cross(cfg: Config) -> list[ConfigError]:
    errs = []
    rs = cfg.grpo.reward_scaling
    if rs.enabled and rs.source_max <= rs.source_min:
        errs.append(ConfigError("grpo.reward_scaling.source_max", f"must exceed source_min = {rs.source_min}, "
                                                                  f"got {rs.source_max}"))
    if rs.enabled and rs.target_max <= rs.target_min:
        errs.append(ConfigError("grpo.reward_scaling.target_max", f"must exceed target_min = {rs.target_min}, "
                                                                  f"got {rs.target_max}"))
    r = cfg.ray
    if r.min_worker_port >= r.max_worker_port:
        errs.append(ConfigError("ray.max_worker_port", f"must exceed ray.min_worker_port = {r.min_worker_port}, "
                                                       f"got {r.max_worker_port}"))
    fixed = {"ray.port": r.port, "ray.node_manager_port": r.node_manager_port,
             "ray.object_manager_port": r.object_manager_port}
    seen: dict[int, str] = {}
    for key, port in fixed.items():
        if port in seen:
            errs.append(ConfigError(key, f"is {port}, the same port as {seen[port]}"))
        elif r.min_worker_port <= port <= r.max_worker_port:
            errs.append(ConfigError(key, f"is {port}, inside the worker port range [{r.min_worker_port}, "
                                         f"{r.max_worker_port}]"))
        seen[port] = key
    if cfg.optim.min_lr > cfg.optim.lr:
        errs.append(ConfigError("optim.min_lr", f"must be at most optim.lr = {cfg.optim.lr}, got {cfg.optim.min_lr}"))
    if cfg.grpo.loss.reference_policy_kl_penalty > 0 and not cfg.peft.enabled:
        errs.append(ConfigError("grpo.loss.reference_policy_kl_penalty",
                                "needs peft.enabled=true (the reference policy is the base model with the LoRA "
                                "adapters switched off); set it to 0 for full fine-tuning"))
    if cfg.checkpointing.metric_name.startswith(names.VAL) and not (cfg.grpo.val_period or cfg.grpo.val_at_start):
        errs.append(ConfigError("checkpointing.metric_name", f"{cfg.checkpointing.metric_name} is only logged with "
                                                             f"validation on (grpo.val_period > 0)"))
    if cfg.grpo.pipeline.enabled and cfg.grpo.loss.truncated_importance_sampling_ratio is None:
        errs.append(ConfigError("grpo.pipeline.enabled", "needs grpo.loss.truncated_importance_sampling_ratio (e.g. "
                                                         "5.0): the truncated importance weight corrects for samples "
                                                         "generated with older weights"))
    if cfg.vllm.max_model_len < cfg.grpo.max_total_sequence_length:
        errs.append(ConfigError("vllm.max_model_len", f"must be at least grpo.max_total_sequence_length = "
                                                      f"{cfg.grpo.max_total_sequence_length}, got {cfg.vllm.max_model_len}"))
    return errs
