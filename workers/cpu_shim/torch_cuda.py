"""torch.cuda on a machine without CUDA, for megatron's sake (what each patch does and why):

  current_device    torch.cuda.current_device() returns "cpu". Rotary embeddings, DDP buffers and
                    many layers call `device=torch.cuda.current_device()`.
  cuda_sync         torch.cuda.current_stream() returns a stream whose waits do nothing and
                    torch.cuda.synchronize() does nothing: megatron DDP's grad sync asks for the
                    current stream before every reduction and dist_checkpointing synchronizes
                    before writing (CPU ops are synchronous: there is nothing to wait for).
  cuda_factories    (scoped, see cuda_factories_on_cpu) a TorchFunctionMode that rewrites
                    device="cuda[:N]" to "cpu" and lets `Tensor.type()` report the CUDA spelling,
                    because the optimizer, clip_grads and the schedules hard-code
                    `torch.tensor(..., device="cuda")` and assert `grad.type() ==
                    "torch.cuda.FloatTensor"`. Scoped, not global: a global mode would put a
                    Python call in front of every op of the forward pass.
"""

from __future__ import annotations

import contextlib

from workers.cpu_shim._registry import APPLIED, is_cpu, once


def current_device() -> None:
    import torch

    if not torch.cuda.is_available() and once("current_device"):
        torch.cuda.current_device = lambda: "cpu"


class NoEvent:
    """A stand-in for torch.cuda.Event on CPU: already complete."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class NoStream:
    """A stand-in for torch.cuda.Stream on CPU: every wait is already satisfied."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or NoEvent()


def cuda_sync() -> None:
    import torch

    if not torch.cuda.is_available() and once("cuda_sync"):
        torch.cuda.current_stream = lambda device=None: NoStream()
        torch.cuda.synchronize = lambda device=None: None


def cuda_factories_on_cpu(device: str):
    """Context: inside it, megatron's hard-coded device="cuda" tensors are made on CPU (cpu only)."""
    if not is_cpu(device):
        return contextlib.nullcontext()
    import torch
    from torch.overrides import TorchFunctionMode

    class _CudaFactoriesOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            result = func(*args, **kwargs)
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
                return result.replace("torch.", "torch.cuda.", 1)  # clip_grads asserts CUDA grads
            return result

    if "cuda_factories" not in APPLIED:
        APPLIED.append("cuda_factories")
    return _CudaFactoriesOnCpu()
