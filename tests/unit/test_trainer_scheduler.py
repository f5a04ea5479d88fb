"""The trainer's megatron OptimizerParamScheduler: resume semantics of override_opt_param_scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers import cpu_shim
from workers.trainer.actor import MegatronTrainer
from workers.trainer.config import TrainerConfig


def scheduler(max_num_steps: int, override: bool, style: str = "linear"):
    cpu_shim.apply("cpu")  # megatron.core imports triton at import time
    cfg = TrainerConfig.from_sections("/m", optim={"lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": style,
                                                   "override_opt_param_scheduler": override},
                                      max_num_steps=max_num_steps)
    trainer = MegatronTrainer(cfg, rank=0, world_size=1)  # no setup: only the scheduler is built
    trainer.optimizer = SimpleNamespace(param_groups=[{"params": []}])
    return trainer._make_scheduler(), trainer.optimizer.param_groups[0]


def test_resume_with_other_max_num_steps_needs_override():
    saved, _ = scheduler(max_num_steps=10, override=False)
    for _ in range(4):
        saved.step(increment=1)
    state = saved.state_dict()

    same, group = scheduler(max_num_steps=10, override=False)
    same.load_state_dict(state)
    assert same.num_steps == 4 and group["lr"] == pytest.approx(1e-3 - 0.4 * (1e-3 - 1e-4))

    changed, _ = scheduler(max_num_steps=20, override=False)
    with pytest.raises(AssertionError, match="total number of iterations"):
        changed.load_state_dict(state)

    overridden, group = scheduler(max_num_steps=20, override=True)
    overridden.load_state_dict(state)  # the new run's schedule, the saved step count
    assert overridden.num_steps == 4 and group["lr"] == pytest.approx(1e-3 - 0.2 * (1e-3 - 1e-4))
