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


def submitit_folder(run_dir: Path) -> Path:
    return run_dir / "submitit" / "%j"


def submit_slurm(cfg: Config, plan: topology.Plan, run_dir: Path) -> submitit.Job:
    spec = sbatch.job_spec(cfg, plan)
    executor = submitit.SlurmExecutor(folder=submitit_folder(run_dir), max_num_timeout=cfg.slurm.max_num_timeout,
                                      python=spec.python)
    executor.update_parameters(**sbatch.submitit_parameters(spec))
    return executor.submit(JobTask(str(run_dir)))


def run_local(cfg: Config, plan: topology.Plan, run_dir: Path) -> dict:
    """executor=local: this process is task 0 of a one-node job (Ray head + driver)."""
    from launcher import bootstrap

    ctx = bootstrap.JobContext.local(run_dir)
    return bootstrap.run_head(ctx, cfg, plan)
