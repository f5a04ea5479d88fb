"""tests/helpers/batches.py, the trainer tests' batch: the mask covers each row's response span and
nothing else, the tokens after it are <pad>, and the same shape gives the same draw."""

from __future__ import annotations

import torch

from tests.helpers.batches import padded_batch, with_prev


def test_each_rows_response_span_is_its_mask_and_pad_follows_it():
    spans = [(4, 14), (5, 9), (6, 12)]
    b = padded_batch(14, spans)
    assert b["input_ids"].shape == b["loss_mask"].shape == (3, 14)
    for row, (start, end) in enumerate(spans):
        assert b["loss_mask"][row].nonzero().flatten().tolist() == list(range(start, end))
        assert b["input_ids"][row, end:].eq(0).all() and b["input_ids"][row, :end].ge(4).all()
    assert torch.equal(b["advantages"], torch.tensor([1.0, -0.8, 0.5]))
    assert torch.equal(padded_batch(14, spans)["input_ids"], b["input_ids"])        # the same draw
    assert not torch.equal(padded_batch(14, spans, seed=4)["input_ids"], b["input_ids"])


def test_with_prev_adds_the_groups_own_logprobs_and_leaves_the_batch_alone():
    class Group:
        def logprobs(self, batch):
            return torch.full(batch["input_ids"].shape, -1.5)

    b = padded_batch(8, [(2, 8), (3, 5)])
    out = with_prev(Group(), b)
    assert "prev_logprobs" not in b and out["prev_logprobs"].eq(-1.5).all() and out["input_ids"] is b["input_ids"]
