"""One run directory, one job: a second launch with the same run.name while the first job is
queued is refused with one line naming the job and its Slurm state (launcher/job/run_dir.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm
PY = sys.executable


def launcher(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", f"run.root={tmp_path}", "run.name=shared",
                           *overrides], capture_output=True, text=True, timeout=120)


def test_second_launch_while_the_first_job_is_queued_is_refused(slurm_cluster, tmp_path):
    first = launcher(tmp_path, "run.job=placement_smoke", "+slurm.extra_sbatch.begin=now+1hour")  # stays PENDING
    assert first.returncode == 0, first.stdout + first.stderr
    job = re.search(r"submitted job (\d+)", first.stdout).group(1)
    run = tmp_path / "shared"
    try:
        config = (run / "config.yaml").read_bytes()
        for extra in ([], ["submit=false"], ["grpo.max_num_steps=3"]):
            second = launcher(tmp_path, "run.job=placement_smoke", *extra)
            assert second.returncode == 2, second.stdout + second.stderr
            assert second.stderr == (f"error: run.name: {run} belongs to job {job} (PENDING), which reads its "
                                     f"config.yaml when it starts or requeues; wait for it, scancel {job}, or use "
                                     f"run.name=<new name>\n")
            assert (run / "config.yaml").read_bytes() == config
    finally:
        slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"
    third = launcher(tmp_path, "run.job=placement_smoke", "submit=false")  # the job is gone: the dir is free
    assert third.returncode == 0, third.stderr
