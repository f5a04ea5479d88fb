"""What every part inside the job knows about where it runs: the job's identity, its nodes, its
run directory, and how it reports (`log`, ClusterError naming nodes and logs).

The liveness checks: `check_reports` (each node's bootstrap reports its own Ray stopping) and
`check_alive` (Ray's node list). The bootstrap's watch loop uses both (the list asked from a thread
of its own, watch.NodeQuery); the driver's failure messages the reports (failures.lost_node).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from launcher import logs, paths, records
from launcher import plan as plan_mod

_log = logs.get(__name__)


class ClusterError(RuntimeError):
    """The Ray cluster of the job could not be formed (names the nodes and the logs to read)."""


@dataclass
class JobContext:
    run_dir: Path
    job_id: str
    attempt: int             # Slurm restart count: a requeued job gets a fresh rendezvous
    node_index: int
    hostnames: list[str]
    progress: dict = field(default_factory=dict)   # the driver's {"step", "phase"}, for error messages
    startup: list = field(default_factory=list)    # (phase, time.time() at its end) before the driver

    @classmethod
    def from_slurm(cls, run_dir: Path) -> "JobContext":
        import submitit

        env = submitit.JobEnvironment()
        return cls(run_dir, str(env.job_id), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                   env.global_rank, list(env.hostnames))

    @classmethod
    def local(cls, run_dir: Path, attempt: int = 0) -> "JobContext":
        return cls(run_dir, f"local-{os.getpid()}", attempt, 0, [socket.gethostname()])

    @property
    def rendezvous(self) -> Path:
        return self.run_dir / paths.RENDEZVOUS / f"{self.job_id}.{self.attempt}"

    @property
    def hostname(self) -> str:
        return self.hostnames[self.node_index]

    def log_path(self, what: str) -> Path:
        return self.run_dir / paths.LOGS / f"{what}-{self.hostname}.log"

    @property
    def ray_temp_dir(self) -> Path:
        """Node-local and short (Ray's unix socket paths must stay under 108 characters); removed
        when this node's Ray stops (launcher.cluster.reaper.clean_up)."""
        return Path(f"/tmp/ray_{self.job_id}_{self.attempt}_{self.node_index}")

    @property
    def worker_tmp(self) -> Path:
        """TMPDIR of this node's Ray workers, inside ray_temp_dir: what they leave in "the temp dir"
        (vLLM's rendezvous file vllm_dist_* and IPC sockets, refit adapters) goes with it."""
        return self.ray_temp_dir / "tmp"

    @property
    def ray_logs(self) -> Path:
        """RUN/logs/ray/<host>/: where the Ray daemons' logs of this node's Ray sessions are kept."""
        return self.run_dir / paths.RAY_LOGS / self.hostname


def log(msg: str) -> None:
    """A line of the job's log: `[launcher HH:MM:SS] msg` on stdout (launcher.logs)."""
    _log.info(msg)


def doing(ctx: JobContext) -> str:
    p = ctx.progress  # a phase before the first step (start-up, resume) has no step yet
    if not p.get("phase"):
        return ""
    return f" during {p['phase']}" + (f" at step {p['step']}" if p.get("step") is not None else "")


def node_reports(ctx: JobContext, plan: plan_mod.Plan) -> list[dict]:
    """The nodes' reports (failed_node<i>.json, launcher.records.NODE_REPORT), each naming a
    planned node; one that does not is a ClusterError naming the file."""
    out = []
    for path in sorted(ctx.rendezvous.glob(paths.NODE_REPORTS)):
        try:
            r = records.load(path, records.NODE_REPORT)
            if r["node_index"] >= len(plan.nodes):
                raise records.RecordError(path, "node_index", f"must name one of the {len(plan.nodes)} planned "
                                                              f"nodes, got {r['node_index']}")
        except records.RecordError as e:
            raise ClusterError(f"a node report that is not one: {e}") from None
        out.append(r)
    return out


def check_reports(ctx: JobContext, plan: plan_mod.Plan) -> None:
    """Raise ClusterError for a node whose bootstrap reported its Ray gone (failed_node<i>.json)."""
    for r in node_reports(ctx, plan):
        node = plan.nodes[r["node_index"]]
        raise ClusterError(f"node {node.index} ({r['host']}, {'+'.join(node.roles)}) left the Ray cluster"
                           f"{doing(ctx)}: {r['reason']} (log: {r['log']})")


def check_alive(ctx: JobContext, plan: plan_mod.Plan, alive: set[str]) -> None:
    """Raise ClusterError for a planned node missing from `alive` (an alive_resources() answer)."""
    for node in plan.nodes:
        if plan_mod.node_resource(node.index) not in alive:
            raise ClusterError(f"node {node.index} ({ctx.hostnames[node.index]}, {'+'.join(node.roles)}) is no "
                               f"longer alive in the Ray cluster{doing(ctx)} (log: "
                               f"{ctx.run_dir / 'logs' / f'ray-{ctx.hostnames[node.index]}.log'})")


def alive_resources() -> set[str]:
    """The resource names of the nodes Ray lists alive (each node's `node_resource` among them)."""
    import ray

    return {key for n in ray.nodes() if n.get("Alive") for key in n.get("Resources", {})}
