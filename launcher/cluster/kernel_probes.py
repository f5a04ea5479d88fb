"""Tiny forward and backward passes of the kernels the run's recipe uses, on a node's GPU, before any
weights are loaded (run.job=preflight: launcher.cluster.preflight runs them on every node).

An import proves little about a kernel: a wheel built without this GPU's architecture (sm_100 on
GB200) imports and then fails at its first launch ("no kernel image is available for execution on
the device"), a Triton kernel may not compile for it, cuDNN may have no fused attention for it.
Each probe runs one kernel forward and backward (forward only for vLLM's, which only serves) on
tensors of a few KiB on cuda:0, compares the output with torch's where that takes one line, and
raises on any failure; the preflight makes each failure one PROBLEM line naming the node, the kernel
and the GPU architecture, before the run spends its allocation loading the model.

Which probes a node runs (`chosen`, from the config as preflight.build_needs chooses its imports;
on cuda only, a CPU run has none of these kernels):
  te_attention:<backend>  training: Transformer Engine's DotProductAttention with the chosen
                          topology.train.attention_backend (none for local, megatron's own)
  mamba_chunk_scan        training, Nemotron-H: mamba_ssm's Mamba-2 chunked scan
                          (mamba_chunk_scan_combined; megatron's training path runs the same Triton
                          kernels inside mamba_split_conv1d_scan_combined)
  causal_conv1d           training, Nemotron-H: causal_conv1d_fn, the Mamba layers' conv1d
  te_grouped_linear       training, an MoE model: TE's GroupedLinear (megatron's TEGroupedMLP: the
                          bridges of both MoE families set moe_grouped_gemm)
  vllm_fused_moe:<act>    generation, an MoE model: vLLM's Triton fused_experts with the family's
                          expert activation (MOE_ACTIVATION)
Shapes follow the recipe where they pick a kernel (head dim 128 with GQA, Mamba state 128, chunk
128, conv width 4, bf16); sizes are tiny. Torch-free at import (the launcher imports this module to
choose); each probe imports its library inside.
"""

from __future__ import annotations

import contextlib
import os

