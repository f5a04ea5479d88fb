"""Prompt datasets and verifiable rewards.

The order in which prompts are served is a pure function of (seed, epoch, position): a resumed
run that knows how many prompts it consumed serves exactly the prompts an uninterrupted run
would have served next. No iterator state to save.

- `say_number` (the embedded demo): "say numbers between 40 and 49 ." rewarded with the fraction
  of the answer's words that are numbers in the range. A random tiny model rarely does this
  (about 4% of its vocabulary qualifies); LoRA on attention learns it in a few minutes on CPU.
- `math_add` (for real models): "what is 12 + 25 ? give only the answer ." rewarded 1 when the
  first number in the answer is the sum (the reference's smoke prompt, with random operands).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    index: int
    prompt: str
    target: Any


def _say_number(seed: int) -> list[Example]:
    lows = (10, 40, 70, 100)
    return [Example(i, f"say numbers between {lo} and {lo + 9} .", [lo, lo + 9]) for i, lo in enumerate(lows)]


def _math_add(seed: int, n: int = 256) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(Example(i, f"what is {a} + {b} ? give only the answer .", a + b))
    return out


DATASETS = {"say_number": _say_number, "math_add": _math_add}


class PromptDataset:
    """Examples served in a per-epoch shuffled order derived from (seed, epoch)."""

    def __init__(self, name: str, seed: int):
        self.name = name
        self.seed = seed
        self.examples = DATASETS[name](seed)

    def __len__(self) -> int:
        return len(self.examples)

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.examples)))
        random.Random(f"{self.name}:{self.seed}:{epoch}").shuffle(idx)
        return idx

    def take(self, position: int, n: int) -> list[Example]:
        """The n examples served from global position `position` (position = prompts consumed)."""
        out = []
        for p in range(position, position + n):
            epoch, k = divmod(p, len(self.examples))
            out.append(self.examples[self.order(epoch)[k]])
        return out


_INT = re.compile(r"-?\d+")


def say_number(response: str, target: list[int]) -> float:
    words = response.split()
    hits = sum(1 for w in words if _INT.fullmatch(w) and target[0] <= int(w) <= target[1])
    return hits / len(words) if words else 0.0


def math_answer(response: str, target: int) -> float:
    m = _INT.search(response)
    return 1.0 if m is not None and int(m.group()) == int(target) else 0.0


REWARDS = {"say_number": say_number, "math_answer": math_answer}
