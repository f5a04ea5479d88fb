"""The MoE model end to end on this machine, as a user runs it: `python -m launcher model=tiny_qwen3_moe
topology.train.expert_parallel=2` (TP2 x EP2 over 2 trainer ranks, sequence parallel on for MoE at TP2;
the default refit, merged: every weight, the experts' too, reloaded into vLLM CPU each step)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_tiny_moe_trains_at_ep2_with_exact_refits(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launcher", "model=tiny_qwen3_moe", "topology.train.expert_parallel=2",
                        "grpo.max_num_steps=2", "logging.tensorboard=false",
                        f"run.root={tmp_path}", "run.name=moe"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    run = tmp_path / "moe"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # step 1 on the weights the engines loaded (model.path: the trainers' W_0), later steps refit
    assert all(r["train/gen_kl_error"] < 1e-5 and (r["refit/bytes"] > 0) == (r["step"] > 1) for r in rows), rows
    assert (run / "checkpoints" / "step_2").is_dir()
    # the plan says what ran: 2 trainer ranks, TP2 x EP2
    assert "EP 2" in (run / "plan.txt").read_text()