# TE's attention backends by megatron's choice: (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN), as
# megatron-core 0.19.2's LanguageModule._set_attention_backend sets them before TE picks a kernel
ATTENTION_ENV = {"flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1), "auto": (1, 1, 1)}
# vLLM's expert activation per family (MoEActivation's value): Nemotron-H's experts are relu2 without a
# gate (vllm/model_executor/models/nemotron_h.py: activation_without_mul(mlp_hidden_act)); the others'
# are gated SiLU (Qwen3-MoE)
MOE_ACTIVATION = {"nemotron_h": "relu2_no_mul"}
TE = "transformer_engine.pytorch"  # workers.trainer.kernels.TRANSFORMER_ENGINE (the import rules keep workers/ out)
SKIPPED = "skipped"          # a status that starts with it is no failure
TOLERANCE = 0.05             # of the reference's largest magnitude (at least 1): bf16 in, fp32 reference


def chosen(cfg, plan) -> dict[str, list[str]]:
    """role -> the probes a node of that role runs (names as the module docstring lists them)."""
    train: list[str] = []
    generation: list[str] = []
    if plan.device != "cuda":
        return {"train": train, "generation": generation}
    backend = cfg.topology.train.attention_backend
    if backend in ATTENTION_ENV:
        train.append(f"te_attention:{backend}")
    if cfg.model.family == "nemotron_h":
        train += ["mamba_chunk_scan", "causal_conv1d"]
    if cfg.model.num_experts:
        train.append("te_grouped_linear")
        generation.append(f"vllm_fused_moe:{MOE_ACTIVATION.get(cfg.model.family, 'silu')}")
    return {"train": train, "generation": generation}


def requires(name: str) -> str | None:
    """The import a probe needs (the preflight reports that import's failure once, and skips the probe)."""
    return {"te_attention": TE, "te_grouped_linear": TE, "mamba_chunk_scan": "mamba_ssm",
            "causal_conv1d": "causal_conv1d"}.get(name.partition(":")[0])


def arch() -> str:
    """cuda:0's architecture as nvcc names it: sm_100 on GB200, sm_90 on H100."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}"


def run(name: str) -> None:
    """Run one probe on cuda:0; raises what the kernel raised (an asynchronous error at the synchronize)."""
    import torch

    kind, _, arg = name.partition(":")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    PROBES[kind](*([arg] if arg else []))
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ the probes
def te_attention(backend: str) -> None:
    import torch
    import torch.nn.functional as F

    with _env(dict(zip(("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"),
                       (str(v) for v in ATTENTION_ENV[backend])))):
        from transformer_engine.pytorch import DotProductAttention

        seq, batch, heads, groups, dim = 128, 2, 4, 2, 128
        attention = DotProductAttention(heads, dim, num_gqa_groups=groups, attn_mask_type="causal",
                                        qkv_format="sbhd")
        q, k, v = _randn(seq, batch, heads, dim), _randn(seq, batch, groups, dim), _randn(seq, batch, groups, dim)
        out = attention(q, k, v)                                        # [s, b, h * d]
    to_bhsd = lambda t: t.float().permute(1, 2, 0, 3).repeat_interleave(heads // t.shape[2], dim=1)  # noqa: E731
    want = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=True)
    _agrees(out, want.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim), "the attention")
    _backward(out, q, k, v)


def mamba_chunk_scan() -> None:
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    batch, seq, heads, head_dim, groups, state, chunk = 1, 256, 4, 64, 2, 128, 128   # two chunks: state passes
    x, z = _randn(batch, seq, heads, head_dim), _randn(batch, seq, heads, head_dim)
    dt = _randn(batch, seq, heads)
    B, C = (_randn(batch, seq, groups, state, scale=state ** -0.5) for _ in "BC")
    A = (-(torch.rand(heads, device="cuda") + 0.5)).requires_grad_()
    D = torch.ones(heads, device="cuda", requires_grad=True)
    dt_bias = torch.rand(heads, device="cuda", requires_grad=True)
    out = mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    _backward(out, x, z, dt, B, C, A, D, dt_bias)


def causal_conv1d() -> None:
    import torch.nn.functional as F
    from causal_conv1d import causal_conv1d_fn

    batch, dim, seq, width = 2, 256, 128, 4
    x, weight, bias = _randn(batch, dim, seq), _randn(dim, width, scale=0.5), _randn(dim)
    out = causal_conv1d_fn(x=x, weight=weight, bias=bias, activation="silu")
    want = F.silu(F.conv1d(x.float(), weight.float().unsqueeze(1), bias.float(), padding=width - 1,
                           groups=dim)[..., :seq])
    _agrees(out, want, "the conv1d")
    _backward(out, x, weight, bias)


def te_grouped_linear() -> None:
    import torch
    from transformer_engine.pytorch import GroupedLinear

    splits, n_in, n_out = [16, 8, 24, 16], 128, 256          # the tokens each local expert got
    layer = GroupedLinear(len(splits), n_in, n_out, bias=False, params_dtype=torch.bfloat16, device="cuda")
    weights = [getattr(layer, f"weight{i}") for i in range(len(splits))]
    x = _randn(sum(splits), n_in)
    out = layer(x, splits)
    want = torch.cat([part.float() @ w.float().t() for part, w in zip(x.split(splits), weights)])
    _agrees(out, want, "the grouped GEMM")
    _backward(out, x, *weights)


def vllm_fused_moe(activation: str) -> None:
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    act = MoEActivation(activation)
    experts, hidden, inner, tokens, topk = 8, 128, 64, 16, 2
    w1 = _randn(experts, 2 * inner if act.is_gated else inner, hidden, scale=hidden ** -0.5, grad=False)
    w2 = _randn(experts, hidden, inner, scale=inner ** -0.5, grad=False)
    x = _randn(tokens, hidden, grad=False)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device="cuda"), dim=-1), topk)
    out = fused_experts(x, w1, w2, weights, ids.to(torch.int32), activation=act)
    h = torch.einsum("tc,tknc->tkn", x.float(), w1.float()[ids])
    h = F.silu(h[..., :inner]) * h[..., inner:] if act.is_gated else F.relu(h) ** 2
    want = (torch.einsum("tkn,tkcn->tkc", h, w2.float()[ids]) * weights[..., None]).sum(1)
    _agrees(out, want, "the fused MoE")


PROBES = {"te_attention": te_attention, "mamba_chunk_scan": mamba_chunk_scan, "causal_conv1d": causal_conv1d,
          "te_grouped_linear": te_grouped_linear, "vllm_fused_moe": vllm_fused_moe}


# ----------------------------------------------------------------------------------------------- helpers
def _randn(*shape: int, scale: float = 1.0, grad: bool = True):
    import torch

    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16).requires_grad_(grad)


def _agrees(got, want, what: str) -> None:
    diff = (got.float() - want.float()).abs().max().item()
    tolerance = TOLERANCE * max(1.0, want.abs().max().item())
    if not diff <= tolerance:   # NaN too
        raise RuntimeError(f"{what} differs from torch's by {diff:.3g} (tolerance {tolerance:.3g})")


def _backward(out, *inputs) -> None:
    import torch

    if not torch.isfinite(out).all():
        raise RuntimeError("the forward gave a non-finite output")
    out.backward(torch.randn_like(out))
    for i, t in enumerate(inputs):
        if t.grad is None or not torch.isfinite(t.grad).all():
            raise RuntimeError(f"the backward gave input {i} {'no' if t.grad is None else 'a non-finite'} gradient")


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """`values` in os.environ for the block, then as before (megatron asserts its own NVTE_* values later)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
