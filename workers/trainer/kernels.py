"""Which of Megatron's fusions this machine can run: each one that needs an optional kernel is on
only where that kernel imports.

Megatron-Bridge's providers turn fusions on by default (`gradient_accumulation_fusion` whenever
Transformer Engine *or* APEX is importable; the llama bridge adds rope, softmax and layer-norm
fusions), but megatron-core 0.19.2 needs a compiled kernel for several of them and raises at build
or at the first step without it. The case that bites: a CUDA image with Transformer Engine and no
APEX. `ColumnParallelLinear` (the output layer, and every LoRA adapter linear) raises "the custom
CUDA extension fused_weight_gradient_mlp_cuda module is not found" whatever the layer spec
(megatron/core/tensor_parallel/layers.py, `_grad_accum_fusion_available`). NeMo RL and vLLM's
`examples/rl/rlhf_nccl_megatron.py` set it False unless APEX is there.

`FUSION_KERNELS` names, per provider flag, what must import (`module` or `module:attribute`, the
attribute not None) for megatron to run it; read from megatron-core 0.19.2:
  gradient_accumulation_fusion  APEX's fused_weight_gradient_mlp_cuda (tensor_parallel/layers.py)
  masked_softmax_fusion         APEX's scaled_masked_softmax_cuda and scaled_upper_triang_masked_
                                softmax_cuda (fusions/fused_softmax.py imports them at the first
                                fused call, in bf16/fp16)
  persist_layer_norm            APEX contrib's FastLayerNormFN (fusions/fused_layer_norm.py; torch
                                norms assert it is off)
  apply_rope_fusion             TE's fused rotary embedding (TransformerConfig.__post_init__ raises
                                "Please install TE >= 1.4")
  moe_permute_fusion            TE >= 2.1's fused permute (TransformerConfig.__post_init__ raises)
  moe_grouped_gemm              TE: the trainer's TE layer spec gives TEGroupedMLP; without TE the
                                local spec would need the separate grouped_gemm package
`CPU_OFF` are fusions with no optional kernel (torch.jit / torch code) that the CPU trainer
still turns off. `settings(is_cpu)` is what workers.trainer.build applies; the preflight probes
the same table on every training node, so nodes that would build different models are named
before the run.

Torch-free at import; the probes import the kernels only when called.
"""

from __future__ import annotations

import importlib
from typing import Callable

FUSION_KERNELS: dict[str, tuple[str, ...]] = {
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
    "masked_softmax_fusion": ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
    "persist_layer_norm": ("apex.contrib.layer_norm.layer_norm:FastLayerNormFN",),
    "apply_rope_fusion": ("transformer_engine.pytorch",
                          "megatron.core.extensions.transformer_engine:fused_apply_rotary_pos_emb"),
    "moe_permute_fusion": ("transformer_engine.pytorch", "megatron.core.extensions.transformer_engine:fused_permute"),
    "moe_grouped_gemm": ("transformer_engine.pytorch",),
}
CPU_OFF = ("bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion")
TRANSFORMER_ENGINE = "transformer_engine.pytorch"
# What each attention backend (topology.train.attention_backend) runs on cuda: Transformer Engine's
# DotProductAttention picks the kernel megatron asks for (NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
# NVTE_UNFUSED_ATTN, set by megatron's LanguageModule); its flash path calls the flash-attn package.
# `local` is megatron's own attention (no kernel to install). The preflight probes these on every
# training node (launcher.cluster.preflight.build_needs).
ATTENTION_KERNELS: dict[str, tuple[tuple[str, str], ...]] = {
    "fused": ((TRANSFORMER_ENGINE, "attention_backend fused: Transformer Engine's cuDNN attention"),),
    "unfused": ((TRANSFORMER_ENGINE, "attention_backend unfused: Transformer Engine's attention"),),
    "auto": ((TRANSFORMER_ENGINE, "attention_backend auto: Transformer Engine's attention"),),
    "flash": ((TRANSFORMER_ENGINE, "attention_backend flash: Transformer Engine's attention"),
              ("flash_attn", "attention_backend flash: the flash-attn package Transformer Engine's flash "
                             "attention runs")),
    "local": (),
}
# megatron's TE extension module prints a traceback when imported without TE: probe TE first
_NEEDS_FIRST = {"megatron.core.extensions.transformer_engine": TRANSFORMER_ENGINE}


def importable(need: str) -> str:
    """'ok' when `module` (or `module:attribute`, not None) imports here, else the reason in one line."""
    module, _, attr = need.partition(":")
    try:
        mod = importlib.import_module(module)
        if attr and getattr(mod, attr, None) is None:
            return f"{module}.{attr} is None (the installed version lacks it)"
    except Exception as e:  # noqa: BLE001 - ImportError, or a kernel library that fails to load
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return "ok"


def mamba_takes_state_dtype() -> bool:
    """Whether the installed mamba_ssm's scans take `state_dtype` (megatron-core reads their signatures:
    MAMBA_HAS_STATE_DTYPE; without it megatron refuses mamba_training_ssm_states_dtype)."""
    from megatron.core.ssm import mamba_mixer

    return bool(getattr(mamba_mixer, "MAMBA_HAS_STATE_DTYPE", False))


def settings(is_cpu: bool, probe: Callable[[str], str] = importable) -> dict[str, bool]:
    """{provider flag: False} for every fusion this machine cannot run (all of them on CPU)."""
    off = {flag: False for flag in CPU_OFF} if is_cpu else {}
    for flag, needs in FUSION_KERNELS.items():
        if is_cpu or any(probe(n) != "ok" for n in needs):
            off[flag] = False
    return off


def report(probe: Callable[[str], str] = importable) -> dict[str, str]:
    """{kernel need: 'ok' or why not} for every need in the table (the preflight's view of a node)."""
    out: dict[str, str] = {}
    for n in sorted({n for ns in FUSION_KERNELS.values() for n in ns}, key=lambda n: (n in _first_of(), n)):
        first = _NEEDS_FIRST.get(n.partition(":")[0])
        out[n] = f"needs {first}" if first and out.get(first, probe(first)) != "ok" else probe(n)
    return out


def _first_of() -> set[str]:
    return {n for ns in FUSION_KERNELS.values() for n in ns if n.partition(":")[0] in _NEEDS_FIRST}
