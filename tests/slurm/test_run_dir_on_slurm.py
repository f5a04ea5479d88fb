"""One run directory, one job: a second launch with the same run.name while the first job is
queued is refused with one line naming the job and its Slurm state (launcher/job/run_dir.py)."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.slurm_jobs import launcher, submit

pytestmark = pytest.mark.slurm


def launch(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return launcher(tmp_path, "topology=slurm_3n", "run.name=shared", *overrides)


def test_second_launch_while_the_first_job_is_queued_is_refused(slurm_cluster, tmp_path):
    job = submit(tmp_path, "topology=slurm_3n", "run.name=shared", "run.job=placement_smoke",
                 "+slurm.extra_sbatch.begin=now+1hour").id  # stays PENDING
    run = tmp_path / "shared"
    try:
        config = (run / "config.yaml").read_bytes()
        for extra in ([], ["submit=false"], ["grpo.max_num_steps=3"]):
            second = launch(tmp_path, "run.job=placement_smoke", *extra)
            assert second.returncode == 2, second.stdout + second.stderr
            assert second.stderr == (f"error: run.name: {run} belongs to job {job} (PENDING), which reads its "
                                     f"config.yaml when it starts or requeues; wait for it, scancel {job}, or use "
                                     f"run.name=<new name>\n")
            assert (run / "config.yaml").read_bytes() == config
    finally:
        slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"
    third = launch(tmp_path, "run.job=placement_smoke", "submit=false")  # the job is gone: the dir is free
    assert third.returncode == 0, third.stderr
