"""The embedded default end to end, as a user runs it (`python -m launcher ...` on this machine):
metrics and agreement per step, complete checkpoints, resume equality, a crash during a save."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
PY = sys.executable
STEPS = 4
COMMON = [f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=2", "checkpointing.keep_top_k=null",
          "logging.tensorboard=false"]


def launch(root: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([PY, "-m", "launcher", f"run.root={root}", *COMMON, *overrides],
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without wall-clock values."""
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k != "train/train_seconds"}


def trainer_tensors(ckpt: Path) -> dict:
    """Every tensor of a trainer checkpoint (adapter + optimizer), read with torch DCP."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / "trainer"), str(out))
    state = torch.load(out, weights_only=False)
    out.unlink()
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    p = launch(root)
    return root / "local-tiny_llama", p


def test_demo_steps_metrics_agreement_and_checkpoints(straight):
    run, p = straight
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
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    for c in (run / "checkpoints").iterdir():
        from launcher.driver.checkpoints import verify

        verify(c)
        info = json.loads((c / "training_info.json").read_text())
        assert info["consumed_prompts"] == info["step"] * 8
    assert "PEFT Statistics:" in p.stdout and "Trainable parameters: 10,240" in p.stdout
    assert "finished at step 4/4" in p.stdout
    assert (run / "reward.png").stat().st_size > 1000 and (run / "summary.txt").is_file()


def test_resume_equals_an_uninterrupted_run(straight, tmp_path):
    run_a, _ = straight
    # k=2 steps in a run that ends there (its scheduler was built for 2 steps) ...
    launch(tmp_path, "grpo.max_num_steps=2")
    run_b = tmp_path / "local-tiny_llama"
    # ... then continue to N with a changed max_num_steps: needs override_opt_param_scheduler
    p = launch(tmp_path, "+resume=step_2", "optim.override_opt_param_scheduler=true")
    assert "resumed from" in p.stdout and "(step 2, 16 prompts consumed" in p.stdout
    assert [deterministic(x) for x in rows(run_b)] == [deterministic(x) for x in rows(run_a)]
    a, b = trainer_tensors(run_a / "checkpoints" / "step_4"), trainer_tensors(run_b / "checkpoints" / "step_4")
    assert sorted(a) == sorted(b) and any(".adapter." in k for k in a) and any("exp_avg" in k for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k  # bitwise


def _kill_tree_of(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


def test_crash_during_a_checkpoint_keeps_the_previous_one(tmp_path, no_ray_left):
    proc = subprocess.Popen([PY, "-m", "launcher", f"run.root={tmp_path}", *COMMON], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ckpts = tmp_path / "local-tiny_llama" / "checkpoints"
    try:
        deadline = time.time() + 600
        while not (ckpts / "tmp_step_4").exists():  # step 4's save has begun
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        _kill_tree_of(proc.pid)  # the launcher (and its process group) dies mid-save
        proc.wait()
    job = next((tmp_path / "local-tiny_llama" / "ray").iterdir()).name.split(".")[0]
    no_ray_left(job, wait_s=30)  # the reaper took Ray down with the launcher
    assert (ckpts / "step_2").is_dir() and not (ckpts / "step_4").exists()
    p = launch(tmp_path, "+resume=latest")
    assert "resumed from" in p.stdout and "(step 2, 16 prompts consumed" in p.stdout
    assert sorted(c.name for c in ckpts.iterdir()) == ["step_2", "step_4"]  # the partial one was replaced
    assert [x["step"] for x in rows(tmp_path / "local-tiny_llama")] == [1, 2, 3, 4]
