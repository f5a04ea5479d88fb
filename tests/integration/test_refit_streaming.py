"""Refit through the Ray object store streams too: trainer rank 0 holds one bucket's worth of the
exported tensors at once, on the first refit of a kind (when the layout is new) and after it
(tests/unit/test_refit_buckets.py checks the broadcast transport the same way). The receiving
side is workers.refit.transports.RayTransport.receive, in this process."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.exports import SIZES, CountingExport, assert_bounded
from workers.refit.sender import Sender
from workers.refit.transports import RayTransport

pytestmark = pytest.mark.integration


def test_ray_transport_send_holds_one_bucket_of_the_export(local_ray):
    sender, layouts = Sender(), {}
    for seed, first in ((1, True), (2, False)):
        export = CountingExport(SIZES, seed=seed)
        payload = sender.payload(export, "merged", bucket_mb=8192 / 2**20)
        assert (payload.layout_bytes > 0) == first and len(payload.buckets) > 5
        assert_bounded(export, 8192)
        incoming = RayTransport().receive(payload.to_spec(), layouts)
        got = [(n, t.clone()) for n, t in incoming.stream]
        assert incoming.layout_received == first
        assert [n for n, _ in got] == [n for n, _ in export.made]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(export.made, got))
