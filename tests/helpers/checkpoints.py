"""Run checkpoints as the driver and the trainers write them, without a Megatron model.

`trainer_state(dir, step, tensors)` writes a torch distributed checkpoint the way megatron-core's
torch_dist format does (what `workers.trainer.state.save_state` produces): the given tensors under
their ShardedTensor keys plus the common state, one bytes item under megatron's key
`common_state/shard_0_1` holding `torch.save([common])` as is (megatron-core
dist_checkpointing/strategies/torch.py `_mcore_to_torch_sharded_object` and
`MCoreSavePlanner.transform_object`; read back by `serialization.load_common_state_dict`).
`checkpoint(root, step, ...)` commits a whole `step_N` with the launcher's CheckpointManager.
"""

from __future__ import annotations

import io
from pathlib import Path

COMMON_STATE_KEY = "common_state/shard_0_1"


def save_like_megatron(state: dict, directory: Path) -> None:
    """dcp.save as megatron's torch_dist does it: a bytes item is written as the bytes it holds
    (megatron-core MCoreSavePlanner.transform_object: "bytes objects are already serialized"),
    where DCP's default planner would torch.save the BytesIO object itself."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return object

    with warnings.catch_warnings():  # "torch.distributed ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), planner=Planner(), no_dist=True)


def trainer_state(directory: Path, step: int, tensors: dict | None = None, **info) -> Path:
    import torch

    trainer = {"step": step, "layout": {"tp": 1, "pp": 1, "ep": 1, "dp": 1}, "peft": {}, "has_optimizer_state": False,
               **info}
    common = io.BytesIO()
    torch.save([{"trainer": trainer, "scheduler": {"num_steps": step}}], common)
    save_like_megatron({**(tensors or {}), COMMON_STATE_KEY: common}, directory)
    return Path(directory)


def config_yaml(*overrides: str) -> str:
    from launcher.config.compose import compose, to_yaml

    return to_yaml(compose(list(overrides)))


def checkpoint(root: Path, step: int, *, config: str | None = None, tensors: dict | None = None,
               consumed_prompts: int = 0, metrics: dict | None = None, trainer_step: int | None = None,
               keep_top_k: int | None = None) -> Path:
    """A complete `root/step_N` (CheckpointManager.commit), its trainer state at `trainer_step`
    (default: `step`), its config.yaml `config` (default: the composed default config)."""
    from launcher.config.schema import Checkpointing
    from launcher.driver.checkpoints import CheckpointManager

    import shutil

    manager = CheckpointManager(Path(root), Checkpointing(keep_top_k=keep_top_k))
    tmp = manager.begin(step)
    trainer_state(tmp / "trainer", step, tensors)
    final = manager.commit(tmp, step, {"consumed_prompts": consumed_prompts, "metrics": metrics or {}},
                           config if config is not None else config_yaml()).path
    if trainer_step is not None and trainer_step != step:  # forged afterwards (commit verifies what it wrote)
        shutil.rmtree(final / "trainer")
        trainer_state(final / "trainer", trainer_step, tensors)
        rewrite_manifest(final)
    return final


def rewrite_manifest(ckpt: Path) -> None:
    """What anyone who can write the folder can do: a manifest that matches whatever is there now."""
    import json

    from launcher.driver.checkpoints import MANIFEST, _files

    (ckpt / MANIFEST).write_text(json.dumps({"files": _files(ckpt)}))
