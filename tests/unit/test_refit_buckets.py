"""Refit wire format: bucket planning and packing, the layout sent once, the name guard, and the
broadcast transport end to end over a real gloo group (two threads, no Ray)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tests.helpers.exports import SIZES, CountingExport, assert_bounded
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

    def export_merged(self, buffers=None, keep=True):
        return iter(self.named)


BUCKET_MB = 8192 / 2**20  # 8 KiB buckets: most tensors share one, the largest travel alone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stream_buckets_closes_the_buckets_plan_buckets_plans():
    sizes = [100, 3000, 900, 10, 5000, 64, 64, 0, 7]
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    got = []
    for bucket, chunk in refit.stream_buckets(iter(named), 1024):
        assert [m.name for m, _ in chunk] == [n for n, _ in named[bucket.start:bucket.stop]]
        assert refit.bucket_of([m for m, _ in chunk], bucket.start) == bucket
        got.append(bucket)
        chunk.clear()
    assert got == plan_buckets(sizes, 1024)


def group_of(world: int, *receivers, timeout_s: float = 30):
    """Run receivers[i](BroadcastTransport joined as rank i+1) in threads; returns (sender's transport
    opener, a join() that returns the receivers' errors)."""
    port, errors, threads = _free_port(), [None] * len(receivers), []

    def run(i, fn):
        try:
            fn(BroadcastTransport.join("127.0.0.1", port, rank=i + 1, world_size=world, backend="gloo",
                                       timeout_s=timeout_s))
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors[i] = e

    for i, fn in enumerate(receivers):
        threads.append(threading.Thread(target=run, args=(i, fn)))
        threads[-1].start()
    sender = Sender()
    sender.open_group("127.0.0.1", port, world_size=world, backend="gloo", timeout_s=timeout_s)

    def join():
        for t in threads:
            t.join(timeout_s * 2)
        sender.close_group()
        return errors

    return sender, join


def receive_all(transport, layouts, mode="merged"):
    incoming = transport.receive(BroadcastTransport.expect(mode).to_spec(), layouts)
    return incoming, [(n, t.clone()) for n, t in incoming.stream]


def test_broadcast_transport_over_gloo_sends_layout_once():
    """Sender.payload over a gloo BroadcastTransport (the cuda path with backend nccl) to one receiver."""
    first = _named()
    second = [(n, t + 1 if t.is_floating_point() else t) for n, t in first]
    received = []

    def receiver(transport):
        layouts = {}
        for _ in range(2):
            incoming, got = receive_all(transport, layouts)
            received.append((incoming.layout_received, incoming.layout, got))

    sender, join = group_of(2, receiver)
    try:
        p1 = sender.payload(_Producer(first), "merged", bucket_mb=0.001)
        p2 = sender.payload(_Producer(second), "merged", bucket_mb=0.001)
    finally:
        errors = join()
    assert errors == [None]
    assert p1.transport == p2.transport == "broadcast" and p1.bytes == p2.bytes > 0
    assert p1.layout_bytes > 0 and p2.layout_bytes == 0  # (name, shape, dtype) only the first time
    assert [r[0] for r in received] == [True, False]
    assert received[0][1] == received[1][1] and received[0][1].key == p1.layout_key == p2.layout_key
    assert len(received[0][1].buckets) > 1 and received[0][1].nbytes == p1.bytes
    for sent, (_, _, got) in ((first, received[0]), (second, received[1])):
        assert [n for n, _ in got] == [n for n, _ in sent]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, got))


def test_broadcast_send_holds_one_bucket_of_the_export_first_refit_too():
    got = []
    sender, join = group_of(2, lambda t: [got.append(receive_all(t, layouts)[1]) for layouts in [{}] for _ in range(2)])
    try:
        exports = [CountingExport(SIZES, seed=s) for s in (1, 2)]
        payloads = [sender.payload(e, "merged", bucket_mb=BUCKET_MB) for e in exports]
    finally:
        assert join() == [None]
    assert payloads[0].layout_bytes > 0 and payloads[1].layout_bytes == 0  # the first refit of the kind, then not
    for export, received in zip(exports, got):
        assert_bounded(export, 8192)
        assert [n for n, _ in received] == [n for n, _ in export.made]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(export.made, received))


def test_a_receiver_that_fails_reads_the_rest_and_the_group_goes_on():
    """Rank 1's loader fails at its 4th tensor: it drains the refit, so rank 0 and rank 2 finish,
    and the next refit (layout known) reaches both."""
    results = {}

    def failing(transport):
        layouts = {}
        incoming = transport.receive(BroadcastTransport.expect("merged").to_spec(), layouts)
        for i, (name, _) in enumerate(incoming.stream):
            if i == 3:
                incoming.drain()
                results["failed_at"] = name
                break
        results["second"] = receive_all(transport, layouts)[1]

    def healthy(transport):
        layouts = {}
        results["healthy"] = [receive_all(transport, layouts)[1] for _ in range(2)]

    sender, join = group_of(3, failing, healthy)
    try:
        exports = [CountingExport(SIZES, seed=s) for s in (3, 4)]
        payloads = [sender.payload(e, "merged", bucket_mb=BUCKET_MB) for e in exports]
    finally:
        assert join() == [None, None]
    assert results["failed_at"] == "w.3" and payloads[1].layout_bytes == 0
    for got in (results["second"], results["healthy"][1]):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(exports[1].made, got)) and len(got) == len(SIZES)


