"""Driver-side pieces without Ray: data order, rewards, advantages, checkpoint manager, metrics."""

from __future__ import annotations


import pytest

from launcher.driver import advantages, data, rewards
from launcher.driver.checkpoints import CheckpointError, CheckpointManager, verify
from launcher.driver.metrics import MetricsLogger, read, summary
from launcher.config.schema import Checkpointing, ConfigError, Grpo, Logging, RewardScaling


def test_data_order_is_a_pure_function_of_seed_epoch_position():
    a, b = data.PromptDataset("math_add", 3), data.PromptDataset("math_add", 3)
    straight, end, skipped = a.take(0, 700)  # crosses two epoch boundaries (256 examples)
    assert (end, skipped) == (700, 0)
    resumed = b.take(0, 300)[0] + b.take(300, 400)[0]
    assert [e.index for e in straight] == [e.index for e in resumed]
    assert sorted(e.index for e in straight[:256]) == list(range(256))  # each epoch is a permutation
    assert [e.index for e in straight[:256]] != [e.index for e in straight[256:512]]
    assert [e.index for e in data.PromptDataset("math_add", 4).take(0, 10)[0]] != [e.index for e in straight[:10]]


def test_rewards():
    assert rewards.say_number("42 41 49 40", [40, 49]) == 1.0
    assert rewards.say_number("42 and more 39", [40, 49]) == 0.25
    assert rewards.say_number("39 50", [40, 49]) == 0.0
    assert rewards.say_number("", [40, 49]) == 0.0
    assert rewards.math_answer("37", 37) == 1.0
    assert rewards.math_answer("the answer is 37 .", 37) == 1.0
    assert rewards.math_answer("36 or 37", 37) == 0.0
    ex = data.PromptDataset("math_add", 0).example(0)
    a, b = [int(t) for t in ex.prompt.split() if t.isdigit()]
    assert ex.target == a + b and ex.prompt == f"what is {a} + {b} ? give only the answer ."


def test_advantages_by_hand():
    g = Grpo(num_generations_per_prompt=4, normalize_rewards=False, use_leave_one_out_baseline=False,
             advantage_clip=None, reward_scaling=RewardScaling(enabled=False))
    assert advantages.compute([1, 0, 0, 0, 1, 1, 1, 1], g) == [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]
    g.use_leave_one_out_baseline = True
    assert advantages.compute([1, 0, 0, 0], g) == [1.0, -1 / 3, -1 / 3, -1 / 3]
    g.use_leave_one_out_baseline = False
    g.normalize_rewards = True
    adv = advantages.compute([1, 0, 0, 0, 1, 1, 1, 1], g)
    std = (0.75 ** 2 + 3 * 0.25 ** 2) ** 0.5 / 3 ** 0.5
    assert adv[:4] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[4:] == [0, 0, 0, 0]  # equal rewards carry no signal
    g.advantage_clip = 1.0
    assert max(advantages.compute([1, 0, 0, 0], g)) == 1.0
    g.reward_scaling = RewardScaling(enabled=True)
    assert advantages.scale([0.0, 0.5, 1.0, 2.0], g.reward_scaling) == [-1.0, 0.0, 1.0, 1.0]


def _save(mgr: CheckpointManager, step: int, reward: float):
    from tests.helpers.checkpoints import config_yaml, trainer_state

    tmp = mgr.begin(step)
    trainer_state(tmp / "trainer", step)
    (tmp / "trainer" / "weights.bin").write_bytes(b"x" * (100 + step))
    return mgr.commit(tmp, step, {"consumed_prompts": step * 8, "metrics": {"train/reward": reward}}, config_yaml())


