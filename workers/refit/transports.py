"""Refit transports: how buckets get from trainer rank 0 to every vLLM worker. One class per transport,
each with its send (trainer rank 0, `sender.Sender`) and its receive (every vLLM worker,
`vllm_extension.RefitWorkerExtension`); which one is used is decided once, by constructing it.

Both stream in bounded memory: the sender packs each bucket as soon as it is closed
(`wire.stream_buckets`) and drops its tensors before asking the export for more, so it never holds
more than one bucket's tensors (plus the one that closed it), on the first refit too. A layout that
had to precede the data would need the whole export first: instead it is assembled as the buckets
go (NeMo RL runs a metadata pass of the export instead; per-bucket headers cost nothing extra).

  RayTransport        each bucket is `ray.put` by trainer rank 0 as a list of the tensors' bytes
                      (numpy uint8 views: one copy, into the store; no staging buffer); workers
                      `ray.get` them (zero-copy). The layout is put once, after the last bucket; a
                      worker fetches it only when it lacks it (first refit, a restarted engine). The
                      default on CPU. (The object store holds a refit's buckets until the workers
                      have read them: Ray spills to disk beyond `ray.object_store_mb`.)
  BroadcastTransport  a process group of trainer rank 0 + all vLLM workers (rank 0 = source),
                      rendezvous through a TCP store on rank 0's node; NCCL on cuda (as upstream),
                      gloo on CPU (how the same code path is tested here). Created and warmed up by
                      one broadcast when the run starts (`control.BroadcastRefit.connect`), so NCCL's communicator
                      exists before the first refit; both sides use `refit.timeout_s`.

The broadcast protocol of one refit (every message is a broadcast from rank 0; a control value c
precedes each message: c >= 0 announces a bucket of c bytes, c < 0 a JSON message of -c bytes):
  {"open": kind, "key": K}      the receivers hold the layout K: buckets follow as announced
  {"open": kind, "head": {...}} first refit of this kind (or a new bucket size / LoRA groups): each
                                bucket is preceded by {"metas": [[name, shape, dtype], ...]}, and
                                the receivers assemble the layout from them
  {"end": n}                    after the n-th bucket; or {"error": "..."} when the sender failed
A receiver that fails while loading keeps reading to the end of the refit (`Incoming.drain`), so
the sender and the other workers finish and the run fails at once naming the worker and the
tensor, instead of every process waiting for a collective until the timeout. A receiver whose
stream meets a protocol problem drains the same way before it raises. What it reads then goes into
one reused buffer (the last bucket's), never a new one per bucket: the likeliest loader failure is
an out-of-memory error, which a fresh allocation per bucket would only repeat.

send(mode, kind, named, groups, dim, alpha, bucket_bytes, release) -> RefitPayload (sender_s left to the caller).
receive(spec, layouts) -> Incoming(layout, lazy (name, tensor) stream, layout_received); `layouts` is
the receiver's cache (kind -> layout), updated in place. Buckets are fetched one at a time as the
stream is consumed, so at most one bucket is resident beyond what the consumer keeps.
A sender's transport remembers the layouts it has sent (kind -> layout); a new instance starts fresh.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

import torch

from workers.refit.wire import (RefitLayout, RefitPayload, TensorMeta, bucket_of, kind_of, pack_bucket, stream_buckets,
                                unpack_bucket, unpack_metas, unpack_tensors)

BROADCAST_BACKENDS = ("nccl", "gloo")
DEFAULT_TIMEOUT_S = 600.0


class RefitAborted(RuntimeError):
    """The sender failed during a refit (its message says why); the receivers read to its end."""


class RefitProtocolError(RuntimeError):
    """What arrived does not fit what this receiver holds (it read to the end of the refit first)."""


@dataclass
class Incoming:
    """One refit as a receiver sees it.

    layout: complete, or on the first broadcast refit of a kind its head (kind, bucket size, LoRA
    groups, dim, alpha): the tensors are known once `stream` is exhausted, when `layout` is replaced
    by the whole layout. stream: (name, tensor) views, a bucket fetched as it is reached."""

    layout: RefitLayout
    stream: Iterator[tuple[str, torch.Tensor]]
    layout_received: bool
    _drain: Callable[[], None] = field(default=lambda: None, repr=False)

    def drain(self) -> None:
        """Read whatever this refit still has to deliver and drop it (after the consumer failed), so
        that a collective transport's sender and other receivers finish."""
        self._drain()


