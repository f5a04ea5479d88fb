"""The one place that adapts megatron-core 0.19 / Megatron-Bridge 0.6 and vLLM CPU 0.32 to a CPU-only machine.

Megatron assumes CUDA (and Transformer Engine, triton, mamba_ssm) in a handful of places; vLLM's CPU
build lacks a few paths our models take. Each adapted library has its module here, and each patch
is listed with what it does and why in that module's docstring:

  torch_cuda.py  torch.cuda on a machine without CUDA: current_device, streams and events, and the
                 scoped rewrite of megatron's hard-coded device="cuda" tensors (cuda_factories_on_cpu)
  megatron.py    megatron-core / Megatron-Bridge: the import hook (Transformer Engine, triton and
                 mamba_ssm stand-ins handed to megatron's importers only), causal mask, the bridge's
                 TE probe, MoE dispatcher streams, torch norms under sequence parallelism, the
                 hybrid (Mamba) stack's final norm, the RNG states activation recompute keeps,
                 LatentMoE's projections without TE
  mamba.py       a pure-torch stand-in for the three mamba_ssm entry points megatron's Mamba mixer
                 imports (SSD chunk scan, fused split-conv1d-scan, gated group RMSNorm)
  vllm.py        vLLM CPU: MoE weight reloads, LoRA on MoE bases, non-gated (relu2) MoE experts,
                 prefix caching over hybrid (Mamba) models

Use: the trainer calls `apply(device)` before it imports megatron, and wraps the few megatron calls
that build tensors on "cuda" (optimizer step, gradient clipping, grad-norm) in
`cuda_factories_on_cpu(device)`. vLLM's process (the generator, the refit extension inside vLLM's
worker, `workers.generator.serve`) calls `apply_vllm(device)`. On cuda `apply` does nothing
except the Python 3.11 alias (not about the device) and, where Transformer Engine is not
installed, the TE import stub, bridge_no_te (the bridge's LoRA imports TE unconditionally) and
no_fp8_checkpoint (megatron's output-discarding recompute calls TE's fp8 state);
`apply_vllm` does nothing; the context manager is a no-op. So the same code runs unchanged on
GPUs, where the real mamba_ssm is used (docs/gpu.md says what to install).

Every applied patch is recorded by name in APPLIED (idempotent: each applies once per process).
"""

from __future__ import annotations

from workers.cpu_shim._registry import APPLIED, installed as _installed, is_cpu
from workers.cpu_shim.torch_cuda import cuda_factories_on_cpu

__all__ = ["APPLIED", "apply", "apply_vllm", "cuda_factories_on_cpu", "is_cpu"]


def apply(device: str) -> list[str]:
    """Patch megatron for `device` ("cpu" or "cuda"); idempotent; returns the names applied."""
    from workers.cpu_shim import megatron, torch_cuda

    megatron.typing_override()
    if not is_cpu(device):
        if not _installed("transformer_engine"):  # cuda without TE: the bridge's LoRA still imports it
            megatron.import_stubs(triton=not _installed("triton"), mamba_ssm=False)
            megatron.bridge_no_te()
            megatron.no_fp8_checkpoint()
        return list(APPLIED)
    torch_cuda.current_device()
    torch_cuda.cuda_sync()
    megatron.import_stubs(triton=True, mamba_ssm=True)  # before anything imports megatron's Mamba mixer
    megatron.no_jit_fuser()  # before megatron.core.activations is imported
    megatron.causal_mask()
    megatron.bridge_no_te()
    megatron.moe_dispatcher()
    megatron.torch_norm_sequence_parallel()
    megatron.linear_tp_size()
    megatron.hybrid_final_norm()
    megatron.recompute_rng()
    megatron.no_fp8_checkpoint()
    megatron.moe_latent_projections()
    return list(APPLIED)


def apply_vllm(device: str) -> list[str]:
    """Patch vLLM in its process for `device`; idempotent; nothing on cuda."""
    if is_cpu(device):
        from workers.cpu_shim import vllm

        vllm.apply()
    return list(APPLIED)
