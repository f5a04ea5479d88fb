"""GRPO advantages: rewards of the n generations of each prompt against their group's baseline.

scale rewards (e.g. [0, 1] -> [-1, 1]) -> add DAPO's overlong penalty when on -> per-prompt
baseline (group mean, or the mean of the other generations with leave-one-out) -> optionally
divide by the group's standard deviation (groups whose rewards are all equal get advantage 0)
-> clip to +-advantage_clip.
Pure Python on plain floats: small, exact and easy to check by hand.

DAPO's dynamic sampling keeps a prompt group when its samples' scores differ (`informative`),
judged on reward.fn's score or on correctness (grpo.dynamic_sampling.metric), never on the
overlong penalty: a group of wrong answers of different lengths differs only in that penalty and
would otherwise count as informative (NeMo RL filters on the raw score, verl's DAPO on `acc`).
"""

from __future__ import annotations

import math

from launcher.config.schema import Grpo, RewardScaling


def scale(rewards: list[float], s: RewardScaling) -> list[float]:
    if not s.enabled:
        return list(rewards)
    span = s.source_max - s.source_min
    out = []
    for r in rewards:
        r = min(max(r, s.source_min), s.source_max)
        out.append(s.target_min + (r - s.source_min) / span * (s.target_max - s.target_min))
    return out


def overlong_penalty(lengths: list[int], g: Grpo) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
    -max_penalty at max_new_tokens (a response that hit the limit)."""
    op = g.overlong_penalty
    if not op.enabled:
        return [0.0] * len(lengths)
    buffer = op.buffer_tokens or max(1, g.max_new_tokens // 4)
    start = g.max_new_tokens - buffer
    return [-op.max_penalty * min(1.0, max(0, n - start) / buffer) for n in lengths]


def shaped(rewards: list[float], g: Grpo, penalties: list[float] | None = None) -> list[float]:
    """Scaled rewards plus the overlong penalties (what the advantages are computed from)."""
    r = scale(rewards, g.reward_scaling)
    return [x + p for x, p in zip(r, penalties)] if penalties is not None else r


def correct(reward: float) -> bool:
    """A sample reward.fn scored 1 or more (val/accuracy, dynamic_sampling.metric=accuracy)."""
    return reward >= 1.0


def informative(rewards: list[float], g: Grpo) -> bool:
    """Whether one prompt group's samples differ in grpo.dynamic_sampling.metric: `reward` (the
    scores as grpo.reward_scaling maps them, so scores it clamps together count as equal) or
    `accuracy` (correct or not). The overlong penalty is left out on purpose."""
    if g.dynamic_sampling.metric == "accuracy":
        return len({correct(r) for r in rewards}) > 1
    return len(set(scale(rewards, g.reward_scaling))) > 1


def compute(rewards: list[float], g: Grpo, penalties: list[float] | None = None) -> list[float]:
    """Advantages for rewards ordered prompt-major: [p0 g0, p0 g1, ..., p1 g0, ...]."""
    n = g.num_generations_per_prompt
    if len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards is not a multiple of {n} generations per prompt")
    r = shaped(rewards, g, penalties)
    adv = []
    for start in range(0, len(r), n):
        group = r[start:start + n]
        mean = sum(group) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1)) if n > 1 else 0.0
        for i, x in enumerate(group):
            baseline = (sum(group) - x) / (n - 1) if g.use_leave_one_out_baseline and n > 1 else mean
            a = x - baseline
            if g.normalize_rewards:
                a = a / (std + 1e-6) if std > 0 else 0.0
            if g.advantage_clip is not None:
                a = max(-g.advantage_clip, min(g.advantage_clip, a))
            adv.append(a)
    return adv
