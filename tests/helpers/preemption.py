"""A submitit job on the Slurm test cluster, preempted the way submitit's Job._interrupt() does it
(SIGTERM, then the USR2 it handles): it must checkpoint, requeue itself once, resume and finish
with every step logged exactly once."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path


def steps_logged(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.exists() else []


def preempt_and_finish(cluster, job: str, run: Path, steps: int, *, train_timeout: float,
                       finish_timeout: float) -> list[dict]:
    """Preempt `job` (run directory `run`, grpo.max_num_steps=`steps`, 8 prompts per step) once two
    steps are logged, wait for it to complete, assert the resume; its metrics rows."""
    log0 = run / "submitit" / job / f"{job}_0_log.out"
    deadline = time.time() + train_timeout
    while len(steps_logged(run)) < 2:  # let it train a little
        state = cluster.sacct_state(job)
        assert state in (None, "PENDING", "RUNNING"), (state, log0.read_text() if log0.exists() else "")
        assert time.time() < deadline, log0.read_text() if log0.exists() else "no log"
        time.sleep(1)
    cluster.run("scancel", job, "--signal", "SIGTERM")
    cluster.run("scancel", job, "--signal", "USR2")
    state = cluster.wait_job(job, timeout=finish_timeout)
    text = log0.read_text() + (run / "submitit" / job / f"{job}_0_log.err").read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job)
    # no step lost or repeated: every step logged exactly once, in order
    assert steps_logged(run) == list(range(1, steps + 1)), text[-3000:]
    m = re.search(rf"stopped at step (\d+)/{steps}", text)
    assert m, text[-3000:]
    k = int(m.group(1))
    assert 2 <= k < steps
    assert f"resuming from {run}/checkpoints/step_{k}" in text
    ckpts = sorted(c.name for c in (run / "checkpoints").iterdir())
    assert f"step_{k}" in ckpts and f"step_{steps}" in ckpts
    info = json.loads((run / "checkpoints" / f"step_{steps}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == steps * 8
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
