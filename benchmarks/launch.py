"""Launch benchmark: seconds from submission until every node of the job is registered in Ray.

On the local multi-node Slurm test cluster (tests/slurm_cluster), for each node count it submits,
side by side and alternating which goes first:

- launcher: `python -m launcher <n-node shape> run.job=placement_smoke` (the product path:
  Hydra compose + validate + run dir, submitit's sbatch, then in the job submitit's task runner,
  launcher.cluster.bootstrap: head under launcher.cluster.reaper with token auth, head.json rendezvous, workers
  join, the driver connects and polls until all nodes are registered);
- bare: an sbatch script written here that srun's plain `ray start --head --block` on the first
  node and `ray start --address=HEAD --block` on the others (workers poll the head's port every
  0.1 s), while a small Python waiter on the head connects (`ray.init`) and polls `ray.nodes()`
  every 0.1 s until all nodes are alive. The `ray start` flags are the launcher's own (pinned
  ports, object store size, no dashboard, a node-local temp dir), minus the role resources, so
  the difference is orchestration, not Ray configuration. A worker whose `ray start` fails retries
  as the launcher's do (after a random delay below --join-jitter, up to --join-retries attempts),
  so both paths survive Ray refusing a herd of nodes the same way. Token auth: `--bare-auth` (set
  explicitly: with RAY_AUTH_MODE unset, `ray start` uses token auth whenever ~/.ray/auth_token
  exists, which Ray 2.60 writes on a local `ray.init()`).

Both are timed the same way: from just before the submitting command starts to the moment this
script sees the line "all N node(s) registered" in the job's task-0 log (polled every 50 ms).
The phases come from the same polling: the submitting command returns ("submit"), the job's
task-0 log appears = the batch script started ("queue"), the "Ray head up" line ("head"), the
registered line ("join"); and from the head's own Ray log, how long its `ray start` took (first
line to "Ray runtime started"). Each job runs to its end (and the nodes are idle again) before the next
one is submitted. Nothing is added to the product: the launcher's log lines are the markers.

The shapes: `topology=slurm_<n>n` where a preset exists (2, 3, 4), else slurm_4n scaled to n nodes
(tests/helpers/slurm_nodes.slurm_shape: a power of two, half train, half generate).

Per-node costs, for the model of a bigger join (docs/benchmarks.md): each node's own `ray start`
(its log: first line to "Ray runtime started"), the failed `ray start` attempts (Ray refused the
node; it retried), the head's GCS CPU seconds when all nodes are registered (/proc of gcs_server),
and, on the bare path, how long one `ray.nodes()` takes with all n nodes (the driver's per-check
call) and the size of its answer.

The cluster: if one is up (tests/slurm_cluster/up.sh, `$SLURM_TEST_ROOT/cluster.env`) it is
used and left up; otherwise this script starts it and takes it down at the end. Either way it
holds the cluster's lock (`$SLURM_TEST_ROOT.lock`, as the pytest fixture does) while it runs, so
no test session tears the cluster down under it; it waits for the lock when another session has it.
Needs root (network namespaces).

    python benchmarks/launch.py [--nodes 2 4 8 16] [--repeats 2] [--bare-auth disabled|token|both]
                                [--join-jitter 10] [--join-retries 3]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from launcher.job.slurm_job import OVER as TERMINAL  # noqa: E402
from tests.helpers.slurm_nodes import slurm_shape  # noqa: E402  (after REPO is on the path)

PY = sys.executable
CLUSTER_SCRIPTS = REPO / "tests" / "slurm_cluster"
POLL_S = 0.05


# ------------------------------------------------------------------------------------ cluster
class Cluster:
    """The local Slurm test cluster, held under its lock for the whole benchmark."""

    def __init__(self, root: Path, nodes_needed: int, lock_wait_s: float):
        self.root = root
        self.nodes_needed = nodes_needed
        self.lock_wait_s = lock_wait_s
        self.started = False
        self.lock = None
        self.conf = root / "etc" / "slurm.conf"

    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> rc={p.returncode}\n{p.stdout}{p.stderr}")
        return p.stdout

    def __enter__(self) -> "Cluster":
        if os.geteuid() != 0:
            sys.exit("benchmarks/launch.py needs root (the Slurm test cluster uses network namespaces)")
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self.lock = open(f"{self.root}.lock", "a+")
        end = time.monotonic() + self.lock_wait_s
        said = False
        while True:
            try:
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    self.lock.seek(0)
                    print(f"waiting for {self.root}.lock (held by: {self.lock.read().strip() or '?'})", flush=True)
                    said = True
                if time.monotonic() > end:
                    sys.exit(f"{self.root}.lock still held after {self.lock_wait_s:.0f}s; try again later")
                time.sleep(2)
        self.lock.seek(0), self.lock.truncate()
        self.lock.write(f"pid {os.getpid()} (benchmarks/launch.py) since {time.ctime()}\n"), self.lock.flush()
        if self.is_up():
            print(f"using the Slurm test cluster that is already up ({self.root}); leaving it up", flush=True)
        else:
            env = {**os.environ, "ROOT": str(self.root), "NNODES": str(max(16, self.nodes_needed)),
                   "SLURM_TEST_LOCK_HELD": "1"}
            t = time.monotonic()
            p = subprocess.run(["bash", str(CLUSTER_SCRIPTS / "up.sh")], env=env, capture_output=True, text=True,
                               timeout=300)
            if p.returncode != 0:
                self._release()
                sys.exit(f"tests/slurm_cluster/up.sh failed (rc={p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
            self.started = True
            print(f"started the Slurm test cluster in {time.monotonic() - t:.0f}s (taken down at the end)", flush=True)
        idle = self.idle_nodes()
        if len(idle) < self.nodes_needed:
            self.__exit__(None, None, None)
            sys.exit(f"the cluster has {len(idle)} idle node(s) ({' '.join(idle)}), {self.nodes_needed} needed")
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.started:
                env = {**os.environ, "ROOT": str(self.root), "SLURM_TEST_LOCK_HELD": "1", "QUIET": "1"}
                p = subprocess.run(["bash", str(CLUSTER_SCRIPTS / "down.sh")], env=env, capture_output=True,
                                   text=True, timeout=300)
                print("took the Slurm test cluster down" if p.returncode == 0 else
                      f"down.sh rc={p.returncode}: {(p.stdout + p.stderr)[-2000:]}", flush=True)
                self.started = False
        finally:
            self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.seek(0), self.lock.truncate(), self.lock.flush()
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()
            self.lock = None

    def is_up(self) -> bool:
        if not (self.root / "cluster.env").is_file() or not self.conf.is_file():
            return False
        try:
            return bool(self.run("sinfo", "-h", "-N", "-o", "%N", timeout=10).strip())
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def idle_nodes(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False)
        return sorted(set(out.split()), key=lambda n: int(re.sub(r"\D", "", n) or 0))

    def sacct_state(self, job: str) -> str | None:
        out = self.run("sacct", "-n", "-X", "-P", "-j", job, "-o", "State", check=False)
        lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
        return lines[-1] if lines else None

    def wait_ended(self, job: str, nodes: list[str], timeout: float = 300) -> str:
        """Wait until the job has ended and its nodes are idle again (so the next job starts at once)."""
        end = time.monotonic() + timeout
        while (state := self.sacct_state(job)) not in TERMINAL:
            if time.monotonic() > end:
                self.run("scancel", job, check=False)
                raise TimeoutError(f"job {job} still {state} after {timeout:.0f}s (cancelled)")
            time.sleep(0.3)
        while not set(nodes) <= set(self.idle_nodes()):
            if time.monotonic() > end:
                raise TimeoutError(f"nodes {nodes} not idle {timeout:.0f}s after job {job}")
            time.sleep(0.2)
        return state


# ------------------------------------------------------------------------------ measurement
@dataclass
class Launch:
    kind: str
    nodes: int
    rep: int
    job: str = ""
    state: str = ""
    marks: dict = field(default_factory=dict)   # phase -> seconds since submission started
    driver_wait_s: float | None = None          # the launcher's own "registered in Xs" (after connect)
    error: str = ""
    load: float = 0.0                           # 1-minute load average when it was submitted
    ray_start: dict = field(default_factory=dict)  # node index -> seconds of its `ray start` (Ray's own log)
    failed_attempts: int = 0                    # `ray start` attempts that failed (Ray refused the node), all nodes
    gcs_cpu_s: float | None = None              # the head's gcs_server CPU seconds when all nodes were registered
    nodes_ms: float | None = None               # bare: one ray.nodes() with all n nodes (median of 5), ms
    nodes_bytes: int | None = None              # bare: the size of its answer (JSON), bytes

    @property
    def total(self) -> float | None:
        return self.marks.get("registered")


def gcs_cpu_seconds(marker: str) -> float | None:
    """CPU seconds (user + system) of the gcs_server whose command line names `marker` (the job's
    Ray temp dir on the head), or None if there is none."""
    hz = os.sysconf("SC_CLK_TCK")
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if (p / "comm").read_text().strip() != "gcs_server" or marker.encode() not in (p / "cmdline").read_bytes():
                continue
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / hz
        except OSError:
            continue
    return None


def watch(cluster: Cluster, t0: float, proc: subprocess.Popen, job_of, log_glob, n: int, timeout: float,
          r: Launch, gcs_marker=None) -> str:
    """Poll until the task-0 log shows all n nodes registered (or the job ended, or timeout); fill
    r.marks and r.job. Returns the task-0 log text."""
    registered, head = f"all {n} node(s) registered", "Ray head up at"
    text, out, next_check = "", None, 0.0
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = time.time()
        if out is None and proc.poll() is not None:
            r.marks["submitted"] = now - t0
            out = proc.stdout.read()
            r.job = job_of(out) or ""
            if not r.job:
                r.error = f"not submitted: {out.strip()[-800:]}"
                return text
        logs = log_glob()
        if logs:
            r.marks.setdefault("started", now - t0)
            try:
                text = logs[0].read_text(errors="replace")
            except OSError:
                text = ""
            if head in text:
                r.marks.setdefault("head", now - t0)
            if registered in text:
                r.marks["registered"] = now - t0
                if gcs_marker is not None:
                    r.gcs_cpu_s = gcs_cpu_seconds(gcs_marker(r.job))
                return text
        if r.job and now > next_check:  # a job that ended without registering all nodes
            next_check = now + 2.0
            if cluster.sacct_state(r.job) in TERMINAL:
                time.sleep(0.5)
                return logs[0].read_text(errors="replace") if logs else text
        time.sleep(POLL_S)
    return text


def submit_and_time(cluster: Cluster, r: Launch, cmd: list, cwd: Path, job_of, logs, n: int, timeout: float,
                    gcs_marker) -> str:
    """Submit `cmd`, time it to "all nodes registered" (watch), wait for the job to end; the task-0 log."""
    r.load = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    text = watch(cluster, t0, proc, job_of, logs, n, timeout, r, gcs_marker)
    if not r.job:
        return text
    m = re.search(r"registered in ([\d.]+)s", text)
    r.driver_wait_s = float(m.group(1)) if m else None
    if r.total is None:
        cluster.run("scancel", r.job, check=False)
    r.state = cluster.wait_ended(r.job, [f"node{i}" for i in range(1, n + 1)])
    return text


FAILED_ATTEMPT = re.compile(r"attempt \d+/\d+ to join failed")


def launcher_once(cluster: Cluster, n: int, rep: int, work: Path, timeout: float, jitter: float,
                  retries: int) -> Launch:
    r = Launch("launcher", n, rep)
    root = work / f"launcher-{n}n-{rep}"
    run_dir = root / f"slurm_{n}n-tiny_llama"
    cmd = [PY, "-m", "launcher", *slurm_shape(n), "run.job=placement_smoke", f"run.root={root}",
           f"+slurm.extra_sbatch.nodelist='node[1-{n}]'", f"ray.join_jitter_s={jitter:g}", f"ray.join_retries={retries}"]
    text = submit_and_time(cluster, r, cmd, REPO, lambda out: (re.findall(r"submitted job (\d+)", out) or [None])[0],
                           lambda: sorted(run_dir.glob("submitit/*/*_0_log.out")), n, timeout,
                           gcs_marker=lambda job: f"/tmp/ray_{job}_")
    if not r.job:
        return r
    fill_ray_start(r, [run_dir / "logs" / f"ray-node{i}.log" for i in range(1, n + 1)])
    r.failed_attempts = sum(len(FAILED_ATTEMPT.findall(f.read_text(errors="replace")))
                            for f in run_dir.glob(f"submitit/{r.job}/*_log.out"))
    if r.total is None or r.state != "COMPLETED":
        r.error = f"job {r.job} {r.state}; log tail: {text.strip()[-800:]}"
    return r


BARE_TASK = r"""#!/bin/bash
# One task per node (srun): node 0 = plain Ray head + a waiter that polls ray.nodes(); the others
# plain Ray workers. Every ray start runs in its own process group and is killed by that group.
set -u
N=$SLURM_JOB_NUM_NODES; I=$SLURM_PROCID; JOB=$SLURM_JOB_ID; DIR=__DIR__
RAY=__RAY__; PY=__PY__; PORT=6379
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
HEAD_IP=$(getent hosts "$HEAD" | awk '{print $1; exit}')
MY_IP=$(getent hosts "$(hostname)" | awk '{print $1; exit}')
export RAY_USAGE_STATS_ENABLED=0 __AUTH__
COMMON=(--block --disable-usage-stats --node-ip-address="$MY_IP" --num-cpus="${SLURM_CPUS_ON_NODE:-2}" --num-gpus=0
        --object-store-memory=268435456 --temp-dir=/tmp/rb_${JOB}_$I --node-manager-port=6800
        --object-manager-port=6801 --min-worker-port=10002 --max-worker-port=10999)
