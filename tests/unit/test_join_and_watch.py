"""Joining and watching a job's Ray cluster cost the same per node at 1, 16 and 1,024 nodes
(issue 21): the join schedule has no term in the node's index, the driver's deadline follows the
nodes' progress, and the watch loop's checks per second do not grow with the node count.

Pure functions and the real watch classes, driven by a simulated clock: no Ray, no sleeps. The
costs are counted where they are paid: calls of the function that asks the GCS, and the
filesystem calls (os.stat, os.scandir and the entries it yields, io.open) on the shared run
directory, which is laid out as a 1,024-node job's is (a Ray log and task logs per node)."""

from __future__ import annotations

import io
import os
import random
import subprocess
from pathlib import Path

import pytest

from launcher import plan as plan_mod
from launcher.cluster import watch as watch_mod
from launcher.cluster.context import ClusterError, JobContext
from launcher.cluster.join import JoinDeadline, index_ranges, retry_delay
from launcher.cluster.ray_node import wait_for_nodes
from launcher.config.schema import Config, GenerationRole, Topology, TrainRole

SIZES = (1, 16, 1024)


def plan_of(n: int) -> plan_mod.Plan:
    if n == 1:
        return plan_mod.build(Topology(nodes=1, colocate_roles=True))
    half = n // 2
    return plan_mod.build(Topology(name=f"t{n}", executor="slurm", nodes=n, train=TrainRole(nodes=half),
                                   generation=GenerationRole(nodes=n - half, engines=n - half)))


def job(tmp_path: Path, n: int, node_index: int = 0) -> JobContext:
    """A job's context and its run directory as a run of n nodes leaves it on the shared disk."""
    run = tmp_path / f"run{n}"
    ctx = JobContext(run, f"t{os.getpid()}n{n}", 0, node_index, [f"node{i + 1}" for i in range(n)])
    ctx.rendezvous.mkdir(parents=True)
    for name in ("token", "head.json", "registered"):
        (ctx.rendezvous / name).write_text("{}")
    for d in ("logs", f"submitit/{ctx.job_id}"):
        (run / d).mkdir(parents=True)
    for i, host in enumerate(ctx.hostnames):
        (run / "logs" / f"ray-{host}.log").write_text("x")
        (run / "submitit" / ctx.job_id / f"{ctx.job_id}_{i}_log.out").write_text("x")
    return ctx


# ------------------------------------------------------------------------------ join schedule
@pytest.mark.parametrize("n", SIZES)
def test_every_worker_starts_ray_at_once_and_retries_spread_within_the_bound(n):
    rng, jitter = random.Random(n), 10.0
    first = [retry_delay(1, jitter, rng) for _ in range(1, n)]
    assert first == [0.0] * (n - 1)  # the last node starts when the first does: no term in its index
    retries = [retry_delay(a, jitter, rng) for _ in range(1, n) for a in (2, 3)]
    assert all(0.0 <= d < jitter for d in retries)
    # a node's whole join: its attempts plus at most (retries - 1) x jitter of waiting, for any n
    assert sum(max(retry_delay(a, jitter, rng) for _ in range(200)) for a in (1, 2, 3)) < 2 * jitter
    if n >= 1024:  # a herd of refused nodes comes back spread over the window, not together again
        per_second = [sum(1 for d in retries if s <= d < s + 1) for s in range(10)]
        assert max(per_second) < 2 * len(retries) / 10, per_second


def test_no_jitter_means_an_immediate_retry():
    assert retry_delay(2, 0.0, random.Random(0)) == 0.0


# ------------------------------------------------------------------------------ deadline rule
@pytest.mark.parametrize("n", SIZES)
def test_the_driver_waits_while_nodes_keep_registering(n):
    """Nodes register one every 0.3 s: 1,024 of them take 307 s, more than twice the 120 s window."""
    d = JoinDeadline(range(n), stall_s=120.0, now=0.0)
    t = 0.0
    while not d.complete():
        t += 0.5
        d.observe(range(min(n, int(t / 0.3) + 1)), t)
        assert not d.expired(t), (t, len(d.missing))
    assert t == pytest.approx(max(0.5, (n - 1) * 0.3), abs=0.5)


