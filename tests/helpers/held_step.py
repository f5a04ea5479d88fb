"""Acting on a run at a known step. A run with HELD_REWARD (tests/helpers/held_reward.py) waits in
the rewards of step HELD_STEP until `release(run)`: a test signals, kills or stops something while
that step runs, on a machine of any speed (a poll for "N steps logged" can find the run finished)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from tests.helpers import held_reward

HELD_REWARD = [f"reward.fn={Path(held_reward.__file__).resolve()}:reward", "reward.timeout_s=600"]
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