stop_ray() { kill -KILL -- "-$1" 2>/dev/null; wait "$1" 2>/dev/null; }
if [ "$I" = 0 ]; then
  setsid "$RAY" start "${COMMON[@]}" --head --port=$PORT --include-dashboard=false > "$DIR/ray-$JOB-$I.log" 2>&1 &
  RP=$!
  "$PY" "$DIR/bare_waiter.py" "$HEAD_IP" $PORT "$N" __LIMIT__; rc=$?
  touch "$DIR/done-$JOB"
  stop_ray $RP
  exit $rc
fi
until (exec 3<>"/dev/tcp/$HEAD_IP/$PORT") 2>/dev/null; do
  [ -e "$DIR/done-$JOB" ] && exit 1
  sleep 0.1
done
# all workers start at once; one whose `ray start` ends before the job is done (Ray refused it)
# retries after a random delay below JITTER seconds, RETRIES attempts in all (as the launcher does)
for attempt in $(seq __RETRIES__); do
  setsid "$RAY" start "${COMMON[@]}" --address="$HEAD_IP:$PORT" > "$DIR/ray-$JOB-$I.log" 2>&1 &
  RP=$!
  while [ ! -e "$DIR/done-$JOB" ] && kill -0 $RP 2>/dev/null; do sleep 0.1; done
  [ -e "$DIR/done-$JOB" ] && break
  wait $RP 2>/dev/null
  echo "node $I: attempt $attempt failed" >> "$DIR/failed-$JOB"
  sleep "$(awk -v r=$RANDOM -v j=__JITTER__ 'BEGIN { printf "%.2f", r / 32768 * j }')"
