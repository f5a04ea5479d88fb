"""The field's own test vectors, run against our loss, advantage, dynamic-sampling and agreement code.

Each case names its source: repository, file, test name and the commit read. Only inputs and
expected numbers are taken (with the tolerance the source asserts); the code under test is ours.
Translation notes: NeMo RL's loss tests mask token 0 of a 4-token row and put the three trained
tokens after it; that layout is kept. Their ClippedPGLossConfig defaults are ratio_clip_min =
ratio_clip_max = 0.2, no dual clip, KL clamps 20 / 10, and importance sampling only when asked
(our truncated_importance_sampling_ratio=None is "off"). verl's advantage tests compare two verl
implementations on random groups; the translation checks ours against the definition both share.

Where we differ on purpose the test pins our choice, and docs/architecture.md ("The loss and the
advantages next to NeMo RL and verl") says why.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from launcher.config.schema import DynamicSampling, Grpo, OverlongPenalty, RewardScaling
from launcher.driver import advantages
from launcher.driver.agreement import gen_kl_error, token_mult_prob_error
from workers.trainer.loss import LossConfig, grpo_loss

NEMO_RL = "NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909"
VERL = "volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7"

# NeMo RL's ClippedPGLossConfig defaults, in our keys
NEMO_DEFAULTS = dict(ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=None, reference_policy_kl_penalty=0.0,
                     kl_input_clamp_value=20.0, kl_output_clamp_value=10.0,
                     truncated_importance_sampling_ratio=None, token_level_loss=True)


def nemo_row(values) -> torch.Tensor:
    """[[0, v1, v2, v3]]: NeMo RL's tests train tokens 1..3 of a 4-token row (token_mask[:, 0] = 0)."""
    return torch.tensor([[0.0, *values]], dtype=torch.float64)


MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def nemo_loss(adv, prev, curr, gen=None, ref=None, **cfg):
    loss, metrics = grpo_loss(nemo_row(curr), nemo_row(prev), nemo_row(adv), MASK,
                              LossConfig(**{**NEMO_DEFAULTS, **cfg}),
                              generation_logprobs=None if gen is None else nemo_row(gen),
                              reference_logprobs=None if ref is None else nemo_row(ref))
    return loss.item(), metrics


# ------------------------------------------------------------------------------ NeMo RL: the loss
CURR = [-1.69315, -1.0, -0.59453]   # ratios 0.5, 1, 1.5 against prev -1


def test_nemo_rl_ppo_clipping():
    """NeMo RL, tests/unit/algorithms/test_loss_functions.py, test_clipped_pg_loss_ppo_clipping:
    adv [1, -1, 2], prev [-1, -1, -1], curr log(0.5)-1, -1, log(1.5)-1 -> max(loss1, loss2) =
    [-0.5, 1.0, -2.4], loss -0.6333 (rtol 1e-3)."""
    loss, _ = nemo_loss([1.0, -1.0, 2.0], [-1.0] * 3, CURR)
    assert loss == pytest.approx(-0.6333, rel=1e-3)
    assert loss == pytest.approx((-0.5 + 1.0 - 2.4) / 3, rel=1e-4)


def test_nemo_rl_kl_penalty():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_kl_penalty: adv 0, curr [0, -1, -2],
    ref [-1, -1, -1], prev 0, beta 0.1 -> k3 [0.368, 0.0, 0.718], mean 0.362, loss 0.0362 (rtol 1e-3)."""
    loss, m = nemo_loss([0.0] * 3, [0.0] * 3, [0.0, -1.0, -2.0], ref=[-1.0] * 3, reference_policy_kl_penalty=0.1)
    assert m["kl"] == pytest.approx(0.362, rel=1e-3)
    assert loss == pytest.approx(0.0362, rel=1e-3)


def test_nemo_rl_importance_sampling():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_on_policy_kl_importance_sampling (KL
    penalty 0 there): gen [-0.5, -1.5, -0.8] -> weights exp(prev - gen) = [0.6065, 1.6487, 0.8187],
    weighted [-0.30325, 1.6487, -1.96488], loss -0.2065 (rtol 1e-3). Untruncated there: our
    truncation at 5 does not bind."""
    loss, m = nemo_loss([1.0, -1.0, 2.0], [-1.0] * 3, CURR, gen=[-0.5, -1.5, -0.8], ref=[-1.0] * 3,
                        truncated_importance_sampling_ratio=5.0)
    assert loss == pytest.approx(-0.2065, rel=1e-3)
    assert m["is_weight_mean"] == pytest.approx((0.6065 + 1.6487 + 0.8187) / 3, rel=1e-3)


