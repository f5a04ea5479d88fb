"""A Ray node of a 3-node Slurm GRPO job dies (its raylet is killed): the run ends with a message
naming the node and what the driver was doing, within 60 s; with retry.max_restarts=1 the job
requeues itself, resumes from the latest checkpoint and finishes with all its steps (one job for
both); the head's Ray lost ends the job FAILED, naming the head."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.helpers.held_step import HELD_REWARD, release, steps_logged, wait_held, wait_until
from tests.helpers.preemption import job_ended
from tests.helpers.slurm_jobs import driver_out, submit, task_log
from tests.helpers.slurm_nodes import kill_ray_daemon as kill_raylet

pytestmark = pytest.mark.slurm
STEPS = 8
FAULT_JOB = ["topology=slurm_3n", f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=2",
             "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false", *HELD_REWARD]


def test_the_heads_ray_lost_fails_the_job_fast_naming_the_head(slurm_cluster, tmp_path):
    """node 0's GCS dies in step 3 (the whole cluster's state: nothing can go on, though the actors'
    direct calls may finish a step or two): node 0's main thread sees its own `ray start` end and
    names node 0; it never waits on the dead GCS (watch.NodeQuery); a trainer's collective
    failing with it says the same node (failures.lost_node)."""
    submitted = submit(tmp_path, *FAULT_JOB)
    job, run = submitted.id, submitted.run
    wait_held(run, job_ended(slurm_cluster, job, driver_out(run, job)), timeout=420)
    kill_raylet("node1", job, daemon="gcs_server")
    release(run)
    state = slurm_cluster.wait_job(job, timeout=60)
    text = task_log(run, job)
    assert state == "FAILED", text[-3000:]
    assert re.search(r"node 0 \(node1, [\w+]+\) left the Ray cluster( during \w+ at step \d+)?: this node's Ray "
                     r"stopped: `ray start` exited with code", text), text[-3000:]


def test_lost_node_ends_the_run_fast_with_its_name_then_the_restart_resumes_and_finishes(slurm_cluster, tmp_path):
    """node3 is lost while the driver thread is inside step 3 (held in its rewards): the main
    thread's node check ends the run within 60 s naming the node, and the abandoned driver thread,
    released only once node3's report is out, must not keep the task alive (its next Ray call once
    started a local Ray instance on node1 that kept the job RUNNING). With retry.max_restarts=1
    the job then requeues itself, resumes from the latest checkpoint and finishes every step once.
    (Without a restart a lost node's job ends FAILED: the head's test below, and the many-node
    test of test_launcher_on_slurm.py.)"""
    submitted = submit(tmp_path, *FAULT_JOB, "retry.max_restarts=1", "checkpointing.keep_top_k=null")
    job, run = submitted.id, submitted.run
    ended = job_ended(slurm_cluster, job, driver_out(run, job))
    wait_held(run, ended, timeout=420)
    kill_raylet("node3", job)  # in step 3 (held_step.HELD_STEP)
    wait_until("node3's bootstrap to report its Ray stopped", (run / "ray" / f"{job}.0" / "failed_node2.json").exists,
               lambda: None, timeout=30)
    time.sleep(3)  # > the main thread's 2 s node check: the run is ending while the driver thread waits
    release(run)
    # the bound: a lost node ends the run (here: its first attempt) within 60 s
    wait_until("the run to end and requeue", lambda: "requeueing job" in task_log(run, job), ended, timeout=60)
    state = slurm_cluster.wait_job(job, timeout=600)
    text = task_log(run, job)
    assert state == "COMPLETED", text[-4000:]
    # the main thread's check, while the driver thread waits in step 3 (not its vLLM engine's death)
    assert re.search(r"node 2 \(node3, generation\) left the Ray cluster during \w+ at step 3: this node's Ray "
                     r"stopped", text), text[-4000:]
    assert "Started a local Ray instance" not in text, text[-3000:]
    assert re.search(r"restart 1/1 \(retry.max_restarts\): requeueing job", text)
    assert re.search(rf"resuming from {run}/checkpoints/step_\d+", text)
    assert steps_logged(run) == list(range(1, STEPS + 1))
    assert json.loads((run / "checkpoints" / f"step_{STEPS}" / "training_info.json").read_text())["step"] == STEPS
    failures = [json.loads(x) for x in (run / "failures.jsonl").read_text().splitlines()]
    assert len(failures) == 1 and failures[0]["job"] == job
