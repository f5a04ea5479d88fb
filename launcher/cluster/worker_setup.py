"""Ray's `worker_process_setup_hook` for every worker process of a run (installed by the driver).

- stdout/stderr go to RUN/logs/actors/<host>-pid<pid>.log: vLLM's and Megatron's chatter lands in
  files on the shared run directory (readable after the job, from any node) instead of scrolling
  over the driver's progress lines. Exceptions still reach the driver through ray.get.
- SIGTERM and SIGUSR2 are ignored: Slurm sends them to every process of the job (preemption, the
  time-limit warning) and an actor must live on until the driver has saved the checkpoint; the
  bootstrap then stops everything by PID. (Ray's daemons block them; the raylet starts workers
  with a fresh signal mask, so workers ignore them here. Ray's worker main loop installs its own
  SIGTERM handler - exit - right after this hook: we make that registration keep SIGTERM ignored.)
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from launcher import files, paths
from launcher.cluster import stop

ENV = "LAUNCHER_ACTOR_LOG_DIR"   # RUN/logs/actors (launcher.paths.ACTOR_LOGS), set by ray_node.connect


def setup() -> None:
    import ray._private.utils as ray_utils

    stop.ignore_job_signals()
    ray_utils.set_sigterm_handler = lambda handler: None  # Worker.main_loop calls it after this hook
    directory = os.environ.get(ENV)
    if not directory:
        return
    log = files.open_append(Path(paths.actor_log(directory, os.getpid(), socket.gethostname())), binary=True)  # the run directory's mode
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    log.close()