@pytest.mark.parametrize("refit", ["first (layout streamed)", "later (layout known)"])
def test_what_a_failed_receiver_reads_after_its_error_goes_into_one_reused_buffer(refit):
    """After its loader failed (an out-of-memory error, most likely) a vLLM worker reads the rest of the
    refit so that the others finish; a fresh buffer per bucket would repeat the error and leave trainer
    rank 0 waiting for refit.timeout_s. Every bucket read after the failure lands in the buffer of the
    bucket it failed in (the buffers are held here, so a freed one cannot come back at the same address)."""
    buffers, out = [], {}

    def failing(transport):
        real = transport.group.recv_bucket

        def recording(*args, **kwargs):
            buf = real(*args, **kwargs)
            buffers.append(buf)
            return buf

        transport.group.recv_bucket = recording
        layouts = {}
        if refit.startswith("later"):
            receive_all(transport, layouts)
        buffers.clear()
        incoming = transport.receive(BroadcastTransport.expect("merged").to_spec(), layouts)
        for i, (name, _) in enumerate(incoming.stream):
            if name == "w.5":  # alone in the largest bucket (16 KB): every later one fits in its buffer
                failed_in = len(buffers)
                incoming.drain()
                out["after"] = [b.data_ptr() for b in buffers[failed_in - 1:]]
                break
        out["next"] = receive_all(transport, layouts)[1]

    sender, join = group_of(2, failing)
    try:
        exports = [CountingExport(SIZES, seed=s) for s in (6, 7, 8)]
        for e in exports[:3 if refit.startswith("later") else 2]:
            sender.payload(e, "merged", bucket_mb=BUCKET_MB)
    finally:
        assert join() == [None]
    assert len(out["after"]) > 10  # the bucket it failed in, and every later one
    assert set(out["after"]) == {out["after"][0]}
    last = exports[2 if refit.startswith("later") else 1]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(last.made, out["next"])) and len(out["next"]) == len(SIZES)


def test_a_sender_that_fails_is_named_by_every_receiver_and_the_next_refit_works():
    from workers.refit.transports import RefitAborted

    seen = []

    def receiver(transport):
        layouts = {}
        with pytest.raises(RefitAborted, match="refit aborted by the sender, trainer rank 0: ValueError: export "
                                               "failed at tensor 7"):
            receive_all(transport, layouts)
        seen.append(receive_all(transport, layouts)[1])

    sender, join = group_of(3, receiver, receiver)
    try:
        with pytest.raises(ValueError, match="export failed at tensor 7"):
            sender.payload(CountingExport(SIZES, fail_at=7), "merged", bucket_mb=BUCKET_MB)
        good = CountingExport(SIZES, seed=5)
        payload = sender.payload(good, "merged", bucket_mb=BUCKET_MB)
    finally:
        assert join() == [None, None]
    assert payload.layout_bytes > 0  # the failed refit left no layout behind: streamed again
    assert all(len(got) == len(SIZES) and torch.equal(got[-1][1], good.made[-1][1]) for got in seen)


def test_a_receiver_without_the_layout_reads_the_refit_and_says_so():
    from workers.refit.transports import RefitProtocolError

    out = {}

    def receiver(transport):
        receive_all(transport, {})
        with pytest.raises(RefitProtocolError, match="does not hold"):
            transport.receive(BroadcastTransport.expect("merged").to_spec(), {})  # forgot its layout
        out["third"] = receive_all(transport, {})  # a new kind of refit reaches it again

    sender, join = group_of(2, receiver)
    try:
        for mode in ("merged", "merged"):
            sender.payload(CountingExport(SIZES), mode, bucket_mb=BUCKET_MB)
        sender.payload(CountingExport(SIZES), "merged", bucket_mb=2 * BUCKET_MB)  # new bucket size: streamed
    finally:
        assert join() == [None]
    assert out["third"][0].layout_received and len(out["third"][1]) == len(SIZES)


def test_a_bucket_gives_its_tensors_back_to_the_pool_once_the_consumer_is_past_it():
    """The merged export writes into pooled buffers (workers.refit.buffers); stream_buckets returns a
    bucket's buffers when the transport asks for what follows it, so the next tensors reuse them and
    never overwrite a bucket before it has been copied out."""
    from workers.refit.buffers import BufferPool

    pool, made, released = BufferPool(), set(), []

    def export():
        for i in range(9):
            t = pool.take((256,), torch.float32, "cpu")   # 1 KiB: two per 2 KiB bucket
            made.add(t.data_ptr())
            t.fill_(i)
            yield f"w.{i}", t

    def release(tensors):
        released.append(len(tensors))
        pool.give_back(tensors)

    seen = []
    for _, chunk in refit.stream_buckets(export(), 2048, release):
        seen.append([float(t[0]) for _, t in chunk])   # what a transport copies out
        assert not any(pool.holds(t) for _, t in chunk)
    assert seen == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0]]
    assert released == [2, 2, 2, 2, 1]
    assert len(made) == 3 and pool.nbytes == 3 * 1024   # a bucket and the tensor that closed it, reused
    pool.give_back([torch.zeros(256)])                    # not the pool's: ignored
    assert pool.nbytes == 3 * 1024
