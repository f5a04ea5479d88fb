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


def path_for(pid: int, host: str | None = None) -> str:
    return os.path.join(os.environ.get(ENV, "."), f"{host or socket.gethostname()}-pid{pid}.log")


def redirect() -> None:
    log_dir = os.environ.get(ENV)
    if not log_dir:
        return
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(path_for(os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
