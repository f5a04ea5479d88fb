"""`slurm_cluster`: a real multi-node Slurm cluster on this machine, for the whole test session.

tests/slurm_cluster/up.sh starts it (node i = network namespace with its own address and
hostname, slurmctld + slurmdbd + MariaDB for accounting, 4 fake GPUs per node) and down.sh
removes it again, always. Needs root: without root, or when Slurm cannot be installed, the tests
are skipped, except under CI (CI=true), where that is a failure.

    pytestmark = pytest.mark.slurm

    def test_x(slurm_cluster, tmp_path):
        slurm_cluster.nodes                  # ["node1", ..., "node6"]
        slurm_cluster.addresses["node2"]     # "10.77.0.12"
        job_id = slurm_cluster.sbatch("#!/bin/bash\\nsrun hostname", cwd=tmp_path, args=["-N", "2"])
        slurm_cluster.wait_job(job_id)       # -> "COMPLETED" (the sacct state once the job ended)

submitit and the Slurm commands find the cluster through SLURM_CONF, set in os.environ for the
session. Use a fresh submitit folder per test (tmp_path): /tmp is shared by all nodes.
Knobs: SLURM_TEST_ROOT (/tmp/slurm-test), SLURM_TEST_NODES (16), SLURM_TEST_LOCK_WAIT_S (120).
16 nodes: room for the join at scale (test_launcher_on_slurm.py::test_a_many_node_job_..., 8 nodes,
16 with SLURM_TEST_JOIN_NODES=16); the reference topology (ultra_6n4g, test_ultra_placement.py)
needs 6, the other tests 3 at most (most pin node[1-3]); a test that needs more nodes than the
cluster has skips. An idle node costs one slurmd (~5 MB) and little bring-up time (4 nodes 2.8 s,
6 nodes 2.9 s on a quiet machine; 6, 8 and 16 nodes 15.5, 14.3 and 16.9 s under load average 22-32).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher.job.slurm_job import OVER

SCRIPTS = Path(__file__).resolve().parents[1] / "slurm_cluster"
# states after which this instance of a job is over (sacct); REQUEUED/PENDING/RUNNING are not among them
TERMINAL = OVER


@dataclass
class SlurmCluster:
    root: Path                       # everything of the cluster: etc/, log/, state/, ...
    conf: Path                       # slurm.conf (also in os.environ["SLURM_CONF"])
    nodes: list[str]                 # node names = their hostnames
    addresses: dict[str, str]        # node name -> its own IP address
    controller_addr: str             # slurmctld/slurmdbd, reachable from every node
    gpus_per_node: int
    cpus_per_node: int
    log_dir: Path = field(init=False)

    def __post_init__(self):
        self.log_dir = self.root / "log"

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        """Run a Slurm command (sinfo, squeue, scontrol ...) against this cluster; its stdout."""
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "SLURM_CONF": str(self.conf)})
        if check and p.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} -> rc={p.returncode}\n{p.stdout}{p.stderr}")
        return p.stdout

    def sbatch(self, script: str, cwd: Path, args: list[str] = ()) -> str:
        """Submit a batch script (text) from cwd; the job id."""
        path = Path(cwd) / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        return self.run("sbatch", "--parsable", f"--chdir={cwd}", *args, str(path)).strip().split(";")[0]

    def sacct_state(self, job_id: str) -> str | None:
        """The job's state in the accounting DB ("COMPLETED", "CANCELLED" ...), None if not there yet."""
        out = self.run("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State", check=False)
        lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]   # "CANCELLED by 0"
        return lines[-1] if lines else None

    def squeue_state(self, job_id: str) -> str | None:
        """The job's state while the controller lists it ("PENDING", "RUNNING" ...), else None."""
        out = self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).strip()
        return out.splitlines()[0] if out else None

    def wait_running(self, job_id: str, timeout: float = 60) -> None:
        """Wait until the job runs (squeue); an error if it ends or times out first."""
        end = time.monotonic() + timeout
        while self.squeue_state(job_id) != "RUNNING":
            if self.sacct_state(job_id) in TERMINAL:
                raise RuntimeError(f"job {job_id} ended before it was seen running: {self._describe(job_id)}")
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id} not running after {timeout}s: {self._describe(job_id)}")
            time.sleep(0.3)

    def wait_job(self, job_id: str, timeout: float = 120) -> str:
        """Wait until the accounting DB records the job as ended; its final state (e.g. "COMPLETED")."""
        end = time.monotonic() + timeout
        while (state := self.sacct_state(job_id)) not in TERMINAL:
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id} not ended after {timeout}s: {self._describe(job_id)}")
            time.sleep(0.3)
        return state

    def _describe(self, job_id: str) -> str:
        shown = self.run("scontrol", "show", "job", str(job_id), check=False)
        return (f"squeue={self.squeue_state(job_id)} sacct={self.sacct_state(job_id)}\n{shown}"
                f"{_log_tails(shown)}(logs: {self.log_dir})")


