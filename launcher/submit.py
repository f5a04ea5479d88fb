"""Start the job: one multi-node Slurm job through submitit, or in this process (executor=local).

The submitted callable is `JobTask(run_dir)`: every task of the job calls launcher.bootstrap with
the run directory, where the resolved config waits. It is a submitit Checkpointable, so a time
limit or preemption signal requeues the job and the restarted tasks resume from the run dir.
"""

from __future__ import annotations

from pathlib import Path

import submitit

from launcher import sbatch, topology
from launcher.schema import Config


class JobTask(submitit.helpers.Checkpointable):
    """What every task of the Slurm job runs (picklable: it carries only the run directory)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> dict:
        from launcher.bootstrap import run_task

        return run_task(self.run_dir)

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        """submitit calls this on task 0 when USR2 arrives (time limit or preemption): stop the
        driver at the end of its step (it saves a checkpoint), then requeue. The restarted job
        resumes from the latest checkpoint by itself (bootstrap.run_task)."""
        from launcher import bootstrap

        running = bootstrap.CURRENT
        if running is not None:
            bootstrap.log("USR2: checkpointing at the end of this step, then requeueing")
            running.stop.set()
            running.thread.join(timeout=_budget_s(self.run_dir))
        return submitit.helpers.DelayedSubmission(JobTask(self.run_dir))


def _budget_s(run_dir: str) -> float:
    """Time to finish the step and save: the signal's lead on the kill, less a margin to requeue."""
    from launcher import config as config_mod
    from launcher.schema import typed

    cfg = typed(config_mod.load(Path(run_dir) / "config.yaml"))
    return max(5.0, cfg.slurm.signal_delay_s - 15.0)


def submitit_folder(run_dir: Path) -> Path:
    return run_dir / "submitit" / "%j"


def submit_slurm(cfg: Config, plan: topology.Plan, run_dir: Path) -> submitit.Job:
    spec = sbatch.job_spec(cfg, plan)
    executor = submitit.SlurmExecutor(folder=submitit_folder(run_dir), max_num_timeout=cfg.slurm.max_num_timeout,
                                      python=spec.python)
    executor.update_parameters(**sbatch.submitit_parameters(spec))
    return executor.submit(JobTask(str(run_dir)))


def run_local(cfg: Config, plan: topology.Plan, run_dir: Path, attempt: int = 0) -> dict:
    """executor=local: this process is task 0 of a one-node job (Ray head + driver); `attempt`
    counts restarts after failures (retry.max_restarts)."""
    from launcher import bootstrap

    import signal

    ctx = bootstrap.JobContext.local(run_dir, attempt)

    def on_sigint(signum, frame):
        if bootstrap.CURRENT is None or bootstrap.CURRENT.stop.is_set():
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        print("\nCtrl-C: stopping after the current step and saving a checkpoint (Ctrl-C again to stop now)",
              flush=True)
        bootstrap.CURRENT.stop.set()

    return bootstrap.run_head(ctx, cfg, plan, signals={signal.SIGINT: on_sigint})
