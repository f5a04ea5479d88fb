"""A run directory held as a local run's process holds it while it lives: an exclusive flock on
RUN/.in_use (launcher.job.run_dir.hold). `launcher.status` and `launcher.stop` call a local run
RUNNING only while that lock is held, never on a pid alone."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from launcher import paths


@contextmanager
def held(run_dir: Path):
    """RUN/.in_use locked by this process for the block (made 0600 if it is not there yet)."""
    fd = os.open(run_dir / paths.IN_USE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
