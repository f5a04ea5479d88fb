"""A submitit job on the Slurm test cluster, preempted the way submitit's Job._interrupt() does it
(SIGTERM, then the USR2 it handles) in step HELD_STEP (tests/helpers/held_step.py): it must
checkpoint, requeue itself once, resume and finish with every step logged exactly once. Or not
preempted (`finished`): it completes at once, every step once, every checkpoint whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

from launcher.job import slurm_job
from tests.helpers.held_step import release, steps_logged, wait_held, wait_until


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


def finished(cluster, job: str, run: Path, steps: int, ranks: int = 2, timeout: float = 900) -> list[dict]:
    """Wait for `job` (run directory `run`, grpo.max_num_steps=`steps`, 8 prompts per step) to
    complete without a requeue, every step logged once; its checkpoints complete, each written by
    all `ranks` trainer ranks (a torch distributed checkpoint file per rank: on two nodes, both
    nodes wrote). Its metrics rows."""
    from launcher.driver.checkpoints import verify

    log0 = run / "submitit" / job / f"{job}_0_log.out"
    state = cluster.wait_job(job, timeout=timeout)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=0" in cluster.run("scontrol", "show", "job", job)
    assert steps_logged(run) == list(range(1, steps + 1)), text[-3000:]
    ckpts = sorted((run / "checkpoints").iterdir())
    assert ckpts and ckpts[-1].name == f"step_{steps}", ckpts
    for ckpt in ckpts:
        verify(ckpt)
        writers = {int(re.match(r"__(\d+)_", f.name).group(1)) for f in (ckpt / "trainer").glob("*.distcp")}
        assert writers == set(range(ranks)), (ckpt, writers)
    info = json.loads((run / "checkpoints" / f"step_{steps}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == steps * 8
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