@pytest.mark.parametrize("n", SIZES[1:])
def test_the_driver_fails_when_no_further_node_registered_for_the_window(n):
    """All but three nodes register within 10 s; the window starts at the last one."""
    stuck = {1, n // 2, n - 1}
    joins = {i: i * 10.0 / n for i in range(n) if i not in stuck}
    d = JoinDeadline(range(n), stall_s=120.0, now=0.0)
    for tick in range(1, 21):
        d.observe([i for i, at in joins.items() if at <= tick * 0.5], tick * 0.5)
    last = 0.5 * -(-max(joins.values()) // 0.5)  # the first observation after the last join
    assert d.last_progress == last
    assert not d.expired(last + 120.0)
    assert d.expired(last + 120.5)
    assert d.missing == sorted(stuck)


def test_a_node_that_registers_again_is_not_progress():
    d = JoinDeadline(range(3), stall_s=10.0, now=0.0)
    d.observe([0, 1], 1.0)
    d.observe([0], 2.0)       # node 1 dropped out of Ray's list
    d.observe([0, 1], 9.0)    # and came back: not a new node
    assert d.missing == [2] and d.expired(11.5)


def test_index_ranges():
    assert index_ranges([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    assert index_ranges(range(24, 1024)) == "24-1023"
    assert index_ranges([]) == ""


class SimulatedRay:
    """Ray's node list as the head would see it while `joins[i]` (seconds) is when node i registers;
    the clock advances only when the code under test sleeps."""

    def __init__(self, joins: dict[int, float]):
        self.joins, self.t, self.calls = joins, 0.0, 0

    def alive(self) -> set[str]:
        self.calls += 1
        return {plan_mod.node_resource(i) for i, at in self.joins.items() if at <= self.t}

    def sleep(self, s: float) -> None:
        self.t += s


def test_wait_for_nodes_at_1024_waits_out_a_long_join_and_names_stragglers_in_one_line(tmp_path, capsys):
    n, cfg = 1024, Config()
    plan, ctx = plan_of(n), job(tmp_path, n)
    ray = SimulatedRay({i: 5.0 + i * 0.2 for i in range(n)})  # 210 s in all, the window 120 s
    wait_for_nodes(ctx, cfg, plan, query=ray.alive, clock=lambda: ray.t, sleep=ray.sleep)
    assert f"all {n} node(s) registered in 210.0s" in capsys.readouterr().out  # the first poll after 209.6 s
    assert ray.calls == 421  # one GCS call per 0.5 s poll, not one per node

    stuck = set(range(100, 1000))
    ray = SimulatedRay({i: 1.0 + i * 0.01 for i in range(n) if i not in stuck})
    with pytest.raises(ClusterError) as e:
        wait_for_nodes(ctx, cfg, plan, query=ray.alive, clock=lambda: ray.t, sleep=ray.sleep)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 3000
    assert msg.startswith("900 of 1024 node(s) did not register with the Ray head: no further node registered "
                          "for 120.5s (ray.register_timeout_s=120; the last of 124 registered 11.5s after the head "
                          "started): node 100 (node101, train; log: "), msg
    assert msg.endswith("; and 884 more: nodes 116-999"), msg[-200:]
    assert ray.t == 132.0  # the first poll more than 120 s after the one that saw node 1023 (at 11.23 s)


def test_wait_for_nodes_fails_at_once_naming_a_node_that_could_not_join(tmp_path):
    plan, ctx = plan_of(16), job(tmp_path, 16)
    watch_mod.write_node_report(JobContext(ctx.run_dir, ctx.job_id, 0, 8, ctx.hostnames), "raylet died: port taken")
    ray = SimulatedRay({0: 0.0})
    with pytest.raises(ClusterError, match=r"^node 8 \(node9, generation\) could not join the Ray cluster: "
                                           r"raylet died: port taken"):
        wait_for_nodes(ctx, Config(), plan, query=ray.alive, clock=lambda: ray.t, sleep=ray.sleep)
    assert ray.t == 0.0


# ------------------------------------------------------------------------------ watch loop cost
class FsCount:
    """Counts the filesystem calls on paths below `root` (the shared run directory)."""

    def __init__(self, monkeypatch, root: Path):
        self.root = str(root)
        self.n = {"stat": 0, "scandir": 0, "entries": 0, "open": 0}
        real_stat, real_scandir, real_open, real_os_open = os.stat, os.scandir, io.open, os.open
        count = self

        class Listing:
            def __init__(self, it):
                self.it = it

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.it.close()

            def __iter__(self):
                for entry in self.it:
                    count.n["entries"] += 1
                    yield entry

        def stat(path, *a, **kw):
            self._add("stat", path)
            return real_stat(path, *a, **kw)

        def scandir(path="."):
            self._add("scandir", path)
            return Listing(real_scandir(path))

        def open_(file, *a, **kw):
            self._add("open", file)
            return real_open(file, *a, **kw)

        def os_open(file, *a, **kw):  # the bounded reader's one open (bounded.open_regular)
            self._add("open", file)
            return real_os_open(file, *a, **kw)

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os, "scandir", scandir)
        monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(os, "open", os_open)

    def _add(self, what: str, path) -> None:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(self.root):
            self.n[what] += 1


@pytest.fixture
def ray_start_stand_in():
    """A live process in place of the node's `ray start` (only its liveness is read)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_heads_checks_cost_the_same_at_1_16_and_1024_nodes(tmp_path, monkeypatch, ray_start_stand_in):
    costs = {}
    for n in SIZES:
        plan, ctx = plan_of(n), job(tmp_path, n)
        everyone = {plan_mod.node_resource(i) for i in range(n)}
        gcs_calls = []
        watch = watch_mod.HeadWatch(ctx, plan, ray_start_stand_in, query=lambda: gcs_calls.append(1) or everyone)
        fs = FsCount(monkeypatch, ctx.run_dir)
        for tick in range(120):  # a minute of the loop (it ticks every 0.5 s)
            watch.tick(tick * 0.5)
            if watch.nodes._thread is not None:
                watch.nodes._thread.join()  # the query's answer is in before the next check
        monkeypatch.undo()
        costs[n] = (len(gcs_calls), dict(fs.n))
    assert costs[1] == costs[16] == costs[1024], costs
    gcs, fs = costs[1024]
    assert gcs == 30  # one GCS call per 2 s check, for the whole cluster
    # per check: one listing of the rendezvous directory (its few fixed files), never of the logs
    assert fs["scandir"] == 30 and fs["entries"] == 30 * 3, fs
    assert fs["open"] == 120 and fs["stat"] <= 120, fs  # the stop request, read every 0.5 s


def test_the_heads_check_names_a_lost_node_among_1024(tmp_path, ray_start_stand_in):
    plan, ctx = plan_of(1024), job(tmp_path, 1024)
    alive = {plan_mod.node_resource(i) for i in range(1024) if i != 700}
    watch = watch_mod.HeadWatch(ctx, plan, ray_start_stand_in, query=lambda: alive)
    watch.tick(0.0)
    watch.nodes._thread.join()
    with pytest.raises(ClusterError, match=r"^node 700 \(node701, generation\) is no longer alive"):
        watch.tick(2.0)


@pytest.mark.parametrize("n", SIZES)
def test_a_workers_checks_cost_the_same_at_any_node_count(tmp_path, monkeypatch, ray_start_stand_in, n):
    ctx = job(tmp_path, n, node_index=n - 1)
    probes = []
    w = watch_mod.WorkerWatch(ctx, {"ip": "10.0.0.1", "port": 6379, "host": "node1"}, ray_start_stand_in,
                              started=0.0, probe=lambda ip, port: probes.append(ip) or True, rng=random.Random(n))
    fs = FsCount(monkeypatch, ctx.run_dir)
    states = [w.check(float(t)) for t in range(60)]  # a minute of ticks, one a second
    monkeypatch.undo()
    assert states == [None] * 60
    # on the shared disk: one stat of `done` a second, no listing; the head's GCS: one probe per 10 s
    assert fs.n == {"stat": 60, "scandir": 0, "entries": 0, "open": 0}, fs.n
    assert len(probes) == 6
    (ctx.rendezvous / "done").write_text("{}")
    assert w.check(60.0) == "done"


def test_a_worker_gives_up_on_a_head_that_stopped_answering(tmp_path, ray_start_stand_in):
    ctx = job(tmp_path, 2, node_index=1)
    slept = []
    w = watch_mod.WorkerWatch(ctx, {"ip": "10.0.0.1", "port": 6379, "host": "node1"}, ray_start_stand_in,
                              started=0.0, probe=lambda ip, port: False, rng=random.Random(0), grace_s=0.05,
                              sleep=slept.append)
    with pytest.raises(ClusterError, match="the Ray head node1 stopped answering"):
        for t in range(11):
            w.check(float(t))


def test_rays_health_checks_are_the_ray_sections_in_every_ray_start():
    """The GCS reads RAY_health_check_* when it starts; every node's `ray start` gets them (the
    stress test on Slurm: tests/slurm/test_launcher_on_slurm.py). The defaults outlast a minute's
    silence and still report a refused node within the 60 s the lost-node tests promise."""
    from launcher.cluster.ray_node import health_check_env
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    default = typed(compose([])).ray
    assert default.health_check_failure_threshold * default.health_check_period_s <= 60  # a node that is gone
    assert default.health_check_failure_threshold * (default.health_check_timeout_s + default.health_check_period_s) \
        > 5 * (10 + 3) + 60   # a node that answers nothing: well past Ray's own ~65 s
    env = health_check_env(typed(compose(["ray.health_check_period_s=2.5", "ray.health_check_timeout_s=45",
                                          "ray.health_check_failure_threshold=7"])))
    assert env == {"RAY_health_check_period_ms": "2500", "RAY_health_check_timeout_ms": "45000",
                   "RAY_health_check_failure_threshold": "7"}
