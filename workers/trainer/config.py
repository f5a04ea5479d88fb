"""TrainerConfig: what one trainer rank needs, built from the run config's plain sections.

The sections are launcher.config.schema's dataclasses (one definition of every key): topology.train
(the layout and the micro-batch size), peft, optim and grpo.loss; every field here is one a run sets.
A trainer built outside the launcher refuses the same sections the launcher does: each field's own
range or set is read from the schema's field metadata (schema.field_errors), and the
rules that tie fields together (sequence / context parallelism, the loss) are schema's functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.config import model_facts
from launcher.config.model_facts import ModelFacts
from launcher.config.schema import (GenerationRole, Grpo, Model, Optim, Peft, Run, Topology, TrainRole, field_errors,
                                    from_dict, train_parallel_errors)
from workers import cpu_shim
from workers.trainer.loss import LossConfig, loss_config

ParallelConfig, PeftConfig, OptimConfig = TrainRole, Peft, Optim


@dataclass
class TrainerConfig:
    model_path: str
    # the defaults: the schema's, of the keys a run sets them from
    device: str = Topology.device
    dtype: str = Model.dtype
    seed: int = Run.seed
    max_num_steps: int = Grpo.max_num_steps  # scheduler decay steps when optim.lr_decay_iters is null
    temperature: float = Grpo.temperature  # logprobs are log_softmax(logits / temperature), as sampled
    # the dtype vLLM keeps a hybrid's SSM state in (topology.train.mamba_ssm_states_dtype=auto follows it)
    generation_ssm_cache_dtype: str = GenerationRole.mamba_ssm_cache_dtype
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # the run's `model:` section (its resolved facts, launcher.config.model_facts); None: read them from
    # model_path's config.json (a trainer built outside the launcher)
    model: Optional[dict] = None

    @classmethod
    def from_sections(cls, model_path: str, *, parallel: dict | None = None, peft: dict | None = None,
                      optim: dict | None = None, loss: dict | None = None, **top) -> "TrainerConfig":
        """Build from plain config sections (topology.train, peft, optim, grpo.loss) + top-level keys."""
        cfg = from_dict(cls, {"model_path": str(model_path), **top}, "trainer")
        cfg.parallel = from_dict(TrainRole, parallel, "topology.train")
        cfg.peft = from_dict(Peft, peft, "peft")
        cfg.optim = from_dict(Optim, optim, "optim")
        cfg.loss = loss_config(loss)
        cfg.check()
        return cfg

    @classmethod
    def from_run_config(cls, cfg: dict, model_path: str) -> "TrainerConfig":
        """From the composed run config as plain data (OmegaConf.to_container(cfg, resolve=True))."""
        return cls.from_sections(
            model_path, parallel=cfg["topology"]["train"], peft=cfg["peft"], optim=cfg["optim"],
            loss=cfg["grpo"]["loss"], device=cfg["topology"]["device"], dtype=cfg["model"]["dtype"],
            seed=cfg["run"]["seed"], max_num_steps=cfg["grpo"]["max_num_steps"],
            temperature=cfg["grpo"]["temperature"], model=cfg["model"],
            generation_ssm_cache_dtype=cfg["topology"]["generation"]["mamba_ssm_cache_dtype"])

    @property
    def facts(self) -> ModelFacts:
        """The model's facts: the run's (resolved at submission), else model_path's config.json."""
        facts = model_facts.of_section(self.model) if self.model else None
        return facts if facts is not None else model_facts.read(self.model_path)[0]

    def check(self) -> None:
        """The first problem of the sections, as the launcher words it ('peft.dim: ...')."""
        errors = (field_errors(self.parallel, "topology.train.") + field_errors(self.peft, "peft.")
                  + field_errors(self.optim, "optim.") + train_parallel_errors(self.parallel))
        if errors:
            raise ValueError(str(errors[0]))

    @property
    def use_distributed_optimizer(self) -> bool:
        flag = self.optim.use_distributed_optimizer
        if flag == "auto":
            return not cpu_shim.is_cpu(self.device)  # megatron's distributed optimizer refuses CPU
        return bool(flag)
