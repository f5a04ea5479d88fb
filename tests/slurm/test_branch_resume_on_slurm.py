"""Branch-safe resume on the local Slurm cluster (docs/security.md): +resume=step_2 on a run that
has step_4 starts a branch (step_4 and its metrics rows moved aside, never deleted); the branch's
job is preempted, requeues itself and resumes from the branch's own newest checkpoint, not from
the abandoned step_4; metrics.jsonl holds one history.

This is also the suite's preemption of a GRPO job submitted with submitit (3 nodes: 2 training
nodes at TP 2, 1 generation node; the plain-sbatch path: test_grpo_on_slurm.py): preempted as
submitit's Job._interrupt() does it, in step HELD_STEP, it checkpoints, requeues itself and
finishes with no step lost or repeated, exact refits on every step."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.held_step import HELD_REWARD, HELD_STEP, steps_logged
from tests.helpers.preemption import signal_in_held_step
from tests.helpers.slurm_jobs import driver_out, submit, task_log

pytestmark = pytest.mark.slurm
COMMON = ["topology=slurm_3n", "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false"]



def test_branch_resume_then_requeue_continues_the_branch(slurm_cluster, tmp_path):
    run = tmp_path / "slurm_3n-tiny_llama"
    first = submit(tmp_path, *COMMON, "grpo.max_num_steps=4", "checkpointing.save_period=2",
                   "checkpointing.keep_top_k=null").id
    assert slurm_cluster.wait_job(first, timeout=600) == "COMPLETED", task_log(run, first)[-4000:]
    assert steps_logged(run) == [1, 2, 3, 4]

    second = submit(tmp_path, *COMMON, "+resume=step_2", "grpo.max_num_steps=6", "checkpointing.save_period=1",
                    "checkpointing.keep_top_k=1", "optim.override_opt_param_scheduler=true", *HELD_REWARD)
    job = second.id
    assert "starts a new branch" in second.stderr and second.run == run
    (branch,) = (run / "checkpoints" / "abandoned").iterdir()
    assert [c.name for c in branch.iterdir()] == ["step_4"]
    # a preemption, as submitit's _interrupt sends it, in the branch's first step (3: its rewards are
    # held while two rows, the branch's base, are logged)
    assert HELD_STEP == 3
    signal_in_held_step(slurm_cluster, job, run, driver_out(run, job), ("SIGTERM", "USR2"),
                        timeout=420)
    state = slurm_cluster.wait_job(job, timeout=600)
    text = task_log(run, job)
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job)
    assert "stopped at step 3/6" in text and f"resuming from {run}/checkpoints/step_3" in text, text[-5000:]
    resumed = re.findall(r"resumed from (\S+)/step_(\d+) \(", text)   # the submission's, then the requeue's
    assert len(resumed) == 2 and resumed[0] == (f"{run}/checkpoints", "2"), text[-3000:]
    assert resumed[1] == (f"{run}/checkpoints", "3"), resumed  # the branch's step 3, not abandoned/step_4
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]                 # one history, the branch's: no step lost or repeated
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/gen_kl_error"] < 1e-5 for r in rows), rows  # exact refits, before and after the requeue
    info = json.loads((run / "checkpoints" / "step_6" / "training_info.json").read_text())
    assert info["consumed_prompts"] == 6 * 8
    moved = (run / "abandoned" / branch.name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in moved] == [3, 4]        # the old one, kept aside
    assert (branch / "step_4" / "manifest.json").is_file()        # never deleted
    assert "step_6" in [c.name for c in (run / "checkpoints").iterdir()]
