"""GRPO loss vs a plain float64 per-token reference, on hand-made inputs hitting every branch."""

from __future__ import annotations

import math

import pytest
import torch

from workers.trainer.loss import LossConfig, grpo_loss, loss_config

CFG = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=3.0,
                 reference_policy_kl_penalty=0.0, truncated_importance_sampling_ratio=2.0,
                 token_level_loss=True)


def reference(lp, prev, adv, mask, cfg, gen=None, ref=None):
    """The loss written out token by token in float64 Python (independent of the torch code)."""
    per_seq, tokens = [], []
    for b in range(len(lp)):
        seq = []
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            a = adv[b]
            r = math.exp(min(max(lp[b][t] - prev[b][t], -20.0), 20.0))
            rc = min(max(r, 1 - cfg.ratio_clip_min), 1 + cfg.ratio_clip_max)
            pg = max(-a * r, -a * rc)
            if cfg.ratio_clip_c is not None and a < 0:
                pg = min(pg, -a * cfg.ratio_clip_c)
            if gen is not None and cfg.truncated_importance_sampling_ratio is not None:
                pg *= min(math.exp(prev[b][t] - gen[b][t]), cfg.truncated_importance_sampling_ratio)
            if ref is not None and cfg.reference_policy_kl_penalty:
                x = ref[b][t] - lp[b][t]
                if cfg.kl_input_clamp_value is not None:
                    x = min(max(x, -cfg.kl_input_clamp_value), cfg.kl_input_clamp_value)
                k3 = math.exp(x) - x - 1
                if cfg.kl_output_clamp_value is not None:
                    k3 = min(max(k3, -cfg.kl_output_clamp_value), cfg.kl_output_clamp_value)
                pg += cfg.reference_policy_kl_penalty * k3
            seq.append(pg)
            tokens.append(pg)
        if seq:
            per_seq.append(sum(seq) / len(seq))
    if cfg.token_level_loss:
        return sum(tokens) / len(tokens)
    return sum(per_seq) / len(per_seq)


