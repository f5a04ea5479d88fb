"""vLLM worker extension: the generator side of refit, run inside every vLLM worker.

Loaded with `LLM(worker_extension_cls="workers.refit.vllm_extension.RefitWorkerExtension")`; vLLM mixes
it into its worker class and the engine calls the methods with `collective_rpc("refit_...")`.
Every name starts with `refit_` / `_refit_`: vLLM refuses an extension whose attributes clash
with the worker's (it already has e.g. `update_weights`).

Loading weights into a running engine, on CPU and cuda alike:
`Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM's layerwise
reload, model_executor/model_loader/reload/). It restores each layer's checkpoint layout, loads,
and runs the layer's post-load processing (repacking, MoE kernel re-layout, quantization) only for
the layers whose weights arrived, then copies the results into the original kernel tensors (CUDA
graphs keep their pointers); a layer that got no weights gets its kernel tensors back unprocessed.
So a partial reload (merged_delta sends only the LoRA-targeted modules) leaves every other layer
exactly as it was. A plain `model.load_weights` + whole-model `process_weights_after_loading`
would re-process layers that were not reloaded (MoE kernels re-layout their already processed
weights) and fails on CPU, whose linear Parameters are empty after repacking. Each fused vLLM
module must get all its parts (q, k and v together): one Megatron linear maps to one whole vLLM
module, so it does.

merged_delta: the worker keeps the base tensors of the targeted modules in host memory (read once
from the checkpoint the engine was started from, in the engine's dtype; pinned on a GPU) and
writes W = W_base + (alpha/r) B A with `lora_layout.merge_lora_weight` (the Bridge's arithmetic)
on its device, one module's base there at a time.

A failure while applying a refit (a loader error, a name the model lacks) is one RefitError naming
the worker and the tensor; the rest of the refit is read and dropped first, so the broadcast
group's sender and the other workers finish (workers.refit.transports, Incoming.drain).
adapter: the worker writes the PEFT adapter into a node-local directory given by the engine,
which then registers it as a new LoRA adapter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import torch

from workers import cpu_shim, hf_checkpoint
from workers.lora import layout as lora_layout
from workers.lora.peft import write_peft_adapter
from workers.refit import wire
from workers.refit.transports import DEFAULT_TIMEOUT_S, BroadcastTransport, RayTransport, RefitAborted

_PARTIAL_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                           "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def _quiet_partial_reload():
    """A merged_delta reload loads only the targeted modules; vLLM warns about every other layer."""
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class RefitError(RuntimeError):
    """A vLLM worker could not apply a refit: names the worker and the tensor (one line)."""


def _one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".strip().splitlines() or [type(e).__name__])[0][:800]


class _Tracked:
    """An iterator over (name, tensor) that remembers the last name it handed on."""

    def __init__(self, stream):
        self.stream, self.name = stream, None

    def __iter__(self):
        return self

    def __next__(self):
        name, tensor = next(self.stream)
        self.name = name
        return name, tensor


class RefitWorkerExtension:
    """Methods vLLM adds to its worker (self is the worker: self.model_runner, self.rank, ...)."""

    # ------------------------------------------------------------------ group
    def refit_open_group(self, host: str, port: int, world_size: int, rank_offset: int,
                         backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Join trainer rank 0's broadcast group as rank rank_offset + this worker's rank."""
        rank = rank_offset + int(self.rank)
        device = None if backend == "gloo" else self._refit_device()
        self._refit_receivers()[BroadcastTransport.name] = BroadcastTransport.join(
            host, port, rank, world_size, backend, timeout_s, device)
        self._refit_layouts().clear()
        return rank

    # ------------------------------------------------------------------ apply
    def refit_apply(self, spec: dict) -> dict:
        """Receive one refit (see wire.RefitPayload.to_spec) and apply it to this worker's model.

        Whatever fails here is raised as one RefitError naming this worker (rank, host, pid) and
        the last tensor it was handed; before that the rest of the refit is read and dropped, so a
        broadcast group's sender and other workers finish instead of waiting out the timeout."""
        t0 = time.perf_counter()
        mode = spec["mode"]
        wire.kind_of(mode)
        try:
            incoming = self._refit_receiver(spec["transport"]).receive(spec, self._refit_layouts())
        except Exception as e:
            raise RefitError(f"{self._refit_who()} could not receive the {mode} refit: {_one_line(e)}") from e
        named = _Tracked(incoming.stream)
        try:
            if mode == "merged":
                self._refit_load(wire.guard_names(named), partial=False)
            elif mode == "merged_delta":
                self._refit_load(self._refit_merged_deltas(incoming.layout, named), partial=True)
            else:  # adapter
                groups = list(wire.lora_groups_from_stream(incoming.layout, named))
                self._refit_write_adapter(spec["adapter_dir"], groups, incoming.layout)
            extra = sum(1 for _ in named)  # reads the refit's end (the broadcast group's last message)
            if extra:
                raise RuntimeError(f"{extra} tensor(s) more than the {mode} refit used")
        except Exception as e:
            raise self._refit_failed(spec, incoming, e, named.name) from e
        layout = incoming.layout
        return {"rank": int(self.rank), "seconds": time.perf_counter() - t0, "bytes": layout.nbytes,
                "buckets": len(layout.buckets), "layout_received": incoming.layout_received}

    def _refit_who(self) -> str:
        return f"vLLM worker {int(self.rank)} ({socket.gethostname()}, pid {os.getpid()})"

    def _refit_failed(self, spec: dict, incoming, error: Exception, name: str | None) -> "RefitError":
        """Drain the rest of the refit (aborting the group if even that fails) and say what failed."""
        where = f"at {name!r}" if name else "before its first tensor"
        line = f"{self._refit_who()} failed in the {spec['mode']} refit {where}: {_one_line(error)}"
        if isinstance(error, RefitAborted):  # the sender's failure, already at the refit's end
            return RefitError(line)
        try:
            incoming.drain()
        except RefitAborted as e:
            line += f" (and {e})"
        except Exception as e:  # noqa: BLE001 - the group cannot follow the protocol any more
            receiver = self._refit_receivers().pop(spec["transport"], None)
            if receiver is not None and hasattr(receiver, "group"):
                receiver.group.abort()
            line += f"; reading the rest of the refit failed too ({_one_line(e)}): this worker left the refit group"
        return RefitError(line)

    def _refit_layouts(self) -> dict:
        if not hasattr(self, "_refit_layout_cache"):
            self._refit_layout_cache = {}
        return self._refit_layout_cache

    def _refit_receivers(self) -> dict:
        """transport name -> its receiving end: the object store always, the broadcast group once joined."""
        if not hasattr(self, "_refit_receiver_cache"):
            self._refit_receiver_cache = {RayTransport.name: RayTransport()}
        return self._refit_receiver_cache

    def _refit_receiver(self, name: str):
        receiver = self._refit_receivers().get(name)
        if receiver is None:
            if name == BroadcastTransport.name:
                raise RuntimeError("broadcast refit, but this worker joined no refit group")
            raise ValueError(f"unknown refit transport {name!r}")
        return receiver

    def _refit_load(self, named, partial: bool) -> None:
        """Only the layers `named` reaches are reloaded and re-processed (see the module docstring)."""
        cpu_shim.apply_vllm(self._refit_device().type)  # vLLM CPU's MoE reload (see there)
        # through the Worker's own entry point: it runs the reload inside set_current_vllm_config, as
        # a layer's post-load step may read the config (model_runner.reload_weights alone does not)
        with _quiet_partial_reload() if partial else contextlib.nullcontext():
            self.reload_weights(weights_iterator=named, is_checkpoint_format=True)

    # ------------------------------------------------------------------ merged_delta
    def _refit_merged_deltas(self, layout: wire.RefitLayout, named):
        """Yield (HF weight name, base + scale * B @ A) for every module of every LoRA group."""
        groups = wire.lora_groups_from_stream(layout, named)
        bases = self._refit_bases([m for g in layout.groups for m in g.modules])
        device = self._refit_device()
        for group in groups:
            for module, b in zip(group.hf_modules, group.lora_b):
                base = bases[module].to(device)  # one module's base on the device at a time
                yield f"{module}.weight", lora_layout.merge_lora_weight(base, b, group.lora_a, layout.alpha, layout.dim)
                del base

    def _refit_bases(self, modules: list[str]) -> dict[str, torch.Tensor]:
        """Base weights of `modules` from the engine's checkpoint, in the engine's dtype, cached in
        host memory (pinned on a GPU, for the copy of one module at a time): on the GPU they would
        sit outside vLLM's gpu_memory_utilization budget (launcher.memory plans for one module)."""
        cache = getattr(self, "_refit_base_cache", None)
        if cache is None:
            cache = self._refit_base_cache = {}
        missing = [m for m in modules if m not in cache]
        if missing:
            model_config = self.model_runner.model_config
            loaded = hf_checkpoint.read_tensors(model_config.model, [m + ".weight" for m in missing])
            pin = self._refit_device().type == "cuda"
            for m in missing:
                base = loaded.pop(m + ".weight").to(dtype=model_config.dtype)
                cache[m] = base.pin_memory() if pin else base
        return cache

    # ------------------------------------------------------------------ adapter
    def _refit_write_adapter(self, adapter_dir: str, groups, layout: wire.RefitLayout) -> None:
        """Write the PEFT adapter atomically (every worker of a node may write the same files)."""
        final = Path(adapter_dir)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{int(self.rank)}")
        write_peft_adapter(tmp, groups, layout.dim, layout.alpha,
                           base_model_name_or_path=str(self.model_runner.model_config.model))
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another worker of this node was first: same content
            shutil.rmtree(tmp, ignore_errors=True)
        previous = getattr(self, "_refit_adapter_path", None)
        if previous and previous != str(final):
            shutil.rmtree(previous, ignore_errors=True)
        self._refit_adapter_path = str(final)

    def _refit_device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return torch.device("cpu")
        return torch.device(current_platform.device_type, torch.cuda.current_device())
