"""The tiny Mixture-of-Experts model as a 3-node Slurm job: 2 training nodes, one trainer rank each, at
EP 2 (2 of the 4 experts on each node; TP 2 with sequence parallel, as slurm_3n trains), 1 generation
node, refit merged_delta (the refit vLLM CPU takes for an MoE model, docs/moe.md). Preempted mid-run,
it checkpoints its expert-sharded state, requeues itself, resumes and finishes with no step lost or
repeated and exact refits on every step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
PY = sys.executable
STEPS = 6


def steps_logged(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.exists() else []


def test_moe_job_at_ep2_over_two_nodes_preempted_resumes_and_finishes(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", "model=tiny_qwen3_moe",
                        "topology.train.expert_parallel=2", "refit=merged_delta", f"run.root={tmp_path}",
                        "run.name=moe", f"grpo.max_num_steps={STEPS}", "grpo.max_new_tokens=8",
                        "checkpointing.save_period=3", "checkpointing.keep_top_k=null",
                        "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    run = tmp_path / "moe"
    plan = (run / "plan.txt").read_text()
    assert "EP 2" in plan, plan
    log0 = run / "submitit" / job / f"{job}_0_log.out"
    deadline = time.time() + 600
    while len(steps_logged(run)) < 2:  # let it train a little
        state = slurm_cluster.sacct_state(job)
        assert state in (None, "PENDING", "RUNNING"), (state, log0.read_text() if log0.exists() else "")
        assert time.time() < deadline, log0.read_text() if log0.exists() else "no log"
        time.sleep(1)
    # what submitit's Job._interrupt() does for a preemption: SIGTERM, then the USR2 it handles
    slurm_cluster.run("scancel", job, "--signal", "SIGTERM")
    slurm_cluster.run("scancel", job, "--signal", "USR2")
    state = slurm_cluster.wait_job(job, timeout=900)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    # no step lost or repeated: every step logged exactly once, in order
    assert steps_logged(run) == list(range(1, STEPS + 1)), text[-3000:]
    m = re.search(rf"stopped at step (\d+)/{STEPS}", text)
    assert m, text[-3000:]
    k = int(m.group(1))
    assert 2 <= k < STEPS
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    ckpts = sorted(c.name for c in (run / "checkpoints").iterdir())
    assert f"step_{k}" in ckpts and f"step_{STEPS}" in ckpts
    info = json.loads((run / "checkpoints" / f"step_{STEPS}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == STEPS * 8
    # the generator got exactly the trained weights on every step, before and after the resume
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/gen_kl_error"] < 1e-5 and r["refit/bytes"] > 0 for r in rows), rows
