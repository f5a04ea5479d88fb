"""A rank killed mid-collective reaches the driver first as its peers' failed call (gloo's
"Connection reset by peer"); the run's error still names the rank that died (launcher.driver.failures)."""

from __future__ import annotations

import os
import re
import signal
from types import SimpleNamespace

import pytest

from tests.helpers.idle_actor import Idle

pytestmark = pytest.mark.integration


def _actors(ray, n: int) -> SimpleNamespace:
    actors = [ray.remote(Idle).options(num_cpus=0).remote() for _ in range(n)]
    return SimpleNamespace(actors=actors, infos=[{"pid": p} for p in ray.get([a.pid.remote() for a in actors])])


def _run(tmp_path, ray):
    from launcher import plan as plan_mod
    from launcher.cluster.context import JobContext
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    plan = plan_mod.build(typed(compose(["topology=slurm_3n"])).topology)
    ctx = JobContext(tmp_path, "7", 0, 0, ["node1", "node2", "node3"], progress={"phase": "refit", "step": 3})
    return ctx, plan, _actors(ray, plan.train_world), _actors(ray, plan.engines)


def test_a_peers_failed_collective_is_reported_as_the_rank_that_died(tmp_path, local_ray):
    from launcher.driver import failures
    from workers.trainer.group import TrainerGroupError

    ctx, plan, trainers, engines = _run(tmp_path, local_ray)
    busy = engines.actors[0].sleep.remote(30)  # an engine still generating: it answers no ping
    try:
        os.kill(trainers.infos[1]["pid"], signal.SIGKILL)  # Ray learns of it a moment later
        err = TrainerGroupError("trainer rank 0 (node 10.0.0.1) failed: RuntimeError: [gloo/transport/tcp/pair.cc:537]"
                                " Read error [127.0.0.1]:11661: Connection reset by peer")
        line = failures.describe(err, ctx, plan, trainers, engines)
        host = ctx.hostnames[plan.trainer_node(1)]
        pid = trainers.infos[1]["pid"]
        assert re.fullmatch(rf"trainer rank 1 on {host} \(pid {pid}\) died during refit at step 3: .+ \(then: "
                            r"trainer rank 0 \(node 10\.0\.0\.1\) failed: RuntimeError: .*Connection reset by peer\)",
                            line), line
    finally:
        for a in trainers.actors + engines.actors:
            local_ray.kill(a)
        del busy


def test_with_every_rank_alive_the_failed_call_itself_is_named(tmp_path, local_ray):
    from launcher.driver import failures
    from workers.trainer.group import TrainerGroupError

    ctx, plan, trainers, engines = _run(tmp_path, local_ray)
    try:
        err = TrainerGroupError("trainer rank 0 (node 10.0.0.1) failed: ValueError: bad batch")
        assert failures.describe(err, ctx, plan, trainers, engines) == (
            "TrainerGroupError during refit at step 3: trainer rank 0 (node 10.0.0.1) failed: ValueError: bad batch")
    finally:
        for a in trainers.actors + engines.actors:
            local_ray.kill(a)


def test_an_actor_ray_cannot_reach_is_not_named_dead(tmp_path, local_ray, monkeypatch):
    """ActorUnavailableError (its node's raylet refuses connections: a head or node going) is not a
    death: the failed call itself is named, never the ping's error (CI's Slurm fault test met it)."""
    from launcher.driver import failures
    from workers.trainer.group import TrainerGroupError

    ctx, plan, trainers, engines = _run(tmp_path, local_ray)
    real_get = local_ray.get

    def unavailable(ref, *a, **k):
        raise local_ray.exceptions.ActorUnavailableError("the actor is temporarily unavailable", b"\0" * 16)

    try:
        monkeypatch.setattr(local_ray, "get", unavailable)
        err = TrainerGroupError("trainer rank 0 (node 10.0.0.1) failed: RuntimeError: Connection reset by peer")
        assert failures.describe(err, ctx, plan, trainers, engines) == (
            "TrainerGroupError during refit at step 3: trainer rank 0 (node 10.0.0.1) failed: RuntimeError: "
            "Connection reset by peer")
    finally:
        monkeypatch.setattr(local_ray, "get", real_get)
        for a in trainers.actors + engines.actors:
            local_ray.kill(a)
