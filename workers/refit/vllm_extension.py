"""vLLM worker extension: the generator side of refit, run inside every vLLM worker.

Loaded with `LLM(worker_extension_cls="workers.refit.vllm_extension.RefitWorkerExtension")`; vLLM mixes
it into its worker class and the engine calls the methods with `collective_rpc("refit_...")`.
Every name starts with `refit_` / `_refit_`: vLLM refuses an extension whose attributes clash
with the worker's (it already has e.g. `update_weights`).

Loading weights into a running engine:
  CPU   `model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`. A plain
        `model.load_weights` fails after start-up because the CPU backend has repacked the
        linear weights (their Parameters are empty and have no weight_loader); the layerwise
        reload restores the checkpoint layout, loads and re-packs. A partial set of weights is
        fine as long as each fused vLLM module gets all its parts (q, k and v together), which
        holds because one Megatron linear maps to one whole vLLM module.
  cuda  `model.load_weights(...)` then `process_weights_after_loading(...)` (as upstream).

merged_delta: the worker keeps the base tensors of the targeted modules (read once from the
checkpoint the engine was started from, in the engine's dtype) and writes
W = W_base + (alpha/r) B A with `lora_layout.merge_lora_weight` (the Bridge's arithmetic).
adapter: the worker writes the PEFT adapter into a node-local directory given by the engine,
which then registers it as a new LoRA adapter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from workers.lora import layout as lora_layout
from workers.refit import wire as refit

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
        self._refit_group = refit.BroadcastGroup(host, port, rank, world_size, backend, timeout_s, device)
        self._refit_layouts().clear()
        return rank

    # ------------------------------------------------------------------ apply
    def refit_apply(self, spec: dict) -> dict:
        """Receive one refit (see refit.RefitPayload.to_spec) and apply it to this worker's model."""
        t0 = time.perf_counter()
        layout, named, layout_received = refit.receive_named(spec, self._refit_layouts(),
                                                             getattr(self, "_refit_group", None))
        mode = spec["mode"]
        if mode == "merged":
            self._refit_load(refit.guard_names(named), partial=False)
        elif mode == "merged_delta":
            self._refit_load(self._refit_merged_deltas(layout, named), partial=True)
        else:  # adapter
            groups = list(refit.lora_groups_from_stream(layout, named))
            self._refit_write_adapter(spec["adapter_dir"], groups, layout)
        return {"rank": int(self.rank), "seconds": time.perf_counter() - t0, "bytes": layout.nbytes,
                "buckets": len(layout.buckets), "layout_received": layout_received}

    def _refit_layouts(self) -> dict:
        if not hasattr(self, "_refit_layout_cache"):
            self._refit_layout_cache = {}
        return self._refit_layout_cache

    def _refit_load(self, named, partial: bool) -> None:
        from vllm.platforms import current_platform

        named = self._refit_recording(named)
        if current_platform.is_cpu():
            with _quiet_partial_reload() if partial else contextlib.nullcontext():
                self.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            model = self.model_runner.get_model()
            model.load_weights(weights=named)
            process_weights_after_loading(model, self.model_runner.model_config, self._refit_device())

    # ------------------------------------------------------------------ merged_delta
    def _refit_merged_deltas(self, layout: refit.RefitLayout, named):
        """Yield (HF weight name, base + scale * B @ A) for every module of every LoRA group."""
        groups = refit.lora_groups_from_stream(layout, named)
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
            loaded = _read_checkpoint_tensors(model_config.model, [m + ".weight" for m in missing])
            device = self._refit_device()
            for m in missing:
                cache[m] = loaded[m + ".weight"].to(device=device, dtype=model_config.dtype)
        return cache

    # ------------------------------------------------------------------ adapter
    def _refit_write_adapter(self, adapter_dir: str, groups, layout: refit.RefitLayout) -> None:
        """Write the PEFT adapter atomically (every worker of a node may write the same files)."""
        final = Path(adapter_dir)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{int(self.rank)}")
        lora_layout.write_peft_adapter(tmp, groups, layout.dim, layout.alpha,
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

    # ------------------------------------------------------------------ test support
    def refit_record(self, on: bool) -> None:
        """Keep a copy of every tensor handed to the model loader (tests: merged vs merged_delta)."""
        self._refit_recorded = {} if on else None

    def refit_recorded(self) -> dict[str, torch.Tensor]:
        return dict(getattr(self, "_refit_recorded", None) or {})

    def _refit_recording(self, named):
        recorded = getattr(self, "_refit_recorded", None)
        if recorded is None:
            return named

        def record():
            for name, tensor in named:
                recorded[name] = tensor.detach().cpu().clone()
                yield name, tensor

        return record()

    def _refit_device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return torch.device("cpu")
        return torch.device(current_platform.device_type, torch.cuda.current_device())


def _read_checkpoint_tensors(model_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Named tensors from a local HF safetensors checkpoint (one file, or shards with an index).

    Nemotron-H checkpoints store `backbone.` where transformers v5 / vLLM say `model.`: both match.
    """
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        file_of = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            file_of = {key: "model.safetensors" for key in f.keys()}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        candidates = [name] + [b + name[len(a):] for a, b in (("model.", "backbone."), ("backbone.", "model."))
                               if name.startswith(a)]
        stored = next((c for c in candidates if c in file_of), None)
        if stored is None:
            raise KeyError(f"{name} is not in the checkpoint {model_dir}")
        by_file.setdefault(file_of[stored], []).append((name, stored))
    out = {}
    for file, pairs in by_file.items():
        with safe_open(str(root / file), framework="pt") as f:
            for name, stored in pairs:
                out[name] = f.get_tensor(stored)
    return out