def test_nemo_rl_truncated_importance_sampling():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_on_policy_truncated_importance_sampling
    [sequence_level_importance_ratios=False], type tis, ratio 0.8: weights [0.6065, 0.8, 0.8],
    weighted [-0.3033, 0.8, -1.92], loss -0.4744 (rtol 1e-3)."""
    loss, m = nemo_loss([1.0, -1.0, 2.0], [-1.0] * 3, CURR, gen=[-0.5, -1.5, -0.8], ref=[-1.0] * 3,
                        truncated_importance_sampling_ratio=0.8)
    assert loss == pytest.approx(-0.4744, rel=1e-3)
    assert m["is_weight_mean"] == pytest.approx((0.6065 + 0.8 + 0.8) / 3, rel=1e-3)


def test_nemo_rl_dual_clip():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_dual_clip: ratio_clip_c 3, adv
    [1, -1, -4], prev [-1, -1, -3], curr [-1.69315, -1, -0.69741] (ratios 0.5, 1, 10) -> clip loss
    [-0.5, 1.0, 12.0], loss 4.1667 (rtol 1e-3)."""
    loss, m = nemo_loss([1.0, -1.0, -4.0], [-1.0, -1.0, -3.0], [-1.69315, -1.0, -0.69741], ratio_clip_c=3.0)
    assert loss == pytest.approx(4.1667, rel=1e-3)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 3)


def test_nemo_rl_zero_mask():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_zero_mask: no trained token -> loss 0."""
    g = torch.Generator().manual_seed(0)
    lp, prev, ref = (torch.randn(1, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cfg = LossConfig(**{**NEMO_DEFAULTS, "reference_policy_kl_penalty": 0.1})
    loss, _ = grpo_loss(lp, prev, torch.ones(1, 4, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64),
                        cfg, reference_logprobs=ref)
    assert loss.item() == 0.0


def test_nemo_rl_masking():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_masking (beta 0.1, random inputs):
    masking one more trained token changes the loss; leaving sample 1 out (its sample_mask 0; here
    its token mask 0) equals the loss of sample 0 alone."""
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(2, 4, generator=g, dtype=torch.float64)
    prev, ref = (torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 for _ in range(2))
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64) + 1.0
    cfg = LossConfig(**{**NEMO_DEFAULTS, "reference_policy_kl_penalty": 0.1})
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float64)
    whole = grpo_loss(lp, prev, adv, mask, cfg, reference_logprobs=ref)[0].item()
    fewer = mask.clone()
    fewer[0, 1] = 0
    assert grpo_loss(lp, prev, adv, fewer, cfg, reference_logprobs=ref)[0].item() != pytest.approx(whole, abs=1e-4)
    no_b1 = mask.clone()
    no_b1[1] = 0
    only_b0 = grpo_loss(lp[:1], prev[:1], adv[:1], mask[:1], cfg, reference_logprobs=ref[:1])[0].item()
    assert grpo_loss(lp, prev, adv, no_b1, cfg, reference_logprobs=ref)[0].item() == pytest.approx(only_b0, rel=1e-12)


@pytest.mark.parametrize("clamped, expected", [(False, [0.7183, 13.0, 28.0]), (True, [0.7183, 10.0, 10.0])])
def test_nemo_rl_and_verl_k3_with_and_without_the_clamps(clamped, expected):
    """NeMo RL, tests/unit/algorithms/test_loss_functions.py, test_calculate_kl[k3]:
    logprobs [-1, -1, -1], reference [0, -15, -30] -> k3 [0.7183, 13, 28] unclamped and
    [0.7183, 10, 10] with input clamp 20 and output clamp 10 (rtol 1e-3). verl
    (verl/trainer/ppo/core_algos.py, kl_penalty_forward, low_var_kl) clamps at the same 20 / 10."""
    clamps = {} if clamped else {"kl_input_clamp_value": None, "kl_output_clamp_value": None}
    for t, want in enumerate(expected):
        mask = torch.zeros(1, 3, dtype=torch.float64)
        mask[0, t] = 1
        lp = torch.full((1, 3), -1.0, dtype=torch.float64)
        _, m = grpo_loss(lp, lp, torch.zeros(1, dtype=torch.float64), mask, LossConfig(**{**NEMO_DEFAULTS, **clamps}),
                         reference_logprobs=torch.tensor([[0.0, -15.0, -30.0]], dtype=torch.float64))
        assert m["kl"] == pytest.approx(want, rel=1e-3)


