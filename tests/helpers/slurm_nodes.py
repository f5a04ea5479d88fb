"""The local Slurm test cluster's nodes from a test's side: jobs of any node count (`slurm_shape`)
and a node's Ray daemon killed the way a lost node loses it (`kill_ray_daemon`).

Shapes are command-line overrides of the `slurm_4n` topology: half the nodes train (one trainer
rank each, TP 2), half generate (one vLLM engine each). The presets conf/topology/slurm_{2,3,4}n
stay the user-facing examples; larger shapes (8, 16 nodes: the join at scale) exist only for the
tests and benchmarks/launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

NS = "slt-"  # network namespace prefix of the test cluster's nodes (tests/slurm_cluster/common.sh)

PRESETS = Path(__file__).resolve().parents[2] / "conf" / "topology"


def slurm_shape(nodes: int) -> list[str]:
    """The launcher's topology overrides for an n-node job (n >= 2): the preset slurm_<n>n where one
    exists, else slurm_4n scaled; the run is named slurm_<n>n either way."""
    if (PRESETS / f"slurm_{nodes}n.yaml").is_file():
        return [f"topology=slurm_{nodes}n"]
    if nodes < 2 or nodes & (nodes - 1):
        raise ValueError(f"{nodes} nodes: a power of two (half train at TP 2, half generate; the default "
                         f"batch must divide over the data-parallel groups)")
    half = nodes // 2
    return ["topology=slurm_4n", f"topology.name=slurm_{nodes}n", f"topology.nodes={nodes}",
            f"topology.train.nodes={half}", f"topology.generation.nodes={half}", f"topology.generation.engines={half}"]


def kill_ray_daemon(node: str, job: str, daemon: str = "raylet", sig: int = signal.SIGKILL) -> int:
    """Send `sig` (SIGKILL: the node is lost) to the job's Ray `daemon` (raylet, gcs_server) on `node`
    (in its network namespace); its pid."""
    pids = subprocess.run(["ip", "netns", "pids", f"{NS}{node}"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if daemon in cmd.split("\0")[0] and f"ray_{job}_" in cmd:
            os.kill(int(pid), sig)
            return int(pid)
    raise AssertionError(f"no {daemon} of job {job} on {node}")


# Ray's own health-check defaults (ray_config_def.h: a check every 3 s, 10 s to answer, 5 failures) declare a
# raylet that answers nothing dead after about 5 x (10 + 3) = 65 s; the `ray` section's defaults after minutes
RAY_DEFAULT_DETECTION_S = 65


def starve_raylet(node: str, job: str, seconds: float) -> None:
    """The job's raylet on `node` gets no CPU at all for `seconds` (SIGSTOP, then SIGCONT): the worst a busy
    node does to it (a checkpoint save or a refit's packing on every core leaves it some)."""
    import time

    pid = kill_ray_daemon(node, job, sig=signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
