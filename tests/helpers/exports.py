"""Test-only stand-ins for a trainer's export: each tensor made when it is asked for, and counted.

Used by tests/unit/test_refit_buckets.py (broadcast transport) and tests/integration/
test_refit_streaming.py (Ray object store): a refit sender must hold at most one bucket's worth of
the exported tensors at once, on the first refit of a kind too.
"""

from __future__ import annotations

import weakref

import torch

# float32 numels: 40 B .. 16 KB, 180 KB in all; with 8 KiB buckets most tensors share one and the
# largest travel alone
SIZES = [300, 1200, 50, 700, 700, 4000, 10, 10, 2500, 900, 64, 1100, 300, 300, 3000] * 3


class CountingExport:
    """An export that makes each tensor when it is asked for (as the Bridge's export does) and,
    each time, counts the tensors it handed out before that are still alive (weak references):
    what a sender holds at once. `fail_at`: raise instead of making that tensor."""

    def __init__(self, sizes, seed=0, fail_at=None):
        self.sizes, self.seed, self.fail_at, self.rank = sizes, seed, fail_at, 0
        self.alive_bytes, self.made = [], []

    def export_merged(self, buffers=None, keep=True):
        refs = []
        g = torch.Generator().manual_seed(self.seed)
        for i, n in enumerate(self.sizes):
            self.alive_bytes.append(sum(4 * numel for r, numel in refs if r() is not None))
            if i == self.fail_at:
                raise ValueError(f"export failed at tensor {i}")
            t = torch.randn(n, generator=g)
            self.made.append((f"w.{i}", t.clone()))
            refs.append((weakref.ref(t), n))
            yield f"w.{i}", t
            del t


def assert_bounded(export: CountingExport, bucket_bytes: int) -> None:
    """At no point did the sender hold more exported tensors than one bucket's worth (or one
    tensor larger than a bucket, which travels alone)."""
    bound = max(bucket_bytes, 4 * max(export.sizes))
    assert max(export.alive_bytes) <= bound, (export.alive_bytes, bound)
    assert sum(4 * n for n in export.sizes) > 4 * bound  # the stream is far larger than the bound
