"""The trainer tests' batches: right-padded sequences of random tokens with a response span per row,
the same draw wherever a test asks for the same shape (tests/integration/test_trainer.py, test_moe.py,
test_nemotron_h.py, tests/gpu/conftest.py). Torch only: the unit tier may import it."""

from __future__ import annotations

import torch

ADVANTAGES = (1.0, -0.8, 0.5, -0.6)


def padded_batch(length: int, spans: list[tuple[int, int]], seed: int = 3, advantages=ADVANTAGES) -> dict:
    """len(spans) sequences of `length` tokens (ids 4..249, drawn with `seed`); row r's response is
    spans[r] = (start, end): its loss mask, and <pad> (0) after it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 250, (len(spans), length), generator=g)
    mask = torch.zeros(len(spans), length)
    for row, (start, end) in enumerate(spans):
        mask[row, start:end] = 1
        ids[row, end:] = 0  # <pad>
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.tensor(list(advantages[:len(spans)]))}


def with_prev(group, batch: dict) -> dict:
    """`batch` with the group's own log-probabilities as the previous policy's (an on-policy step)."""
    return {**batch, "prev_logprobs": group.logprobs(batch)}
