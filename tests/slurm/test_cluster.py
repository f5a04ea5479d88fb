"""The local Slurm test cluster behaves like a real multi-node GPU cluster: nodes, GRES, srun,
submitit (results, cancellation through accounting), node-to-node networking."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import cloudpickle
import pytest
import submitit

# A backstop: every wait below has its own shorter limit. The first test also pays for the cluster's
# bring-up (seconds), for installing Slurm if needed (a minute) or for another session's cluster.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

# Jobs unpickle the functions below; this test module is not importable on the nodes (pytest puts
# tests/slurm on sys.path only in this process), so pickle them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _executor(folder, nodes, **kw):
    ex = submitit.AutoExecutor(folder=str(folder / "%j"), cluster="slurm")
    ex.update_parameters(nodes=nodes, tasks_per_node=1, cpus_per_task=2, gpus_per_node=4,
                         timeout_min=5, **kw)
    return ex


def test_nodes_idle_with_gpus(slurm_cluster):
    end = time.monotonic() + 30            # nodes of a job that just ended may still be "completing"
    while True:
        rows = [ln.split("|") for ln in slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N|%T|%G|%c").split()]
        if all(r[1] == "idle" for r in rows) or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert sorted(r[0] for r in rows) == sorted(slurm_cluster.nodes)
    assert len(slurm_cluster.nodes) >= 3
    assert {(r[1], r[2], r[3]) for r in rows} == {("idle", "gpu:4", "4")}, rows


def test_sbatch_srun_three_nodes(slurm_cluster, tmp_path):
    job_id = slurm_cluster.sbatch(
        "#!/bin/bash\n"
        "srun bash -c 'echo \"$(hostname) $SLURMD_NODENAME $(hostname -I) ${CUDA_VISIBLE_DEVICES:-unset}\"'\n",
        cwd=tmp_path, args=["-N", "3", "--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=4",
                            "-o", str(tmp_path / "out.txt")])
    assert slurm_cluster.wait_job(job_id, timeout=60) == "COMPLETED"
    rows = [ln.split() for ln in (tmp_path / "out.txt").read_text().splitlines()]
    assert len(rows) == 3, rows
    hostnames = {r[0] for r in rows}
    assert len(hostnames) == 3 and hostnames <= set(slurm_cluster.nodes), rows
    for hostname, nodename, addr, cuda in rows:
        assert nodename == hostname                       # each node has its own hostname ...
        assert addr == slurm_cluster.addresses[hostname]  # ... and its own address
        assert cuda == "0,1,2,3"                          # set by Slurm from the gpu GRES


def _where_am_i():
    env = submitit.JobEnvironment()
    return dict(rank=env.global_rank, num_nodes=env.num_nodes, hostnames=env.hostnames,
                hostname=socket.gethostname(), node=os.environ["SLURMD_NODENAME"],
                cuda=os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_submitit_three_nodes(slurm_cluster, tmp_path):
    job = _executor(tmp_path, nodes=3).submit(_where_am_i)
    assert slurm_cluster.wait_job(job.job_id, timeout=60) == "COMPLETED"
    results = sorted(job.results(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({r["hostname"] for r in results}) == 3
    for r in results:
        assert r["hostname"] == r["node"] and r["num_nodes"] == 3
        assert r["hostnames"] == results[0]["hostnames"] and r["hostname"] in r["hostnames"]
        assert r["cuda"] == "0,1,2,3"


def test_cancelled_submitit_job_raises(slurm_cluster, tmp_path):
    """Needs accounting: without sacct the job's state stays UNKNOWN and result() blocks forever."""
    job = _executor(tmp_path, nodes=1).submit(time.sleep, 600)
    slurm_cluster.wait_running(job.job_id)
    job.cancel(check=True)
    assert slurm_cluster.wait_job(job.job_id, timeout=60) == "CANCELLED"

    outcome = {}

    def get_result():
        try:
            outcome["result"] = job.result()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    t0 = time.monotonic()
    waiter = threading.Thread(target=get_result, daemon=True)  # daemon: a hang must not block exit
    waiter.start()
    waiter.join(90)    # submitit waits up to 15 s for a result file before it gives up
    assert not waiter.is_alive(), "job.result() still blocks 90 s after the job was cancelled"
    assert isinstance(outcome.get("error"), submitit.core.utils.UncompletedJobError), outcome
    print(f"cancelled job: UncompletedJobError after {time.monotonic() - t0:.1f}s")


def _tcp_ping(port):
    """Rank 1 serves on its node address; rank 0 connects from its own node, sends, reads the echo."""
    env = submitit.JobEnvironment()
    me = socket.gethostname()
    if env.global_rank == 1:
        with socket.create_server((socket.gethostbyname(me), port)) as srv:
            srv.settimeout(60)
            conn, (peer, _) = srv.accept()
            with conn:
                data = conn.recv(256)
                conn.sendall(b"pong: " + data)
        return dict(rank=1, host=me, peer=peer, got=data.decode())
    target = socket.gethostbyname(env.hostnames[1])
    end = time.time() + 60
    while True:                           # rank 1 may not be listening yet
        try:
            conn = socket.create_connection((target, port), timeout=5)
            break
        except OSError:
            if time.time() > end:
                raise
            time.sleep(0.2)
    with conn:
        local = conn.getsockname()[0]
        conn.sendall(f"ping from {me}".encode())
        reply = conn.recv(256).decode()
    return dict(rank=0, host=me, target=target, local=local, reply=reply)


def test_nodes_reach_each_other_over_tcp(slurm_cluster, tmp_path):
    job = _executor(tmp_path, nodes=2).submit(_tcp_ping, 29500)
    assert slurm_cluster.wait_job(job.job_id, timeout=90) == "COMPLETED"
    r0, r1 = sorted(job.results(), key=lambda r: r["rank"])
    addr = slurm_cluster.addresses
    assert r0["host"] != r1["host"]
    assert r0["target"] == addr[r1["host"]] and r0["local"] == addr[r0["host"]]
    assert r1["peer"] == addr[r0["host"]]            # the connection came from rank 0's node
    assert r0["reply"] == f"pong: ping from {r0['host']}"
