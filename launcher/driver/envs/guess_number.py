"""env=guess_number, the multi-turn demo: the model guesses a hidden number in [low, high] and
the environment answers "no , plus ." (higher) or "no , minus ." (lower) until it is found or the
turns run out. Words of the tiny models' vocabulary (workers.tiny_models), so a random tiny model
reads them.

Reward per turn: 0.3 x the fraction of the reply's words that are numbers in [low, high] (what a
random model can learn first, as in the say_number demo), and 1 when the reply's first number is
the hidden one (the episode ends). A record: {"low": 40, "high": 49, "secret": 44}
(launcher.driver.data's built-in `guess_number` set).
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, example: dict):
        self.low, self.high, self.secret = int(example["low"]), int(example["high"]), int(example["secret"])

    def first_messages(self) -> list[dict]:
        return [{"role": "user", "content": f"say a number between {self.low} and {self.high} ."}]

    def respond(self, reply: str) -> dict:
        words = reply.split()
        hits = sum(1 for w in words if _INT.fullmatch(w) and self.low <= int(w) <= self.high)
        shaped = 0.3 * hits / len(words) if words else 0.0
        first = _INT.search(reply)
        if first is not None and int(first.group()) == self.secret:
            return {"messages": [], "reward": 1.0 + shaped, "done": True, "metrics": {"found": 1.0}}
        hint = "say a number ." if first is None else ("no , plus ." if int(first.group()) < self.secret
                                                       else "no , minus .")
        return {"messages": [{"role": "user", "content": hint}], "reward": shaped, "done": False,
                "metrics": {"found": 0.0}}
