"""Failures before the first step (start-up, resume) are one named line and a ClusterError, so
retry.max_restarts covers them too; a user's mistake stays a ConfigError."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.cluster.context import ClusterError, JobContext, doing
from launcher.config.schema import ConfigError
from launcher.driver.failures import StepFailed
from launcher.driver.grpo import GrpoRun


def ctx(**progress) -> JobContext:
    return JobContext(Path("/tmp/run"), "local-1", 0, 0, ["vm"], progress=dict(progress))


def test_a_phase_without_a_step_is_named_without_one():
    assert doing(ctx()) == ""
    assert doing(ctx(phase="resume")) == " during resume"   # was KeyError('step')
    assert doing(ctx(phase="training", step=3)) == " during training at step 3"


def _grpo(progress: dict) -> SimpleNamespace:
    return SimpleNamespace(ctx=ctx(**progress), plan=None, trainers=None, generators=None)


def test_a_failure_during_resume_is_a_step_failure_naming_the_phase():
    def load_state(path):
        raise RuntimeError("connection to rank 1 lost\nlong traceback text")

    with pytest.raises(StepFailed) as e:
        GrpoRun.named_failures(_grpo({"phase": "resume"}), load_state, "/ckpt")
    assert isinstance(e.value, ClusterError)  # what the restart policy retries
    assert str(e.value) == "RuntimeError during resume: connection to rank 1 lost"


def test_a_config_error_is_not_turned_into_a_retry():
    def start():
        raise ConfigError("data.train", "no such file")

    with pytest.raises(ConfigError):
        GrpoRun.named_failures(_grpo({"phase": "start-up"}), start)
    assert GrpoRun.named_failures(_grpo({}), lambda x: x + 1, 1) == 2


def test_submitits_checkpoint_hook_waits_for_the_save_after_a_sigterm():
    """A preemption is SIGTERM then USR2: the USR2 hook must wait for the step being saved even
    though SIGTERM already asked the driver to stop (else the requeue kills the save)."""
    import time

    from launcher.cluster import stop

    finished = []

    def driver(stop_event):
        stop_event.wait(5)
        time.sleep(0.5)  # the rest of the step and its checkpoint
        finished.append(time.time())

    with stop.running(driver, {}) as current:
        assert stop.request_stop("SIGTERM: stopping after the current step")  # the preemption's SIGTERM
        stop.stop_and_wait(budget_s=10)                                      # then submitit's USR2 hook
        assert finished, "returned before the driver had saved"
        current.thread.join(1)


def test_a_ray_call_after_the_driver_disconnected_raises_instead_of_starting_a_local_ray(tmp_path):
    """A lost node ends the run from the main thread, which stops the head and disconnects while
    the driver thread may still be in a step: that thread's next Ray call must fail, not start a
    new local Ray instance on the node (whose processes kept the Slurm task from exiting)."""
    import os
    import subprocess
    import sys

    from launcher.cluster.ray_node import driver_env

    env = {**os.environ, **driver_env(ctx()), "RAY_TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", "import ray; ray.put(1)"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "Ray has not been started yet" in p.stderr, p.stderr[-2000:]
    assert "Started a local Ray instance" not in p.stderr
    assert not list(tmp_path.iterdir())  # no session directory: nothing was started
