"""megatron-core 0.19 / Megatron-Bridge 0.6 on CPU (what each patch does and why; all recorded in APPLIED):

  typing_override   typing.override := typing_extensions.override. megatron-core 0.19 declares
                    Python >= 3.12 and uses `from typing import override`; we run 3.11.
  import_stubs      (te_stub: part (a) alone, on cuda without TE)
                    a builtins.__import__ hook that hands (a) a dummy `transformer_engine` only to
                    `megatron.bridge.peft.*` (lora_layers.py imports it unconditionally),
                    (b) a permissive dummy `triton` only to `megatron.*` (megatron-core imports
                    triton at import time for kernels we never run) and (c, "mamba_ssm") the
                    pure-torch `mamba_ssm` of workers.cpu_shim.mamba only to `megatron.*`
                    (megatron's Mamba mixer imports three of its functions and refuses to build
                    without them; no CPU wheel of mamba-ssm exists). sys.modules is untouched, so
                    torch, transformers and vLLM see none of them: transformers probes for
                    `mamba_ssm` itself and must keep its own torch path. Installed before anything
                    imports megatron's mixer, which binds the names at import time (importing
                    megatron.bridge imports it, through the hybrid layer specs).
  no_jit_fuser      megatron's `jit_fuser` (torch.compile) becomes a no-op decorator before the modules
                    that use it are imported (megatron.core.activations.squared_relu: Nemotron-H's MLP
                    and expert activation). On CPU inductor compiles C++ at first use in every process,
                    again for each new batch shape until dynamo's recompile limit (then it warns and
                    runs eagerly anyway): measured on tiny_nemotron_h, the first logprobs calls took
                    12 s instead of 0.3 s, with the same logprobs. (The fused kernels it also wraps are
                    off on CPU: workers.trainer.build.)
  causal_mask       megatron.core.transformer.utils.get_default_causal_mask builds its mask on
                    "cuda"; replaced (also where it was imported by name) by a CPU version.
  bridge_no_te      megatron.bridge.peft.utils.HAVE_TE := False. Without TE, megatron-core's TE
                    classes are MagicMock placeholders, so the bridge believes TE is present and
                    LoRA's isinstance checks fail ("isinstance() arg 2 must be a type").
  moe_dispatcher    MoE expert parallelism (docs/moe.md): megatron's all-to-all
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
  linear_tp_size    Megatron-Bridge's LoRA reads `tp_size` from the Mamba in_proj it wraps when it
                    checkpoints the adapter (adapter_wrapper._compute_mamba_dim_info): an attribute
                    of Transformer Engine's linears that megatron's Column/RowParallelLinear (the
                    local spec's) lack. They get it as a read-only property, their tp_group's size.
  recompute_rng     activation recompute (topology.train.recompute): megatron's checkpoints
                    (tensor_parallel.checkpoint, CheckpointWithoutOutput) save the CPU RNG state,
                    the CUDA one and the RNG tracker's before the forward and restore them for the
                    recomputation, so that dropout draws the same masks; reading the CUDA state
                    asserts without CUDA. On CPU there is no CUDA state to keep: its reader returns
                    an empty state and its writer does nothing (the CPU state is still kept).
  no_fp8_checkpoint (also on cuda without TE) megatron-core's CheckpointWithoutOutput, the
                    output-discarding checkpoint of `layernorm` and `moe_act` recompute, sets
                    `self.fp8 = fp8 is not None`, so its default fp8=False reads as fp8 on and the
                    forward calls Transformer Engine's FP8GlobalStateManager, a NameError without
                    TE. Without TE there is no fp8: the flag is set to what was asked (bool(fp8)).
  moe_latent_proj   LatentMoE (Nemotron 3 Super/Ultra: `moe_latent_size`): MoELayer.__init__ builds the
                    projections around the routed experts, fc1_latent_proj (hidden -> latent) and
                    fc2_latent_proj (latent -> hidden), as Transformer Engine's TELinear with
                    parallel_mode="duplicated", and asserts TE is installed. On CPU they are
                    `LatentLinear`: a torch linear with TELinear's duplicated semantics (every TP rank
                    holds the whole weight and applies it to its own tokens; the weight's grads are
                    summed over TP under sequence parallelism and over data parallel ranks, replicated in
                    checkpoints; Megatron-Bridge maps it as replicated). The layer's other use of TE
                    (te_checkpoint) is for fp8 recompute only. On cuda TE's TELinear stays.
  hybrid_final_norm megatron/core/models/hybrid/hybrid_block.py builds the hybrid (Mamba) stack's
                    final norm as TENorm whatever the layer spec says; without Transformer Engine
                    that is a placeholder, so it becomes megatron's WrappedTorchNorm (the norm the
                    local layer specs use; Nemotron-H's RMSNorm). CPU only: a hybrid model on cuda
                    needs Transformer Engine and mamba_ssm (docs/gpu.md).
"""

from __future__ import annotations

import builtins
import contextlib
import sys
import types

from workers.cpu_shim._registry import APPLIED, once

_ORIGINAL_IMPORT = builtins.__import__


def typing_override() -> None:
    import typing

    if not hasattr(typing, "override") and once("typing_override"):
        import typing_extensions

        typing.override = typing_extensions.override


# ------------------------------------------------------------------------------------------ imports


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


# What the import hook hands out: "te" (always once installed), "triton" and "mamba_ssm" (a dict of
# module name -> module; cpu only). The hook reads this dict on every call, so a stub added later counts.
_STUBS: dict = {}


