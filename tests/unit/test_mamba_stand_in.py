"""workers.cpu_shim.mamba (the pure-torch mamba_ssm megatron gets on CPU) against what it replaces.

References it did not write: (a) the plain Mamba-2 recurrence, one step at a time, written out here
from its definition (h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t); (b)
transformers' own torch path of Nemotron-H (`mamba2_chunk_scan`, and the whole
`NemotronHMamba2Mixer` for the fused conv1d + scan + gated group RMSNorm of training). Values and
gradients, float32; lengths that are not a multiple of the chunk; an initial state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.cpu_shim import mamba

B_, L_, H, P, G, N, CHUNK = 2, 37, 8, 16, 2, 16, 16   # 37 tokens: two full chunks of 16 and 5 more


def recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial=None):
    """Mamba-2 one token at a time (float64): the definition the chunked scan must reproduce."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    x, dt, A, B, C = x.double(), dt.double(), A.double(), B.double(), C.double()
    dt = F.softplus(dt + (dt_bias.double() if dt_bias is not None else 0))
    state = initial.double() if initial is not None else torch.zeros(b, h, p, n, dtype=torch.float64)
    ys = []
    for t in range(length):
        for head in range(h):
            group = head // (h // g)
            decay = torch.exp(dt[:, t, head] * A[head])[:, None, None]
            state_h = decay * state[:, head] + dt[:, t, head, None, None] * x[:, t, head, :, None] * B[:, t, group, None, :]
            state = torch.cat([state[:, :head], state_h[:, None], state[:, head + 1:]], dim=1)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t].repeat_interleave(h // g, dim=1)))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * (D.double()[:, None] if D.dim() == 1 else D.double())
    if z is not None:
        y = y * F.silu(z.double())
    return y, state


def inputs(seed=0, length=L_):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(B_, length, H, P, generator=g), dt=torch.randn(B_, length, H, generator=g),
                A=-torch.rand(H, generator=g) * 4 - 0.5, B=torch.randn(B_, length, G, N, generator=g),
                C=torch.randn(B_, length, G, N, generator=g), dt_bias=torch.randn(H, generator=g) * 0.5)


def grads(fn, tensors: dict, names) -> dict:
    leaves = {k: v.clone().requires_grad_(k in names) for k, v in tensors.items()}
    out = fn(**leaves)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)  # not a plain sum
    (out * weight).sum().backward()
    return {k: leaves[k].grad for k in names}


def close(a, b, tol):
    err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1.0)
    assert err < tol, f"relative max diff {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("d_shape", ["per_head", "per_channel"])
def test_chunk_scan_is_the_recurrence(d_shape):
    t = inputs()
    g = torch.Generator().manual_seed(1)
    t["D"] = torch.rand(H, generator=g) if d_shape == "per_head" else torch.rand(H, P, generator=g)
    t["z"] = torch.randn(B_, L_, H, P, generator=g)
    y, final = mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True, return_final_states=True)
    want, want_final = recurrence(**t)
    assert y.dtype == torch.float32 and y.shape == (B_, L_, H, P)
    close(y, want, 1e-5)
    close(final, want_final, 1e-5)
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    got = grads(lambda **k: mamba.mamba_chunk_scan_combined(**k, chunk_size=CHUNK, dt_softplus=True), t, names)
    ref = grads(lambda **k: recurrence(**k)[0], t, names)
    for name in names:
        close(got[name], ref[name], 1e-5)


def test_an_initial_state_continues_a_scan():
    t = inputs(seed=2)
    cut = 21  # inside the second chunk
    first = {k: (v[:, :cut] if v.dim() > 1 else v) for k, v in t.items()}
    rest = {k: (v[:, cut:] if v.dim() > 1 else v) for k, v in t.items()}
    y1, state = mamba.mamba_chunk_scan_combined(**first, chunk_size=CHUNK, dt_softplus=True, return_final_states=True)
    y2 = mamba.mamba_chunk_scan_combined(**rest, chunk_size=CHUNK, dt_softplus=True, initial_states=state)
    whole = mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True)
    close(torch.cat([y1, y2], dim=1), whole, 1e-5)
    # and against the recurrence started from that state
    close(y2, recurrence(**rest, initial=state)[0], 1e-5)


