"""While the job runs: what the head and each worker check, how often, and the reports a node
writes when its Ray stops.

The cost per check does not grow with the node count (tests/unit/test_join_and_watch.py counts it):
- the head (HeadWatch, every CHECK_S): its own `ray start` (a waitpid), the stop request (one read
  of RUN/stop_requested), the nodes' reports (one listing of the rendezvous directory, which
  holds a few fixed files plus a report per failed node: it does not grow with the node count),
  and Ray's node list (one call to the GCS, asked from a thread of its own, NodeQuery: a dead
  GCS does not answer and the loop must not wait for it);
- each worker (WorkerWatch, every WORKER_TICK_S): `done` (one stat on the shared filesystem), its
  own `ray start` (a waitpid) and its daemons' logs (node-local /tmp), and only every
  HEAD_PROBE_S, at a random phase, whether the head's GCS port still answers: a thousand workers
  probing every second would be a thousand connections per second to the GCS.
No check lists the shared filesystem per node, and no node asks the GCS about every other node.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable

from launcher import files, paths
from launcher import plan as plan_mod
from launcher.cluster.context import ClusterError, JobContext, alive_resources, check_alive, check_reports
from launcher.cluster.ray_node import fatal_ray_error, port_open, tail
from launcher.cluster import stop

CHECK_S = 2.0        # the head's liveness checks (a lost node is named within about this, plus Ray's report)
WORKER_TICK_S = 1.0  # a worker's checks of `done` and its own Ray
HEAD_PROBE_S = 10.0  # a worker's probe of the head's GCS port
HEAD_GRACE_S = 20.0  # how long the head may not answer before a worker gives up on it


class NodeQuery:
    """Ray's list of alive nodes for the watch loop, asked in a daemon thread of its own: the main
    thread never blocks on the GCS. While an answer is pending (the GCS is slow, or gone with the
    head's Ray, which the loop sees from `ray start` ending) the loop goes on without one."""

    def __init__(self, query: Callable[[], set[str]] = alive_resources):
        self._query = query
        self._thread: threading.Thread | None = None
        self._answer: set[str] | None = None

    def latest(self) -> set[str] | None:
        """The answer of the last query, if it has come (and then ask again); None while pending."""
        if self._thread is not None and self._thread.is_alive():
            return None
        answer, self._answer = self._answer, None
        self._thread = threading.Thread(target=self._ask, name="ray-nodes", daemon=True)
        self._thread.start()
        return answer

    def _ask(self) -> None:
        try:
            self._answer = self._query()
        except Exception:  # noqa: BLE001 - disconnected meanwhile: no answer; the reports still count
            self._answer = None


class HeadWatch:
    """The head's checks while the driver runs; `tick(now)` as often as the loop likes (it acts
    every `period` s) raises ClusterError naming a lost node."""

    def __init__(self, ctx: JobContext, plan: plan_mod.Plan, ray_proc: subprocess.Popen | None = None,
                 query: Callable[[], set[str]] = alive_resources, period: float = CHECK_S):
        self.ctx, self.plan, self.ray_proc, self.period = ctx, plan, ray_proc, period
        self.nodes = NodeQuery(query)
        self.next_check = 0.0

    def tick(self, now: float) -> None:
        stop.poll_stop_request(self.ctx.run_dir)  # `python -m launcher.stop`: like a preemption, no requeue
        if now < self.next_check:
            return
        if self.ray_proc is not None and self.ray_proc.poll() is not None:  # the head's own Ray
            write_node_report(self.ctx, ray_stopped(self.ctx, self.ray_proc))
        check_reports(self.ctx, self.plan)
        alive = self.nodes.latest()  # never waits for the GCS (a dead head's does not answer)
        if alive is not None:
            check_alive(self.ctx, self.plan, alive)
        self.next_check = now + self.period


class WorkerWatch:
    """A joined worker's checks; `check(now)` every WORKER_TICK_S: None while all is well, "done"
    once the driver is done, "stopped" when this node's Ray stopped (`fatal`: a daemon's own error,
    if its log has one). Raises ClusterError when the head stopped answering for HEAD_GRACE_S."""

    def __init__(self, ctx: JobContext, head: dict, proc: subprocess.Popen, started: float,
                 probe: Callable[[str, int], bool] = port_open, rng: random.Random | None = None,
                 probe_s: float = HEAD_PROBE_S, grace_s: float = HEAD_GRACE_S, sleep=time.sleep):
        self.ctx, self.head, self.proc, self.started = ctx, head, proc, started
        self.done = ctx.rendezvous / paths.DONE
        self.probe, self.probe_s, self.grace_s, self.sleep = probe, probe_s, grace_s, sleep
        self.next_probe = started + (rng or random.Random()).uniform(0.0, probe_s)  # spread over the nodes
        self.fatal: str | None = None

    def check(self, now: float) -> str | None:
        if self.done.exists():
            return "done"
        if self.proc.poll() is not None:
            return "stopped"
        self.fatal = fatal_ray_error(self.ctx, since=self.started)  # node-local logs
        if self.fatal:
            return "stopped"
        if now >= self.next_probe:
            self.next_probe = now + self.probe_s
            if not self.probe(self.head["ip"], self.head["port"]) and not self._head_back():
                raise ClusterError(f"the Ray head {self.head['host']} stopped answering")
        return None

    def _head_back(self) -> bool:
        """True if the head answers again within grace_s (or the job finished meanwhile)."""
        t = time.time() + self.grace_s
        while time.time() < t:
            if self.done.exists() or self.probe(self.head["ip"], self.head["port"]):
                return True
            self.sleep(1.0)
        return False


# ------------------------------------------------------------------------------------ reports
def write_node_report(ctx: JobContext, reason: str) -> None:
    """RUN/ray/<job>.<attempt>/failed_node<i>.json: what check_reports (and failures.lost_node) name."""
    files.write_json(ctx.rendezvous / paths.NODE_REPORT.format(index=ctx.node_index),
                     {"node_index": ctx.node_index, "host": ctx.hostname, "reason": reason,
                      "log": str(ctx.log_path("ray"))})


def ray_exit(ctx: JobContext, proc: subprocess.Popen) -> str:
    return f"`ray start` exited with code {proc.returncode} ({tail(ctx.log_path('ray'))})"


def ray_stopped(ctx: JobContext, proc: subprocess.Popen, fatal: str | None = None) -> str:
    return f"this node's Ray stopped: {fatal or ray_exit(ctx, proc)}"