def import_stubs(triton: bool, mamba_ssm: bool) -> None:
    """The import hook: the TE stub ("te_stub"); with `triton` the triton stub ("import_stubs": on
    cpu, and on cuda only where triton is not installed); with `mamba_ssm` the pure-torch mamba_ssm
    ("mamba_ssm": cpu only)."""
    if triton and "triton" not in _STUBS:
        stub = _StubModule("triton")
        stub.__version__ = "3.0.0"
        _STUBS["triton"] = stub
        once("import_stubs")
    if mamba_ssm and "mamba_ssm" not in _STUBS:
        from workers.cpu_shim.mamba import package

        _STUBS["mamba_ssm"] = package()
        once("mamba_ssm")
    if "te" in _STUBS:
        return  # the hook is installed; it reads _STUBS
    _STUBS["te"] = _te_stub()
    once("te_stub")
    builtins.__import__ = _import


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals is not None:
        importer = globals.get("__name__", "") or ""
        top = name.partition(".")[0]
        if top == "transformer_engine" and importer.startswith("megatron.bridge.peft."):
            te = _STUBS["te"]
            return te.pytorch if name == "transformer_engine.pytorch" and fromlist else te
        if importer.startswith("megatron."):
            if top == "triton" and "triton" in _STUBS:
                return _STUBS["triton"]
            if top == "mamba_ssm" and "mamba_ssm" in _STUBS:
                modules = _STUBS["mamba_ssm"]
                if name not in modules:
                    raise ImportError(f"{name} is not part of the CPU stand-in for mamba_ssm (workers.cpu_shim.mamba)")
                return modules[name] if fromlist else modules["mamba_ssm"]
    return _ORIGINAL_IMPORT(name, globals, locals, fromlist, level)


# ------------------------------------------------------------------------------------------ patches


def no_jit_fuser() -> None:
    if "no_jit_fuser" in APPLIED:
        return
    import megatron.core.jit as jit

    jit.disable_jit_fuser()  # read by `from megatron.core.jit import jit_fuser` in modules imported later
    once("no_jit_fuser")


def causal_mask() -> None:
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
    once("causal_mask")


def bridge_no_te() -> None:
    if "bridge_no_te" in APPLIED:
        return
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
    once("bridge_no_te")


def moe_dispatcher() -> None:
    if "moe_dispatcher" in APPLIED:
        return
    import torch
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    from workers.cpu_shim.torch_cuda import NoStream

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = NoStream()  # it makes one if None
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    once("moe_dispatcher")


def torch_norm_sequence_parallel() -> None:
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
    once("torch_norm_sp")


def hybrid_final_norm() -> None:
    if "hybrid_final_norm" in APPLIED:
        return
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm  # only its final_norm reads this module-level name
    once("hybrid_final_norm")


def linear_tp_size() -> None:
    if "linear_tp_size" in APPLIED:
        return
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        if not hasattr(cls, "tp_size"):
            cls.tp_size = property(lambda self: self.tp_group.size())
    once("linear_tp_size")


def recompute_rng() -> None:
    if "recompute_rng" in APPLIED:
        return
    import torch
    import megatron.core.tensor_parallel.random as random

    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    once("recompute_rng")


def no_fp8_checkpoint() -> None:
    if "no_fp8_checkpoint" in APPLIED:
        return
    import megatron.core.tensor_parallel.random as random

    if random.HAVE_TE:  # TE is there: megatron's flag is harmless (FP8GlobalStateManager answers)
        return
    original = random.CheckpointWithoutOutput.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = bool(fp8)

    random.CheckpointWithoutOutput.__init__ = __init__
    once("no_fp8_checkpoint")
def _latent_linear_class():
    """LatentLinear (made here: this module imports torch only once the shim applies)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class LatentLinear(torch.nn.Linear):
        """TELinear(parallel_mode="duplicated") without Transformer Engine (LatentMoE's projections)."""

        tensor_model_parallel = False   # Megatron-Bridge's AutoMapping: a replicated weight

        def __init__(self, input_size: int, output_size: int, *, parallel_mode, config, init_method, bias: bool,
                     skip_bias_add: bool, skip_weight_param_allocation: bool, is_expert: bool = False,
                     name=None, **_ignored):
            if parallel_mode != "duplicated" or is_expert or skip_weight_param_allocation:
                raise ValueError(f"LatentLinear stands in for a duplicated, non-expert TELinear only "
                                 f"(parallel_mode {parallel_mode!r}, is_expert {is_expert})")
            super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
            if config.perform_initialization:
                with torch.no_grad():
                    init_method(self.weight)
                    if bias:
                        self.bias.zero_()
            self.config, self.return_bias = config, skip_bias_add and bias
            for param in self.parameters():
                param.allreduce = True                                  # summed over data parallel ranks
                param.sequence_parallel = config.sequence_parallel    # each TP rank saw its own tokens
                param.tensor_model_parallel = False

        def forward(self, x):
            if self.return_bias:
                return F.linear(x, self.weight), self.bias
            return super().forward(x), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """Replicated over TP and DP, as TELinear's duplicated mode."""
            from megatron.core import parallel_state

            dp_cp = (metadata or {}).get("dp_cp_group")
            groups = {} if dp_cp is None else {"tp_group": parallel_state.get_tensor_model_parallel_group(),
                                               "dp_cp_group": dp_cp}
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                       sharded_offsets, **groups)

    return LatentLinear


def moe_latent_projections() -> None:
    if "moe_latent_proj" in APPLIED:
        return
    import megatron.core.transformer.moe.moe_layer as moe_layer

    moe_layer.TELinear = _latent_linear_class()
    moe_layer.HAVE_TE = True   # read only by the latent projections' assert (te_checkpoint: fp8 only)
    once("moe_latent_proj")