done
stop_ray $RP
exit 0
"""

BARE_WAITER = r"""import json, socket, statistics, sys, time
ip, port, n, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.time() + limit
while True:
    try:
        socket.create_connection((ip, port), timeout=1).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(f"error: the Ray head did not answer on {ip}:{port}")
        time.sleep(0.1)
print(f"Ray head up at {ip}:{port} ({time.time():.3f})", flush=True)
import ray
ray.init(address=f"{ip}:{port}", logging_level="WARNING", log_to_driver=False)
t0 = time.time()
while sum(1 for x in ray.nodes() if x["Alive"]) < n:
    if time.time() > deadline:
        sys.exit(f"error: only {sum(1 for x in ray.nodes() if x['Alive'])} of {n} nodes registered")
    time.sleep(0.1)
print(f"all {n} node(s) registered in {time.time() - t0:.1f}s ({time.time():.3f})", flush=True)
calls = []
for _ in range(5):  # the driver's per-check question, with all n nodes in the answer
    t = time.perf_counter()
    answer = ray.nodes()
    calls.append(time.perf_counter() - t)
print(f"ray.nodes(): {statistics.median(calls) * 1000:.1f} ms, {len(json.dumps(answer, default=str))} bytes", flush=True)
ray.shutdown()
"""


def bare_once(cluster: Cluster, n: int, rep: int, work: Path, auth: str, timeout: float, keep: bool,
              jitter: float, retries: int) -> Launch:
    r = Launch(f"bare ({auth})", n, rep)
    d = work / f"bare-{auth}-{n}n-{rep}"
    d.mkdir(parents=True)
    auth_env = "RAY_AUTH_MODE=disabled"
    if auth == "token":
        token = d / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        auth_env = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}"
    ray_bin = str(Path(PY).with_name("ray"))
    (d / "bare_task.sh").write_text(BARE_TASK.replace("__DIR__", str(d)).replace("__RAY__", ray_bin)
                                    .replace("__PY__", PY).replace("__AUTH__", auth_env)
                                    .replace("__RETRIES__", str(retries)).replace("__JITTER__", f"{jitter:g}")
                                    .replace("__LIMIT__", f"{timeout:.0f}"))
    (d / "bare_waiter.py").write_text(BARE_WAITER)
    (d / "job.sbatch").write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name=bare-ray-{n}n\n#SBATCH --nodes={n}\n#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --cpus-per-task=2\n#SBATCH --gpus-per-node=4\n#SBATCH --time=10\n"
        f"#SBATCH --nodelist=node[1-{n}]\n#SBATCH --output={d}/%j_0_log.out\n#SBATCH --open-mode=append\n"
        f"srun --unbuffered --kill-on-bad-exit=1 --output {d}/%j_%t_log.out bash {d}/bare_task.sh\n")
    text = submit_and_time(cluster, r, ["sbatch", "--parsable", str(d / "job.sbatch")], d,
                           lambda out: (re.findall(r"^(\d+)", out.strip()) or [None])[0],
                           lambda: sorted(d.glob("*_0_log.out")), n, timeout, gcs_marker=lambda job: f"/tmp/rb_{job}_")
    if not r.job:
        return r
    fill_ray_start(r, [d / f"ray-{r.job}-{i}.log" for i in range(n)])
    failed = d / f"failed-{r.job}"
    r.failed_attempts = len(failed.read_text().splitlines()) if failed.exists() else 0
    m = re.search(r"ray.nodes\(\): ([\d.]+) ms, (\d+) bytes", text + _read(d / f"{r.job}_0_log.out"))
    if m:
        r.nodes_ms, r.nodes_bytes = float(m.group(1)), int(m.group(2))
    left = reap_leftovers(f"/tmp/rb_{r.job}_", remove=not keep)
    if left:
        print(f"  note: {left} process(es) of bare job {r.job} outlived it (killed by PID)", flush=True)
    if r.total is None or r.state != "COMPLETED":
        r.error = f"job {r.job} {r.state}; log tail: {text.strip()[-800:]}"
    return r


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def reap_leftovers(marker: str, remove: bool) -> int:
    """SIGKILL, by PID, processes whose command line names this bare job's Ray temp dir."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in Path("/tmp").glob(marker.rsplit("/", 1)[1] + "*") if remove else ():
        shutil.rmtree(p, ignore_errors=True)
    return len(pids)


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\s")


