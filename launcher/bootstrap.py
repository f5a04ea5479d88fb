"""Inside the job: form a Ray cluster across the job's nodes, run the driver, stop Ray by PID.

Every task of the job (one per node) runs `run_task(run_dir)`: through submitit (the launcher's
path) or through `srun python -m launcher.bootstrap RUN_DIR` (the sbatch template's path).

- Task 0 starts the Ray head on its node with token authentication (a fresh per-job token, file
  mode 0600) and no dashboard beyond loopback, publishes `head.json` in the rendezvous directory
  on the shared run directory, then runs the driver.
- Other tasks wait for `head.json` and for the head's port to answer, then join with the role
  resources the plan gives their node, retrying a failed `ray start` a few times. A node that
  cannot join writes `failed_node<i>.json`, so the driver fails at once naming it.
- The driver waits until every planned node has registered; after `ray.register_timeout_s` it
  fails naming the missing nodes. When the driver ends it writes `done`; every task then stops
  its own `ray start` process tree by PID (never `ray stop`, which kills every Ray on the host).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher import config as config_mod
from launcher import topology
from launcher.schema import Config, typed


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
        return self.run_dir / "ray" / f"{self.job_id}.{self.attempt}"

    @property
    def hostname(self) -> str:
        return self.hostnames[self.node_index]

    def log_path(self, what: str) -> Path:
        return self.run_dir / "logs" / f"{what}-{self.hostname}.log"

    @property
    def ray_temp_dir(self) -> Path:
        """Node-local and short (Ray's unix socket paths must stay under 108 characters)."""
        return Path(f"/tmp/ray_{self.job_id}_{self.attempt}_{self.node_index}")


def log(msg: str) -> None:
    print(f"[launcher {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_task(run_dir: str | Path, plain_sbatch: bool = False) -> dict:
    """One task of a Slurm job: node 0 runs head + driver, the others run Ray workers.

    Under submitit, its handler takes USR2 (checkpoint + requeue, launcher.submit.JobTask). Under
    plain sbatch (`plain_sbatch`), USR2 and SIGTERM both stop the driver after a checkpoint and the
    job requeues itself with scontrol."""
    run_dir = Path(run_dir).resolve()
    cfg = typed(config_mod.load(run_dir / "config.yaml"))
    plan = topology.build(cfg.topology)
    ctx = JobContext.from_slurm(run_dir)
    if len(ctx.hostnames) != len(plan.nodes):
        raise ClusterError(f"the job has {len(ctx.hostnames)} nodes but topology {cfg.topology.name} plans "
                           f"{len(plan.nodes)}")
    if ctx.node_index != 0:
        return run_worker(ctx, cfg, plan)
    if ctx.attempt > 0:  # requeued (preemption, time limit, node failure): continue from the latest checkpoint
        cfg.resume = resume_after_requeue(cfg, run_dir)
        log(f"restart {ctx.attempt} of job {ctx.job_id}: " +
            (f"resuming from {cfg.resume}" if cfg.resume else "no complete checkpoint yet, starting over"))
    signals = {signal.SIGTERM: _stop_on_signal}  # Slurm's preemption warning
    if plain_sbatch:
        signals[signal.SIGUSR2] = _stop_on_signal  # the time-limit warning (#SBATCH --signal=USR2@...)
    try:
        out = run_head(ctx, cfg, plan, signals=signals)
        if plain_sbatch and (out.get("result") or {}).get("stopped"):
            log(f"requeueing job {ctx.job_id}: the restarted job resumes from the checkpoint just saved")
            subprocess.run(["scontrol", "requeue", ctx.job_id], check=True, timeout=60)
        return out
    except ClusterError as e:
        restarts = record_failure(run_dir, ctx.job_id, e)
        if restarts > cfg.retry.max_restarts:
            raise
        log(f"error: {e}\nrestart {restarts}/{cfg.retry.max_restarts} (retry.max_restarts): requeueing job "
            f"{ctx.job_id}; it continues from the latest complete checkpoint")
        subprocess.run(["scontrol", "requeue", ctx.job_id], check=True, timeout=60)
        return {"node": ctx.hostname, "role": "head", "requeued": str(e)}


def record_failure(run_dir: Path, job_id: str, error: BaseException) -> int:
    """Append the failure to RUN/failures.jsonl; how many failures this job (all its restarts) had."""
    path = run_dir / "failures.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job": job_id, "error": str(error)}) + "\n")
    return sum(1 for line in path.read_text().splitlines() if json.loads(line)["job"] == job_id)


