"""What Slurm says about a submitted job, in one place: its state and restarts, its log files, and
what each state means for the run.

- `queued(job)`: squeue, while the controller lists the job: its state and why it waits;
- `state(job)`: that, with the restarts (`scontrol show job`), else sacct (one row per requeued
  instance: the last is the job's state, the others its restarts);
- `task_logs(run_dir, job)`: task 0's stdout and stderr, where submitit writes them
  (submitit's own JobPaths: its folder with the job id, the task's files in it).
submitit's `SlurmJob.state` asks sacct alone (every registered job's latest instance, cached for
minutes); the status view needs a waiting job's reason and a requeued job's count of instances,
so the three commands are made here, each once per look. The sets below say what a state means
to the run directory (`FINISHED`: another submission may use it), to the status view and the
waits (`OVER`), and to `python -m launcher.stop` (`ACTIVE`: a job that can still be asked to stop).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from launcher import logs

# the job never runs again (squeue still lists it for a while)
FINISHED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                      "REVOKED", "TIMEOUT"})
# this instance of the job has ended (after PREEMPTED a requeued instance may follow)
OVER = FINISHED | {"PREEMPTED"}
# running, or about to (it has taken or will take its step boundary): a stop request reaches it
ACTIVE = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED", "RESIZING", "STOPPED",
                    "SUBMITTED"})
# ended by a failure: its log's last `error:` line says why
FAILED = frozenset({"FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL"})
TIMEOUT_S = 20
_log = logs.get(__name__)


def _run(*cmd: str) -> str | None:
    """A Slurm command's stdout; None when it failed or there is no Slurm here."""
    _log.debug("$ " + shlex.join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def queued(job_id: str) -> tuple[str, str] | None:
    """(state, reason) while squeue lists the job (reason "" when there is none); else None."""
    out = _run("squeue", "-h", "-j", str(job_id), "-o", "%T|%r")
    if not out or not out.strip():
        return None
    state, _, reason = out.strip().splitlines()[0].partition("|")
    return state, "" if reason in ("None", "") else reason


def state(job_id: str) -> dict:
    """{"state", "reason", "restarts", "source"}: squeue while queued or running, else sacct."""
    listed = queued(job_id)
    if listed is not None:
        shown = _run("scontrol", "show", "job", "-o", str(job_id)) or ""
        m = re.search(r"\bRestarts=(\d+)", shown)
        return {"state": listed[0], "reason": listed[1], "restarts": int(m.group(1)) if m else 0, "source": "squeue"}
    out = _run("sacct", "-n", "-X", "-P", "-D", "-j", str(job_id), "-o", "State")
    rows = [ln.split()[0] for ln in (out or "").splitlines() if ln.strip()]
    if rows:  # -D: one row per requeued instance of the job
        return {"state": rows[-1], "reason": "", "restarts": len(rows) - 1, "source": "sacct"}
    return {"state": "UNKNOWN" if out is None else "SUBMITTED", "reason": "" if out is not None else
            "squeue/sacct unavailable here", "restarts": 0, "source": None}


def submitit_folder(run_dir: Path) -> Path:
    """Where submitit keeps a job's script, pickles and logs: RUN/submitit/<job id>/."""
    return Path(run_dir) / "submitit" / "%j"


def task_logs(run_dir: Path, job_id: str, task: int = 0) -> tuple[Path, Path]:
    """(stdout, stderr) of a task of a job submitted by the launcher (task 0: the driver's)."""
    from submitit.core.utils import JobPaths

    p = JobPaths(submitit_folder(run_dir), job_id=str(job_id), task_id=task)
    return p.stdout, p.stderr
