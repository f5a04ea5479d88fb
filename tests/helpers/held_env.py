"""A user environment file (`env.fn=tests/helpers/held_env.py:HeldGuess`) that lets a test act at a
known step of a multi-turn run: the guess_number demo's environment, except that its answers in step
3 (the first with two metrics rows in the run directory) wait until the test writes
RUN/rewards_released, as tests/helpers/held_reward.py does for rewards (its HELD / RELEASED files,
MAX_WAIT_S bound). The launcher copies this file into RUN/env/ at submission: the run directory is
the parent of this file's folder."""

from __future__ import annotations

from launcher.driver.envs.guess_number import GuessNumber
from tests.helpers.held_reward import hold


class HeldGuess(GuessNumber):
    def respond(self, reply: str) -> dict:
        hold(__file__)
        return super().respond(reply)
