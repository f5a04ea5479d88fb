"""GRPO as a 3-node Slurm job (2 training nodes at TP 2, 1 generation node), submitted with plain
sbatch, pipelined and multi-turn (the guess_number demo's episodes), preempted by the time limit's
signal while an episode of a rollout generated ahead waits in its environment: it checkpoints with
that rollout, requeues itself and finishes with no step lost or repeated, every step generated with
the weights the schedule names. One job for the four claims (plain sbatch's signal and requeue, the
pipelined checkpoint, its schedule across a requeue, episodes across a preemption): each Slurm job
costs a 3-node Ray start-up. The sync single-turn loop preempted under submitit:
tests/slurm/test_branch_resume_on_slurm.py; a pipelined single-turn run stopped with its rewards held
and resumed: tests/e2e/test_pipeline_local.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.held_reward import HELD
from tests.helpers.held_step import HELD_ENV, release, steps_logged, wait_until
from tests.helpers.preemption import job_ended

pytestmark = pytest.mark.slurm
PY = sys.executable
STEPS = 8



def test_pipelined_plain_sbatch_job_requeues_itself_on_the_time_limit_signal_and_resumes_on_its_schedule(
        slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}", "submit=false",
                        f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=100", "checkpointing.keep_top_k=null",
                        "grpo.pipeline.enabled=true", "+slurm.extra_sbatch.nodelist='node[1-3]'",
                        "logging.tensorboard=false", *HELD_ENV],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "slurm_3n-tiny_llama_chat"  # the demo's model (env=guess_number)
    job = slurm_cluster.run("sbatch", "--parsable", str(run / "ray_job.sbatch")).strip().split(";")[0]
    out = run / "logs" / f"sbatch-{job}.out"
    ended = job_ended(slurm_cluster, job, out)
    wait_until("an episode's answer to be held", (run / HELD).exists, ended, timeout=420)
    slurm_cluster.run("scancel", job, "--signal", "USR2")  # what #SBATCH --signal=USR2@N sends before the limit
    wait_until("task 0 to take the signal", lambda: re.search(r"\] (SIGUSR2|USR2): ", out.read_text()),
               ended, timeout=420)
    release(run)
    state = slurm_cluster.wait_job(job, timeout=600)
    text = out.read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    assert steps_logged(run) == list(range(1, STEPS + 1)), text[-3000:]
    k = int(re.search(rf"stopped at step (\d+)/{STEPS}", text).group(1))
    assert f"resuming from {run}/checkpoints/step_{k}" in text, text[-5000:]
    assert f"the rollouts of step(s) {k + 1} come from the checkpoint" in text, text[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["pipeline/generated_with"] for r in rows] == [max(0, s - 2) for s in range(1, STEPS + 1)]
    # every step trained on episodes, the held one's and those of the requeued job included
    assert all(r["env/turns"] >= 1.0 and r["env/episode_tokens"] > 0 and r["reward/errors"] == 0 for r in rows), rows
