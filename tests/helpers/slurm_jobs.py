"""A Slurm job as the Slurm tests submit and read it.

    job = submit(tmp_path, "topology=slurm_3n", "grpo.max_num_steps=4")   # asserts it was submitted
    job.id, job.run, job.nodes, job.stdout, job.stderr
    task_log(job.run, job.id)          # task 0's submitit log, stdout and stderr (what exists of them)
    driver_out(job.run, job.id)        # the path of task 0's stdout: what the driver prints
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable


@dataclass(frozen=True)
class Submitted:
    id: str
    run: Path
    nodes: int
    stdout: str
    stderr: str


def launcher(root: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m launcher run.root=ROOT OVERRIDES...`, its result as it came (a refusal is a result)."""
    return subprocess.run([PY, "-m", "launcher", f"run.root={root}", *overrides], capture_output=True, text=True,
                          timeout=timeout)


def submit(root: Path, *overrides: str, timeout: float = 120) -> Submitted:
    """A launcher run that submits a job: exit code 0, its 'submitted job N (K nodes)' and 'run directory:'
    lines read."""
    p = launcher(root, *overrides, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"submitted job (\d+) \((\d+) nodes\)", p.stdout)
    assert m, p.stdout
    run = Path(re.search(r"run directory: (\S+)", p.stdout).group(1))
    return Submitted(m.group(1), run, int(m.group(2)), p.stdout, p.stderr)


def driver_out(run: Path, job: str) -> Path:
    return run / "submitit" / job / f"{job}_0_log.out"


def task_log(run: Path, job: str, task: int = 0) -> str:
    d = run / "submitit" / job
    return "".join((d / f"{job}_{task}_log.{ext}").read_text() for ext in ("out", "err")
                   if (d / f"{job}_{task}_log.{ext}").exists())
