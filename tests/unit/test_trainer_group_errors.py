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


def test_the_driver_names_the_remote_method_and_its_exception():
    ray = pytest.importorskip("ray")
    from launcher.driver import failures

    class Ctx:
        progress = {"phase": "generation", "step": 3}

    err = ray.exceptions.RayTaskError("VllmGenerator.generate", "Traceback ...\nValueError: bad", ValueError("bad"),
                                      pid=12, ip="10.0.0.5")
    assert failures.describe(err, Ctx(), None, None, None) == (
        "VllmGenerator.generate (pid 12, 10.0.0.5) failed during generation at step 3: ValueError: bad")
