"""The restart policy (`retry.max_restarts`), one place for both ways a run restarts after a failure:
a local run starts its job again in the same process (launcher.__main__), a Slurm job requeues
itself and its next attempt starts (launcher.cluster.bootstrap.run_task). Either way the failure
is recorded in RUN/failures.jsonl, counted per job over all its restarts, and the restart continues
from the newest complete checkpoint (else from the run's own `+resume`, else from the beginning).
docs/reliability.md lists what fails and what each restart costs."""

from __future__ import annotations

import time
from pathlib import Path

from launcher import files, paths, records
from launcher.config.schema import Config


def record_failure(run_dir: Path, job_id: str, error: BaseException) -> int:
    """Append the failure to RUN/failures.jsonl; how many failures this job (all its restarts) had."""
    path = run_dir / paths.FAILURES
    files.append_line(path, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job": str(job_id), "error": str(error)})
    return sum(1 for row in records.load_lines(path, records.FAILURE) if row["job"] == str(job_id))


def after_failure(cfg: Config, run_dir: Path, job_id: str, error: BaseException) -> int | None:
    """Record `error`; the number of the restart it allows (1..retry.max_restarts), or None: the run ends."""
    n = record_failure(run_dir, job_id, error)
    return n if n <= cfg.retry.max_restarts else None


def restart_line(cfg: Config, n: int) -> str:
    """'restart 1/2 (retry.max_restarts)': how each restart begins its line in the log."""
    return f"restart {n}/{cfg.retry.max_restarts} (retry.max_restarts)"


def latest_checkpoint(cfg: Config, run_dir: Path):
    """The newest complete checkpoint of the run (a driver.checkpoints.Checkpoint), or None."""
    from launcher.driver.checkpoints import CheckpointManager

    done = CheckpointManager(paths.checkpoint_dirs(cfg, run_dir), cfg.checkpointing).complete()
    return done[-1] if done else None


def resume_point(cfg: Config, ckpt) -> str | None:
    """What a restart resumes from, given the newest complete checkpoint (or None)."""
    return str(ckpt.path) if ckpt is not None else cfg.resume


def resume_after_requeue(cfg: Config, run_dir: Path) -> str | None:
    """What a restart resumes from: the newest complete checkpoint, else the run's own +resume."""
    return resume_point(cfg, latest_checkpoint(cfg, run_dir))
