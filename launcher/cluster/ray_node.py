"""One node's Ray: start `ray start --block` under the reaper, connect the driver, wait for the
planned nodes, read a daemon's fatal error from its own log, stop a node's whole tree by PID, and
the few network helpers these need."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from launcher import plan as plan_mod
from launcher import files, logs, paths
from launcher.cluster.context import ClusterError, JobContext, alive_resources, log, node_reports
from launcher.cluster.join import JoinDeadline, index_ranges
from launcher.config.schema import Config
from launcher.cluster import stop

_log = logs.get(__name__)


class HeadDied(ClusterError):
    """The head's own Ray daemons died while it started (its `ray start` can be tried again)."""


def connect(ctx: JobContext, ip: str, port: int, timeout_s: float, died=lambda: None, clock=time.monotonic,
            sleep=time.sleep) -> None:
    """Connect this process (the driver) to the job's Ray cluster with the job's token.

    `ray.init` gives up when the head's own raylet has not registered with its GCS within Ray's one
    GCS request timeout (60 s; ray/_private/services.py get_node_to_connect_for_driver): on a busy
    node the GCS port opens well before that. A head is not declared unreachable before
    `ray.register_timeout_s` (`timeout_s`), the window every node of the job gets to register:
    the driver tries again until then, saying so. But not on a head whose daemons died: `died()`
    (the daemon's fatal line, or None) is asked after each failed try, and a death is HeadDied at once."""
    os.environ.update(driver_env(ctx))  # before ray is imported: Ray reads both once
    import ray

    from launcher.cluster import worker_setup

    actor_logs = str(ctx.run_dir / paths.ACTOR_LOGS)
    deadline = clock() + timeout_s
    while True:
        try:
            ray.init(address=f"{ip}:{port}", logging_level="WARNING", log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1", worker_setup.ENV: actor_logs},
                                  "worker_process_setup_hook": "launcher.cluster.worker_setup.setup"})
            break
        except (ConnectionError, RuntimeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            if ray.is_initialized():
                ray.shutdown()
            dead = died()
            if dead is not None:
                raise HeadDied(f"the Ray head at {ip}:{port} is down: {dead}") from e
            if clock() >= deadline:
                raise ClusterError(f"the driver could not connect to the Ray head at {ip}:{port} in "
                                   f"ray.register_timeout_s={timeout_s:g}: {first}") from e
            log(f"the driver could not connect to the Ray head at {ip}:{port} yet ({first}); trying again")
            sleep(1.0)
    log(f"actor logs: {actor_logs}/<host>-pid<pid>.log")


def disconnect() -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # before the head goes, else interpreter exit can hang


def wait_for_nodes(ctx: JobContext, cfg: Config, plan: plan_mod.Plan, poll_s: float = 0.5,
                   query=alive_resources, clock=time.time, sleep=time.sleep) -> None:
    """Block until every planned node is registered in Ray; fail at once naming a node that
    reported it could not join, or naming the missing ones once no further node has registered for
    `ray.register_timeout_s` (launcher.cluster.join: the deadline follows progress). Each poll is
    one call to Ray's node list (`query`) and one listing of the rendezvous directory, whatever the
    node count."""
    t0 = clock()
    deadline = JoinDeadline([n.index for n in plan.nodes], cfg.ray.register_timeout_s, now=t0)
    index_of = {plan_mod.node_resource(n.index): n.index for n in plan.nodes}
    while True:
        alive = query()
        now = clock()
        deadline.observe((index_of[r] for r in alive if r in index_of), now)
        fatal = fatal_ray_error(ctx, since=0.0)  # this job attempt's own temp dir
        if fatal:
            raise ClusterError(f"node 0 ({ctx.hostname}, head): {fatal}")
        reports = node_reports(ctx, plan)
        if reports:
            raise ClusterError("; ".join(
                f"node {r['node_index']} ({r['host']}, {'+'.join(plan.nodes[r['node_index']].roles)}) could not "
                f"join the Ray cluster: {r['reason']} (log: {r['log']})" for r in reports))
        if deadline.complete():
            log(f"all {len(plan.nodes)} node(s) registered in {now - t0:.1f}s")
            return
        if deadline.expired(now):
            raise ClusterError(_not_registered(ctx, plan, deadline, now))
        sleep(poll_s)


def _not_registered(ctx: JobContext, plan: plan_mod.Plan, deadline: JoinDeadline, now: float, named: int = 16) -> str:
    """'3 of 16 node(s) did not register ...: node 2 (node3, generation; log: ...), ...': the first
    `named` with their logs, the rest as index ranges (a thousand-node job must stay one line)."""
    missing = deadline.missing
    last = (f"the last of {len(deadline.seen)} registered {deadline.last_progress - deadline.started:.1f}s after the "
            f"head started" if deadline.seen else "none registered")
    text = (f"{len(missing)} of {len(plan.nodes)} node(s) did not register with the Ray head: no further node "
            f"registered for {deadline.stalled_for(now):.1f}s (ray.register_timeout_s={deadline.stall_s:g}; {last}): "
            + ", ".join(f"node {i} ({ctx.hostnames[i]}, {'+'.join(plan.nodes[i].roles)}; log: "
                        f"{ctx.run_dir / 'logs' / f'ray-{ctx.hostnames[i]}.log'})" for i in missing[:named]))
    if len(missing) > named:
        text += f"; and {len(missing) - named} more: nodes {index_ranges(missing[named:])}"
    return text


def auth_env(ctx: JobContext) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ctx.rendezvous / paths.TOKEN)}


