"""`python -m launcher.cluster.reaper PARENT_PID CMD...`: run CMD (`ray start --block ...`) so that no
process of its tree can outlive the job.

The reaper is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): processes that Ray daemonizes or
that lose their parent are re-parented to it instead of to init, so the reaper's descendants are
always the whole Ray tree of this node. It kills that tree (SIGKILL, by PID) when
- CMD exits (a half-dead Ray node is worse than none), or
- PARENT_PID, the bootstrap that started it, is gone (killed with SIGKILL, crashed): without the
  reaper, Ray's processes - in their own session - would keep running, holding ports and memory.
The bootstrap stops Ray normally by killing the reaper's tree itself (bootstrap.stop_process_tree).
The job's signals (SIGTERM, SIGUSR2) are blocked here and in CMD (see bootstrap._block_job_signals).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    """pid and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def kill_below(pid: int) -> None:
    for p in descendants(pid):
        if p != pid:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main(argv: list[str]) -> int:
    parent, cmd = int(argv[0]), argv[1:]
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
                time.sleep(0.05)
            return rc if rc is not None else 1
        _reap_zombies(me, child.pid)
        time.sleep(0.2)


def _reap_zombies(me: int, keep: int) -> None:
    """Re-parented daemons that exit become our zombies: reap them (not CMD: Popen reaps that)."""
    for p in descendants(me):
        if p in (me, keep):
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" and int(fields[1]) == me:
                os.waitpid(p, os.WNOHANG)
        except (OSError, ValueError, ChildProcessError):
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