class _Transport:
    name: str

    def __init__(self):
        self._sent: dict[str, tuple[RefitLayout, Any]] = {}  # sender side: kind -> (layout, its handle)

    def receive(self, spec: dict, layouts: dict[str, RefitLayout]) -> Incoming:
        raise NotImplementedError


# ------------------------------------------------------------------------------------ Ray object store


def _as_uint8_tensor(obj) -> torch.Tensor:
    """A bucket fetched from the object store (read-only numpy) as a torch uint8 tensor, no copy."""
    if isinstance(obj, torch.Tensor):
        return obj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        return torch.from_numpy(obj)


def _bytes_of(t: torch.Tensor):
    """A tensor's bytes as a flat numpy uint8 array (a view for a contiguous CPU tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


class RayTransport(_Transport):
    name = "ray"

    def send(self, mode: str, kind: str, named: Iterable[tuple[str, torch.Tensor]], groups: tuple,
             dim: int, alpha: float, bucket_bytes: int, release: Callable | None = None) -> RefitPayload:
        """Stream: each bucket is ray.put as soon as it is closed, and its tensors dropped (or
        released: `release`, see wire.stream_buckets)."""
        import ray

        metas: list[TensorMeta] = []
        refs = []
        for _, chunk in stream_buckets(named, bucket_bytes, release):
            # one array per tensor, no staging buffer: ray.put copies each once, into the store
            refs.append(ray.put([_bytes_of(t) for _, t in chunk]))
            metas.extend(m for m, _ in chunk)
            chunk.clear()
        layout = RefitLayout(kind, tuple(metas), bucket_bytes, groups, dim, alpha)
        assert len(layout.buckets) == len(refs), "sender and plan_buckets disagree"
        known, layout_ref = self._sent.get(kind, (None, None))
        new_layout = known is None or known.key != layout.key
        if new_layout:
            layout_ref = ray.put(layout.to_plain())
            self._sent[kind] = (layout, layout_ref)
        return RefitPayload(mode=mode, transport=self.name, layout_key=layout.key, layout_ref=layout_ref,
                            buckets=refs, bytes=layout.nbytes,
                            layout_bytes=len(json.dumps(layout.to_plain())) if new_layout else 0,
                            tensors=len(metas))

    def receive(self, spec: dict, layouts: dict[str, RefitLayout]) -> Incoming:
        import ray

        kind = kind_of(spec["mode"])
        layout, received = layouts.get(kind), False
        if layout is None or layout.key != spec["layout_key"]:  # first refit here, or the layout changed
            layout = layouts[kind] = RefitLayout.from_plain(ray.get(spec["layout_ref"]))
            received = True
            if layout.key != spec["layout_key"]:
                raise RuntimeError("refit layout does not match its key")
        if len(spec["buckets"]) != len(layout.buckets):
            raise RuntimeError("refit payload and layout disagree on the number of buckets")

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket, ref in zip(layout.buckets, spec["buckets"]):
                obj = ray.get(ref)
                yield from (unpack_tensors([_as_uint8_tensor(a) for a in obj], bucket, layout) if isinstance(obj, list)
                            else unpack_bucket(_as_uint8_tensor(obj), bucket, layout))

        return Incoming(layout, stream(), received)  # nothing to drain: every bucket waits in the store


# ------------------------------------------------------------------------------------ broadcast group


class BroadcastGroup:
    """A process group outside torch.distributed's default group: trainer rank 0 + vLLM workers.

    Built from a TCPStore on rank 0's node (rank 0 hosts it), so neither Megatron's nor vLLM's
    own default groups are touched. backend "nccl" on cuda, "gloo" on CPU. The constructor returns
    after one warm-up broadcast: every member has joined and (NCCL) the communicator exists.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
                 timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None):
        import torch.distributed as dist

        if backend not in BROADCAST_BACKENDS:
            raise ValueError(f"unknown broadcast backend {backend!r} (nccl | gloo)")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        store = dist.PrefixStore("refit", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self.device = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        self.backend, self.rank, self.world_size, self.timeout_s = backend, rank, world_size, timeout_s
        self._store = store  # keep the rendezvous alive as long as the group
        self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))  # warm-up: NCCL connects here

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def send_int(self, value: int) -> None:
        self.broadcast(torch.tensor([value], dtype=torch.int64, device=self.device))

    def recv_int(self) -> int:
        return int(self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device)).item())

    def send_raw(self, data: bytes) -> None:
        if data:
            self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def recv_raw(self, size: int) -> bytes:
        if not size:
            return b""
        return self.broadcast(torch.empty(size, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes()

    def recv_bucket(self, nbytes: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The next bucket: into a new buffer, or into the first `nbytes` of `into` where it is large
        enough (what a receiver that keeps nothing passes: its one reused buffer)."""
        if into is not None and into.numel() >= nbytes:
            buf = into[:nbytes]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.broadcast(buf) if nbytes else buf

    def abort(self) -> None:
        """Give up the group (a receiver that can no longer follow the protocol); best effort."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - already failing
                pass


class BroadcastTransport(_Transport):
    """Over a BroadcastGroup: rank 0 hosts it (`host`), every vLLM worker joins it (`join`)."""

    name = "broadcast"

    def __init__(self, group: BroadcastGroup):
        super().__init__()
        self.group = group

    @classmethod
    def host(cls, host: str, port: int, world_size: int, backend: str = "nccl",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "BroadcastTransport":
        """Trainer rank 0: host the group (blocks until every vLLM worker has joined)."""
        return cls(BroadcastGroup(host, port, 0, world_size, backend, timeout_s))

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
             timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None) -> "BroadcastTransport":
        """A vLLM worker: join rank 0's group as `rank` (blocks until all have joined)."""
        return cls(BroadcastGroup(host, port, rank, world_size, backend, timeout_s, device))

    @classmethod
    def expect(cls, mode: str) -> RefitPayload:
        """What generators get when the data comes over the broadcast group (layout in-band)."""
        kind_of(mode)
        return RefitPayload(mode=mode, transport=cls.name)

    # ---------------------------------------------------------------- messages
    def _say(self, message: dict) -> int:
        data = json.dumps(message).encode()
        self.group.send_int(-len(data))
        self.group.send_raw(data)
        return len(data)

    def _hear(self) -> int | dict:
        """A bucket's size (int), or the JSON message that came instead."""
        c = self.group.recv_int()
        return c if c >= 0 else json.loads(self.group.recv_raw(-c))

    # ---------------------------------------------------------------- sender
    def send(self, mode: str, kind: str, named: Iterable[tuple[str, torch.Tensor]], groups: tuple,
             dim: int, alpha: float, bucket_bytes: int, release: Callable | None = None) -> RefitPayload:
        """Open, then each bucket as soon as the export has closed it, then end (see the module
        docstring); `release` as in wire.stream_buckets."""
        known, _ = self._sent.get(kind, (None, None))
        head = RefitLayout(kind, (), bucket_bytes, tuple(groups), dim, alpha)
        streaming = known is None or _head(known) != _head(head)
        layout_bytes = self._say({"open": kind, "head": head.to_plain()} if streaming
                                 else {"open": kind, "key": known.key})
        metas_all: list[TensorMeta] = []
        n = 0
        try:
            for bucket, chunk in stream_buckets(named, bucket_bytes, release):
                metas = tuple(m for m, _ in chunk)
                if streaming:
                    layout_bytes += self._say({"metas": [[m.name, list(m.shape), m.dtype] for m in metas]})
                elif n >= len(known.buckets) or known.buckets[n] != bucket \
                        or known.tensors[bucket.start:bucket.stop] != metas:
                    raise RefitProtocolError(f"refit layout changed at {metas[0].name}: the trainer exports other "
                                             f"tensors than at the first refit; reopen the refit group")
                buf = pack_bucket([t for _, t in chunk], bucket, self.group.device)
                chunk.clear()  # the exported tensors go now, before the next ones are asked for
                self.group.send_int(buf.numel())
                if buf.numel():
                    self.group.broadcast(buf)
                del buf
                metas_all.extend(metas)
                n += 1
            if not streaming and n != len(known.buckets):
                raise RefitProtocolError(f"refit layout changed: {n} buckets, the first refit sent "
                                         f"{len(known.buckets)}; reopen the refit group")
        except Exception as e:
            try:  # tell the receivers, so that they stop waiting and name this error
                self._say({"error": f"trainer rank 0: {type(e).__name__}: {e}".splitlines()[0][:500]})
            except Exception:  # noqa: BLE001 - the group itself failed: nothing more can be said
                pass
            raise
        self._say({"end": n})
        layout = RefitLayout(kind, tuple(metas_all), bucket_bytes, tuple(groups), dim, alpha) if streaming else known
        self._sent[kind] = (layout, None)
        return RefitPayload(mode=mode, transport=self.name, layout_key=layout.key, bytes=layout.nbytes,
                            layout_bytes=layout_bytes if streaming else 0, tensors=len(layout.tensors))

    # ---------------------------------------------------------------- receiver
    def receive(self, spec: dict, layouts: dict[str, RefitLayout]) -> Incoming:
        kind = kind_of(spec["mode"])
        opening = self._hear()
        if not isinstance(opening, dict) or opening.get("open") != kind:
            raise RefitProtocolError(f"refit expected to open a {kind} refit, got {opening!r}")
        streaming = "head" in opening
        layout = RefitLayout.from_plain(opening["head"]) if streaming else layouts.get(kind)
        incoming = Incoming(layout, iter(()), streaming)
        if not streaming and (layout is None or layout.key != opening["key"]):
            # read this refit to its end (every bucket is announced with its size), then say why
            _exhaust(self._stream(kind, incoming, layouts, streaming, draining=[True], problem=(
                "the sender assumes a refit layout this worker does not hold (it joined after the first refit?)")))
        draining = [False]
        incoming.stream = self._stream(kind, incoming, layouts, streaming, problem=None, draining=draining)

        def drain() -> None:
            draining[0] = True  # what is still to come is read into one reused buffer, and dropped
            _exhaust(incoming.stream)

        incoming._drain = drain
        return incoming

    def _stream(self, kind: str, incoming: Incoming, layouts: dict, streaming: bool, problem: str | None,
                draining: list[bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit's tensors as they arrive. A bucket whose tensors go to the consumer gets a buffer of
        its own (the consumer may keep views: vLLM's layerwise reload holds a layer's tensors until it is
        complete). Once nothing is kept (a problem was found, or the consumer failed and drains), every
        further bucket is read into the same buffer, the last one received, grown only for a larger
        bucket: after an out-of-memory error in the loader, reading the rest allocates nothing more."""
        head = incoming.layout
        metas_all: list[TensorMeta] = []
        n = 0
        spare = None  # the last bucket's buffer (after a failure: the one every further bucket is read into)
        while True:
            message = self._hear()
            if isinstance(message, int):  # a bucket of a layout this worker holds
                buf, spare = self._recv_bucket(message, spare, keep=problem is None and not draining[0])
                if problem is None and (streaming or n >= len(head.buckets) or head.buckets[n].nbytes != message):
                    problem = f"bucket {n} ({message} bytes) does not fit this worker's refit layout"
                if problem is None and not draining[0]:
                    yield from unpack_bucket(buf, head.buckets[n], head)
                n += 1
            elif "metas" in message:
                metas = [TensorMeta(name, tuple(shape), dtype) for name, shape, dtype in message["metas"]]
                bucket = bucket_of(metas, start=len(metas_all))
                announced = self.group.recv_int()
                buf, spare = self._recv_bucket(announced, spare, keep=problem is None and not draining[0])
                if problem is None and (not streaming or announced != bucket.nbytes):
                    problem = f"bucket {n} ({announced} bytes) does not fit its header ({bucket.nbytes} bytes)"
                metas_all.extend(metas)
                if problem is None and not draining[0]:
                    yield from unpack_metas(buf, bucket, metas)
                n += 1
            elif "error" in message:
                raise RefitAborted(f"refit aborted by the sender, {message['error']}")
            elif "end" in message:
                if problem is None and message["end"] != n:
                    problem = f"the sender sent {message['end']} buckets, this worker read {n}"
                if problem is None and streaming:
                    whole = RefitLayout(kind, tuple(metas_all), head.bucket_bytes, head.groups, head.dim, head.alpha)
                    if len(whole.buckets) != n:
                        problem = f"the sender's buckets ({n}) differ from plan_buckets' ({len(whole.buckets)})"
                    else:
                        layouts[kind] = incoming.layout = whole
                if problem is not None:
                    raise RefitProtocolError(problem)
                return
            else:
                raise RefitProtocolError(f"unknown refit message {message!r}")

    def _recv_bucket(self, nbytes: int, spare: torch.Tensor | None, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the bucket, the buffer to reuse next): a new buffer for a bucket the consumer gets; a
        dropped one goes into `spare` (replaced only by a larger one)."""
        if keep:
            buf = self.group.recv_bucket(nbytes)
            return buf, buf
        buf = self.group.recv_bucket(nbytes, into=spare)
        return buf, buf if spare is None or buf.numel() > spare.numel() else spare


def _head(layout: RefitLayout) -> tuple:
    """What must not change for buckets to follow a layout the receivers hold."""
    return layout.kind, layout.bucket_bytes, tuple(layout.groups), layout.dim, layout.alpha


def _exhaust(stream: Iterator) -> None:
    for _ in stream:
        pass
