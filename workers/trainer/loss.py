"""GRPO clipped policy-gradient loss, pure torch (no megatron), on per-token logprobs.

Per generated token t of a sequence with advantage A (all tensors [B, T], aligned as in
docs/architecture.md, `mask` = 1 on trained tokens):

    ratio   = exp(clamp(logprobs - prev_logprobs, -20, 20))   (verl's bound: finite loss and gradient
                                                          for any log ratio; no gradient past it)
    pg      = max(-A * ratio, -A * clamp(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max))
    pg      = min(pg, -A * ratio_clip_c)                  where A < 0   (dual clip; None: off)
    pg     *= w,  w = min(exp(prev_logprobs - generation_logprobs), truncated_importance_sampling_ratio)
                                                        (truncated importance sampling, w detached;
                                                         None or no generation_logprobs: w = 1)
    loss_t  = pg + beta * k3,  k3 = clamp(exp(x) - x - 1, -out, out),  x = clamp(ref - logprobs, -in, in)
                                                        (beta = reference_policy_kl_penalty; in / out =
                                                         kl_input_clamp_value / kl_output_clamp_value,
                                                         20 / 10 as NeMo RL and verl; null: unclamped)

Reduced by a token-level masked mean (token_level_loss) or the mean over sequences of each
sequence's masked mean. Under data parallelism each rank holds part of the batch: pass the global
token (or sequence) count as `normalizer` so the sum of the ranks' losses is the global loss.

Field names of `LossConfig` are the keys of `grpo.loss` in conf/grpo/*.yaml.

The clamps are the field's (tests/unit/test_peer_vectors.py holds NeMo RL's and verl's cases): one
token the policy gives far less probability than the reference (log(ref/pi) = 30, say) would add
exp(30) ~ 1e13 to the loss unclamped, and a log ratio past ~88 overflows exp() in float32 (inf * 0
in the backward pass: NaN gradients for the whole batch).
"""

from __future__ import annotations

from typing import Optional

import torch

from launcher.config.schema import Loss, from_dict, loss_errors


LossConfig = Loss  # the `grpo.loss` section (launcher.config.schema holds the one definition)
LOG_RATIO_CLAMP = 20.0  # |log(pi / pi_old)| bound, verl's compute_policy_loss_vanilla


def loss_config(d: dict | None) -> Loss:
    """The `grpo.loss` section from plain data; ValueError naming the key on a value schema refuses."""
    cfg = from_dict(Loss, d, "grpo.loss")
    errors = loss_errors(cfg)
    if errors:
        raise ValueError(str(errors[0]))
    return cfg


def grpo_loss(
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    generation_logprobs: Optional[torch.Tensor] = None,
    reference_logprobs: Optional[torch.Tensor] = None,
    normalizer: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (loss, metrics). `advantages` is [B] (per sequence) or [B, T].

    metrics (masked means over this call's tokens, plus `num_tokens` to combine calls):
    clip_fraction_low / clip_fraction_high (tokens whose gradient the lower / upper ratio clip
    removes), dual_clip_fraction, kl (k3 to the reference, 0 without one), is_weight_mean,
    ratio_mean.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logprobs)
    on = mask > 0
    # Positions outside the mask may hold anything (padding): keep exp() finite there.
    log_ratio = torch.where(on, logprobs - prev_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.zeros_like(on)
    if cfg.ratio_clip_c is not None:
        dual = on & (adv < 0) & (-adv * cfg.ratio_clip_c < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)

    weight = torch.ones_like(logprobs)
    if generation_logprobs is not None and cfg.truncated_importance_sampling_ratio is not None:
        log_w = torch.where(on, prev_logprobs - generation_logprobs, torch.zeros_like(prev_logprobs))
        weight = torch.clamp(torch.exp(log_w.to(logprobs.dtype)), max=cfg.truncated_importance_sampling_ratio)
        weight = weight.detach()
    per_token = pg * weight

    kl = torch.zeros_like(logprobs)
    if reference_logprobs is not None:
        log_ref_ratio = torch.where(on, reference_logprobs.to(logprobs.dtype) - logprobs, torch.zeros_like(logprobs))
        if cfg.kl_input_clamp_value is not None:
            log_ref_ratio = torch.clamp(log_ref_ratio, -cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        if cfg.kl_output_clamp_value is not None:
            kl = torch.clamp(kl, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
        if cfg.reference_policy_kl_penalty:
            per_token = per_token + cfg.reference_policy_kl_penalty * kl

    per_token = per_token * mask
    if cfg.token_level_loss:
        total = per_token.sum()
        count = mask.sum()
    else:
        seq_tokens = mask.sum(dim=1)
        has_tokens = seq_tokens > 0
        total = (per_token.sum(dim=1) / seq_tokens.clamp(min=1))[has_tokens].sum()
        count = has_tokens.sum().to(logprobs.dtype)
    denominator = normalizer if normalizer is not None else count
    loss = total / torch.clamp(torch.as_tensor(denominator, dtype=logprobs.dtype), min=1.0)

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)

        def frac(flags: torch.Tensor) -> float:
            return float((flags.to(mask.dtype) * mask).sum() / n)

        metrics = {
            "clip_fraction_low": frac(on & (adv < 0) & (ratio < 1.0 - cfg.ratio_clip_min)),
            "clip_fraction_high": frac(on & (adv > 0) & (ratio > 1.0 + cfg.ratio_clip_max)),
            "dual_clip_fraction": frac(dual),
            "kl": float((kl * mask).sum() / n),
            "is_weight_mean": float((weight * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "num_tokens": float(mask.sum()),
        }
    return loss, metrics
