"""`run.job=preflight` on the local multi-node Slurm cluster: a healthy cpu topology passes with a
table of every node and a measured gloo all-reduce; a node that cannot see the run directory (its
slurmd restarted in a private mount namespace with an empty tmpfs over the runs' root, so that
node really sees another filesystem there) is named and the job fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.slurm_jobs import submit, task_log

pytestmark = pytest.mark.slurm
NS = "slt-"  # network namespace prefix of the test cluster's nodes (tests/slurm_cluster/common.sh)
PIN = "+slurm.extra_sbatch.nodelist='node[1-3]'"


def launch(root: Path) -> tuple[str, Path]:
    job = submit(root, "topology=slurm_3n", "run.job=preflight", PIN)
    assert job.nodes == 3, job.stdout
    return job.id, job.run


def test_preflight_of_a_healthy_cpu_topology_passes(slurm_cluster, tmp_path):
    job, run = launch(tmp_path)
    state = slurm_cluster.wait_job(job, timeout=300)
    log = task_log(run, job)
    assert state == "COMPLETED", log
    report = json.loads((run / "preflight.json").read_text())
    assert report["problems"] == [], report["problems"]
    assert [n["host"] for n in report["nodes"]] == ["node1", "node2", "node3"]
    for n in report["nodes"]:
        assert n["gpus"] == 4 and n["planned"] == 4          # the fake GRES Slurm hands out
        assert (n["run_dir_read"], n["run_dir_write"], n["seen_by_node0"]) == ("ok", "ok", "ok")
        assert n["free_gib"] > 0
    assert len({n["packages_hash"] for n in report["nodes"]}) == 1
    nets = report["net"]
    assert sorted(nets) == ["node1", "node2", "node3"] and all(v["ok"] and v["backend"] == "gloo" for v in nets.values())
    assert nets["node1"]["busbw_gbs"] > 0
    table = (run / "preflight.txt").read_text()
    assert re.search(r"^2 +node3 +4/4 ", table, re.M), table
    assert "all-reduce: gloo, 16 MiB, 3/3 node(s)" in table and "0 problem(s)" in table
    assert table.strip() in log                                # printed in the driver's log too
    assert "preflight passed: 3 node(s) checked, 3 actors on their planned nodes" in log


def _slurmd_pid(pidfile: Path) -> int | None:
    """The pid in `pidfile` when it names a running slurmd, else None."""
    try:
        pid = int(pidfile.read_text().strip() or 0)
        return pid if pid and Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd" else None
    except (OSError, ValueError):
        return None


def _slurmd(cluster, node: str, mask: Path | None) -> None:
    """(Re)start `node`'s slurmd; with `mask`, in a private mount namespace with a tmpfs over it."""
    pidfile = cluster.root / "pids" / f"slurmd-{node}.pid"
    pid = _slurmd_pid(pidfile)
    if pid:
        os.kill(pid, 15)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.1)
    inner = f"hostname {node} && " + (f"mount -t tmpfs preflight-mask {mask} && " if mask else "") + \
        f"exec slurmd -N {node}"
    ns = ["unshare", "--uts"] + (["--mount", "--propagation", "slave"] if mask else [])
    subprocess.run(["nsenter", f"--net=/run/netns/{NS}{node}", *ns, "sh", "-c", inner], check=True, timeout=30,
                   env={**os.environ, "SLURM_CONF": str(cluster.conf)})
    end = time.monotonic() + 60
    # the daemon writes its pid file after the command that started it returns, and sinfo may still show
    # the old slurmd's state: wait for the new one's pid first
    while _slurmd_pid(pidfile) in (None, pid):
        assert time.monotonic() < end, f"{node}'s new slurmd wrote no pid file ({pidfile})"
        time.sleep(0.1)
    while node not in cluster.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).split():
        assert time.monotonic() < end, cluster.run("sinfo", "-N", check=False)
        time.sleep(0.3)


@pytest.fixture
def node2_without_runs(slurm_cluster, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    _slurmd(slurm_cluster, "node2", mask=root)
    # what node2 now sees at that path: an empty filesystem of its own
    out = subprocess.run(["nsenter", "-t", str(_slurmd_pid(slurm_cluster.root / "pids" / "slurmd-node2.pid")),
                          "-m", "stat", "-f", "-c", "%T", str(root)], capture_output=True, text=True)
    assert out.stdout.strip() == "tmpfs", out.stdout + out.stderr
    try:
        yield root
    finally:
        _slurmd(slurm_cluster, "node2", mask=None)


def test_preflight_names_the_node_that_cannot_see_the_run_directory(slurm_cluster, node2_without_runs):
    job, run = launch(node2_without_runs)
    state = slurm_cluster.wait_job(job, timeout=300)
    log = task_log(run, job)
    assert state == "FAILED", log
    report = json.loads((run / "preflight.json").read_text())
    assert any(p.startswith(f"node 1 (node2): cannot see the run directory {run}") for p in report["problems"]), \
        report["problems"]
    assert not any("node 0 (node1)" in p or "node 2 (node3)" in p for p in report["problems"]), report["problems"]
    node2 = next(n for n in report["nodes"] if n["host"] == "node2")
    assert node2["run_dir_read"].startswith("FileNotFoundError"), node2
    assert all(n["run_dir_read"] == "ok" for n in report["nodes"] if n["host"] != "node2")
    assert all(v["ok"] for v in report["net"].values()) and len(report["net"]) == 3  # the network is fine
    assert re.search(r"PROBLEM: node 1 \(node2\): cannot see the run directory", log), log
    assert "preflight found 1 problem(s) that would stop the run" in log
    assert not (run / "placement.json").exists()               # Ray never formed
