"""Test-only vLLM worker extension: records every tensor handed to the model loader, can hand one
under a wrong name (a real loader error), remembers where every tensor of the model lives (to prove
a refit writes in place) and can plant a refit that replaces a parameter instead of copying into it.

Used by tests/integration/test_generator.py (merged_delta must write bitwise what merged writes; a
worker's loader error ends the refit at once, naming the worker and the tensor; every refit mode
leaves every tensor of the engine where it was, as CUDA graphs need).
Engines load it with GeneratorConfig(worker_extension=RECORDING_EXTENSION); vLLM imports it by
this path inside the engine's process (the driver's working directory is on Ray workers' path).
"""

from __future__ import annotations

import torch

from workers.refit.vllm_extension import RefitWorkerExtension

RECORDING_EXTENSION = f"{__name__}.RecordingRefitExtension"
HOST_MIRROR = "_cpu"   # vLLM's suffix for a host-side copy of a device tensor (model_tensors)


class RecordingRefitExtension(RefitWorkerExtension):
    def refit_record(self, on: bool) -> None:
        """Keep a copy of every tensor handed to the model loader (on=False stops and forgets)."""
        self._refit_recorded = {} if on else None

    def refit_recorded(self) -> dict[str, torch.Tensor]:
        return dict(getattr(self, "_refit_recorded", None) or {})

    def refit_recorded_in_config(self) -> bool | None:
        """Whether the recorded refit's loader ran with this engine's config current (what vLLM's own
        Worker.reload_weights sets, and a layer's post-load step may read); None: nothing recorded."""
        return getattr(self, "_refit_in_config", None)

    def refit_rename(self, name: str | None, new_name: str | None = None) -> None:
        """Hand `name` to the model loader as `new_name` (a name the model lacks: vLLM's loader then
        fails as it would on a real mismatch); None stops."""
        self._refit_renames = {name: new_name} if name else {}

    def _refit_load(self, named, partial: bool) -> None:
        recorded = getattr(self, "_refit_recorded", None)
        if recorded is not None:
            named = self._refit_recording(named, recorded, self)
        renames = getattr(self, "_refit_renames", None)
        if renames:
            named = ((renames.get(name, name), tensor) for name, tensor in named)
        super()._refit_load(named, partial)
        plant, self._refit_plant = getattr(self, "_refit_plant", None), None
        if plant:
            _replace(self.model_runner.get_model(), *plant)

    # ------------------------------------------------------------------ storage
    def refit_storage_mark(self) -> dict:
        """Remember every tensor the model holds (the objects themselves, so that their ids stay
        theirs) with its data_ptr, shape and dtype; say how many there are and how many bytes."""
        self._refit_storage = model_tensors(self.model_runner.get_model())
        held = [t for t, *_ in self._refit_storage.values() if t.numel()]
        return {"tensors": len(self._refit_storage), "with_data": len(held),
                "bytes": sum(t.numel() * t.element_size() for t in held), "names": sorted(self._refit_storage)}

    def refit_storage_moved(self) -> list[str]:
        """The names whose tensor is another object, or lives elsewhere, or changed shape or dtype
        since refit_storage_mark (or appeared or vanished): what a captured CUDA graph would miss."""
        before, now = self._refit_storage, model_tensors(self.model_runner.get_model())
        moved = [name for name in sorted(before.keys() | now.keys())
                 if name not in before or name not in now or now[name][0] is not before[name][0]
                 or now[name][1:] != before[name][1:]]
        return moved

    def refit_plant_replace(self, name: str, how: str) -> None:
        """The next refit, after loading, replaces parameter `name` with a copy of itself: how =
        "parameter" assigns a new Parameter to the module, "data" points the Parameter's .data at a
        new tensor (the same values either way: only where they live changes)."""
        self._refit_plant = (name, how)

    @staticmethod
    def _refit_recording(named, recorded: dict, worker):
        from vllm.config import get_current_vllm_config_or_none

        for name, tensor in named:  # consumed by the loader: the context is the reload's
            recorded[name] = tensor.detach().cpu().clone()
            worker._refit_in_config = get_current_vllm_config_or_none() is worker.vllm_config
            yield name, tensor


def model_tensors(model: torch.nn.Module) -> dict[str, tuple]:
    """{name: (tensor, data_ptr, shape, dtype)} of every tensor the model's modules hold: parameters,
    buffers, and tensors kept as plain attributes or in lists/tuples of them (a vLLM CPU linear's
    packed kernel state is not a tensor; an attention layer's KV cache and a LoRA layer's stacked
    adapter slots are).

    Left out: host-side copies kept for host code, which no kernel reads at a captured address.
    vLLM names them `*_cpu` (an attention layer's `_k_scale_cpu` / `_v_scale_cpu`: "scales on host
    instead of on device" for FlashInfer/AITER, set anew to 1.0 by every reload of an unquantized
    model, attention.set_default_quant_scales), and on an accelerator any attribute tensor in host
    memory is one. Parameters and buffers are always kept."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                items = [(name, t) for name, t in value.items() if t is not None]
            elif attr.endswith(HOST_MIRROR):
                continue
            elif isinstance(value, torch.Tensor):
                items = [(attr, value)]
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
                items = [(f"{attr}[{i}]", v) for i, v in enumerate(value)]
            else:
                continue
            for name, t in items:
                if attr not in ("_parameters", "_buffers") and device.type != "cpu" and t.device.type == "cpu":
                    continue
                out[prefix + name] = (t, t.data_ptr(), tuple(t.shape), t.dtype)
    return out


def _replace(model: torch.nn.Module, name: str, how: str) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr)
    if how == "parameter":
        setattr(module, attr, torch.nn.Parameter(param.detach().clone(), requires_grad=False))
    elif how == "data":
        param.data = param.data.clone()
    else:
        raise ValueError(how)