@pytest.mark.parametrize("length", [16, 37, 5])
def test_chunk_scan_matches_transformers_torch_path(length):
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    t = inputs(seed=3, length=length)
    t["D"] = torch.rand(H, generator=torch.Generator().manual_seed(4))
    ours = mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True)
    theirs = hf.mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=CHUNK, D=t["D"],
                                  dt_bias=t["dt_bias"], dt_softplus=True)
    close(ours, theirs, 1e-5)
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    got = grads(lambda **k: mamba.mamba_chunk_scan_combined(**k, chunk_size=CHUNK, dt_softplus=True), t, names)
    ref = grads(lambda x, dt, A, B, C, D, dt_bias: hf.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=CHUNK, D=D,
                                                                      dt_bias=dt_bias, dt_softplus=True), t, names)
    for name in names:
        close(got[name], ref[name], 1e-5)


def test_fused_conv_scan_and_gated_norm_match_the_transformers_mixer():
    """megatron's training path (in_proj output -> conv1d -> scan -> gated group RMSNorm -> out_proj)
    against transformers' whole NemotronHMamba2Mixer on its torch path, including the parameter grads."""
    import transformers
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    cfg = transformers.NemotronHConfig(hidden_size=64, mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G,
                                       chunk_size=CHUNK, conv_kernel=4, layer_norm_epsilon=1e-5,
                                       hybrid_override_pattern="M", num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(5)
    mixer = hf.NemotronHMamba2Mixer(cfg, layer_idx=0)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name in ("norm.weight", "D") else 0))
        mixer.A_log.copy_(torch.log(torch.rand(H) * 6 + 1))
    hidden = torch.randn(B_, L_, 64)

    def ours(m, h):
        return mamba.mamba_split_conv1d_scan_combined(
            m.in_proj(h), m.conv1d.weight[:, 0, :], m.conv1d.bias, m.dt_bias, -torch.exp(m.A_log.float()), m.D,
            CHUNK, dt_limit=m.time_step_limit, activation="silu", rmsnorm_weight=m.norm.weight,
            rmsnorm_eps=m.norm.variance_epsilon, outproj_weight=m.out_proj.weight, headdim=P, ngroups=G,
            norm_before_gate=False)

    got, want = ours(mixer, hidden), mixer(hidden)
    close(got, want, 1e-5)
    weight = torch.linspace(-1, 1, got.numel()).reshape(got.shape)
    (got * weight).sum().backward()
    ours_grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    mixer.zero_grad()
    (mixer(hidden) * weight).sum().backward()
    for name, p in mixer.named_parameters():
        close(ours_grads[name], p.grad, 1e-5)


def test_packed_sequences_are_refused_by_name():
    t = inputs()
    with pytest.raises(NotImplementedError, match="seq_idx"):
        mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, seq_idx=torch.zeros(B_, L_, dtype=torch.int32))


def test_the_package_is_what_megatrons_mixer_imports():
    modules = mamba.package()
    assert modules["mamba_ssm.ops.triton.layernorm_gated"].RMSNorm is mamba.RMSNorm
    ssd = modules["mamba_ssm.ops.triton.ssd_combined"]
    assert {ssd.mamba_chunk_scan_combined, ssd.mamba_split_conv1d_scan_combined} == {
        mamba.mamba_chunk_scan_combined, mamba.mamba_split_conv1d_scan_combined}


def test_state_dtype_keeps_the_states_between_chunks_in_that_dtype():
    """megatron passes mamba_training_ssm_states_dtype as `state_dtype` (where the scans take it): the state
    carried from one chunk to the next is held in that dtype. Against the scan chunk by chunk, each
    chunk's final state rounded before it starts the next (initial_states: checked above)."""
    import inspect

    for fn in (mamba.mamba_chunk_scan_combined, mamba.mamba_split_conv1d_scan_combined):  # megatron's test
        assert "state_dtype" in inspect.signature(fn).parameters
    t = inputs(seed=5)
    plain = mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True)
    assert torch.equal(mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True,
                                                       state_dtype=torch.float32), plain)
    y, final = mamba.mamba_chunk_scan_combined(**t, chunk_size=CHUNK, dt_softplus=True, state_dtype=torch.bfloat16,
                                               return_final_states=True)
    pieces, state = [], None
    for start in range(0, L_, CHUNK):
        part = {k: (v[:, start:start + CHUNK] if v.dim() > 1 else v) for k, v in t.items()}
        out, state = mamba.mamba_chunk_scan_combined(**part, chunk_size=CHUNK, dt_softplus=True,
                                                     initial_states=state, return_final_states=True)
        state = state.to(torch.bfloat16).float()
        pieces.append(out)
    close(y, torch.cat(pieces, dim=1), 1e-6)
    close(final, state, 1e-6)
    assert (y - plain).abs().max() > 1e-4  # bf16 states are not float32's
