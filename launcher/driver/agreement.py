"""Train-vs-generation logprob agreement: `token_mult_prob_error` and `gen_kl_error`.

Every GRPO step compares the logprobs vLLM reported while sampling with the logprobs the trainer
computes for the same tokens. A refit that loses or garbles weights (stale prefix cache, a LoRA
delta rounded away in a merged bf16 refit, a wrong QKV split) shows up here first.

Definitions (the reference system's, see the project's upstream notes), masked means over tokens:
  token_mult_prob_error = mean exp(|generation_logprob - train_logprob|)        (1.0 = agree)
  gen_kl_error          = mean exp(logr) - 1 - logr, logr = train - generation  (0.0 = agree)
The second is the k3 estimator of KL(generation || train) on tokens sampled from the generator.
Both are computed in float64 (they are tiny numbers near their neutral value). A mask without
any token gives NaN: there is nothing to compare, and a neutral value would hide that.

Inputs follow the trainer batch contract ([B, T] tensors, value at t is log p(x_t | x_<t)).
"""

from __future__ import annotations

import torch


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(torch.float64)
    count = mask.sum()
    if count.item() == 0:
        return float("nan")
    return float((values * mask).sum() / count)


def _aligned(generation_logprobs, train_logprobs, mask):
    gen = torch.as_tensor(generation_logprobs, dtype=torch.float64)
    train = torch.as_tensor(train_logprobs, dtype=torch.float64)
    mask = torch.as_tensor(mask)
    if not (gen.shape == train.shape == mask.shape):
        raise ValueError(f"shapes differ: generation {tuple(gen.shape)}, train {tuple(train.shape)}, "
                         f"mask {tuple(mask.shape)}")
    # Padding positions may hold anything (even -inf); zero them so they cannot poison the sums.
    keep = mask.to(torch.bool)
    return torch.where(keep, gen, 0.0), torch.where(keep, train, 0.0), mask


def token_mult_prob_error(generation_logprobs, train_logprobs, mask) -> float:
    """Masked token mean of exp(|generation - train|); 1.0 when the two sides agree exactly."""
    gen, train, mask = _aligned(generation_logprobs, train_logprobs, mask)
    return _masked_mean(torch.exp((gen - train).abs()), mask)


def gen_kl_error(generation_logprobs, train_logprobs, mask) -> float:
    """Masked token mean of exp(logr) - 1 - logr with logr = train - generation; 0.0 when equal."""
    gen, train, mask = _aligned(generation_logprobs, train_logprobs, mask)
    logr = train - gen
    return _masked_mean(torch.expm1(logr) - logr, mask)


def agreement_metrics(generation_logprobs, train_logprobs, mask) -> dict[str, float]:
    """Both metrics under the names the driver logs (train/<name>)."""
    return {
        "token_mult_prob_error": token_mult_prob_error(generation_logprobs, train_logprobs, mask),
        "gen_kl_error": gen_kl_error(generation_logprobs, train_logprobs, mask),
    }