def resume_after_requeue(cfg: Config, run_dir: Path) -> str | None:
    from launcher.checkpoints import CheckpointManager
    from launcher.run_dir import checkpoint_dirs

    done = CheckpointManager(checkpoint_dirs(cfg, run_dir), cfg.checkpointing).complete()
    return str(done[-1].path) if done else cfg.resume


# --------------------------------------------------------------------------------- the driver
@dataclass
class RunningDriver:
    stop: threading.Event
    thread: threading.Thread


CURRENT: RunningDriver | None = None  # the driver running in this process, for signal handlers


def _stop_on_signal(signum, frame) -> None:
    if CURRENT is not None and not CURRENT.stop.is_set():
        log(f"{signal.Signals(signum).name}: stopping after the current step (a checkpoint is saved first)")
        CURRENT.stop.set()


def run_driver(driver, cfg: Config, plan: topology.Plan, ctx: JobContext, signals: dict | None = None):
    """Run `driver(cfg, plan, ctx, stop)` in a thread: the main thread stays free to take signals
    (preemption, Ctrl-C), whose handlers set `stop`; the driver ends at its next step boundary.
    The handlers are installed here, after ray.init, which installs its own (a SIGTERM then
    aborts the process instead of letting it checkpoint)."""
    global CURRENT
    box: dict = {}
    previous = {sig: signal.signal(sig, handler) for sig, handler in (signals or {}).items()}

    def target():
        try:
            box["result"] = driver(cfg, plan, ctx, CURRENT.stop)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            box["error"] = e

    CURRENT = RunningDriver(threading.Event(), threading.Thread(target=target, name="driver", daemon=True))
    CURRENT.thread.start()
    try:
        next_check = 0.0
        while CURRENT.thread.is_alive():
            CURRENT.thread.join(0.5)
            if time.time() >= next_check and CURRENT.thread.is_alive():
                check_nodes(ctx, plan)  # a lost node ends the run now, whatever the driver waits for
                next_check = time.time() + 2.0
    finally:
        CURRENT = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in box:
        raise box["error"]
    return box["result"]


# ----------------------------------------------------------------------------------------- head
def run_head(ctx: JobContext, cfg: Config, plan: topology.Plan, driver=None, signals: dict | None = None) -> dict:
    """Start the head, run `driver(cfg, plan, ctx, stop)` (default: launcher.driver.run) with
    `signals` {signal: handler} installed, stop Ray."""
    ctx.rendezvous.mkdir(parents=True, exist_ok=True)
    os.chmod(ctx.rendezvous, 0o700)
    os.environ.update(auth_env(ctx))  # this process becomes the driver; Ray reads the auth mode at import
    token = ctx.rendezvous / "token"
    earlier = ctx.run_dir / "ray" / f"{ctx.job_id}.{ctx.attempt - 1}" / "token"
    # a restart inside this process keeps the job's token: Ray reads it once per process
    secret = earlier.read_text() if ctx.attempt > 0 and earlier.exists() else secrets.token_hex(32)
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    ip = resolve_ip(ctx.hostnames[0])
    port = cfg.ray.port if cfg.topology.executor == "slurm" else free_port()
    ray_proc = start_ray(ctx, cfg, plan.nodes[0], head_ip=ip, port=port, head=True)
    status = {"ok": False, "error": None}
    try:
        wait_port(ip, port, timeout=60, proc=ray_proc, what=f"the Ray head on {ctx.hostname}",
                  log_file=ctx.log_path("ray"))
        _write_json(ctx.rendezvous / "head.json", {"ip": ip, "port": port, "host": ctx.hostname})
        log(f"Ray head up at {ip}:{port} on {ctx.hostname} (job {ctx.job_id}); waiting for "
            f"{len(plan.nodes)} node(s)")
        connect(ctx, ip, port)
        wait_for_nodes(ctx, cfg, plan)
        (ctx.rendezvous / "registered").touch()  # from now on a lost node is a failure, not a retry
        if driver is None:
            from launcher import driver as driver_mod
            driver = driver_mod.run
        result = run_driver(driver, cfg, plan, ctx, signals)
        status["ok"] = True
        return {"node": ctx.hostname, "role": "head", "result": result}
    except BaseException as e:
        status["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        _write_json(ctx.rendezvous / "done", status)
        if any(t.name == "driver" and t.is_alive() for t in threading.enumerate()):
            stop_process_tree(ray_proc)  # first: unblocks the abandoned driver's pending Ray calls
            disconnect()
        else:
            disconnect()
            stop_process_tree(ray_proc)


def connect(ctx: JobContext, ip: str, port: int) -> None:
    """Connect this process (the driver) to the job's Ray cluster with the job's token."""
    os.environ.update(auth_env(ctx))  # before ray is imported: Ray reads the auth mode once
    import ray

    from launcher import worker_setup

    actor_logs = worker_setup.log_dir(ctx.run_dir)
    try:
        ray.init(address=f"{ip}:{port}", logging_level="WARNING", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1", worker_setup.ENV: actor_logs},
                              "worker_process_setup_hook": "launcher.worker_setup.setup"})
        log(f"actor logs: {actor_logs}/<host>-pid<pid>.log")
    except (ConnectionError, RuntimeError) as e:
        raise ClusterError(f"the driver could not connect to the Ray head at {ip}:{port}: "
                           f"{str(e).splitlines()[0]}") from e


