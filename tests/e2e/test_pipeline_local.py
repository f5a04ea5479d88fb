"""Pipelined GRPO end to end, as a user runs it (`python -m launcher grpo.pipeline.enabled=true`):
the run learns, the generators sample each step with the weights the schedule names, and a run
stopped with Ctrl-C while a rollout is in flight, then resumed with `+resume=latest`, logs exactly
the rows of an uninterrupted pipelined run and ends with the same adapter and optimizer state,
bitwise (as tests/e2e/test_grpo_local.py proves for the sync loop)."""

from __future__ import annotations

import statistics

import pytest

from tests.helpers.held_step import HELD_REWARD, ctrl_c_while_held
from tests.helpers.runs import Background, assert_same_training, launch, left_in_tmp, rows

pytestmark = pytest.mark.e2e
STEPS = 30
PIPELINED = ["grpo.pipeline.enabled=true", f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=1000",
             "checkpointing.keep_top_k=null", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelined")
    p = launch(root, *PIPELINED)
    return root / "local-tiny_llama", p


def test_a_pipelined_run_learns_on_its_schedule(straight):
    run, p = straight
    r = rows(run)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))
    # the rollout of step N comes from the weights after step N-2 (max_lag 1), step 1 and 2 from the start
    assert [x["pipeline/generated_with"] for x in r] == [max(0, s - 2) for s in range(1, STEPS + 1)]
    assert [x["pipeline/lag"] for x in r] == [0] + [1] * (STEPS - 1)
    # gen_kl_error (engine vs trainer, the same weights) only where the trainers held the generating weights
    assert r[0]["train/gen_kl_error"] < 1e-5 and all("train/gen_kl_error" not in x for x in r[1:])
    # the lagged steps' samples come from other weights than the trainers': far beyond the engines' floor
    assert statistics.fmean(x["pipeline/off_policy_kl"] for x in r[1:]) > 1e3 * max(r[0]["train/gen_kl_error"], 1e-9)
    for x in r:
        assert x["timing/exposed_generation"] >= 0 and x["timing/idle_generation"] >= 0
    # it learns: the demo's reward rises (measured 0.04 -> 0.20 over these 30 steps; the sync loop
    # reaches 0.71 in as many at the demo's large learning rate, docs/benchmarks.md)
    first = statistics.fmean(x["train/reward"] for x in r[:3])
    last = statistics.fmean(x["train/reward"] for x in r[-3:])
    assert last > first + 0.1, (first, last)
    assert "finished at step 30/30" in p.stdout


def test_ctrl_c_while_a_rollout_is_in_flight_then_resume_equals_the_uninterrupted_run(straight, tmp_path,
                                                                                      no_ray_left):
    run_a, _ = straight
    run = Background(tmp_path, *PIPELINED, *HELD_REWARD)
    # the rewards of a rollout generated ahead are held (the first scored after step 2 was logged)
    k = ctrl_c_while_held(run, STEPS)
    no_ray_left(run.job())
    assert left_in_tmp(run.job()) == []
    p = launch(tmp_path, *PIPELINED, *HELD_REWARD, "+resume=latest")
    assert f"the rollouts of step(s) {k + 1} come from the checkpoint" in p.stdout
    assert_same_training(run_a, run.run_dir, STEPS)
