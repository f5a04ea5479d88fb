"""Multi-turn episodes end to end, as a user runs them (`python -m launcher env=guess_number`): the
demo learns, vLLM's logprobs equal the trainer's on every model token of every turn, and a pipelined
multi-turn run stopped with Ctrl-C while an episode is in flight, then resumed, logs exactly the rows
of the uninterrupted run and ends with the same adapter and optimizer state, bitwise (with delta refits:
the engines' weights after a resume come from a full push, every later step's from deltas); and episodes
work with the rest: adapter refits, dynamic sampling, greedy validation. Slurm preemption of a
multi-turn run: tests/slurm/test_grpo_on_slurm.py."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers.held_step import HELD_ENV, ctrl_c_while_held
from tests.helpers.runs import Background, assert_same_training, launch, rows

pytestmark = pytest.mark.e2e
NAME = "local-tiny_llama_chat"
STEPS = 40   # the demo's default run (grpo=demo)
DEMO = ["env=guess_number", "logging.tensorboard=false"]
PIPELINED = ["env=guess_number", "refit=merged_delta", "grpo.pipeline.enabled=true", "grpo.max_num_steps=5",
             "checkpointing.save_period=1000", "checkpointing.keep_top_k=null", "logging.tensorboard=false"]


def test_the_guess_number_demo_runs_multi_turn_episodes_and_learns(tmp_path):
    p = launch(tmp_path, *DEMO)
    r = rows(tmp_path / NAME)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))
    for x in r:
        assert x["train/gen_kl_error"] < 1e-5, x  # float32: vLLM and Megatron agree on every model token
        assert 1.0 <= x["env/turns"] <= 4.0 and x["env/episode_tokens"] > x["train/mean_response_tokens"]
        assert x["reward/errors"] == 0
    assert any(x["env/turns"] > 1.5 for x in r)  # episodes of several turns
    first = statistics.fmean(x["train/reward"] for x in r[:3])
    last = statistics.fmean(x["train/reward"] for x in r[-3:])
    assert last > first + 0.1, (first, last)  # it learns (measured 0.07 -> 0.24 over the default 40 steps)
    assert (tmp_path / NAME / "reward.png").stat().st_size > 1000
    assert f"finished at step {STEPS}/{STEPS}" in p.stdout and "episodes with env.fn=guess_number" in p.stdout


def test_ctrl_c_during_a_pipelined_multi_turn_run_then_resume_equals_the_uninterrupted_run(tmp_path, no_ray_left):
    launch(tmp_path / "a", *PIPELINED)
    run_a = tmp_path / "a" / NAME
    run = Background(tmp_path / "b", *PIPELINED, *HELD_ENV, name=NAME)
    k = ctrl_c_while_held(run, 5)  # an episode of a rollout generated ahead was held in respond()
    no_ray_left(run.job())
    p = launch(tmp_path / "b", *PIPELINED, *HELD_ENV, "+resume=latest")
    assert f"the rollouts of step(s) {k + 1} come from the checkpoint" in p.stdout
    assert_same_training(run_a, run.run_dir, 5)
    # with delta refits: the engines after the resume (a full push, then deltas) sample and score as the
    # uninterrupted run's (deltas throughout): the rows above are equal, pipeline/off_policy_kl included;
    # the one on-policy step (1) is exact on every model token of every turn
    assert rows(run.run_dir)[0]["train/gen_kl_error"] < 1e-5


def test_episodes_with_adapter_refits_dynamic_sampling_and_greedy_validation(tmp_path):
    """One run of the demo with what single-turn runs have besides (issue 33: "works with everything that
    exists"): refit.mode=adapter (vLLM serves the LoRA weights, the base never moves), DAPO's dynamic sampling
    over episode groups, and greedy validation episodes on the demo's validation games (data.validation:
    guess_number_val). A run of its own: no shared run has these three together."""
    launch(tmp_path, *DEMO, "refit.mode=adapter", "grpo.dynamic_sampling.enabled=true", "grpo.max_num_steps=3",
           "grpo.val_period=3", "checkpointing.save_period=1000", "checkpointing.keep_top_k=null")
    r = rows(tmp_path / NAME)
    assert [x["step"] for x in r] == [1, 2, 3]
    for x in r:
        assert x["train/gen_kl_error"] < 1e-5, x  # adapter refits: vLLM's logprobs are the trainer's on every turn
        assert 1 <= x["dynamic_sampling/gen_batches"] <= 4 and x["dynamic_sampling/kept_groups"] >= 0
        assert x["env/turns"] >= 1.0 and x["reward/errors"] == 0
    val = r[-1]
    assert 0.0 <= val["val/reward"] <= 1.0 and val["val/reward_errors"] == 0
    assert 1.0 <= val["val/env/turns"] <= 4.0 and val["val/env/episode_tokens"] > 0  # validation played episodes
    assert not any(k.startswith("val/") for x in r[:-1] for k in x)  # every grpo.val_period=3 steps only
