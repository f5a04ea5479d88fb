"""Test-only vLLM worker extension: records every tensor handed to the model loader, and can hand
one under a wrong name (a real loader error).

Used by tests/integration/test_generator.py (merged_delta must write bitwise what merged writes; a
worker's loader error ends the refit at once, naming the worker and the tensor).
Engines load it with GeneratorConfig(worker_extension=RECORDING_EXTENSION); vLLM imports it by
this path inside the engine's process (the driver's working directory is on Ray workers' path).
"""

from __future__ import annotations

import torch

from workers.refit.vllm_extension import RefitWorkerExtension

RECORDING_EXTENSION = f"{__name__}.RecordingRefitExtension"


class RecordingRefitExtension(RefitWorkerExtension):
    def refit_record(self, on: bool) -> None:
        """Keep a copy of every tensor handed to the model loader (on=False stops and forgets)."""
        self._refit_recorded = {} if on else None

    def refit_recorded(self) -> dict[str, torch.Tensor]:
        return dict(getattr(self, "_refit_recorded", None) or {})

    def refit_rename(self, name: str | None, new_name: str | None = None) -> None:
        """Hand `name` to the model loader as `new_name` (a name the model lacks: vLLM's loader then
        fails as it would on a real mismatch); None stops."""
        self._refit_renames = {name: new_name} if name else {}

    def _refit_load(self, named, partial: bool) -> None:
        recorded = getattr(self, "_refit_recorded", None)
        if recorded is not None:
            named = self._refit_recording(named, recorded)
        renames = getattr(self, "_refit_renames", None)
        if renames:
            named = ((renames.get(name, name), tensor) for name, tensor in named)
        super()._refit_load(named, partial)

    @staticmethod
    def _refit_recording(named, recorded: dict):
        for name, tensor in named:
            recorded[name] = tensor.detach().cpu().clone()
            yield name, tensor