def test_kl_gradient_is_the_k3_derivative_alone_unlike_nemo_rl():
    """NeMo RL, test_loss_functions.py, test_clipped_pg_loss_kl_gradient_includes_sampling_term
    [use_on_policy_kl_approximation=False]: curr [-1.2, -0.7], prev [-1.0, -0.8], gen [-1.5, -0.4],
    ref [-0.9, -1.1], adv [0.4, -0.2], beta 0.3; NeMo RL's KL gradient is beta * (k3 + 1 - exp(r)) / 2,
    r = ref - curr (a score-function term through the sampling probability added to k3's own
    derivative). We differ on purpose: our KL term is the per-token k3 loss as verl's low_var_kl
    and the GRPO paper write it, whose gradient is beta * (1 - exp(r)) / 2 (docs/architecture.md)."""
    curr = torch.tensor([[-1.2, -0.7]], dtype=torch.float64)
    data = dict(prev_logprobs=torch.tensor([[-1.0, -0.8]], dtype=torch.float64),
                advantages=torch.tensor([[0.4, -0.2]], dtype=torch.float64),
                mask=torch.ones(1, 2, dtype=torch.float64))
    gen = torch.tensor([[-1.5, -0.4]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -1.1]], dtype=torch.float64)

    def grad(beta):
        lp = curr.clone().requires_grad_(True)
        cfg = LossConfig(**{**NEMO_DEFAULTS, "reference_policy_kl_penalty": beta})
        grpo_loss(lp, data["prev_logprobs"], data["advantages"], data["mask"], cfg, generation_logprobs=gen,
                  reference_logprobs=ref)[0].backward()
        return lp.grad

    r = ref - curr
    k3 = torch.exp(r) - 1 - r
    ours = 0.3 * (1 - torch.exp(r)) / 2
    nemo_rl = 0.3 * (k3 + 1 - torch.exp(r)) / 2
    got = grad(0.3) - grad(0.0)
    assert torch.allclose(got, ours, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(got, nemo_rl, rtol=1e-3)


# ------------------------------------------------------------------------------ NeMo RL: advantages
def grpo(n, normalize=True, loo=False, metric="reward", overlong=None, max_new_tokens=16) -> Grpo:
    """Advantages on the rewards as given (no reward_scaling, no advantage clip), as the peers compute them."""
    return Grpo(num_generations_per_prompt=n, normalize_rewards=normalize, use_leave_one_out_baseline=loo,
                advantage_clip=None, reward_scaling=RewardScaling(enabled=False), max_new_tokens=max_new_tokens,
                dynamic_sampling=DynamicSampling(enabled=True, metric=metric),
                overlong_penalty=overlong or OverlongPenalty())


R2 = 1 / math.sqrt(2)


@pytest.mark.parametrize("source, rewards, n, expected, rel", [
    ("test_grpo_advantage_estimator_zero_std", [2.0, 2.0, 1.0, 3.0], 2, [0.0, 0.0, -R2, R2], 1e-4),
    ("test_grpo_advantage_estimator_tensor_shapes", [1.0, 3.0], 2, [-R2, R2], 1e-4),
    ("test_grpo_advantage_estimator_zero_std_and_zero_advantage", [5.0] * 4, 4, [0.0] * 4, 1e-5),
    ("test_grpo_advantage_estimator_small_nonzero_std", [1.0, 1.01], 2, [-R2, R2], 1e-3),
])
def test_nemo_rl_grpo_advantages(source, rewards, n, expected, rel):
    """NeMo RL, tests/unit/algorithms/test_grpo.py, <source> (use_leave_one_out_baseline=False,
    normalize_rewards=True): (r - group mean) / (unbiased std + 1e-6), 0 where the std is 0."""
    assert advantages.compute(rewards, grpo(n)) == pytest.approx(expected, rel=rel, abs=1e-6)


def test_nemo_rl_grpo_advantages_ordering_and_mean():
    """NeMo RL, test_grpo.py, test_grpo_advantage_estimator_negative_advantages ([0, 2, 4]: negative,
    ~0, positive, symmetric) and test_grpo_advantage_estimator_tensor_shapes (arange(10): mean ~0, < 1e-5)."""
    a = advantages.compute([0.0, 2.0, 4.0], grpo(3))
    assert a[0] < 0 and abs(a[1]) < 1e-5 and a[2] > 0 and a[0] == pytest.approx(-a[2], rel=1e-5)
    assert abs(sum(advantages.compute([float(i) for i in range(10)], grpo(10))) / 10) < 1e-5


@pytest.mark.parametrize("source, rewards, baseline", [
    ("test_calculate_baseline_and_std_per_prompt_basic", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
     [2.5, 2.0, 1.5, 5.5, 5.0, 4.5]),
    ("test_calculate_baseline_and_std_per_prompt_identical_rewards", [3.0, 3.0, 3.0, 7.0, 7.0, 7.0],
     [3.0, 3.0, 3.0, 7.0, 7.0, 7.0]),
    ("test_calculate_baseline_and_std_per_prompt_numerical_precision", [1e-8, 2e-8, 3e-8, 1e8, 2e8, 3e8],
     [2.5e-8, 2e-8, 1.5e-8, 2.5e8, 2e8, 1.5e8]),
])
def test_nemo_rl_leave_one_out_baselines(source, rewards, baseline):
    """NeMo RL, tests/unit/algorithms/test_utils.py, <source> (leave-one-out, the default there):
    the expected baselines; without std normalisation our advantage is reward - baseline (rtol 1e-5)."""
    got = advantages.compute(rewards, grpo(3, normalize=False, loo=True))
    assert got == pytest.approx([r - b for r, b in zip(rewards, baseline)], rel=1e-5, abs=1e-13)


def test_leave_one_out_is_normalised_by_the_groups_std_unlike_nemo_rl():
    """NeMo RL, test_utils.py, test_calculate_baseline_and_std_per_prompt_basic: with leave-one-out
    the std is the others' too ([0.707107, 1.414214, 0.707107] for rewards [1, 2, 3]), so each sample
    is divided by its own number. We differ on purpose: one std per group (here 1), so a group's
    advantages keep their sum 0 and their order (docs/architecture.md)."""
    got = advantages.compute([1.0, 2.0, 3.0], grpo(3, loo=True))
    assert got == pytest.approx([-1.5 / (1 + 1e-6), 0.0, 1.5 / (1 + 1e-6)], rel=1e-12)
    nemo_rl = [-1.5 / (0.707107 + 1e-6), 0.0, 1.5 / (0.707107 + 1e-6)]
    assert got != pytest.approx(nemo_rl, rel=1e-3)


# ------------------------------------------------------------------------------ NeMo RL: DAPO filter
@pytest.mark.parametrize("source, rewards, kept", [
    ("test_dapo_dynamic_sampling_filters_nonzero_std", [1.0, 0.0, 1.0, 0.5, 0.5, 0.0], [True, True]),
    ("test_dapo_dynamic_sampling_filters_zero_std", [1.0, 1.0, 1.0, 0.5, 0.5, 0.0], [False, True]),
])
def test_nemo_rl_dynamic_sampling_keeps_groups_whose_scores_differ(source, rewards, kept):
    """NeMo RL, tests/unit/algorithms/test_grpo.py, <source>: 2 prompts x 3 generations; a group
    with zero std is filtered out."""
    g = grpo(3)
    assert [advantages.informative(rewards[i:i + 3], g) for i in (0, 3)] == kept


def test_nemo_rl_dynamic_sampling_filters_on_the_raw_score_after_overlong_shaping():
    """NeMo RL, test_grpo.py, test_dapo_dynamic_sampling_filters_on_raw_metric_after_overlong_shaping:
    response lengths [10, 22, 30] and [10, 20, 10], raw rewards [0, 0, 0] and [1, 0, 1], overlong
    buffer 5, penalty 0.5, max response length 25: shaping makes group 0's rewards differ
    ([0, -0.2, -1.0] there), yet only group 1 survives. Our lengths stop at max_new_tokens (30 -> 25:
    a response cannot be longer), so our shaped group 0 is [0, -0.2, -0.5]."""
    g = grpo(3, overlong=OverlongPenalty(enabled=True, buffer_tokens=5, max_penalty=0.5), max_new_tokens=25)
    raw = [[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    lengths = [[10, 22, 25], [10, 20, 10]]
    assert advantages.overlong_penalty(lengths[0], g) == pytest.approx([0.0, -0.2, -0.5])
    assert len(set(advantages.shaped(raw[0], g, advantages.overlong_penalty(lengths[0], g)))) > 1
    assert [advantages.informative(r, g) for r in raw] == [False, True]


# ------------------------------------------------------------------------------ verl
@pytest.mark.parametrize("batch_size, num_groups, seed", [(64, 8, 0), (128, 8, 1), (512, 16, 2)])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_verl_grpo_and_rloo_outcome_advantages(batch_size, num_groups, seed, estimator):
    """verl, tests/trainer/ppo/test_core_algos_on_cpu.py, test_grpo_and_vectorized_equivalence and
    test_rloo_and_vectorized_equivalence (batch sizes and seeds as there; groups of equal size here,
    ours samples a fixed n per prompt): outcome scores randn; GRPO = (score - group mean) /
    (unbiased group std + 1e-6), RLOO = score - mean of the group's other scores (rtol 1e-5, atol 1e-6)."""
    rng = random.Random(seed)
    n = batch_size // num_groups
    scores = [rng.gauss(0.0, 1.0) for _ in range(batch_size)]
    expected = []
    for start in range(0, batch_size, n):
        group = torch.tensor(scores[start:start + n], dtype=torch.float64)
        if estimator == "grpo":
            expected += ((group - group.mean()) / (group.std() + 1e-6)).tolist()
        else:
            expected += (group - (group.sum() - group) / (n - 1)).tolist()
    g = grpo(n, normalize=estimator == "grpo", loo=estimator == "rloo")
    assert advantages.compute(scores, g) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_verl_clamps_the_policy_log_ratio_at_20():
    """verl, verl/trainer/ppo/core_algos.py, compute_policy_loss_vanilla: log(pi / pi_old) is
    clamped to [-20, 20] before exp(); a log ratio of 100 or -100 scores as 20 or -20 would."""
    lp = torch.tensor([[100.0, -100.0]], dtype=torch.float64)
    at_bound = torch.tensor([[20.0, -20.0]], dtype=torch.float64)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    for a in (1.0, -1.0):
        cfg = LossConfig(**{**NEMO_DEFAULTS, "ratio_clip_c": None})
        adv = torch.tensor([a], dtype=torch.float64)
        far, _ = grpo_loss(lp, zero, adv, torch.ones(1, 2), cfg)
        near, _ = grpo_loss(at_bound, zero, adv, torch.ones(1, 2), cfg)
        assert far.item() == near.item() and math.isfinite(far.item())


def test_verl_dapo_filters_on_accuracy():
    """verl, docs/algo/dapo.md: `algorithm.filter_groups.metric: acc` filters out "groups whose
    outputs' accuracies are all 1 or 0" (verl/workers/reward_manager/dapo.py records `acc` before the
    overlong reward is added). Partial credit that never reaches 1 is one accuracy value:
    grpo.dynamic_sampling.metric=accuracy drops such a group, metric=reward keeps it."""
    assert advantages.informative([0.5, 0.0, 0.0], grpo(3, metric="accuracy")) is False
    assert advantages.informative([0.5, 0.0, 0.0], grpo(3, metric="reward")) is True
    assert advantages.informative([1.0, 0.0, 0.0], grpo(3, metric="accuracy")) is True


# ------------------------------------------------------------------------------ agreement metrics
@pytest.mark.parametrize("train, k3", [(0.0, 0.7183), (-15.0, 13.0), (-30.0, 28.0)])
def test_gen_kl_error_is_nemo_rls_unclamped_k3(train, k3):
    """NeMo RL, nemo_rl/algorithms/loss/loss_functions.py computes gen_kl_error as calculate_kl(
    logprobs=generation, reference=prev, k3, unclamped); its test_calculate_kl[k3] vectors (generation
    -1, reference 0 / -15 / -30 -> 0.7183 / 13 / 28, rtol 1e-3) hold for ours; token_mult_prob_error
    is exp(|generation - train|) there and here."""
    gen, tr, mask = [[-1.0]], [[train]], [[1.0]]
    assert gen_kl_error(gen, tr, mask) == pytest.approx(k3, rel=1e-3)
    assert token_mult_prob_error(gen, tr, mask) == pytest.approx(math.exp(abs(train + 1.0)), rel=1e-12)
