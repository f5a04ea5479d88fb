"""vLLM worker extension: the generator side of refit, run inside every vLLM worker.

Loaded with `LLM(worker_extension_cls="workers.refit.vllm_extension.RefitWorkerExtension")`; vLLM mixes
it into its worker class and the engine calls the methods with `collective_rpc("refit_...")`.
Every name starts with `refit_` / `_refit_`: vLLM refuses an extension whose attributes clash
with the worker's (it already has e.g. `update_weights`).

Loading weights into a running engine, on CPU and cuda alike:
`model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM's layerwise
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

merged_delta: the worker keeps the base tensors of the targeted modules (read once from the
checkpoint the engine was started from, in the engine's dtype) and writes
W = W_base + (alpha/r) B A with `lora_layout.merge_lora_weight` (the Bridge's arithmetic).
adapter: the worker writes the PEFT adapter into a node-local directory given by the engine,
which then registers it as a new LoRA adapter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from workers import cpu_shim, hf_checkpoint
from workers.lora import layout as lora_layout
from workers.lora.peft import write_peft_adapter
from workers.refit import wire
from workers.refit.transports import BroadcastTransport, RayTransport

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


class RefitWorkerExtension:
    """Methods vLLM adds to its worker (self is the worker: self.model_runner, self.rank, ...)."""

    # ------------------------------------------------------------------ group
    def refit_open_group(self, host: str, port: int, world_size: int, rank_offset: int,
                         backend: str, timeout_s: float = 600.0) -> int:
        """Join trainer rank 0's broadcast group as rank rank_offset + this worker's rank."""
        rank = rank_offset + int(self.rank)
        device = None if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self._refit_receivers()[BroadcastTransport.name] = BroadcastTransport.join(
            host, port, rank, world_size, backend, timeout_s, device)
        self._refit_layouts().clear()
        return rank

    # ------------------------------------------------------------------ apply
    def refit_apply(self, spec: dict) -> dict:
        """Receive one refit (see wire.RefitPayload.to_spec) and apply it to this worker's model."""
        t0 = time.perf_counter()
        wire.kind_of(spec["mode"])
        layout, named, layout_received = self._refit_receiver(spec["transport"]).receive(spec, self._refit_layouts())
        mode = spec["mode"]
        if mode == "merged":
            self._refit_load(wire.guard_names(named), partial=False)
        elif mode == "merged_delta":
            self._refit_load(self._refit_merged_deltas(layout, named), partial=True)
        else:  # adapter
            groups = list(wire.lora_groups_from_stream(layout, named))
            self._refit_write_adapter(spec["adapter_dir"], groups, layout)
        return {"rank": int(self.rank), "seconds": time.perf_counter() - t0, "bytes": layout.nbytes,
                "buckets": len(layout.buckets), "layout_received": layout_received}

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
        with _quiet_partial_reload() if partial else contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)

    # ------------------------------------------------------------------ merged_delta
    def _refit_merged_deltas(self, layout: wire.RefitLayout, named):
        """Yield (HF weight name, base + scale * B @ A) for every module of every LoRA group."""
        groups = wire.lora_groups_from_stream(layout, named)
        bases = self._refit_bases([m for g in layout.groups for m in g.modules])
        for group in groups:
            for module, b in zip(group.hf_modules, group.lora_b):
                base = bases[module]
                yield f"{module}.weight", lora_layout.merge_lora_weight(base, b, group.lora_a, layout.alpha, layout.dim)

    def _refit_bases(self, modules: list[str]) -> dict[str, torch.Tensor]:
        """Base weights of `modules` from the engine's checkpoint, in the engine's dtype (cached)."""
        cache = getattr(self, "_refit_base_cache", None)
        if cache is None:
            cache = self._refit_base_cache = {}
        missing = [m for m in modules if m not in cache]
        if missing:
            model_config = self.model_runner.model_config
            loaded = hf_checkpoint.read_tensors(model_config.model, [m + ".weight" for m in missing])
            device = self._refit_device()
            for m in missing:
                cache[m] = loaded[m + ".weight"].to(device=device, dtype=model_config.dtype)
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