def make_inputs():
    """B=3, T=5; position 0 of rows 0-1 is a prompt token (mask 0).

    Row 0, A = 1.0:  ratios 1 (inside), e^0.5 = 1.65 (upper clip), e^-0.5 = 0.61 (no clip for A > 0).
    Row 1, A = -0.7: ratios e^-0.5 (lower clip), e^0.1 (inside), e^1.5 = 4.5 (dual clip at c = 3);
                     the last token is masked out and holds a huge log-ratio (must stay finite).
    Row 2, A = 0.3:  one token whose importance weight e^1 is truncated to 2.
    """
    lp = torch.tensor([[0.0, -1.0, -2.0, -1.5, 0.0],
                       [0.0, -2.0, -0.4, 1.0, 50.0],
                       [-0.3, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    prev = torch.tensor([[0.0, -1.0, -2.5, -1.0, 0.0],
                         [0.0, -1.5, -0.5, -0.5, -1.9],
                         [-0.3, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    gen = torch.tensor([[0.0, -1.1, -2.4, -1.0, 0.0],
                        [0.0, -1.5, -0.7, -0.6, -2.0],
                        [-1.3, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -0.8, -2.2, -1.4, 0.0],
                        [0.0, -1.9, -0.3, -0.2, -1.9],
                        [-0.5, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.7, 0.3], dtype=torch.float64)
    return lp, prev, adv, mask, gen, ref


def as_lists(*ts):
    return [None if t is None else t.tolist() for t in ts]


@pytest.mark.parametrize("cfg", [
    CFG,
    LossConfig(**{**CFG.__dict__, "token_level_loss": False}),
    LossConfig(**{**CFG.__dict__, "ratio_clip_c": None}),
    LossConfig(**{**CFG.__dict__, "truncated_importance_sampling_ratio": None}),
    LossConfig(**{**CFG.__dict__, "reference_policy_kl_penalty": 0.1}),
], ids=["token", "sequence", "no_dual", "no_tis", "kl"])
@pytest.mark.parametrize("use_gen_ref", [True, False], ids=["gen+ref", "plain"])
def test_loss_matches_float64_reference(cfg, use_gen_ref):
    lp, prev, adv, mask, gen, ref = make_inputs()
    if not use_gen_ref:
        gen = ref = None
    loss, metrics = grpo_loss(lp, prev, adv, mask, cfg, generation_logprobs=gen, reference_logprobs=ref)
    expected = reference(*as_lists(lp, prev), adv.tolist(), mask.tolist(), cfg, *as_lists(gen, ref))
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_branches_and_metrics():
    lp, prev, adv, mask, gen, ref = make_inputs()
    loss, m = grpo_loss(lp, prev, adv, mask, CFG, generation_logprobs=gen, reference_logprobs=ref)
    n = 7
    assert m["num_tokens"] == n
    assert m["clip_fraction_high"] == pytest.approx(1 / n)  # row 0 token 2: ratio e^0.5, A > 0
    assert m["clip_fraction_low"] == pytest.approx(1 / n)   # row 1 token 1: ratio e^-0.5, A < 0
    assert m["dual_clip_fraction"] == pytest.approx(1 / n)  # row 1 token 3: ratio e^1.5 > 3, A < 0
    # prev - gen on trained tokens: row 0 [.1, -.1, 0], row 1 [0, .2, .1], row 2 [1 -> truncated to 2]
    w = [math.exp(0.1), math.exp(-0.1), 1.0, 1.0, math.exp(0.2), math.exp(0.1), 2.0]
    assert m["is_weight_mean"] == pytest.approx(sum(w) / n, rel=1e-12)
    x = (ref - lp)[mask > 0]
    assert m["kl"] == pytest.approx((torch.exp(x) - x - 1).mean().item(), rel=1e-12)


def test_gradients_of_clipped_tokens_are_zero():
    lp, prev, adv, mask, gen, ref = make_inputs()
    lp = lp.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, prev, adv, mask, CFG, generation_logprobs=gen)
    loss.backward()
    g = lp.grad
    assert g[0, 2] == 0 and g[1, 1] == 0 and g[1, 3] == 0  # upper, lower and dual clip
    assert g[0, 1] != 0 and g[0, 3] != 0 and g[1, 2] != 0 and g[2, 0] != 0  # unclipped tokens train
    assert torch.all(g[mask == 0] == 0)  # masked tokens (one with a huge log-ratio) contribute nothing
    assert torch.isfinite(g).all()
    # unclipped, A > 0: d/dlp of -A * w * exp(lp - prev) / n = -A * w * ratio / n
    assert g[0, 1].item() == pytest.approx(-1.0 * math.exp(0.1) * 1.0 / 7, rel=1e-12)


def test_normalizer_splits_across_ranks():
    """Two halves with the global token count as normalizer sum to the loss of the whole batch."""
    lp, prev, adv, mask, gen, ref = make_inputs()
    whole, _ = grpo_loss(lp, prev, adv, mask, CFG, generation_logprobs=gen)
    n = mask.sum()
    parts = [grpo_loss(lp[s], prev[s], adv[s], mask[s], CFG, generation_logprobs=gen[s], normalizer=n)[0]
             for s in (slice(0, 1), slice(1, 3))]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def demo_loss() -> dict:
    """`grpo.loss` as a run of the default preset (conf/grpo/demo.yaml over the schema) gets it."""
    from omegaconf import OmegaConf

    from launcher.config.compose import compose

    return OmegaConf.to_container(compose(["grpo=demo"]).grpo.loss)


def test_config_keys_follow_yaml():
    section = demo_loss()
    assert loss_config(section).ratio_clip_c == section["ratio_clip_c"]
    with pytest.raises(ValueError, match="unknown keys"):
        loss_config({**section, "ratio_clip": 0.2})


def extreme_inputs(dtype=torch.float32):
    """One sequence, three trained tokens: log(pi/pi_old) = 0, 100 (past float32's exp) and -100;
    log(ref/pi) = 0.1, 30 (a token the policy all but ruled out) and -30."""
    lp = torch.tensor([[-1.0, -1.0, -101.0]], dtype=dtype)
    prev = torch.tensor([[-1.0, -101.0, -1.0]], dtype=dtype)
    ref = torch.tensor([[-0.9, 29.0, -131.0]], dtype=dtype)
    return lp, prev, ref, torch.ones((1, 3), dtype=dtype)


@pytest.mark.parametrize("a", [1.0, -1.0])
@pytest.mark.parametrize("dual", [10.0, None])
def test_extreme_log_ratios_keep_loss_and_gradient_finite(a, dual):
    lp, prev, ref, mask = extreme_inputs()
    cfg = LossConfig(**{**CFG.__dict__, "ratio_clip_c": dual, "reference_policy_kl_penalty": 0.1})
    lp.requires_grad_(True)
    loss, m = grpo_loss(lp, prev, torch.tensor([a]), mask, cfg, reference_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert math.isfinite(m["ratio_mean"]) and math.isfinite(m["kl"])
    assert lp.grad[0, 1] == 0 and lp.grad[0, 2] == 0  # past the clamps: no gradient
    assert loss.item() == pytest.approx(reference(*as_lists(lp.detach(), prev), [a], mask.tolist(), cfg,
                                                  None, ref.tolist()), rel=1e-6)


def test_the_kl_term_is_clamped_as_nemo_rl_and_verl_clamp_it():
    """log(ref/pi) in [-20, 20], k3 in [-10, 10] (the defaults); null turns either clamp off."""
    lp, prev, ref, mask = extreme_inputs(torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    _, m = grpo_loss(lp, lp, zero, mask, CFG, reference_logprobs=ref)
    # 30 -> 20: k3 = e^20 - 21 -> 10;  -30 -> -20: k3 = e^-20 + 19 -> 10
    k3 = [math.exp(0.1) - 1.1, 10.0, 10.0]
    assert m["kl"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    loose = LossConfig(**{**CFG.__dict__, "kl_output_clamp_value": None})
    assert grpo_loss(lp, lp, zero, mask, loose, reference_logprobs=ref)[1]["kl"] == pytest.approx(
        (math.exp(0.1) - 1.1 + math.exp(20) - 21 + math.exp(-20) + 19) / 3, rel=1e-12)
    off = LossConfig(**{**CFG.__dict__, "kl_input_clamp_value": None, "kl_output_clamp_value": None})
    assert grpo_loss(lp, lp, zero, mask, off, reference_logprobs=ref)[1]["kl"] == pytest.approx(
        (math.exp(0.1) - 1.1 + math.exp(30) - 31 + math.exp(-30) + 29) / 3, rel=1e-12)


@pytest.mark.parametrize("key, value", [("kl_input_clamp_value", 0.0), ("kl_output_clamp_value", -1.0)])
def test_a_kl_clamp_must_be_positive_or_null(key, value):
    section = demo_loss()
    assert (section["kl_input_clamp_value"], section["kl_output_clamp_value"]) == (20.0, 10.0)
    with pytest.raises(ValueError) as e:
        loss_config({**section, key: value})
    assert str(e.value) == f"grpo.loss.{key}: must be positive or null, got {value}"
    assert loss_config({**section, key: None}).__dict__[key] is None
