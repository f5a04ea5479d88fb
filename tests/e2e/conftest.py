"""The e2e tier's shared runs: a whole run costs 25-60 s of start-up (Ray, the trainers' first
Megatron import, the vLLM engine) against ~0.5 s per tiny step, so a finished run that several
tests can read is launched once per session and read by all of them (docs/testing.md).

    def test_x(trained_run, tmp_path):                # the embedded default, 4 steps: tests/e2e/test_grpo_local.py
        trained_run.rows(), trained_run.checkpoint(2), trained_run.stdout
        run = trained_run.copy(tmp_path, until_step=2)   # to resume or damage: never the shared one

    def test_y(shared_run):                             # any other finished run, launched on first use
        run = shared_run("model=tiny_qwen3_moe", "grpo.max_num_steps=2")

A shared run must not be written to: each is checked unchanged at the end of the session.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.runs import SharedRun, launch

# The embedded default as a user runs it, short: 4 steps, a checkpoint after every one, all kept.
TRAINED = ("grpo.max_num_steps=4", "checkpointing.save_period=1", "checkpointing.keep_top_k=null",
           "logging.tensorboard=false")


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """shared_run(*overrides) -> SharedRun: `python -m launcher OVERRIDES` run to its end once per
    session (the first test that asks launches it), with a private TMPDIR that must stay empty."""
    runs: dict[tuple[str, ...], SharedRun] = {}

    def get(*overrides: str, timeout: float = 900) -> SharedRun:
        if overrides not in runs:
            base = tmp_path_factory.mktemp("shared")
            temp = base / "tmp"
            temp.mkdir()
            env = {**os.environ, "TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": str(base / "torch-cache")}
            p = launch(base / "runs", *overrides, timeout=timeout, env=env)
            run_dir = [d for d in (base / "runs").iterdir() if d.is_dir() and d.name != "models"]
            assert len(run_dir) == 1, run_dir
            run = SharedRun(root=base / "runs", dir=run_dir[0], overrides=overrides, stdout=p.stdout,
                            stderr=p.stderr, temp_dir=temp)
            run.seal()
            runs[overrides] = run
        return runs[overrides]

    yield get
    for run in runs.values():
        run.check_unchanged()


@pytest.fixture(scope="session")
def trained_run(shared_run) -> SharedRun:
    """The embedded default, 4 steps, checkpoints step_1..step_4 (TRAINED)."""
    return shared_run(*TRAINED)
