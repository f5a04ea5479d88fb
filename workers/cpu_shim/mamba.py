"""A pure-torch stand-in for the three mamba_ssm entry points megatron-core's Mamba mixer imports
(megatron/core/ssm/mamba_mixer.py): the gated group RMSNorm (`RMSNorm`, `rmsnorm_fn`), the Mamba-2
SSD chunk scan (`mamba_chunk_scan_combined`) and the fused conv1d + scan of training
(`mamba_split_conv1d_scan_combined`).

Why: mamba-ssm ships Triton/CUDA kernels only (no CPU wheel, its sdist needs CUDA), and megatron's
mixer refuses to build without it. `package()` returns the module tree (`mamba_ssm.ops.triton.
layernorm_gated`, `...ssd_combined`) that workers.cpu_shim.megatron's import hook hands to
`megatron.*` importers only; transformers and vLLM never see it (transformers probes for
`mamba_ssm` and keeps its own torch path). `causal_conv1d` is not needed: megatron falls back to
`F.conv1d` without it, and so does the fused scan here.

Semantics are mamba_ssm's (its reference implementations `ssd_chunk_scan_combined_ref`,
`mamba_split_conv1d_scan_ref`, `rms_norm_ref`): per head h, with a_t = exp(dt_t A_h),
    S_t = a_t S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t  (then y_t * silu(z_t) if z)
B and C are shared by the heads of a group. The scan works in chunks (the SSD form): within a chunk
the output is a causal, decay-weighted attention-like sum; between chunks only the state travels.
Computed in float32 whatever the input dtype (as the kernels do), differentiable by autograd (no
custom backward). `state_dtype` (megatron passes it where mamba_ssm accepts it: MAMBA_HAS_STATE_DTYPE)
rounds the states carried between chunks to that dtype. Not supported (NotImplementedError): packed
sequences (seq_idx / cu_seqlens) and varlen states, which the trainer never uses.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

VERSION = "2.2.4+cpu.torch"  # a version megatron's version checks accept, marked as this stand-in


def rms_norm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMSNorm over groups of `group_size` channels; with z, gated by silu(z) before or after it."""
    dtype = x.dtype
    x = x.float()
    gate = F.silu(z.float()) if z is not None else None
    if gate is not None and not norm_before_gate:
        x = x * gate
    size = x.shape[-1] if group_size is None else group_size
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    out = grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + eps)
    out = out.reshape(x.shape) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(dtype)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    return rms_norm_gated(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


class RMSNorm(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: forward(x, z=None)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rms_norm_gated(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


def _unsupported(**given) -> None:
    named = [k for k, v in given.items() if v is not None and v is not False]
    if named:
        raise NotImplementedError(f"the CPU stand-in for mamba_ssm does not support {', '.join(named)} "
                                  "(packed sequences)")


def _ssd(x, dt, A, B, C, chunk_size, initial_state, state_dtype=None):
    """The SSD scan on float32 inputs: x [b, l, h, p], dt [b, l, h] (final step sizes), A [h],
    B and C [b, l, h, n] (already one per head). Returns (y [b, l, h, p], final state [b, h, p, n]).
    state_dtype: the inter-chunk states are kept in it (rounded at each chunk's end, as mamba_ssm's
    kernels store them), else in float32."""
    b, length, h, p = x.shape
    n = B.shape[-1]
    pad = (-length) % chunk_size
    if pad:  # padded steps have dt = 0: decay 1 and no input, so the state passes through them unchanged
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_size

    def by_chunk(t):  # [b, l, ...] -> [b, chunks, chunk_size, ...]
        return t.reshape(b, chunks, chunk_size, *t.shape[2:])

    x, dt, B, C = by_chunk(x), by_chunk(dt), by_chunk(B), by_chunk(C)
    log_decay = torch.cumsum(dt * A, dim=2)                                # [b, c, L, h]: sum of dt A up to i
    # within a chunk: y_i = sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    between = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]    # [b, c, i, j, h]
    decay = torch.exp(between.masked_fill(~causal[:, :, None], float("-inf")))  # masked before exp: no inf * 0
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * decay
    y = torch.einsum("bcijh,bcjh,bcjhp->bcihp", scores, dt, x)
    # what each chunk adds to the state at its end, and how much the state decays across it
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay)                # [b, c, L, h]
    added = torch.einsum("bcjh,bcjh,bcjhp,bcjhn->bchpn", to_end, dt, x, B)
    across = torch.exp(log_decay[:, :, -1, :])                             # [b, c, h]
    state = initial_state if initial_state is not None else x.new_zeros(b, h, p, n)
    outputs = []
    kept = (lambda t: t.to(state_dtype).float()) if state_dtype not in (None, torch.float32) else (lambda t: t)
    state = kept(state)
    for c in range(chunks):  # between chunks only the state travels: y_i += exp(cum_i) C_i . S_start
        carried = torch.einsum("bihn,bhpn->bihp", C[:, c], state) * torch.exp(log_decay[:, c])[..., None]
        outputs.append(y[:, c] + carried)
        state = kept(state * across[:, c, :, None, None] + added[:, c])
    return torch.cat(outputs, dim=1)[:, :length], state


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, chunk_indices=None, chunk_offsets=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False, state_dtype=None):
    """Mamba-2 SSD. x [b, l, h, p], dt [b, l, h], A [h], B/C [b, l, g, n], D [h] or [h, p], z [b, l, h, p],
    initial_states [b, h, p, n]. Returns y [b, l, h, p] (x's dtype), and the final state if asked."""
    _unsupported(seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=cu_seqlens,
                 return_varlen_states=return_varlen_states)
    heads, groups = x.shape[2], B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    per_head = heads // groups
    y, final = _ssd(xf, dt, A.float(), B.float().repeat_interleave(per_head, dim=2),
                    C.float().repeat_interleave(per_head, dim=2), chunk_size,
                    None if initial_states is None else initial_states.float(), state_dtype)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """The training path: split zxbcdt [b, l, 2 d + 2 g n + h] into z | xBC | dt, causal depthwise
    conv1d (+ silu) over xBC, the SSD scan gated by z (or followed by the gated RMSNorm), optional
    output projection. conv1d_weight [channels, width]."""
    _unsupported(seq_idx=seq_idx)
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"the CPU stand-in for mamba_ssm has no {activation!r} conv activation")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is needed when D has one value per head")
        heads = D.shape[0]
    else:
        heads, headdim = D.shape
    b, length, _ = zxbcdt.shape
    inner = heads * headdim
    state = (zxbcdt.shape[-1] - 2 * inner - heads) // (2 * ngroups)
    z, xbc, dt = torch.split(zxbcdt, [inner, inner + 2 * ngroups * state, heads], dim=-1)
    width = conv1d_weight.shape[-1]
    xbc = F.conv1d(xbc.transpose(1, 2), conv1d_weight.unsqueeze(1), conv1d_bias, padding=width - 1,
                   groups=xbc.shape[-1])[..., :length].transpose(1, 2)
    if activation is not None:
        xbc = F.silu(xbc)
    x, B, C = torch.split(xbc, [inner, ngroups * state, ngroups * state], dim=-1)
    z = z.reshape(b, length, heads, headdim)
    result = mamba_chunk_scan_combined(
        x.reshape(b, length, heads, headdim), dt, A, B.reshape(b, length, ngroups, state),
        C.reshape(b, length, ngroups, state), chunk_size, D=D, z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias, initial_states=initial_states, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, state_dtype=state_dtype)
    y, final = result if return_final_states else (result, None)
    y = y.reshape(b, length, inner)
    if rmsnorm_weight is not None:
        y = rms_norm_gated(y, rmsnorm_weight, None, z=z.reshape(b, length, inner), eps=rmsnorm_eps,
                           group_size=inner // ngroups, norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


def package() -> dict[str, types.ModuleType]:
    """{module name: module} of the stand-in `mamba_ssm` package (what the import hook hands out)."""
    root = types.ModuleType("mamba_ssm")
    root.__version__ = VERSION
    ops = types.ModuleType("mamba_ssm.ops")
    triton = types.ModuleType("mamba_ssm.ops.triton")
    layernorm_gated = types.ModuleType("mamba_ssm.ops.triton.layernorm_gated")
    layernorm_gated.RMSNorm, layernorm_gated.rmsnorm_fn = RMSNorm, rmsnorm_fn
    ssd_combined = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd_combined.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    ssd_combined.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    root.ops, ops.triton = ops, triton
    triton.layernorm_gated, triton.ssd_combined = layernorm_gated, ssd_combined
    return {m.__name__: m for m in (root, ops, triton, layernorm_gated, ssd_combined)}