def ray_start_seconds(log: Path) -> float | None:
    """From a node's `ray start` output: its first timestamped line (after the CLI's imports) to
    "Ray runtime started." (all daemons up and, on a worker, registered with the head)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    text = text.rsplit("\n$ ", 1)[-1]  # the launcher appends one "$ ray start ..." block per attempt
    first = end = None
    for line in text.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        first = t if first is None else first
        if "Ray runtime started" in line:
            end = t
            break
    return end - first if first is not None and end is not None else None


def fill_ray_start(r: Launch, logs: list[Path]) -> None:
    """Per node; a bare worker may be stopped before it prints the line (its job ends at registration)."""
    for i, log in enumerate(logs):
        sec = ray_start_seconds(log)
        if sec is not None:
            r.ray_start[i] = sec


# ------------------------------------------------------------------------------------- output
def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=1) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def tables(results: list[Launch], sizes: list[int], kinds: list[str]) -> str:
    bare = [k for k in kinds if k != "launcher"]
    head = "| nodes | launcher s (median) | " + " | ".join(f"{k} s (median)" for k in bare) + " | " + \
           " | ".join(f"launcher / {k}" for k in bare) + " | launcher range s | " + \
           " | ".join(f"{k} range s" for k in bare) + " | repeats |"
    lines = ["Submission -> all nodes registered (seconds, median over repeats)", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for n in sizes:
        by = {k: [r.total for r in results if r.nodes == n and r.kind == k and r.total is not None] for k in kinds}
        lm = med(by["launcher"])
        ms = [med(by[k]) for k in bare]
        ratios = [f"{lm / m:.2f}" if lm and m else "" for m in ms]
        rng = lambda xs: f"{min(xs):.1f}-{max(xs):.1f}" if xs else ""  # noqa: E731
        lines.append(f"| {n} | {fmt(lm)} | " + " | ".join(fmt(m) for m in ms) + " | " + " | ".join(ratios) +
                     f" | {rng(by['launcher'])} | " + " | ".join(rng(by[k]) for k in bare) +
                     f" | {len(by['launcher'])} |")
    lines += ["", "Where the time goes (median seconds per phase; each phase ends when this script saw its marker; "
              "head's `ray start`: its Ray log from the first line to \"Ray runtime started\")", "",
              "| nodes | path | submit (command returns) | queue (task-0 log appears) | head (\"Ray head up\") | "
              "join (head up -> all registered) | of which driver wait after connect | total | "
              "head's `ray start` |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for k in kinds:
            rs = [r for r in results if r.nodes == n and r.kind == k and r.total is not None]
            if not rs:
                continue
            def phase(a, b):
                return med([r.marks[b] - (r.marks[a] if a else 0.0) for r in rs
                            if b in r.marks and (not a or a in r.marks)])
            lines.append(f"| {n} | {k} | {fmt(phase(None, 'submitted'))} | {fmt(phase('submitted', 'started'))} | "
                         f"{fmt(phase('started', 'head'))} | {fmt(phase('head', 'registered'))} | "
                         f"{fmt(med([r.driver_wait_s for r in rs]))} | {fmt(med([r.total for r in rs]))} | "
                         f"{fmt(med([r.ray_start.get(0) for r in rs]))} |")
    return "\n".join(lines)


def node_costs(results: list[Launch], sizes: list[int], kinds: list[str]) -> str:
    """The per-node costs behind the join, per node count and path (medians over repeats)."""
    lines = ["Per-node costs (median over repeats; a worker's `ray start`: its own log, first line to \"Ray "
             "runtime started\", over the workers that got there; failed attempts: all workers, per launch)", "",
             "| nodes | path | worker `ray start` s (median) | (max) | failed attempts | head GCS CPU-s at all "
             "registered | ray.nodes() ms | ray.nodes() KiB |",
             "|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for k in kinds:
            rs = [r for r in results if r.nodes == n and r.kind == k and r.total is not None]
            if not rs:
                continue
            workers = [sec for r in rs for i, sec in r.ray_start.items() if i > 0]
            kib = med([r.nodes_bytes / 1024 for r in rs if r.nodes_bytes])
            lines.append(f"| {n} | {k} | {fmt(med(workers))} | {fmt(max(workers) if workers else None)} | "
                         f"{fmt(med([r.failed_attempts for r in rs]), 0)} | {fmt(med([r.gcs_cpu_s for r in rs]), 2)} | "
                         f"{fmt(med([r.nodes_ms for r in rs]))} | {fmt(kib)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16],
                    help="node counts (topology slurm_<n>n, or slurm_4n scaled to a power of two)")
    ap.add_argument("--repeats", type=int, default=2, help="launches per path and node count (median)")
    ap.add_argument("--bare-auth", choices=["disabled", "token", "both"], default="disabled",
                    help="bare Ray's RAY_AUTH_MODE (the launcher always uses a per-job token)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch before it counts as failed")
    ap.add_argument("--join-jitter", type=float, default=10.0,
                    help="both paths: a worker retries a failed `ray start` after a random delay below this "
                         "(the launcher's ray.join_jitter_s; its default 10)")
    ap.add_argument("--join-retries", type=int, default=3,
                    help="both paths: `ray start` attempts per worker (the launcher's ray.join_retries; default 3)")
    ap.add_argument("--lock-wait", type=float, default=900, help="seconds to wait for the cluster lock")
    ap.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    args = ap.parse_args(argv)
    for n in args.nodes:
        try:
            slurm_shape(n)
        except ValueError as e:
            ap.error(f"--nodes: {e}")
    kinds = ["launcher"] + ([f"bare ({a})" for a in ("disabled", "token")] if args.bare_auth == "both"
                            else [f"bare ({args.bare_auth})"])
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    root = Path(os.environ.get("SLURM_TEST_ROOT", "/tmp/slurm-test"))
    work = Path(tempfile.mkdtemp(prefix="bench-launch-", dir="/tmp"))  # /tmp: shared by all cluster nodes
    os.chmod(work, 0o755)
    results: list[Launch] = []
    t_all = time.time()
    try:
        with Cluster(root, max(args.nodes), args.lock_wait) as cluster:
            for n in args.nodes:
                for rep in range(args.repeats):
                    order = kinds if rep % 2 == 0 else kinds[::-1]  # alternate who goes first
                    for k in order:
                        if k == "launcher":
                            r = launcher_once(cluster, n, rep, work, args.timeout, args.join_jitter, args.join_retries)
                        else:
                            r = bare_once(cluster, n, rep, work, k[6:-1], args.timeout, args.keep, args.join_jitter,
                                          args.join_retries)
                        results.append(r)
                        ph = " ".join(f"{p}={v:.2f}" for p, v in r.marks.items())
                        print(f"{n} nodes, {k:<15} rep {rep}: job {r.job or '-'} {r.state or ''} "
                              f"{fmt(r.total, 2) or 'FAILED'} s  [{ph}] load {r.load:.1f}; failed attempts "
                              f"{r.failed_attempts}, head GCS {fmt(r.gcs_cpu_s, 2)} CPU-s"
                              + (f"\n  {r.error}" if r.error else ""),
                              flush=True)
    finally:
        if args.keep:
            print(f"run directories and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(tables(results, args.nodes, kinds))
    print()
    print(node_costs(results, args.nodes, kinds))
    bad = [r for r in results if r.error]
    loads = [r.load for r in results] or [0.0]
    print(f"\n{len(results)} launches in {time.time() - t_all:.0f}s; {len(bad)} failed; 1-min load average at "
          f"submission {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs. Bare Ray auth: "
          + ", ".join(k[6:-1] for k in kinds[1:]) + "; the launcher: token (per job).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
