"""Trainer checkpoints and what tensors returned by a trainer process look like.

`save_state` / `load_state`: the trainable (adapter) weights (and an MoE router's expert bias where
training moves it), optimizer and scheduler state in
megatron-core dist_checkpointing's torch_dist format (resharding-safe: saved at TP=2, loads at TP=1),
plus each rank's RNG states as plain tensors in `rng/rank<N>.safetensors`. Collective.
`portable_tensor_pickles`: keeps tensors pickled by this process loadable without megatron.

Megatron is imported inside the functions (see workers.trainer.build for why).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workers import cpu_shim
from workers.trainer.gather import torch_optimizers

# The distributed optimizer (cuda) must save in a format that reshards across TP/DP changes.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                      "chained_optim_avoid_prefix": True}


def plain_results_queue() -> None:
    """No multiprocessing Manager for a synchronous save. megatron-core's FileSystemWriterAsync
    takes its write-results queue from `get_write_results_queue()`, which on a process's first save
    starts `mp.get_context("spawn").Manager()` (a spawned server process: seconds in a Ray worker,
    which it re-imports), also for `dist_checkpointing.save`, whose writes run in this process's
    threads (`async_save(...).execute_sync()`): a thread-safe queue.Queue serves those. Set once,
    where megatron caches its queue; an async save (another process) would need the Manager."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _trained_tensors(module) -> dict:
    """{name: tensor} of what training changes: the trainable parameters, and the expert bias of every
    MoE router that is not frozen (a buffer megatron updates each step; full fine-tuning only)."""
    out = {n: p for n, p in module.named_parameters() if p.requires_grad}
    for name, sub in module.named_modules():
        if getattr(sub, "expert_bias", None) is not None and not getattr(sub, "frozen_expert_bias", False):
            out[f"{name}.expert_bias"] = sub.expert_bias
    return out


def _trainable_sharded_state_dict(module) -> dict:
    trained = _trained_tensors(module)
    sharded = module.sharded_state_dict()
    return {k: v for k, v in sharded.items() if k in trained}


def _rng_path(directory: str, rank: int) -> str:
    return os.path.join(directory, "rng", f"rank{rank}.safetensors")


def save_state(directory: str, *, rank: int, module, optimizer, scheduler, trainer_info: dict, device: str) -> None:
    """Adapter (trainable) weights + optimizer + scheduler + RNG; trainer_info (step, layout, peft) in common."""
    from megatron.core import dist_checkpointing

    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    model_sd = _trainable_sharded_state_dict(module)
    # Before the first step the optimizer has no state (Adam creates it lazily): save none.
    has_optimizer_state = any(len(s) for inner in torch_optimizers(optimizer) for s in inner.state.values())
    state = {"model": model_sd,
             "scheduler": scheduler.state_dict(),
             "trainer": {**trainer_info, "has_optimizer_state": has_optimizer_state},
             }
    if has_optimizer_state:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
    plain_results_queue()
    with cpu_shim.cuda_factories_on_cpu(device):
        dist_checkpointing.save(state, directory)
    save_rng(_rng_path(directory, rank), cpu_shim.is_cpu(device))
    torch.distributed.barrier()


def load_state(directory: str, *, rank: int, module, optimizer, layout: dict, device: str) -> dict:
    """Load weights and optimizer state save_state wrote (possibly at another layout) into module/optimizer.

    The RNG states are restored only at the same layout (otherwise they restart from the seed).
    Returns {"trainer": the saved trainer_info, "scheduler": its state dict, "rng_restored": bool}.
    """
    from megatron.core import dist_checkpointing

    from workers import safe_unpickle

    safe_unpickle.install()  # every `.metadata` megatron reads below: checkpoint classes only, no code
    common = dist_checkpointing.load_common_state_dict(directory)
    model_sd = _trainable_sharded_state_dict(module)
    state = {"model": model_sd}
    if common["trainer"]["has_optimizer_state"]:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    with cpu_shim.cuda_factories_on_cpu(device):
        loaded = dist_checkpointing.load(state, directory)
    trained = _trained_tensors(module)
    with torch.no_grad():
        for name, tensor in loaded["model"].items():
            trained[name].copy_(tensor)
    if "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
    else:  # saved before the first step: a fresh optimizer
        for inner in torch_optimizers(optimizer):
            inner.state.clear()
    same_layout = common["trainer"]["layout"] == layout
    if same_layout:
        load_rng(_rng_path(directory, rank), cpu_shim.is_cpu(device))
    return {"trainer": common["trainer"], "scheduler": common["scheduler"], "rng_restored": same_layout}


# megatron-core's torch_dist format keeps the common (non-sharded) state as one object in the DCP:
# ShardedObject("common_state", None, (1,), (0,)).unique_key, its bytes a torch.save([state]) (what
# megatron.core.dist_checkpointing.load_common_state_dict reads)
COMMON_STATE_KEY = "common_state/shard_0_1"