def disconnect() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # before the head goes, else interpreter exit can hang


def wait_for_nodes(ctx: JobContext, cfg: Config, plan: topology.Plan) -> None:
    """Block until every planned node is registered in Ray; fail fast naming the missing ones."""
    import ray

    deadline = time.time() + cfg.ray.register_timeout_s
    t0 = time.time()
    while True:
        alive = {key for n in ray.nodes() if n.get("Alive") for key in n.get("Resources", {})}
        missing = [n for n in plan.nodes if topology.node_resource(n.index) not in alive]
        fatal = fatal_ray_error(ctx.ray_temp_dir, since=0.0)  # this job attempt's own temp dir
        if fatal:
            raise ClusterError(f"node 0 ({ctx.hostname}, head): {fatal}")
        failed = sorted(ctx.rendezvous.glob("failed_node*.json"))
        if failed:
            reports = [json.loads(p.read_text()) for p in failed]
            raise ClusterError("; ".join(
                f"node {r['node_index']} ({r['host']}, {'+'.join(plan.nodes[r['node_index']].roles)}) could not "
                f"join the Ray cluster: {r['reason']} (log: {r['log']})" for r in reports))
        if not missing:
            log(f"all {len(plan.nodes)} node(s) registered in {time.time() - t0:.1f}s")
            return
        if time.time() > deadline:
            raise ClusterError(
                f"{len(missing)} of {len(plan.nodes)} node(s) did not register with the Ray head within "
                f"{cfg.ray.register_timeout_s:.0f}s: " + ", ".join(
                    f"node {n.index} ({ctx.hostnames[n.index]}, {'+'.join(n.roles)}; log: "
                    f"{ctx.run_dir / 'logs' / f'ray-{ctx.hostnames[n.index]}.log'})" for n in missing))
        time.sleep(0.5)


def doing(ctx: JobContext) -> str:
    p = ctx.progress
    return f" during {p['phase']} at step {p['step']}" if p.get("phase") else ""


def check_nodes(ctx: JobContext, plan: topology.Plan) -> None:
    """Raise ClusterError naming any node that left the cluster (its bootstrap reported it, or
    Ray no longer lists it alive)."""
    import ray

    for report in sorted(ctx.rendezvous.glob("failed_node*.json")):
        r = json.loads(report.read_text())
        node = plan.nodes[r["node_index"]]
        raise ClusterError(f"node {node.index} ({r['host']}, {'+'.join(node.roles)}) left the Ray cluster"
                           f"{doing(ctx)}: {r['reason']} (log: {r['log']})")
    alive = {key for n in ray.nodes() if n.get("Alive") for key in n.get("Resources", {})}
    for node in plan.nodes:
        if topology.node_resource(node.index) not in alive:
            raise ClusterError(f"node {node.index} ({ctx.hostnames[node.index]}, {'+'.join(node.roles)}) is no "
                               f"longer alive in the Ray cluster{doing(ctx)} (log: "
                               f"{ctx.run_dir / 'logs' / f'ray-{ctx.hostnames[node.index]}.log'})")


