"""The reward workers: `n` child processes of the driver, each with a pipe of its own, that call
the user's reward function with a per-call timeout. A worker runs `MODULE.init_worker(*init_args)`
once, then `MODULE.call(*args)` per call (MODULE: launcher.driver.rewards, named by the caller).

Why not multiprocessing.Pool: its workers share one queue lock, held by whichever idle worker
waits for the next task; a worker killed while waiting (SIGKILL, or Ctrl-C's SIGINT that the
terminal sends the whole process group) takes the lock with it, and Pool.terminate() then blocks
forever. Here nothing is shared: a worker is ended by a message or SIGKILL, and a worker past its
call's timeout is killed and replaced without touching the others.

Signals: Slurm signals every process of the job (preemption SIGTERM, the time-limit USR2) and
Ctrl-C reaches the foreground process group; a worker must not die mid-call while the driver
finishes its step, so it ignores them (blocked from its start: the mask survives fork and exec),
and it exits when the driver's process is gone (its parent changed) or its pipe closes.

A worker runs at Ray's workers' niceness (NICENESS), below the Ray daemons of its node.

Messages are pickled over the worker's own socketpair: only between the driver and the processes
it started, never read from a file.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
# as Ray runs its workers (ray_config_def.h worker_niceness: 15): the node's Ray daemons, at the niceness
# the job started with, get the CPU first, so busy reward workers never starve the raylet's health checks
NICENESS = 15


class Worker:
    def __init__(self, init_args: tuple):
        parent, child = socket.socketpair()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)  # inherited by the child until it ignores them
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.driver.reward_pool", str(child.fileno())],
                                         pass_fds=(child.fileno(),), start_new_session=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            child.close()
        self.conn = Connection(parent.detach())
        self.conn.send(init_args)
        self.deadline: float | None = None  # of the call it runs
        self.index: int | None = None       # which item that call scores

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def end(self, timeout_s: float) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class WorkerPool:
    """`call_all(args_list, timeout_s)` -> [result or TIMED_OUT] in order; `close()`."""

    TIMED_OUT = ("timed out",)

    def __init__(self, n: int, module: str, init_args: tuple):
        self.init_args = (module, init_args)
        self.workers = [Worker(self.init_args) for _ in range(n)]
        for w in self.workers:  # the user's module may import a lot: outside any call's timeout
            self._wait_ready(w)

    def _wait_ready(self, w: Worker) -> None:
        try:
            w.conn.recv()  # "ready" after the worker's imports
        except EOFError:
            raise RuntimeError(f"a reward worker exited while starting (exit code {w.proc.wait()})") from None

    def call_all(self, args_list: list[tuple], timeout_s: float, route: list[int] | None = None) -> list:
        """`route[i]`: the worker (its position) that must make call i, for state a worker keeps
        between calls (an environment's episode); None: any free worker."""
        results: list = [None] * len(args_list)
        if route is None:
            shared = list(range(len(args_list)))[::-1]
            todo = [shared] * len(self.workers)
        else:
            todo = [[i for i in range(len(args_list)) if route[i] == k][::-1] for k in range(len(self.workers))]
        busy: dict[Connection, Worker] = {}
        while any(todo) or busy:
            for k, w in enumerate(self.workers):
                if todo[k] and w.deadline is None:
                    w.index = todo[k].pop()
                    w.deadline = time.monotonic() + timeout_s
                    w.conn.send(args_list[w.index])
                    busy[w.conn] = w
            if not busy:
                continue
            next_deadline = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                w = busy.pop(conn)
                try:
                    results[w.index] = conn.recv()
                except EOFError:  # the worker died in the call (killed, or the function ended its process)
                    results[w.index] = ("error", f"the reward worker died (exit code {w.proc.wait()})", "")
                    self._replace(w)
                    continue
                w.deadline = None
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if w.deadline is not None and w.deadline <= now:  # stuck in the call: a fresh worker takes over
                    busy.pop(conn)
                    results[w.index] = self.TIMED_OUT
                    self._replace(w)
        return results

    def _replace(self, w: Worker) -> None:
        w.kill()
        fresh = Worker(self.init_args)
        self._wait_ready(fresh)
        self.workers[self.workers.index(w)] = fresh

    def close(self, timeout_s: float = 5.0) -> None:
        for w in self.workers:
            w.end(timeout_s)
        self.workers = []


# ------------------------------------------------------------------------------------ the worker
def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _serve(fd: int) -> None:
    os.nice(max(0, NICENESS - os.nice(0)))  # never back up: an unprivileged process cannot
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    module, init_args = conn.recv()
    target = importlib.import_module(module)
    target.init_worker(*init_args)
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        conn.send(target.call(*msg))


def main(argv: list[str] | None = None) -> None:
    """`python -m launcher.driver.reward_pool FD`: one reward worker, started by the pool."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m launcher.driver.reward_pool",
                                     description="A reward worker process (started by RewardPool, not by hand).")
    parser.add_argument("fd", type=int, metavar="FD", help="the pool's end of the pipe, inherited")
    _serve(parser.parse_args(argv).fd)


if __name__ == "__main__":
    main()
