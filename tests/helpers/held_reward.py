"""A user reward file (`reward.fn=tests/helpers/held_reward.py:reward`) that lets a test preempt a
Slurm job at a known step: the say_number reward, except that the rewards of step 3 (the first with
two metrics rows in the run directory) wait until the test writes RUN/rewards_released.

The launcher copies this file into RUN/reward/ at submission, so the run directory is the parent of
this file's folder. While it waits, RUN/rewards_held exists. The hold lasts MAX_WAIT_S at most (from
the first held call, for all calls): a test that does not release sees wrong rewards, not a hang."""

from __future__ import annotations

import time
from pathlib import Path

from launcher.driver.rewards import say_number

HELD, RELEASED = "rewards_held", "rewards_released"
HOLD_AFTER_STEPS = 2
MAX_WAIT_S = 300.0


def hold(copy: str) -> None:
    """In step HOLD_AFTER_STEPS + 1 and after, wait until RUN/rewards_released (or MAX_WAIT_S):
    `copy` is the __file__ of the run's copy of the calling file (RUN/<room>/<file>)."""
    run = Path(copy).resolve().parents[1]
    metrics = run / "metrics.jsonl"
    rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    if rows >= HOLD_AFTER_STEPS and not (run / RELEASED).exists():
        held = run / HELD
        if not held.exists():
            held.touch()
        deadline = held.stat().st_mtime + MAX_WAIT_S
        while not (run / RELEASED).exists() and time.time() < deadline:
            time.sleep(0.05)


def reward(response: str, example: dict) -> float:
    hold(__file__)
    return say_number(response, example["answer"])