# --------------------------------------------------------------------------------------- worker
def run_worker(ctx: JobContext, cfg: Config, plan: topology.Plan) -> dict:
    """Join the head (retrying), stay until the driver is done, then stop Ray by PID."""
    node = plan.nodes[ctx.node_index]
    done = ctx.rendezvous / "done"
    head_file = ctx.rendezvous / "head.json"
    deadline = time.time() + cfg.ray.register_timeout_s
    while not head_file.exists():
        if done.exists():
            return {"node": ctx.hostname, "role": "worker", "joined": False}
        if time.time() > deadline:
            return _report_failure(ctx, f"no Ray head published {head_file} within "
                                        f"{cfg.ray.register_timeout_s:.0f}s")
        time.sleep(0.5)
    head = json.loads(head_file.read_text())
    try:
        wait_port(head["ip"], head["port"], timeout=cfg.ray.register_timeout_s, what="the Ray head")
    except ClusterError as e:
        return _report_failure(ctx, str(e))
    time.sleep(0.3 * ctx.node_index)  # stagger joins: many raylets at once miss Ray's registration window
    reason = ""
    for attempt in range(1, cfg.ray.join_retries + 1):
        started = time.time()
        proc = start_ray(ctx, cfg, node, head_ip=head["ip"], port=head["port"], head=False)
        fatal = None
        try:
            while not done.exists() and proc.poll() is None:
                fatal = fatal_ray_error(ctx.ray_temp_dir, since=started)
                if fatal:
                    break
                if not port_open(head["ip"], head["port"]) and not _head_back(head, done):
                    raise ClusterError(f"the Ray head {head['host']} stopped answering")
                time.sleep(1.0)
        finally:
            stop_process_tree(proc)
        if done.exists():
            return {"node": ctx.hostname, "role": "worker", "joined": True, "attempts": attempt}
        reason = fatal or f"`ray start` exited with code {proc.returncode} ({_tail(ctx.log_path('ray'))})"
        if (ctx.rendezvous / "registered").exists():  # the run had started: rejoining cannot help it
            return _report_failure(ctx, f"this node's Ray stopped: {reason}")
        log(f"{ctx.hostname}: attempt {attempt}/{cfg.ray.join_retries} to join failed: {reason}")
        time.sleep(1.0)
    return _report_failure(ctx, f"{cfg.ray.join_retries} attempts failed; last: {reason}")


def _head_back(head: dict, done: Path, grace_s: float = 20.0) -> bool:
    """True if the head answers again within grace_s (or the job finished meanwhile)."""
    t = time.time() + grace_s
    while time.time() < t:
        if done.exists() or port_open(head["ip"], head["port"]):
            return True
        time.sleep(1.0)
    return False


def _report_failure(ctx: JobContext, reason: str) -> dict:
    log(f"{ctx.hostname}: cannot join the Ray cluster: {reason}")
    _write_json(ctx.rendezvous / f"failed_node{ctx.node_index}.json",
                {"node_index": ctx.node_index, "host": ctx.hostname, "reason": reason,
                 "log": str(ctx.log_path("ray"))})
    # exit 0: the driver reports the failure with the whole picture; a non-zero exit would make
    # srun (--kill-on-bad-exit) kill the driver before it can say what happened
    return {"node": ctx.hostname, "role": "worker", "joined": False, "error": reason}


# ------------------------------------------------------------------------------ ray processes
def auth_env(ctx: JobContext) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ctx.rendezvous / "token")}