def _log_tails(scontrol_text: str, lines: int = 25) -> str:
    """The last lines of the job's StdOut/StdErr files named by `scontrol show job` (where a CI
    failure shows what the job was doing; the files are gone with the CI machine)."""
    out = ""
    for path in dict.fromkeys(re.findall(r"\bStd(?:Out|Err)=(\S+)", scontrol_text)):
        try:
            tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        out += f"--- last {len(tail)} lines of {path}\n" + "\n".join(x[:300] for x in tail) + "\n"
    return out


def _unavailable(reason: str):
    """Skip locally; under CI a cluster that cannot start is an error, not a reason to skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"Slurm test cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _script(name: str, env: dict, timeout: float) -> tuple[int, str]:
    # output to a file, not a pipe: a daemon that kept the pipe open would make us wait forever
    with tempfile.TemporaryFile("w+") as out:
        try:
            rc = subprocess.run(["bash", str(SCRIPTS / name)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        out.seek(0)
        return rc, out.read()


@pytest.fixture(scope="session")
def slurm_cluster():
    if sys.platform != "linux" or os.geteuid() != 0:
        _unavailable("needs root on Linux (network namespaces, daemons)")
    rc, out = _script("install_slurm.sh", dict(os.environ), timeout=480)
    if rc != 0:
        _unavailable(f"Slurm cannot be installed (install_slurm.sh rc={rc}):\n{out[-3000:]}")
    if subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True).returncode != 0:
        _unavailable("cannot create network/UTS namespaces here (unshare --net --uts failed)")

    root = Path(os.environ.get("SLURM_TEST_ROOT", "/tmp/slurm-test"))
    env = {**os.environ, "ROOT": str(root), "NNODES": os.environ.get("SLURM_TEST_NODES", "16"),
           "SLURM_TEST_LOCK_HELD": "1"}     # we hold the lock, the scripts must not wait for it
    # one cluster per machine: wait for another session's cluster to be released
    root.parent.mkdir(parents=True, exist_ok=True)
    lock = open(f"{root}.lock", "a+")
    end = time.monotonic() + float(os.environ.get("SLURM_TEST_LOCK_WAIT_S", "120"))
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > end:
                lock.seek(0)
                pytest.fail(f"{root}.lock is held by another session: {lock.read().strip()}", pytrace=False)
            time.sleep(1)
    lock.seek(0), lock.truncate()
    lock.write(f"pid {os.getpid()} ({' '.join(sys.argv[:3])}) since {time.ctime()}\n"), lock.flush()
    old_conf = os.environ.get("SLURM_CONF")
    try:
        t0 = time.monotonic()
        rc, out = _script("up.sh", env, timeout=180)
        if rc != 0:
            pytest.fail(f"up.sh failed (rc={rc}):\n{out[-5000:]}", pytrace=False)
        print(f"\n[slurm_cluster] up in {time.monotonic() - t0:.1f}s: {out.strip().splitlines()[-1]}")
        info = dict(ln.split("=", 1) for ln in (root / "cluster.env").read_text().splitlines() if "=" in ln)
        nodes = info["NODES"].split()
        cluster = SlurmCluster(root=root, conf=Path(info["SLURM_CONF"]), nodes=nodes,
                               addresses=dict(zip(nodes, info["NODE_ADDRS"].split())),
                               controller_addr=info["CONTROLLER_ADDR"],
                               gpus_per_node=int(info["GPUS_PER_NODE"]), cpus_per_node=int(info["CPUS_PER_NODE"]))
        os.environ["SLURM_CONF"] = str(cluster.conf)      # for submitit and any subprocess
        yield cluster
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        t0 = time.monotonic()
        rc, out = _script("down.sh", env, timeout=120)
        lock.seek(0), lock.truncate()
        lock.close()                                      # releases the lock
        if rc != 0:
            pytest.fail(f"down.sh failed (rc={rc}):\n{out[-3000:]}", pytrace=False)
        print(f"\n[slurm_cluster] down in {time.monotonic() - t0:.1f}s")
