"""Every Ray worker process of a run writes its stdout/stderr to RUN/logs/actors/<host>-pid<pid>.log.

Installed as Ray's `worker_process_setup_hook` by the driver, so vLLM's and Megatron's chatter
lands in files on the shared run directory (readable after the job, from any node) instead of
scrolling over the driver's progress lines. Exceptions still reach the driver through ray.get.
"""

from __future__ import annotations

import os
import socket
import sys

ENV = "LAUNCHER_ACTOR_LOG_DIR"


def log_dir(run_dir) -> str:
    return os.path.join(str(run_dir), "logs", "actors")


def path_for(directory: str, pid: int, host: str | None = None) -> str:
    return os.path.join(directory, f"{host or socket.gethostname()}-pid{pid}.log")


def redirect() -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    fd = os.open(path_for(directory, os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
