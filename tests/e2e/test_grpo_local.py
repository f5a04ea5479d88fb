"""The embedded default end to end, as a user runs it (`python -m launcher ...` on this machine):
metrics and agreement per step, complete checkpoints, nothing left outside the run directory, a
crash during a save, and the resume after it equal to the uninterrupted run.

The uninterrupted run is the session's `trained_run` (tests/e2e/conftest.py: 4 steps, a
checkpoint after each), which the other e2e tests read too."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.helpers.runs import Background, assert_same_training, job_of, launch, left_in_tmp, rows

pytestmark = pytest.mark.e2e
STEPS = 4


def test_demo_steps_metrics_agreement_and_checkpoints(trained_run):
    run = trained_run.dir
    r = rows(run)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))
    for x in r:
        for key in ("train/reward", "train/loss", "train/grad_norm", "train/token_mult_prob_error",
                    "train/gen_kl_error", "timing/generation", "timing/logprobs", "timing/training",
                    "timing/transfer_and_update_weights", "timing/total_step", "refit/bytes"):
            assert isinstance(x[key], (int, float)) and math.isfinite(x[key]), (key, x)
        assert x["train/gen_kl_error"] < 1e-5  # float32: vLLM and Megatron agree on every token
        assert abs(x["train/token_mult_prob_error"] - 1.0) < 1e-4
        assert 0.0 <= x["train/reward"] <= 1.0
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [f"step_{s}" for s in range(1, STEPS + 1)]
    for c in (run / "checkpoints").iterdir():
        from launcher.driver.checkpoints import verify

        verify(c)
        info = json.loads((c / "training_info.json").read_text())
        assert info["consumed_prompts"] == info["step"] * 8
    assert "PEFT Statistics:" in trained_run.stdout and "Trainable parameters: 10,240" in trained_run.stdout
    assert "finished at step 4/4" in trained_run.stdout
    assert (run / "reward.png").stat().st_size > 1000 and (run / "summary.txt").is_file()


def test_a_finished_run_leaves_nothing_outside_its_run_directory(trained_run):
    """Ray's temp dir of the run's node is gone, its daemons' logs kept in RUN/logs/ray/<host>/; the
    Ray workers' files (vLLM's vllm_dist_* rendezvous file and IPC sockets) went with it, and the
    launcher's own temp dir (TMPDIR, private to this run) is empty."""
    job = job_of(trained_run.dir)
    assert left_in_tmp(job) == []
    assert sorted(p.name for p in trained_run.temp_dir.iterdir()) == []
    (host,) = (trained_run.dir / "logs" / "ray").iterdir()
    (session,) = host.iterdir()
    assert (session / "raylet.out").stat().st_size > 0 and (session / "gcs_server.out").stat().st_size > 0
    assert oct((session / "raylet.out").stat().st_mode & 0o777) == "0o600"  # the run directory's policy


def test_crash_during_a_checkpoint_keeps_the_previous_one_and_the_resume_equals_the_uninterrupted_run(
        trained_run, tmp_path, no_ray_left):
    """The trained run's directory as it was after step 2 resumes, saving every 2 steps; the
    launcher's whole process group is killed once step 4's save has begun. step_2 is intact, Ray
    and its temp dir are gone; `+resume=latest` continues from step_2 and ends with the rows, the
    adapter and the optimizer state of the uninterrupted run, bitwise. (A resume with another
    grpo.max_num_steps, equal to the uninterrupted run: test_checkpoint_safety_local.py's branch.)"""
    run_dir = trained_run.copy(tmp_path, until_step=2)
    ckpts = run_dir / "checkpoints"
    overrides = [f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=2", "checkpointing.keep_top_k=null",
                 "logging.tensorboard=false"]
    run = Background(tmp_path, *overrides, "+resume=latest")
    try:
        run.wait_for(r"resumed from \S+/step_2 \(step 2, 16 prompts consumed", timeout=600)
        deadline = time.time() + 600
        while not (ckpts / "tmp_step_4").exists():  # step 4's save has begun
            assert run.ended() is None, run.ended()
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        run.kill()  # the launcher (and its process group) dies mid-save
    no_ray_left(run.job(), wait_s=30)  # the reaper took Ray down with the launcher ...
    assert left_in_tmp(run.job()) == []  # ... and removed its temp dir
    assert sorted(c.name for c in ckpts.iterdir() if not c.name.startswith("tmp_")) == ["step_1", "step_2"]
    p = launch(tmp_path, *overrides, "+resume=latest")
    assert "resumed from" in p.stdout and "(step 2, 16 prompts consumed" in p.stdout
    # the partial one was replaced; step_3 was not saved (save_period=2)
    assert sorted(c.name for c in ckpts.iterdir()) == ["step_1", "step_2", "step_4"]
    assert [x["step"] for x in rows(run_dir)] == [1, 2, 3, 4]
    assert_same_training(trained_run.dir, run_dir, step=STEPS)