class SavedStateError(ValueError):
    """A trainer checkpoint whose common state is missing or not what save_state writes (one line)."""


def saved_trainer_info(directory: str) -> dict:
    """The `trainer_info` save_state put in a checkpoint (step, layout, peft, has_optimizer_state),
    read without megatron, a model or a process group, as megatron reads it: the DCP metadata
    through workers.safe_unpickle, the object with torch.load(weights_only=True). The driver
    compares its step with training_info.json's before anything starts."""
    import io
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from workers import safe_unpickle

    safe_unpickle.install()
    reader = FileSystemReader(directory)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise SavedStateError(f"{directory}: no trainer state (no torch distributed checkpoint .metadata)") from None
    if COMMON_STATE_KEY not in metadata.state_dict_metadata:
        raise SavedStateError(f"{directory}: the trainer state has no {COMMON_STATE_KEY} (not written by save_state)")
    box = {COMMON_STATE_KEY: io.BytesIO()}
    with warnings.catch_warnings():  # "torch.distributed ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(box, storage_reader=FileSystemReader(directory), no_dist=True)
        except safe_unpickle.Refused:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a reader's failure (a BaseException)
            refused = _refusal(e)
            if refused is not None:
                raise refused from None
            raise SavedStateError(f"{directory}: the trainer state is unreadable ({type(e).__name__})") from None
    data = box[COMMON_STATE_KEY]  # [common], unpickled by the load planner (weights_only=True: safe_unpickle.install)
    try:
        info = data[0]["trainer"]
        if not isinstance(info, dict) or not isinstance(info.get("step"), int) or isinstance(info["step"], bool):
            raise TypeError
    except Exception:  # noqa: BLE001 - a foreign or damaged object: one line
        raise SavedStateError(f"{directory}: the trainer's common state is not what save_state writes (a trainer "
                              f"dict with an integer step)") from None
    return info


def _refusal(e: BaseException):
    """The safe_unpickle.Refused inside an exception DCP wrapped (its CheckpointException lists the
    failures per rank), if any."""
    from workers import safe_unpickle

    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if id(x) in seen or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, safe_unpickle.Refused):
            return x
        todo += [x.__cause__, x.__context__]
        for v in (getattr(x, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            todo += [w for w in (v if isinstance(v, tuple) else (v,)) if isinstance(w, BaseException)]
    return None


def save_rng(path: str, is_cpu: bool) -> None:
    """This rank's RNG states as plain tensors in a safetensors file: a checkpoint never holds
    pickled Python objects, so loading one cannot run code (a ShardedObject would be unpickled)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python_mt": torch.tensor(mt, dtype=torch.int64),
               "python_meta": torch.tensor([version, gauss is not None], dtype=torch.int64),
               "python_gauss": torch.tensor([gauss or 0.0], dtype=torch.float64),
               "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
               "numpy_meta": torch.tensor([pos, has_gauss], dtype=torch.int64),
               "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
               "torch": torch.get_rng_state()}
    if not is_cpu:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tensors["cuda"] = torch.cuda.get_rng_state()
        for key, state in get_cuda_rng_tracker().get_states().items():
            tensors[f"tracker.{key}"] = state
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def load_rng(path: str, is_cpu: bool) -> None:
    t = load_file(path)
    version, has_gauss = t["python_meta"].tolist()
    random.setstate((int(version), tuple(t["python_mt"].tolist()),
                     float(t["python_gauss"][0]) if has_gauss else None))
    pos, np_has_gauss = t["numpy_meta"].tolist()
    np.random.set_state(("MT19937", t["numpy_keys"].numpy().astype(np.uint32), int(pos), int(np_has_gauss),
                         float(t["numpy_gauss"][0])))
    torch.set_rng_state(t["torch"])
    if not is_cpu and "cuda" in t:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(t["cuda"])
        get_cuda_rng_tracker().set_states({k.split(".", 1)[1]: v for k, v in t.items() if k.startswith("tracker.")})


def portable_tensor_pickles() -> None:
    """Keep tensors returned by this process loadable where megatron is not imported.

    `import megatron.core` replaces torch.storage._load_from_bytes with its weights_only=True
    version, so every tensor pickled afterwards (each Ray return value) names
    megatron.core.safe_globals.safe_load_from_bytes and cannot be unpickled by the driver or a
    vLLM worker without importing megatron (and, on CPU, without our import stubs). Registering
    megatron's function under torch's name keeps its safe behaviour here and the standard name in
    the pickles.
    """
    import megatron.core  # noqa: F401  (applies the replacement first)

    loader = torch.storage._load_from_bytes
    loader.__module__, loader.__qualname__, loader.__name__ = "torch.storage", "_load_from_bytes", "_load_from_bytes"
