"""A submitit job on the Slurm test cluster, preempted the way submitit's Job._interrupt() does it
(SIGTERM, then the USR2 it handles) in step HELD_STEP (tests/helpers/held_step.py): it must
checkpoint, requeue itself once, resume and finish with every step logged exactly once."""

from __future__ import annotations

import json
import re
from pathlib import Path

from launcher.job import slurm_job
from tests.helpers.held_step import HELD_STEP, release, steps_logged, wait_held, wait_until


def job_ended(cluster, job: str, log: Path):
    """For held_step.wait_until: None while `job` is not over (launcher.job.slurm_job.OVER), else
    its state and log tail."""
    def ended() -> str | None:
        state = cluster.sacct_state(job)
        if state is None or state not in slurm_job.OVER:
            return None
        return f"job {job} is {state}: " + (log.read_text()[-3000:] if log.exists() else "no log")
    return ended


def signal_in_held_step(cluster, job: str, run: Path, log: Path, signals: tuple[str, ...],
                        timeout: float) -> None:
    """Once step HELD_STEP is held (a job run with HELD_REWARD), send `signals` to the job's tasks
    (scancel --signal), wait until task 0's log `log` says it took one (launcher.cluster.stop), then release it."""
    ended = job_ended(cluster, job, log)
    wait_held(run, ended, timeout)
    for sig in signals:
        cluster.run("scancel", job, "--signal", sig)
    wait_until("task 0 to take the signal", lambda: re.search(r"\] (SIGTERM|SIGUSR2|USR2): ", log.read_text()),
               ended, timeout)
    release(run)


def preempt_and_finish(cluster, job: str, run: Path, steps: int, *, train_timeout: float,
                       finish_timeout: float) -> list[dict]:
    """Preempt `job` (run directory `run`, grpo.max_num_steps=`steps`, 8 prompts per step, run with
    HELD_REWARD) in step HELD_STEP, wait for it to complete, assert the resume; its metrics rows."""
    log0 = run / "submitit" / job / f"{job}_0_log.out"
    signal_in_held_step(cluster, job, run, log0, ("SIGTERM", "USR2"), train_timeout)
    state = cluster.wait_job(job, timeout=finish_timeout)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job)
    # no step lost or repeated: every step logged exactly once, in order
    assert steps_logged(run) == list(range(1, steps + 1)), text[-3000:]
    m = re.search(rf"stopped at step (\d+)/{steps}", text)
    assert m and int(m.group(1)) == HELD_STEP, text[-5000:]
    k = HELD_STEP
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    ckpts = sorted(c.name for c in (run / "checkpoints").iterdir())
    assert f"step_{k}" in ckpts and f"step_{steps}" in ckpts
    info = json.loads((run / "checkpoints" / f"step_{steps}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == steps * 8
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
