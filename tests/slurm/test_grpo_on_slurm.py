"""GRPO as a 3-node Slurm job (2 training nodes at TP 2, 1 generation node), preempted mid-run:
it checkpoints, requeues itself and finishes with no step lost or repeated."""

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
STEPS = 8


def steps_logged(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.exists() else []


def test_grpo_job_preempted_checkpoints_requeues_and_finishes(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}",
                        f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=4", "checkpointing.keep_top_k=null",
                        "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    run = tmp_path / "slurm_3n-tiny_llama"
    log0 = run / "submitit" / job / f"{job}_0_log.out"
    deadline = time.time() + 420
    while len(steps_logged(run)) < 2:  # let it train a little
        state = slurm_cluster.sacct_state(job)
        assert state in (None, "PENDING", "RUNNING"), (state, log0.read_text() if log0.exists() else "")
        assert time.time() < deadline, log0.read_text() if log0.exists() else "no log"
        time.sleep(1)
    # what submitit's Job._interrupt() does for a preemption: SIGTERM, then the USR2 it handles
    slurm_cluster.run("scancel", job, "--signal", "SIGTERM")
    slurm_cluster.run("scancel", job, "--signal", "USR2")
    state = slurm_cluster.wait_job(job, timeout=600)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    # no step lost or repeated: every step logged exactly once, in order
    assert steps_logged(run) == list(range(1, STEPS + 1)), text[-3000:]
    m = re.search(r"stopped at step (\d+)/8", text)
    assert m, text[-3000:]
    k = int(m.group(1))
    assert 2 <= k < STEPS
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    ckpts = sorted(c.name for c in (run / "checkpoints").iterdir())
    assert f"step_{k}" in ckpts and f"step_{STEPS}" in ckpts
    info = json.loads((run / "checkpoints" / f"step_{STEPS}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == STEPS * 8
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/gen_kl_error"] < 1e-5 for r in rows)


def test_plain_sbatch_job_checkpoints_and_requeues_itself_on_the_time_limit_signal(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}", "submit=false",
                        f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=100",
                        "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "slurm_3n-tiny_llama"
    job = slurm_cluster.run("sbatch", "--parsable", str(run / "ray_job.sbatch")).strip().split(";")[0]
    out = run / "logs" / f"sbatch-{job}.out"
    deadline = time.time() + 420
    while len(steps_logged(run)) < 2:
        assert slurm_cluster.sacct_state(job) in (None, "PENDING", "RUNNING"), out.read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(1)
    slurm_cluster.run("scancel", job, "--signal", "USR2")  # what #SBATCH --signal=USR2@N sends before the limit
    state = slurm_cluster.wait_job(job, timeout=600)
    text = out.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    k = int(re.search(r"stopped at step (\d+)/8", text).group(1))
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    assert steps_logged(run) == list(range(1, STEPS + 1))