def test_checkpoint_commit_retention_and_resolve(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", Checkpointing(save_period=1, keep_top_k=1))
    _save(mgr, 1, 0.9)
    _save(mgr, 2, 0.1)
    _save(mgr, 3, 0.5)
    # latest (3) always kept + the best by reward (1)
    assert [c.step for c in mgr.complete()] == [1, 3]
    assert mgr.resolve("latest").step == 3
    assert mgr.resolve("step_1").info()["consumed_prompts"] == 8
    assert mgr.resolve(str(tmp_path / "ckpt" / "step_3")).step == 3
    with pytest.raises(ConfigError) as e:
        mgr.resolve("step_2")
    assert str(e.value) == (f"resume: {tmp_path}/ckpt/step_2 does not exist; complete checkpoints in "
                            f"{tmp_path}/ckpt: step_1, step_3")


def test_interrupted_save_is_ignored_and_truncation_is_named(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", Checkpointing(save_period=1, keep_top_k=None))
    _save(mgr, 1, 0.1)
    tmp = mgr.begin(2)  # a crash here leaves tmp_step_2 behind
    (tmp / "trainer").mkdir()
    assert [c.step for c in mgr.complete()] == [1]
    assert mgr.resolve("latest").step == 1
    f = tmp_path / "ckpt" / "step_1" / "trainer" / "weights.bin"
    f.write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError) as e:
        verify(tmp_path / "ckpt" / "step_1")
    assert str(e.value) == f"{f}: 10 bytes, the manifest says 101 (truncated?)"
    with pytest.raises(ConfigError) as e:  # the newest one is damaged: an error, not silently skipped
        mgr.resolve("latest")
    assert str(e.value) == (f"resume: {f}: 10 bytes, the manifest says 101 (truncated?); complete checkpoints "
                            f"in {tmp_path}/ckpt: none")
    (f.parent.parent / "extra.bin").write_bytes(b"x")
    f.write_bytes(b"y" * 101)  # same size, other content
    with pytest.raises(CheckpointError) as e:
        verify(tmp_path / "ckpt" / "step_1")
    assert str(e.value) == f"{f}: content differs from the manifest (modified or replaced after the save)"


def test_metrics_jsonl_drops_steps_after_the_resumed_checkpoint(tmp_path, capsys):
    m = MetricsLogger(tmp_path, Logging(tensorboard=False), total_steps=4)
    for s in (1, 2, 3):
        m.log(s, {"train/reward": 0.1 * s, "train/loss": 0.0, "train/gen_kl_error": 0.0,
                  "train/token_mult_prob_error": 1.0, "timing/total_step": 1.0,
                  "timing/transfer_and_update_weights": 0.1, "refit/bytes": 10})
    assert "step 3/4  reward 0.300" in capsys.readouterr().out
    m2 = MetricsLogger(tmp_path, Logging(tensorboard=False), total_steps=4, resumed_step=2)
    m2.log(3, {"train/reward": 0.7})
    assert [(r["step"], r["train/reward"]) for r in read(tmp_path / "metrics.jsonl")] == [(1, 0.1), (2, 0.2), (3, 0.7)]
    text = summary(read(tmp_path / "metrics.jsonl")[:2])
    assert "reward (first -> last 1 steps)     0.100 -> 0.200" in text


def test_overlong_penalty_by_hand():
    from launcher.config.schema import OverlongPenalty

    g = Grpo(max_new_tokens=10, num_generations_per_prompt=4, reward_scaling=RewardScaling(enabled=False),
             normalize_rewards=False, advantage_clip=None)
    assert advantages.overlong_penalty([3, 10], g) == [0.0, 0.0]  # off by default
    g.overlong_penalty = OverlongPenalty(enabled=True, buffer_tokens=4, max_penalty=0.5)
    # free up to 10 - 4 = 6 tokens, then linear down to -0.5 at the limit
    assert advantages.overlong_penalty([3, 6, 7, 8, 10], g) == [0.0, 0.0, -0.125, -0.25, -0.5]
    g.overlong_penalty = OverlongPenalty(enabled=True)  # buffer null: max_new_tokens // 4 = 2
    assert advantages.overlong_penalty([8, 9, 10], g) == [0.0, -0.5, -1.0]
    # equal rewards, different lengths: the penalty alone separates the group
    adv = advantages.compute([1.0, 1.0, 1.0, 1.0], g, advantages.overlong_penalty([4, 9, 10, 10], g))
    assert adv == [0.625, 0.125, -0.375, -0.375]  # shaped [1, 0.5, 0, 0] minus their mean 0.375