def start_ray(ctx: JobContext, cfg: Config, node: topology.NodePlan, head_ip: str, port: int,
              head: bool) -> subprocess.Popen:
    """`ray start --block` for this node, in its own session so its whole tree can be stopped."""
    r = cfg.ray
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    cmd = [ray_bin, "start", "--block", "--disable-usage-stats",
           f"--node-ip-address={resolve_ip(ctx.hostname) if not head else head_ip}",
           f"--num-cpus={max(cpus, len(node.train_ranks) + len(node.generation_workers))}",
           f"--num-gpus={node.gpus if cfg.topology.device == 'cuda' else 0}",
           f"--resources={json.dumps(node.ray_resources())}",
           f"--object-store-memory={r.object_store_mb * 2**20}",
           f"--temp-dir={ctx.ray_temp_dir}"]
    if cfg.topology.executor == "slurm":  # pinned ports (each node has its own port space)
        cmd += [f"--node-manager-port={r.node_manager_port}", f"--object-manager-port={r.object_manager_port}",
                f"--min-worker-port={r.min_worker_port}", f"--max-worker-port={r.max_worker_port}"]
    if head:
        cmd += ["--head", f"--port={port}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_ip}:{port}"]
    log_file = ctx.log_path("ray")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **auth_env(ctx), "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log_file, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        # under launcher.reaper: nothing of this Ray node survives this process (see its docstring)
        return subprocess.Popen([sys.executable, "-m", "launcher.reaper", str(os.getpid()), *cmd], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_block_job_signals)


JOB_SIGNALS = {signal.SIGTERM, signal.SIGUSR2}


def _block_job_signals() -> None:
    """In the child before exec: Slurm signals every process of the job (preemption SIGTERM, the
    time-limit USR2). Ray's daemons and workers would shut down (or die: USR2's default action)
    in the middle of the step that is being checkpointed. The mask is inherited by every Ray
    process, so the bootstrap alone reacts to the job's signals, and stops Ray itself by PID."""
    signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)


def fatal_ray_error(temp_dir: Path, since: float) -> str | None:
    """The fatal error of a Ray daemon on this node (raylet, GCS), from its logs, if one died.

    `ray start` notices a dead raylet only after its 30 s registration timeout; the daemon's own
    log says what happened within a second ("Failed to start the grpc server ... port 6800",
    "Address already in use")."""
    logs = temp_dir / "session_latest" / "logs"
    if not logs.is_dir():
        return None
    for f in sorted(logs.glob("*")):
        if not f.name.startswith(("raylet", "gcs_server")) or f.stat().st_mtime < since:
            continue
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if " C " in line and "Check failed:" in line:
                what = line.split("Check failed:", 1)[1].split(" This means", 1)[0].strip()
                why = " (Address already in use)" if "Address already in use" in text else ""
                return f"{f.name.split('.')[0]} died: {what}{why} (log: {f})"
    return None


def stop_process_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL everything below `proc` (a launcher.reaper: a subreaper, so the node's whole Ray tree
    stays below it, orphans included), then the reaper itself. By PID only. No SIGTERM: Ray's
    processes block it (see _block_job_signals), and a node being taken down has nothing to drain."""
    from launcher.reaper import descendants, kill_below

    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None and len(descendants(proc.pid)) > 1:
        kill_below(proc.pid)  # repeated: catches a process forked while we were killing
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout_s)


# ------------------------------------------------------------------------------------- network
def resolve_ip(host: str) -> str:
    return socket.gethostbyname(host)


def port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float, what: str, proc: subprocess.Popen | None = None,
              log_file: Path | None = None) -> None:
    deadline = time.time() + timeout
    while not port_open(host, port):
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{what} exited with code {proc.returncode} before listening on {host}:{port}"
                               + (f" ({_tail(log_file)})" if log_file else ""))
        if time.time() > deadline:
            raise ClusterError(f"{what} did not answer on {host}:{port} within {timeout:.0f}s")
        time.sleep(0.3)


def _tail(path: Path | None, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]  # type: ignore[union-attr]
        return f"{path}: " + " | ".join(lines[-n:])
    except (OSError, AttributeError):
        return f"see {path}"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """`srun python -m launcher.bootstrap RUN_DIR`: the sbatch template's entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m launcher.bootstrap RUN_DIR   (one task per node, inside a Slurm job)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # lets submitit.JobEnvironment read the Slurm env
    for sig in (signal.SIGTERM, signal.SIGUSR2):  # default action: die; a worker task must outlive the
        signal.signal(sig, signal.SIG_IGN)        # checkpoint (it stops when the head says done)
    try:
        result = run_task(argv[0], plain_sbatch=True)
    except (ClusterError, config_mod.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    log(f"task done: {json.dumps(result, default=str)[:500]}")
    return 0  # a worker that could not join exits 0: the driver reports it (see _report_failure)


if __name__ == "__main__":
    sys.exit(main())
