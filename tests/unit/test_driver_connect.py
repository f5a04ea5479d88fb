"""The driver's connection to its head: a head whose raylet registers late (a busy node) is tried
again within ray.register_timeout_s, and named when it never answers.

What `ray.init` raises here is Ray's own error for this case (ray/_private/worker.py: "Failed to
connect to Ray cluster at <gcs>" after get_node_to_connect_for_driver gave up); seen in CI when the
head's raylet registered more than Ray's 60 s after its GCS port opened, at a load of 40. Making a
raylet that slow on purpose is not possible here, so `ray.init` is replaced by one that fails as Ray
does; the loop, the clock and the message are the code under test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from launcher.cluster import ray_node
from launcher.cluster.context import ClusterError, JobContext


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # driver_env writes the job's token path into it
    return JobContext(tmp_path, "local-1", 0, 0, ["vm"])


def failing_init(clock: Clock, failures: int, each_s: float, calls: list):
    def init(address, **kwargs):
        calls.append(address)
        clock.t += each_s  # Ray's own wait for the head's raylet
        if len(calls) <= failures:
            raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:59277")
    return init


def test_a_head_whose_raylet_registers_late_is_connected_to_on_a_later_try(ctx, monkeypatch, capsys):
    clock, calls = Clock(), []
    monkeypatch.setattr(ray, "init", failing_init(clock, failures=1, each_s=60.0, calls=calls))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    ray_node.connect(ctx, "127.0.0.1", 59277, timeout_s=120.0, clock=clock, sleep=clock.sleep)
    assert calls == ["127.0.0.1:59277", "127.0.0.1:59277"]
    out = capsys.readouterr().out
    assert "could not connect to the Ray head at 127.0.0.1:59277 yet" in out and "trying again" in out
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(ctx.rendezvous / "token")


def test_a_head_that_never_answers_is_named_once_register_timeout_s_has_passed(ctx, monkeypatch):
    clock, calls = Clock(), []
    monkeypatch.setattr(ray, "init", failing_init(clock, failures=10**6, each_s=60.0, calls=calls))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ClusterError) as e:
        ray_node.connect(ctx, "127.0.0.1", 59277, timeout_s=120.0, clock=clock, sleep=clock.sleep)
    assert len(calls) == 2  # at 0 s and 61 s; the second ends past the deadline (120 s)
    assert str(e.value) == ("the driver could not connect to the Ray head at 127.0.0.1:59277 in "
                            "ray.register_timeout_s=120: Failed to connect to Ray cluster at 192.0.2.2:59277")


def test_a_head_whose_daemons_died_is_not_tried_again(ctx, monkeypatch):
    """bootstrap.start_head passes `died` (the raylet's fatal line from its log, or the exit of `ray
    start`): a dead head ends the tries at once, as HeadDied, which start_head answers by starting the
    head again (tests/integration/test_local_launch.py)."""
    clock, calls = Clock(), []
    monkeypatch.setattr(ray, "init", failing_init(clock, failures=10**6, each_s=60.0, calls=calls))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ray_node.HeadDied) as e:
        ray_node.connect(ctx, "127.0.0.1", 59277, timeout_s=120.0, clock=clock, sleep=clock.sleep,
                         died=lambda: "raylet died: Timed out waiting for file /x/metrics_agent_port_1 (log: /r)")
    assert len(calls) == 1
    assert str(e.value) == ("the Ray head at 127.0.0.1:59277 is down: raylet died: Timed out waiting for file "
                            "/x/metrics_agent_port_1 (log: /r)")
