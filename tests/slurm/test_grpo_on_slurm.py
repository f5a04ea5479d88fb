"""GRPO as a 3-node Slurm job (2 training nodes at TP 2, 1 generation node), preempted mid-run:
it checkpoints, requeues itself and finishes with no step lost or repeated: as a plain sbatch job
(the time limit's signal), and pipelined (submitit). The sync loop preempted under submitit:
tests/slurm/test_branch_resume_on_slurm.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.held_reward import HELD
from tests.helpers.held_step import HELD_REWARD, HELD_STEP, release, steps_logged, wait_until
from tests.helpers.preemption import job_ended, signal_in_held_step

pytestmark = pytest.mark.slurm
PY = sys.executable
STEPS = 8



def test_plain_sbatch_job_checkpoints_and_requeues_itself_on_the_time_limit_signal(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}", "submit=false",
                        f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=100",
                        "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false", *HELD_REWARD],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "slurm_3n-tiny_llama"
    job = slurm_cluster.run("sbatch", "--parsable", str(run / "ray_job.sbatch")).strip().split(";")[0]
    out = run / "logs" / f"sbatch-{job}.out"
    # USR2: what #SBATCH --signal=USR2@N sends before the limit
    signal_in_held_step(slurm_cluster, job, run, out, ("USR2",), timeout=420)
    state = slurm_cluster.wait_job(job, timeout=600)
    text = out.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    k = HELD_STEP
    assert f"stopped at step {k}/{STEPS}" in text, text[-4000:]
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    assert steps_logged(run) == list(range(1, STEPS + 1))


def test_pipelined_grpo_job_preempted_mid_rollout_resumes_on_its_schedule(slurm_cluster, tmp_path):
    """grpo.pipeline.enabled: the preemption comes while a rollout generated ahead has its rewards
    held; the checkpoint keeps it, the requeued job takes it from there, and every step is
    generated with the weights the schedule names (step N from those after step N-2)."""
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}",
                        f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=100", "checkpointing.keep_top_k=null",
                        "grpo.pipeline.enabled=true", "+slurm.extra_sbatch.nodelist='node[1-3]'",
                        "logging.tensorboard=false", *HELD_REWARD],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    run = tmp_path / "slurm_3n-tiny_llama"
    log0 = run / "submitit" / job / f"{job}_0_log.out"
    ended = job_ended(slurm_cluster, job, log0)
    wait_until("a rollout's rewards to be held", (run / HELD).exists, ended, timeout=420)
    for sig in ("SIGTERM", "USR2"):
        slurm_cluster.run("scancel", job, "--signal", sig)
    wait_until("task 0 to take the signal", lambda: re.search(r"\] (SIGTERM|SIGUSR2|USR2): ", log0.read_text()),
               ended, timeout=420)
    release(run)
    state = slurm_cluster.wait_job(job, timeout=600)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    assert steps_logged(run) == list(range(1, STEPS + 1)), text[-3000:]
    k = int(re.search(rf"stopped at step (\d+)/{STEPS}", text).group(1))
    assert f"the rollouts of step(s) {k + 1} come from the checkpoint" in text, text[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipeline/generated_with"] for r in rows] == [max(0, s - 2) for s in range(1, STEPS + 1)]
