"""`python -m launcher.cluster.reaper PARENT_PID CMD...`: run CMD (`ray start --block ...`) so that no
process of its tree can outlive the job.

The reaper is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): processes that Ray daemonizes or
that lose their parent are re-parented to it instead of to init, so the reaper's descendants are
always the whole Ray tree of this node. It kills that tree (SIGKILL, by PID) when
- CMD exits (a half-dead Ray node is worse than none), or
- PARENT_PID, the bootstrap that started it, is gone (killed with SIGKILL, crashed): without the
  reaper, Ray's processes - in their own session - would keep running, holding ports and memory.
The bootstrap stops Ray normally by killing the reaper's tree itself (ray_node.stop_process_tree).
The job's signals (SIGTERM, SIGUSR2) are blocked here and in CMD (launcher.cluster.stop.block_job_signals).
The process tree is read with psutil (as the driver's start-up breakdown reads process start times).

Nor do its files: with `--temp-dir TEMP --keep-logs DEST`, once the tree is dead the node's Ray
temp dir TEMP (Ray's session: sockets, spilled objects, its daemons' logs; and the TMPDIR of every
Ray worker: vLLM's rendezvous file and IPC sockets, refit adapters) is removed, the daemons' logs
kept first under DEST in the run directory (`clean_up`; the bootstrap calls it itself when it stops
the tree, launcher.cluster.ray_node.stop_node).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    """pid and every process below it (none below a pid that is gone)."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    return [pid, *(p.pid for p in below)]


def kill_below(pid: int) -> None:
    for p in descendants(pid):
        if p != pid:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def clean_up(temp_dir: Path, keep_logs: Path | None) -> None:
    """Once the node's Ray is dead: its daemons' logs (every regular file of each Ray session's
    `logs/`) copied to `keep_logs/<session>/` with the run directory's modes (launcher.files), then
    `temp_dir` removed. A file that cannot be copied is skipped: the removal must happen anyway."""
    temp_dir = Path(temp_dir)
    if keep_logs is not None:
        from launcher import files

        for logs in sorted(temp_dir.glob("session_2*/logs")):
            for f in sorted(logs.iterdir()):
                try:
                    if f.is_file() and not f.is_symlink() and f.stat().st_size:
                        files.copy(f, Path(keep_logs) / logs.parent.name / f.name)
                except OSError:
                    pass
    shutil.rmtree(temp_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.cluster.reaper",
                                     description="Run CMD as a child subreaper; kill its whole tree when CMD or "
                                                 "PARENT_PID ends (started by launcher.cluster.ray_node.start_ray).")
    parser.add_argument("--temp-dir", type=Path, help="the node's Ray temp dir: removed once the tree is dead")
    parser.add_argument("--keep-logs", type=Path, help="where the Ray daemons' logs are kept before that")
    parser.add_argument("parent", type=int, metavar="PARENT_PID", help="the bootstrap that started this")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="`ray start --block ...`")
    args = parser.parse_args(argv)
    if not args.cmd:
        parser.error("CMD is missing")
    parent, cmd = args.parent, args.cmd
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = subprocess.Popen(cmd)
    me = os.getpid()
    while True:
        rc = child.poll()
        if rc is not None or not _alive(parent) or os.getppid() != parent:
            kill_below(me)
            deadline = time.time() + 10
            while time.time() < deadline and len(descendants(me)) > 1:
                _reap_zombies(me, child.pid)
                child.poll()  # CMD's zombie too
                time.sleep(0.05)
            orphaned = not _alive(parent) or os.getppid() != parent
            if orphaned and args.temp_dir is not None and len(descendants(me)) == 1:
                clean_up(args.temp_dir, args.keep_logs)  # else the bootstrap does, once it read the logs
            return rc if rc is not None else 1
        _reap_zombies(me, child.pid)
        time.sleep(0.2)


def _reap_zombies(me: int, keep: int) -> None:
    """Re-parented daemons that exit become our zombies: reap them (not CMD: Popen reaps that)."""
    try:
        children = psutil.Process(me).children()
    except psutil.NoSuchProcess:
        return
    for p in children:
        if p.pid == keep:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass


if __name__ == "__main__":
    sys.exit(main())
