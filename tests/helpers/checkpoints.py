"""Run checkpoints as the driver and the trainers write them, without a Megatron model.

`trainer_state(dir, step, tensors)` writes a torch distributed checkpoint the way megatron-core's
torch_dist format does (what `workers.trainer.state.save_state` produces): the given tensors under
their ShardedTensor keys plus the common state, one object under megatron's key
`common_state/shard_0_1` whose bytes are `torch.save([common])` (megatron-core
dist_checkpointing/strategies/torch.py `_mcore_to_torch_sharded_object`, read back by
`serialization.load_common_state_dict` with `torch.load(weights_only=True)[0]`).
`checkpoint(root, step, ...)` commits a whole `step_N` with the launcher's CheckpointManager.
"""

from __future__ import annotations

import io
from pathlib import Path

COMMON_STATE_KEY = "common_state/shard_0_1"


def trainer_state(directory: Path, step: int, tensors: dict | None = None, **info) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    trainer = {"step": step, "layout": {"tp": 1, "pp": 1, "ep": 1, "dp": 1}, "peft": {}, "has_optimizer_state": False,
               **info}
    common = io.BytesIO()
    torch.save([{"trainer": trainer, "scheduler": {"num_steps": step}}], common)
    import warnings

    state = {**(tensors or {}), COMMON_STATE_KEY: common}
    with warnings.catch_warnings():  # "torch.distributed ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
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

    manager = CheckpointManager(Path(root), Checkpointing(keep_top_k=keep_top_k))
    tmp = manager.begin(step)
    trainer_state(tmp / "trainer", step if trainer_step is None else trainer_step, tensors)
    return manager.commit(tmp, step, {"consumed_prompts": consumed_prompts, "metrics": metrics or {}},
                          config if config is not None else config_yaml()).path


def rewrite_manifest(ckpt: Path) -> None:
    """What anyone who can write the folder can do: a manifest that matches whatever is there now."""
    import json

    from launcher.driver.checkpoints import MANIFEST, _files

    (ckpt / MANIFEST).write_text(json.dumps({"files": _files(ckpt)}))
