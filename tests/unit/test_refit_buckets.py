"""Refit wire format: bucket planning and packing, the layout sent once, the name guard, and the
broadcast transport end to end over a real gloo group (two threads, no Ray)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from workers.refit import wire as refit
from workers.refit.control import resolve_transport
from workers.refit.sender import Sender
from workers.refit.transports import BroadcastTransport
from workers.refit.wire import RefitLayout, TensorMeta, plan_buckets


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 16, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
        ("counts", torch.arange(7, dtype=torch.int64)),
        ("model.layers.0.self_attn.o_proj.weight", torch.randn(16, 16, generator=g).half()),
        ("lm_head.weight", torch.randn(50, 16, generator=g)),
    ]


def test_plan_respects_the_bound_keeps_order_and_isolates_oversize_tensors():
    sizes = [100, 3000, 900, 10, 5000, 64, 64]
    buckets = plan_buckets(sizes, bucket_bytes=1024)
    assert [b.start for b in buckets] == [0, 1, 2, 4, 5]      # contiguous, in order
    assert sum(len(b.offsets) for b in buckets) == len(sizes)
    for b in buckets:
        sizes_in = sizes[b.start:b.stop]
        if len(sizes_in) > 1:
            assert b.nbytes <= 1024
        assert all(off % refit.ALIGN == 0 for off in b.offsets)
        assert b.nbytes == b.offsets[-1] + sizes_in[-1]
    assert buckets[1].nbytes == 3000 and len(buckets[1].offsets) == 1  # larger than the bound: alone


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 10**6])
def test_pack_unpack_round_trip_mixed_dtypes(bucket_bytes):
    named = _named()
    layout = RefitLayout("weights", tuple(TensorMeta.of(n, t) for n, t in named), bucket_bytes)
    got = []
    for bucket in layout.buckets:
        buf = refit.pack_bucket([t for _, t in named[bucket.start:bucket.stop]], bucket)
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.nbytes
        got.extend(refit.unpack_bucket(buf, bucket, layout))
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got):
        assert t.dtype == want.dtype and torch.equal(t, want)
    assert layout.nbytes == sum(b.nbytes for b in layout.buckets) >= sum(t.nbytes for _, t in named)


def test_pack_zeroes_only_the_gaps_and_per_tensor_buckets_unpack_the_same():
    named = _named()
    layout = RefitLayout("weights", tuple(TensorMeta.of(n, t) for n, t in named), 1000)
    for bucket in layout.buckets:
        tensors = [t for _, t in named[bucket.start:bucket.stop]]
        buf = refit.pack_bucket(tensors, bucket)
        used = torch.zeros(bucket.nbytes, dtype=torch.bool)
        for t, off in zip(tensors, bucket.offsets):
            used[off:off + t.nbytes] = True
        assert not buf[~used].any()  # alignment gaps are zero, not left over memory
        # the Ray transport's bucket: one flat uint8 tensor per tensor, no staging buffer
        raws = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        got = refit.unpack_tensors(raws, bucket, layout)
        assert [(n, t.dtype) for n, t in got] == [(n, t.dtype) for n, t in refit.unpack_bucket(buf, bucket, layout)]
        assert all(torch.equal(a, b) for (_, a), b in zip(got, tensors))
        with pytest.raises(RuntimeError, match="holds 0 tensors"):
            refit.unpack_tensors([], bucket, layout)


def test_layout_plain_round_trip_and_key():
    groups = (refit.LoraGroupMeta("decoder.layers.0.self_attention.linear_qkv", 0, ("q", "k", "v")),)
    layout = RefitLayout("lora", tuple(TensorMeta.of(n, t) for n, t in _named()), 4096, groups, dim=8, alpha=16)
    again = RefitLayout.from_plain(layout.to_plain())
    assert again == layout and again.key == layout.key
    other = RefitLayout("lora", layout.tensors, 8192, groups, dim=8, alpha=16)
    assert other.key != layout.key


def test_guard_rejects_unmerged_peft_names():
    ok = list(refit.guard_names([("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))]))
    assert len(ok) == 1
    for bad in ("model.layers.0.self_attn.q_proj.base_layer.weight",
                "model.layers.0.self_attn.q_proj.lora_A.weight",
                "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"):
        with pytest.raises(ValueError, match="refit guard"):
            list(refit.guard_names([("model.norm.weight", torch.zeros(1)), (bad, torch.zeros(1))]))


def test_unknown_mode_is_refused_and_transport_resolution():
    with pytest.raises(ValueError, match="unknown refit mode"):
        refit.kind_of("merged_lora")
    assert resolve_transport("auto", "cpu") == "ray"
    assert resolve_transport("auto", "cuda") == "nccl"
    assert resolve_transport("gloo", "cpu") == "gloo"
    with pytest.raises(ValueError, match="unknown refit transport"):
        resolve_transport("tcp", "cpu")


class _Producer:
    """The smallest trainer surface: merged weights only."""

    def __init__(self, named):
        self.named, self.rank = named, 0

    def export_merged(self):
        return iter(self.named)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_transport_over_gloo_sends_layout_once():
    """Sender.payload over a gloo BroadcastTransport (the cuda path with backend nccl) to one receiver."""
    port, received, errors, sender = _free_port(), [], [], Sender()
    first = _named()
    second = [(n, t + 1 if t.is_floating_point() else t) for n, t in first]

    def receiver():
        try:
            transport = BroadcastTransport.join("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout_s=60)
            layouts = {}
            for _ in range(2):
                spec = BroadcastTransport.expect("merged").to_spec()
                layout, stream, _ = transport.receive(spec, layouts)
                received.append([(n, t.clone()) for n, t in stream])
        except Exception as e:  # surfaced by the main thread
            errors.append(e)

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        sender.open_group("127.0.0.1", port, world_size=2, backend="gloo", timeout_s=60)
        p1 = sender.payload(_Producer(first), "merged", bucket_mb=0.001)
        p2 = sender.payload(_Producer(second), "merged", bucket_mb=0.001)
    finally:
        thread.join(60)
        sender.close_group()
    assert not errors, errors
    assert p1.transport == p2.transport == "broadcast" and p1.bytes == p2.bytes > 0
    assert p1.layout_bytes > 0 and p2.layout_bytes == 0  # (name, shape, dtype) only the first time
    for sent, got in ((first, received[0]), (second, received[1])):
        assert [n for n, _ in got] == [n for n, _ in sent]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, got))
