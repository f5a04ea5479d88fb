"""Whole local runs (`python -m launcher ...` on this machine), as the e2e tests start and read them.

- `launch(root, *overrides)`: a run to its end (its exit code asserted); `Background`: one in the
  background, its output collected line by line (to kill, signal or Ctrl-C it mid-run).
- `rows`, `deterministic`, `trainer_tensors`: what a run left, for comparing two runs bitwise.
- `SharedRun`: a finished run that many tests read (tests/e2e/conftest.py `shared_run`): built once
  per pytest session, never written to; a test that resumes or damages it works on `copy(dest)`,
  which can also be the run as it was after an earlier step (`until_step`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PY = sys.executable


def launch(root: Path, *overrides: str, rc: int = 0, timeout: float = 900,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m launcher run.root=ROOT OVERRIDES...` to its end; its exit code must be `rc`."""
    p = subprocess.run([PY, "-m", "launcher", f"run.root={root}", *overrides], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == rc, p.stdout[-4000:] + p.stderr[-4000:]
    return p


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without wall-clock values."""
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k != "train/train_seconds"}


def trainer_tensors(ckpt: Path) -> dict:
    """Every tensor of a trainer checkpoint (adapter + optimizer), read with torch DCP."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:  # never written next to the checkpoint (it may be a shared run's)
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(ckpt / "trainer"), str(out))
        state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_same_training(a: Path, b: Path, step: int) -> None:
    """Runs `a` and `b` logged the same rows (wall-clock values aside) and saved, at `step`, the
    same adapter and optimizer state, bitwise."""
    assert [deterministic(x) for x in rows(b)] == [deterministic(x) for x in rows(a)]
    ta, tb = (trainer_tensors(r / "checkpoints" / f"step_{step}") for r in (a, b))
    assert sorted(ta) == sorted(tb) and any(".adapter." in k for k in ta) and any("exp_avg" in k for k in ta)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]), k  # bitwise


class Background:
    """`python -m launcher ...` in the background (its own process group), its output collected line
    by line. `run_dir` is RUN when the run is named `name` (the default run name of tiny_llama)."""

    def __init__(self, root: Path, *overrides: str, name: str = "local-tiny_llama", env: dict | None = None):
        self.root = root
        self.run_dir = root / name
        self.proc = subprocess.Popen([PY, "-m", "launcher", f"run.root={root}", *overrides],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.out):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None, "".join(self.out[-30:] + self.err[-30:])
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n" + "".join(self.out[-30:]))

    def steps(self) -> list[int]:
        f = self.run_dir / "metrics.jsonl"
        return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []

    def wait_steps(self, n: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while len(self.steps()) < n:
            assert self.proc.poll() is None, "".join(self.out[-30:] + self.err[-30:])
            assert time.time() < deadline
            time.sleep(0.05)

    def ended(self) -> str | None:
        """None while the launcher runs, else its output's tail."""
        return None if self.proc.poll() is None else "".join(self.out[-30:] + self.err[-30:])

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def kill(self) -> None:
        """SIGKILL the launcher's whole process group (its Ray nodes' reapers live on: they clean up). A launcher
        that already ended is no error here: the caller's own assertion on it says what went wrong."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def job(self) -> str:
        return job_of(self.run_dir)


def job_of(run_dir: Path) -> str:
    """The job id of a local run's (first) Ray cluster, from its rendezvous RUN/ray/<job>.<attempt>/."""
    return next((run_dir / "ray").iterdir()).name.split(".")[0]


def left_in_tmp(job: str) -> list[str]:
    """What a local job's Ray nodes left in /tmp: their temp dirs /tmp/ray_<job>_<attempt>_<node>."""
    return sorted(str(p) for p in Path("/tmp").glob(f"ray_{job}_*"))


@dataclass
class SharedRun:
    """A finished run read by many tests; `launch`ed once per session by tests/e2e/conftest.py."""
    root: Path                                   # its run.root
    dir: Path                                    # RUN
    overrides: tuple[str, ...]
    stdout: str
    stderr: str
    temp_dir: Path                               # the TMPDIR it ran with (private: must stay empty)
    _fingerprint: dict = field(default_factory=dict, repr=False)

    def rows(self) -> list[dict]:
        return rows(self.dir)

    def checkpoint(self, step: int) -> Path:
        return self.dir / "checkpoints" / f"step_{step}"

    def copy(self, dest_root: Path, until_step: int | None = None) -> Path:
        """RUN copied to dest_root/<its name> (the Ray rendezvous of its job left out); with
        `until_step`, as the run directory was after that step: no later checkpoint, no later
        metrics row (a run that stopped there). Returns the copy's RUN."""
        dest = Path(dest_root) / self.dir.name
        later = (lambda _, names: [n for n in names if n == "ray" or (
            until_step is not None and re.fullmatch(r"step_(\d+)", n) and int(n[5:]) > until_step)])
        shutil.copytree(self.dir, dest, symlinks=True, ignore=later)
        if until_step is not None:
            kept = [r for r in rows(dest) if r["step"] <= until_step]
            (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        return dest

    def seal(self) -> None:
        """Remember every file's size and mtime, to tell at the end of the session that no test wrote
        into the shared run (`check_unchanged`)."""
        self._fingerprint = _fingerprint(self.dir)

    def check_unchanged(self) -> None:
        now = _fingerprint(self.dir)
        changed = sorted(set(now.items()) ^ set(self._fingerprint.items()))
        assert not changed, f"a test wrote into the shared run {self.dir} (use .copy()): {changed[:5]}"


def _fingerprint(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}
