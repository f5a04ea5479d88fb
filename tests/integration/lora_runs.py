"""Run checkpoints with trained LoRA adapters, for the exporter tests (test_export, test_vllm_serve).

`trained_run(cache_root, model_dir, recipe, tp)` composes the run's config with the launcher's own
Hydra tree, builds the trainer from it (`TrainerConfig.from_run_config`), trains a real TrainerGroup
two GRPO steps at lr 5e-3 (LoRA B starts at zero: the adapters must clearly move), records the
trainer's logprobs of a probe batch, and saves `RUN/checkpoints/step_2/` through
`launcher.driver.checkpoints.CheckpointManager` (trainer/ = `save_state`, config.yaml = the composed config).

Training is the slow part (a Megatron actor start per rank), so a run is kept on disk under the
session's base temp dir and reused by the next test module that asks for the same (recipe, tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

STEPS = 2
PEFT_OVERRIDES = ["peft=lora_all_linear", "peft.dim=8", "peft.alpha=16"]


@dataclass
class TrainedRun:
    recipe: str
    tp: int
    checkpoint: Path           # RUN/checkpoints/step_2
    model_dir: Path
    probe_ids: torch.Tensor    # [B, T] int64
    trainer_logprobs: torch.Tensor  # [B, T] float32, log p(ids[t] | ids[:t]), 0 at t = 0


def overrides(model_dir: Path, recipe: str, tp: int, run_name: str) -> list[str]:
    from tests.helpers.recipes import RECIPES

    spec = RECIPES[recipe]
    return [f"model.name={recipe}", f"model.path={model_dir}", "model.builtin=null", f"model.family={spec['family']}",
            f"model.hidden_size={spec['hidden_size']}", f"model.num_attention_heads={spec['num_attention_heads']}",
            f"model.num_query_groups={spec['num_key_value_heads']}", f"model.head_dim={spec['head_dim']}",
            f"model.num_layers={spec.get('num_hidden_layers', len(spec.get('hybrid_override_pattern', '')))}",
            *PEFT_OVERRIDES, "optim.lr=5e-3", "optim.min_lr=5e-3", "grpo.max_num_steps=20",
            f"topology.train.tensor_parallel={tp}", f"topology.train.ranks_per_node={tp}", f"run.name={run_name}"]


def grpo_batch(group, ids: torch.Tensor) -> dict:
    """One GRPO batch over `ids`: responses from token 4 on, mixed advantages, on-policy logprobs."""
    mask = torch.zeros(ids.shape)
    mask[:, 4:] = 1
    batch = {"input_ids": ids, "loss_mask": mask,
             "advantages": torch.tensor([1.0, -0.7, 0.6, -1.0])[: ids.shape[0]]}
    batch["prev_logprobs"] = group.logprobs(batch)
    return batch


def trained_run(cache_root: Path, model_dir: Path, recipe: str, tp: int) -> TrainedRun:
    from omegaconf import OmegaConf

    from launcher.config import compose as config_mod
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.config.schema import Checkpointing
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    run = Path(cache_root) / f"{recipe}-tp{tp}"
    probe_file = run / "probe.pt"
    if not probe_file.exists():
        raw = config_mod.compose(overrides(model_dir, recipe, tp, run.name))
        trainer_cfg = TrainerConfig.from_run_config(OmegaConf.to_container(raw, resolve=True), str(model_dir))
        gen = torch.Generator().manual_seed(7)
        train_ids = torch.randint(4, 250, (4, 12), generator=gen)
        probe_ids = torch.randint(4, 250, (3, 16), generator=gen)
        group = TrainerGroup(trainer_cfg, num_ranks=tp)
        try:
            for _ in range(STEPS):
                group.train(grpo_batch(group, train_ids))
            trainer_logprobs = group.logprobs({"input_ids": probe_ids})
            manager = CheckpointManager(run / "checkpoints", Checkpointing())
            tmp = manager.begin(STEPS)
            group.save_state(tmp / "trainer")
            manager.commit(tmp, STEPS, {"consumed_prompts": 4 * STEPS, "metrics": {}}, config_mod.to_yaml(raw))
        finally:
            group.shutdown()
        torch.save({"probe_ids": probe_ids, "trainer_logprobs": trainer_logprobs}, probe_file)
    saved = torch.load(probe_file)
    return TrainedRun(recipe, tp, run / "checkpoints" / f"step_{STEPS}", Path(model_dir), saved["probe_ids"],
                      saved["trainer_logprobs"])
