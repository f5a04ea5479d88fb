"""Acting on a run at a known step. A run with HELD_REWARD (tests/helpers/held_reward.py) waits in
the rewards of step HELD_STEP until `release(run)` (with HELD_ENV, in its episodes' environment): a test signals, kills or stops something while
that step runs, on a machine of any speed (a poll for "N steps logged" can find the run finished)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Callable

from tests.helpers import held_env, held_reward

HELD_REWARD = [f"reward.fn={Path(held_reward.__file__).resolve()}:reward", "reward.timeout_s=600"]
# the multi-turn demo whose environment's answers wait the same way (tests/helpers/held_env.py)
HELD_ENV = ["env=guess_number", f"env.fn={Path(held_env.__file__).resolve()}:HeldGuess", "reward.timeout_s=600"]
HELD_STEP = held_reward.HOLD_AFTER_STEPS + 1


def steps_logged(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in f.read_text().splitlines()] if f.exists() else []


def wait_until(what: str, done: Callable[[], object], ended: Callable[[], str | None], timeout: float) -> None:
    """Until done(); `ended()` is None while the run lives, else what to say (it ended first)."""
    deadline = time.time() + timeout
    while not done():
        why = ended()
        assert why is None, (f"the run ended while waiting for {what}", why)
        assert time.time() < deadline, f"still waiting for {what} after {timeout:.0f}s"
        time.sleep(0.2)


def wait_held(run: Path, ended: Callable[[], str | None], timeout: float) -> None:
    """Until step HELD_STEP's rewards are held (steps before it are logged, none after)."""
    wait_until(f"step {HELD_STEP}'s rewards to be held", (run / held_reward.HELD).exists, ended, timeout)
    assert steps_logged(run) == list(range(1, HELD_STEP))


def release(run: Path) -> None:
    (run / held_reward.RELEASED).touch()


def ctrl_c_while_held(run, max_steps: int) -> int:
    """A pipelined `Background` run with HELD_REWARD (or held_env): Ctrl-C while a rollout generated
    ahead is held, then release it. The run finishes its step, checkpoints it with the held rollout
    kept, and exits 130; returns that step."""
    wait_until("a rollout to be held", (run.run_dir / held_reward.HELD).exists, run.ended, timeout=600)
    os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: finish the step, checkpoint, stop
    release(run.run_dir)
    rc = run.finish(timeout=300)
    out = "".join(run.out)
    assert rc == 130, out[-3000:] + "".join(run.err)[-2000:]
    k = int(re.search(rf"stopped at step (\d+)/{max_steps}", out).group(1))
    info = json.loads((run.run_dir / "checkpoints" / f"step_{k}" / "training_info.json").read_text())
    assert info["pipeline"] == {"max_lag": 1, "ahead": [k + 1]}  # the rollout in flight was kept
    return k
