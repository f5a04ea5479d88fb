"""`python -m launcher.cluster.task_epilog RUN_DIR`: what a Slurm job leaves on a node, removed once
its task there has ended, however it ended.

The reaper (launcher.cluster.reaper) removes the node's Ray temp dir when the bootstrap stops Ray or
dies, but a step that Slurm cancels (`srun --kill-on-bad-exit` after another node's task failed,
`scancel`, the time limit) is SIGKILLed as a whole, reaper included: the temp dir (Ray's session,
sockets, spilled objects, the workers' TMPDIR with vLLM's files) stayed in /tmp of every node. So
the job's srun names RUN/task_epilog.sh as its `--task-epilog` (launcher.job.sbatch.task_epilog_script): slurmstepd runs
it on each node once the task there has ended, with the task's environment (SLURM_JOB_ID,
SLURM_NODEID, SLURM_RESTART_COUNT, the `slurm.setup` exports), also when the task was killed
(seen on Slurm 22.05 for a failed and a cancelled step). It kills what is left of the node's Ray
(processes of this user whose command line names its temp dir) and calls the reaper's clean_up:
the daemons' logs kept in RUN/logs/ray/<host>/, the temp dir removed. After a task that stopped its
Ray normally there is nothing left: it does nothing. Slurm kills an epilog that runs for more than
a few seconds; this one imports no torch, Ray or vLLM (about 0.2 s) and never fails the job.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

def context(run_dir: Path, env: dict):
    """The JobContext of the task that ended on this node (its paths: launcher.cluster.context)."""
    from launcher.cluster.context import JobContext

    node = int(env.get("SLURM_NODEID") or env.get("SLURM_PROCID") or 0)
    return JobContext(Path(run_dir), str(env["SLURM_JOB_ID"]), int(env.get("SLURM_RESTART_COUNT") or 0), node,
                      [socket.gethostname()] * (node + 1))


def kill_leftovers(temp_dir: Path) -> list[int]:
    """SIGKILL this user's processes whose command line names `temp_dir` (the node's Ray daemons and
    workers: every one is started with it); the pids killed."""
    import psutil

    mark, me, killed = str(temp_dir), os.getuid(), []
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if p.info["uids"] and p.info["uids"].real == me and p.pid != os.getpid() \
                    and any(mark in a for a in p.info["cmdline"] or ()):
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p)
        except (psutil.Error, OSError):
            continue
    psutil.wait_procs(killed, timeout=3)  # gone before their files are removed
    return [p.pid for p in killed]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or "SLURM_JOB_ID" not in os.environ:
        print("usage: python -m launcher.cluster.task_epilog RUN_DIR (run by Slurm as srun's --task-epilog)",
              file=sys.stderr)
        return 2
    try:
        from launcher.cluster.reaper import clean_up

        ctx = context(Path(argv[0]), dict(os.environ))
        if ctx.ray_temp_dir.exists():
            kill_leftovers(ctx.ray_temp_dir)
            clean_up(ctx.ray_temp_dir, ctx.ray_logs)
    except Exception as e:  # noqa: BLE001 - an epilog never changes how the job ended
        print(f"task_epilog: {type(e).__name__}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
