"""Start the job: one multi-node Slurm job through submitit, or in this process (executor=local).

The submitted callable is `JobTask(run_dir)`: every task of the job calls
launcher.cluster.bootstrap.run_task with the run directory, where the resolved config waits. It is a submitit Checkpointable, so a time
limit or preemption signal requeues the job and the restarted tasks resume from the run dir.
"""

from __future__ import annotations

from pathlib import Path

import submitit

from launcher import files, paths
from launcher import plan as plan_mod
from launcher.config.schema import Config
from launcher.job import sbatch
from launcher.job.slurm_job import submitit_folder


class JobTask(submitit.helpers.Checkpointable):
    """What every task of the Slurm job runs (picklable: it carries only the run directory)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> dict:
        from launcher.cluster.bootstrap import run_task

        return run_task(self.run_dir)

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """submitit calls this on task 0 when USR2 arrives (time limit or preemption): stop the
        driver at the end of its step (it saves a checkpoint), then requeue. The restarted job
        resumes from the latest checkpoint by itself (bootstrap.run_task)."""
        from launcher.cluster import stop

        stop.stop_and_wait(_budget_s(self.run_dir))
        return submitit.helpers.DelayedSubmission(JobTask(self.run_dir))


def _budget_s(run_dir: str) -> float:
    """Time to finish the step and save: the signal's lead on the kill, less a margin to requeue."""
    from launcher.config.compose import load_typed

    cfg = load_typed(Path(run_dir) / paths.CONFIG)
    return max(5.0, cfg.slurm.signal_delay_s - 15.0)


def submit_slurm(cfg: Config, plan: plan_mod.Plan, run_dir: Path) -> submitit.Job:
    spec = sbatch.job_spec(cfg, plan)
    executor = submitit.SlurmExecutor(folder=submitit_folder(run_dir), max_num_timeout=cfg.slurm.max_num_timeout,
                                      python=spec.python_q)
    executor.update_parameters(**sbatch.submitit_parameters(spec, run_dir))
    job = executor.submit(JobTask(str(run_dir)))
    files.seal(run_dir / "submitit", files.Policy.of(cfg))  # submitit's pickles and script: the run's modes
    return job


def run_local(cfg: Config, plan: plan_mod.Plan, run_dir: Path, attempt: int = 0) -> dict:
    """executor=local: this process is task 0 of a one-node job (Ray head + driver); `attempt`
    counts restarts after failures (retry.max_restarts). Ctrl-C stops after a checkpoint."""
    from launcher.cluster import bootstrap, stop
    from launcher.cluster.context import JobContext

    return bootstrap.run_head(JobContext.local(run_dir, attempt), cfg, plan, signals=stop.local_handlers())
