"""A trainer rank's exception reaches the user as one line naming it, not Ray's `ray::Class.method()` header."""

from __future__ import annotations

import pytest

from workers.trainer.group import task_error_line


def test_a_remote_exception_is_its_type_and_message():
    ray = pytest.importorskip("ray")
    cause = AssertionError("ChainedOptimizer has more than one optimizer")
    err = ray.exceptions.RayTaskError("MegatronTrainer.save_state", "Traceback (most recent call last):\n  ...\n"
                                      "AssertionError: ChainedOptimizer has more than one optimizer", cause)
    assert "(pid=" in str(err).splitlines()[0]  # the header the message used to show, and nothing else
    assert task_error_line(err) == "AssertionError: ChainedOptimizer has more than one optimizer"


def test_without_a_cause_the_last_line_of_the_traceback():
    class Opaque(Exception):
        def __str__(self):
            return "ray::X.f() (pid=1)\nTraceback (most recent call last):\n  File ...\nKeyError: 'w'\n"

    assert task_error_line(Opaque()) == "KeyError: 'w'"


def _job(tmp_path, phase: str, step: int, rendezvous: bool = False):
    from launcher import plan as plan_mod
    from launcher.cluster.context import JobContext
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    plan = plan_mod.build(typed(compose(["topology=slurm_3n"])).topology)
    ctx = JobContext(tmp_path, "7", 0, 0, ["node1", "node2", "node3"], progress={"phase": phase, "step": step})
    if rendezvous:  # where the nodes' reports go (failed_node<i>.json)
        ctx.rendezvous.mkdir(parents=True)
    return ctx, plan


def test_the_driver_names_the_remote_method_and_its_exception(tmp_path):
    ray = pytest.importorskip("ray")
    from launcher.driver import failures

    ctx, plan = _job(tmp_path, "generation", 3)
    err = ray.exceptions.RayTaskError("VllmGenerator.generate", "Traceback ...\nValueError: bad", ValueError("bad"),
                                      pid=12, ip="10.0.0.5")
    assert failures.describe(err, ctx, plan, None, None) == (
        "VllmGenerator.generate (pid 12, 10.0.0.5) failed during generation at step 3: ValueError: bad")


def test_a_collective_that_failed_with_a_peers_node_names_that_node(tmp_path):
    """A trainer rank's gloo/NCCL error when its peer's node went: the node's report is named too."""
    pytest.importorskip("ray")
    from launcher.files import write_json
    from launcher.driver import failures
    from workers.trainer.group import TrainerGroupError

    ctx, plan = _job(tmp_path, "training", 3, rendezvous=True)
    write_json(ctx.rendezvous / "failed_node0.json", {"node_index": 0, "host": "node1", "reason": "this node's Ray "
                                                      "stopped: `ray start` exited with code 1", "log": "L"})
    err = TrainerGroupError("trainer rank 1 (node2) failed: RuntimeError: Connection reset by peer")
    assert failures.describe(err, ctx, plan, None, None) == (
        "TrainerGroupError during training at step 3: trainer rank 1 (node2) failed: RuntimeError: Connection reset "
        "by peer; node 0 (node1, train) left the Ray cluster: this node's Ray stopped: `ray start` exited with code 1 "
        "(log: L)")