def driver_env(ctx: JobContext) -> dict[str, str]:
    """The driver process's Ray settings, read when ray is imported: the job's token, and no
    auto-connect. Without the latter, a Ray call of the abandoned driver thread after the head
    stopped (a lost node ends the run from the main thread) starts a new local Ray instance on
    the node, whose processes then keep the task from exiting; with it, the call raises."""
    return {**auth_env(ctx), "RAY_ENABLE_AUTO_CONNECT": "0"}


# Every `ray start`'s own settings (ray_config_def.h, read from RAY_<name>): no usage report, and
# no idle Python worker per CPU when the driver connects (the raylet's --num_prestart_python_workers
# is the node's CPU count: 72-144 processes on a GPU node that no actor of ours uses, each starting
# its own worker process; on two cores, a second of CPU each).
DAEMON_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_prestart_worker_first_driver": "0"}


def health_check_env(cfg: Config) -> dict[str, str]:
    """The GCS's node health checks (ray_config_def.h's health_check_*, read from RAY_<name> by every
    Ray daemon when it starts; the head's GCS runs them): the `ray` section's, whose doc says why."""
    r = cfg.ray
    return {"RAY_health_check_period_ms": str(round(r.health_check_period_s * 1000)),
            "RAY_health_check_timeout_ms": str(round(r.health_check_timeout_s * 1000)),
            "RAY_health_check_failure_threshold": str(r.health_check_failure_threshold)}


def worker_tmp_env(ctx: JobContext) -> dict[str, str]:
    """The Ray workers' temp dir is the job's own (ctx.worker_tmp, removed with the node's Ray);
    torch's compile cache, which torch would put in the temp dir, stays where it would have been
    (shared by the user's runs: a GPU run's compiled kernels are not compiled again each run)."""
    import getpass
    import re
    import tempfile

    try:  # torch._inductor.runtime.cache_dir_utils.default_cache_dir, without importing torch
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return {"TMPDIR": str(ctx.worker_tmp),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default)}


def start_ray(ctx: JobContext, cfg: Config, node: plan_mod.NodePlan, head_ip: str, port: int,
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
           f"--temp-dir={ctx.ray_temp_dir}",
           # no log monitor: it streams the workers' output to drivers that ask for it, and ours does not
           # (connect: log_to_driver=False; each actor writes RUN/logs/actors/<host>-pid<pid>.log); it
           # cost 2 s of CPU per node start on two cores, polling files no one reads
           "--include-log-monitor=false"]
    if cfg.topology.executor == "slurm":  # pinned ports (each node has its own port space)
        cmd += [f"--node-manager-port={r.node_manager_port}", f"--object-manager-port={r.object_manager_port}",
                f"--min-worker-port={r.min_worker_port}", f"--max-worker-port={r.max_worker_port}"]
    if head:
        cmd += ["--head", f"--port={port}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_ip}:{port}"]
    log_file = ctx.log_path("ray")
    _log.debug(f"{ctx.hostname}: $ {shlex.join(cmd)} (log: {log_file})")
    ctx.worker_tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {**os.environ, **auth_env(ctx), **worker_tmp_env(ctx), **health_check_env(cfg), **DAEMON_ENV}
    reaper = [sys.executable, "-m", "launcher.cluster.reaper", f"--temp-dir={ctx.ray_temp_dir}",
              f"--keep-logs={ctx.ray_logs}", str(os.getpid())]
    with files.open_append(log_file) as out:  # the run directory's mode
        out.write(f"\n$ {shlex.join(cmd)}\n")
        out.flush()
        # under launcher.cluster.reaper: nothing of this Ray node survives this process (see its docstring)
        return subprocess.Popen([*reaper, *cmd], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=stop.block_job_signals)


def fatal_ray_error(ctx: JobContext, since: float) -> str | None:
    """The fatal error of a Ray daemon on this node (raylet, GCS), from its logs, if one died; the
    log it names is where the file is kept once the node's Ray stopped (stop_node).

    `ray start` notices a dead raylet only after its 30 s registration timeout; the daemon's own
    log says what happened within a second ("Failed to start the grpc server ... port 6800",
    "Address already in use")."""
    logs = ctx.ray_temp_dir / "session_latest" / "logs"
    if not logs.is_dir():
        return None
    kept = ctx.ray_logs / logs.parent.resolve().name
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
                what = re.sub(r"^\S+\.has_value\(\)\s+", "", what)  # RAY_ASSIGN_OR_CHECK_SET's expression
                why = " (Address already in use)" if "Address already in use" in text else ""
                return f"{f.name.split('.')[0]} died: {what}{why} (log: {kept / f.name})"
    return None


def stop_node(ctx: JobContext, proc: subprocess.Popen) -> None:
    """Stop this node's Ray (`proc`, start_ray's reaper) and remove what it left on the node: its
    temp dir, the daemons' logs kept in RUN/logs/ray/<host>/ (launcher.cluster.reaper.clean_up)."""
    from launcher.cluster.reaper import clean_up

    with stop.ctrl_c_held():
        stop_process_tree(proc)
        clean_up(ctx.ray_temp_dir, ctx.ray_logs)


def stop_process_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL everything below `proc` (a launcher.cluster.reaper: a subreaper, so the node's whole Ray tree
    stays below it, orphans included), then the reaper itself. By PID only. No SIGTERM: Ray's
    processes block it (cluster.stop.block_job_signals), and a node being taken down has nothing to drain."""
    from launcher.cluster.reaper import descendants, kill_below

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
                               + (f" ({tail(log_file)})" if log_file else ""))
        if time.time() > deadline:
            raise ClusterError(f"{what} did not answer on {host}:{port} within {timeout:.0f}s")
        time.sleep(0.3)


def tail(path: Path | None, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]  # type: ignore[union-attr]
        return f"{path}: " + " | ".join(lines[-n:])
    except (OSError, AttributeError):
        return f"see {path}"

