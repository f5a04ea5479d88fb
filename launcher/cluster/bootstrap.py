"""Inside the job: form a Ray cluster across the job's nodes, run the driver, stop Ray by PID.

Every task of the job (one per node) runs `run_task(run_dir)`: through submitit (the launcher's
path) or through `srun python -m launcher.cluster.bootstrap RUN_DIR` (the sbatch template's path).

- Task 0 starts the Ray head on its node with token authentication (a fresh per-job token, file
  mode 0600) and no dashboard beyond loopback, publishes `head.json` in the rendezvous directory
  on the shared run directory, then runs the driver.
- Other tasks wait for `head.json` and for the head's port to answer, then all join at once with
  the role resources the plan gives their node (no order among them: launcher.cluster.join),
  retrying a failed `ray start` a few times after a random delay. A node that cannot join writes
  `failed_node<i>.json`, so the driver fails at once naming it; so does a node whose Ray stops
  once the run has started (node 0's main thread watches its own; launcher.cluster.watch).
- The driver waits while nodes keep registering; once none has registered for
  `ray.register_timeout_s` it fails naming the missing nodes. When the driver ends it writes
  `done`; every task then stops its own `ray start` process tree by PID (never `ray stop`, which
  kills every Ray on the host) and removes its Ray temp dir (ray_node.stop_node).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher import files, paths, records
from launcher import plan as plan_mod
from launcher import progress
from launcher.cluster import preflight, restarts, stop
from launcher.cluster.context import ClusterError, JobContext, log
from launcher.cluster.join import retry_delay
from launcher.cluster.ray_node import (HeadDied, connect, disconnect, driver_env, fatal_ray_error, free_port,
                                       resolve_ip, start_ray, stop_node, wait_for_nodes, wait_port)
from launcher.cluster.watch import WORKER_TICK_S, HeadWatch, WorkerWatch, ray_exit, ray_stopped, write_node_report
from launcher.config import compose as config_mod
from launcher.config.schema import Config


def run_task(run_dir: str | Path, plain_sbatch: bool = False) -> dict:
    """One task of a Slurm job: node 0 runs head + driver, the others run Ray workers.

    Under submitit, its handler takes USR2 (checkpoint + requeue, launcher.job.submit.JobTask). Under
    plain sbatch (`plain_sbatch`), USR2 and SIGTERM both stop the driver after a checkpoint and the
    job requeues itself with scontrol."""
    run_dir = Path(run_dir).resolve()
    cfg = config_mod.load_typed(run_dir / paths.CONFIG)  # its schema: launcher.records.load_config
    plan = plan_mod.build(cfg.topology)
    ctx = JobContext.from_slurm(run_dir)
    if len(ctx.hostnames) != len(plan.nodes):
        raise ClusterError(f"the job has {len(ctx.hostnames)} nodes but topology {cfg.topology.name} plans "
                           f"{len(plan.nodes)}")
    if cfg.run.job == "preflight" and ctx.node_index == 0 and ctx.attempt == 0:
        # before Ray: probes every node through its own srun step, so a node whose task could not
        # start (no run directory there) is named too; raises PreflightFailed (exit 1, no requeue)
        preflight.check_nodes(cfg, plan, ctx)
    if ctx.node_index != 0:
        return run_worker(ctx, cfg, plan)
    if ctx.attempt > 0:  # requeued (preemption, time limit, node failure): continue from the latest checkpoint
        from launcher.driver.checkpoints import nothing_left

        ckpt = restarts.latest_checkpoint(cfg, run_dir)  # once: it checksums every checkpoint's files
        if ckpt is not None and nothing_left(cfg, ckpt.step):
            # a signal that came after the last step: start no Ray, no actors
            log(f"restart {ctx.attempt} of job {ctx.job_id}: nothing to run, the run had finished ({ckpt.path} is "
                f"at step {ckpt.step}/{cfg.grpo.max_num_steps})")
            return finished_before(ctx, ckpt.step)
        cfg.resume = restarts.resume_point(cfg, ckpt)
        log(f"restart {ctx.attempt} of job {ctx.job_id}: " +
            (f"resuming from {cfg.resume}" if cfg.resume else "no complete checkpoint yet, starting over"))
        checked = ckpt is not None  # complete() verified it
    else:
        checked = False
    check_start(ctx, cfg, resuming=not checked)
    try:
        out = run_head(ctx, cfg, plan, signals=stop.job_handlers(plain_sbatch))
        if plain_sbatch and (out.get("result") or {}).get("stopped") and not out.get("stop_requested"):
            log(f"requeueing job {ctx.job_id}: the restarted job resumes from the checkpoint just saved")
            stop.requeue(ctx.job_id)
        return out
    except ClusterError as e:
        n = restarts.after_failure(cfg, run_dir, ctx.job_id, e)
        if n is None:
            raise
        log(f"error: {e}\n{restarts.restart_line(cfg, n)}: requeueing job {ctx.job_id}; it continues from the "
            f"latest complete checkpoint")
        stop.requeue(ctx.job_id)
        return {"node": ctx.hostname, "role": "head", "requeued": str(e)}


def check_start(ctx: JobContext, cfg: Config, resuming: bool = True) -> None:
    """Everything the job checks when it starts (launcher.driver.start_check: the same function the
    launcher ran at submission), before Ray and the actors start: the checkpoint to resume may have
    changed since. A ConfigError naming the key (the file and key of a record); the other tasks see
    `done` and end."""
    from launcher.driver import start_check

    try:
        start_check.check(cfg, ctx.run_dir, resuming=resuming)
    except config_mod.ConfigError as e:
        files.make_dir(ctx.rendezvous)
        files.write_json(ctx.rendezvous / paths.DONE, {"ok": False, "error": str(e)})
        raise


def finished_before(ctx: JobContext, step: int) -> dict:
    """Task 0 of a requeued job whose run had finished: the other tasks see `done` and end too."""
    files.make_dir(ctx.rendezvous)
    files.write_json(ctx.rendezvous / paths.DONE, {"ok": True, "error": None})
    return {"node": ctx.hostname, "role": "head", "result": {"step": step, "stopped": False}}


# --------------------------------------------------------------------------------- the driver
def run_driver(driver, cfg: Config, plan: plan_mod.Plan, ctx: JobContext, signals: dict | None = None,
               ray_proc: subprocess.Popen | None = None):
    """Run `driver(cfg, plan, ctx, stop)` in a thread (cluster.stop.running): the main thread stays free
    to take signals, whose handlers set `stop`; the driver ends at its next step boundary. Every
    2 s the main thread checks that every node is still alive, whatever the driver waits for; the
    head's own Ray (`ray_proc`, whose GCS the whole cluster needs) first (watch.HeadWatch)."""
    box: dict = {}

    def target(stop_event):
        try:
            box["result"] = driver(cfg, plan, ctx, stop_event)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            box["error"] = e

    beat = progress.Heartbeat(log)  # "still <phase> (<elapsed>)" while one phase lasts
    watch = HeadWatch(ctx, plan, ray_proc)  # a lost node ends the run now
    with stop.running(target, signals or {}) as current:
        while current.thread.is_alive():
            current.thread.join(0.5)
            if current.thread.is_alive():
                watch.tick(time.time())
            if cfg.run.job == "grpo":  # the other job kinds wait on purpose (hold) or are short
                beat.tick(progress.phase_text(ctx.progress))
    if "error" in box:
        raise box["error"]
    return box["result"]


# ----------------------------------------------------------------------------------------- head
def run_head(ctx: JobContext, cfg: Config, plan: plan_mod.Plan, driver=None, signals: dict | None = None) -> dict:
    """Start the head, run `driver(cfg, plan, ctx, stop)` (default: launcher.driver.jobs.run) with
    `signals` {signal: handler} installed from the start-up to the end of the clean-up
    (cluster.stop.armed: a signal during the start-up stops the driver before its first step), stop Ray."""
    with stop.armed(signals or {}):
        return _run_head(ctx, cfg, plan, driver, signals)


def _run_head(ctx: JobContext, cfg: Config, plan: plan_mod.Plan, driver, signals: dict | None) -> dict:
    ctx.startup.append(("launcher: Python, imports, config, run directory", time.time()))
    files.make_dir(ctx.rendezvous)  # the run directory's policy (RUN/ray/ and below)
    os.environ.update(driver_env(ctx))  # this process becomes the driver; Ray reads these at import
    token = ctx.rendezvous / paths.TOKEN
    earlier = ctx.run_dir / paths.RENDEZVOUS / f"{ctx.job_id}.{ctx.attempt - 1}" / paths.TOKEN
    # a restart inside this process keeps the job's token: Ray reads it once per process
    secret = earlier.read_text() if ctx.attempt > 0 and earlier.exists() else secrets.token_hex(32)
    files.write(token, secret, files.PRIVATE)  # 0600 also in a run directory shared with the group
    if cfg.run.job == "preflight" and not preflight.checked(ctx):  # a local run: its one node, before Ray
        preflight.check_nodes(cfg, plan, ctx)
    warming = None
    if driver is None and cfg.run.job == "grpo":  # after the auth env and the token: it imports ray
        from launcher.driver.startup import warm_imports
        warming = warm_imports()  # while the head starts: the driver's torch/transformers/worker imports
    ray_proc, started = None, False
    status = {"ok": False, "error": None}
    try:
        ray_proc, started = start_head(ctx, cfg, plan), True
        stop.reinstall()  # ray.init installed its own SIGTERM handler
        with progress.waiting(f"waiting for {len(plan.nodes)} node(s) to register with the Ray head", log):
            wait_for_nodes(ctx, cfg, plan)
        ctx.startup.append(("Ray up (head started, all nodes registered)", time.time()))
        files.touch(ctx.rendezvous / paths.REGISTERED)  # from now on a lost node is a failure, not a retry
        if driver is None:
            from launcher.driver import jobs
            driver = jobs.run
        if warming is not None:
            warming.join()  # no import of the driver's beside it (warm_imports)
        result = run_driver(driver, cfg, plan, ctx, signals, ray_proc)
        status["ok"] = True
        asked = stop.finish_stop_request(ctx.run_dir, ctx.job_id, result or {})
        return {"node": ctx.hostname, "role": "head", "result": result, "stop_requested": asked}
    except BaseException as e:
        status["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        with stop.ctrl_c_held():  # a second Ctrl-C ("stop now") must not leave the node's Ray behind
            files.write_json(ctx.rendezvous / paths.DONE, status)
            if not started:  # start_head stopped what it started
                pass
            elif any(t.name == "driver" and t.is_alive() for t in threading.enumerate()):
                stop_node(ctx, ray_proc)  # first: unblocks the abandoned driver's pending Ray calls
                disconnect()
            else:
                disconnect()
                stop_node(ctx, ray_proc)


def start_head(ctx: JobContext, cfg: Config, plan: plan_mod.Plan) -> subprocess.Popen:
    """`ray start --head` on this node, published in RUN/ray/<job>/head.json and connected to as the
    driver; its process (start_ray's reaper). A head whose own daemons die while it starts is stopped
    and started again, ray.join_retries attempts in all, as a worker node's join is: on a busy node
    (or one importing from a slow shared filesystem) Ray's raylet aborts when its dashboard agent has
    not written its port files within 15 s (raylet.out: "Timed out waiting for file
    .../dashboard_agent_listen_port_...", a wait Ray 2.60 neither skips nor lets one set), and the
    second start finds the agent's modules in the page cache. Whatever else fails is not retried."""
    ip = resolve_ip(ctx.hostnames[0])
    for attempt in range(1, cfg.ray.join_retries + 1):
        port = cfg.ray.port if cfg.topology.executor == "slurm" else free_port()
        since = time.time()
        proc = start_ray(ctx, cfg, plan.nodes[0], head_ip=ip, port=port, head=True)

        def died(proc=proc, since=since) -> str | None:
            return fatal_ray_error(ctx, since) or (ray_exit(ctx, proc) if proc.poll() is not None else None)

        try:
            try:
                wait_port(ip, port, timeout=60, proc=proc, what=f"the Ray head on {ctx.hostname}",
                          log_file=ctx.log_path("ray"))
            except ClusterError as e:  # only a head whose daemons died is started again
                dead = died()
                if dead is None:
                    raise
                raise HeadDied(f"{e}: {dead}") from None
            files.write_json(ctx.rendezvous / paths.HEAD, {"ip": ip, "port": port, "host": ctx.hostname})
            log(f"Ray head up at {ip}:{port} on {ctx.hostname} (job {ctx.job_id}); waiting for "
                f"{len(plan.nodes)} node(s)")
            connect(ctx, ip, port, cfg.ray.register_timeout_s, died=died)
            return proc
        except HeadDied as e:
            stop_node(ctx, proc)
            if attempt == cfg.ray.join_retries:
                raise ClusterError(f"the Ray head on {ctx.hostname} did not start in {attempt} attempt(s) "
                                   f"(ray.join_retries); last: {e}") from None
            log(f"{ctx.hostname}: attempt {attempt}/{cfg.ray.join_retries} to start the Ray head failed: {e}; "
                f"starting it again")
        except BaseException:
            stop_node(ctx, proc)
            raise
    raise AssertionError("unreachable")  # the loop returns or raises


# --------------------------------------------------------------------------------------- worker
def run_worker(ctx: JobContext, cfg: Config, plan: plan_mod.Plan) -> dict:
    """Join the head (retrying), stay until the driver is done, then stop Ray by PID."""
    node = plan.nodes[ctx.node_index]
    done = ctx.rendezvous / paths.DONE
    head_file = ctx.rendezvous / paths.HEAD
    deadline = time.time() + cfg.ray.register_timeout_s
    while not head_file.exists():
        if done.exists():
            return {"node": ctx.hostname, "role": "worker", "joined": False}
        if time.time() > deadline:
            return _report_failure(ctx, f"no Ray head published {head_file} within "
                                        f"{cfg.ray.register_timeout_s:.0f}s")
        time.sleep(0.5)
    try:
        head = records.load(head_file, records.HEAD)
    except records.RecordError as e:
        return _report_failure(ctx, str(e))
    try:
        wait_port(head["ip"], head["port"], timeout=cfg.ray.register_timeout_s, what="the Ray head")
    except ClusterError as e:
        return _report_failure(ctx, str(e))
    rng = random.Random()  # seeded from the OS: the nodes' retries must not line up again
    reason = ""
    for attempt in range(1, cfg.ray.join_retries + 1):
        if attempt > 1:
            time.sleep(retry_delay(attempt, cfg.ray.join_jitter_s, rng))
        started = time.time()
        proc = start_ray(ctx, cfg, node, head_ip=head["ip"], port=head["port"], head=False)
        watch = WorkerWatch(ctx, head, proc, started, rng=rng)
        try:
            while (state := watch.check(time.time())) is None:
                time.sleep(WORKER_TICK_S)
        finally:
            stop_node(ctx, proc)
        if state == "done" or done.exists():
            return {"node": ctx.hostname, "role": "worker", "joined": True, "attempts": attempt}
        if (ctx.rendezvous / paths.REGISTERED).exists():  # the run had started: rejoining cannot help it
            return _report_failure(ctx, ray_stopped(ctx, proc, watch.fatal), "left the Ray cluster")
        reason = watch.fatal or ray_exit(ctx, proc)
        log(f"{ctx.hostname}: attempt {attempt}/{cfg.ray.join_retries} to join failed: {reason}")
    return _report_failure(ctx, f"{cfg.ray.join_retries} attempts failed; last: {reason}")


def _report_failure(ctx: JobContext, reason: str, what: str = "cannot join the Ray cluster") -> dict:
    log(f"{ctx.hostname}: {what}: {reason}")
    write_node_report(ctx, reason)
    # exit 0: the driver reports the failure with the whole picture; a non-zero exit would make
    # srun (--kill-on-bad-exit) kill the driver before it can say what happened
    return {"node": ctx.hostname, "role": "worker", "joined": False, "error": reason}


def main(argv: list[str] | None = None) -> int:
    """`srun python -m launcher.cluster.bootstrap RUN_DIR`: the sbatch template's entry point."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m launcher.cluster.bootstrap",
                                     description="One task per node, inside a Slurm job (ray_job.sbatch runs it "
                                                 "through srun): node 0 runs the Ray head and the driver, the "
                                                 "others a Ray worker.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory the launcher wrote")
    run_dir = parser.parse_args(argv).run_dir  # a mistake: usage on stderr, exit code 2
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # lets submitit.JobEnvironment read the Slurm env
    stop.ignore_job_signals()  # default action: die; a worker task must outlive the checkpoint
    try:
        result = run_task(run_dir, plain_sbatch=True)
    except (ClusterError, config_mod.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    log(f"task done: {json.dumps(result, default=str)[:500]}")
    return 0  # a worker that could not join exits 0: the driver reports it (see _report_failure)


if __name__ == "__main__":
    sys.exit(main())
