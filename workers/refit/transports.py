"""Refit transports: how buckets get from trainer rank 0 to every vLLM worker. One class per transport,
each with its send (trainer rank 0, `sender.Sender`) and its receive (every vLLM worker,
`vllm_extension.RefitWorkerExtension`); which one is used is decided once, by constructing it.

  RayTransport        each bucket is `ray.put` by trainer rank 0 as a list of the tensors' bytes
                      (numpy uint8 views: one copy, into the store; no staging buffer); workers
                      `ray.get` them (zero-copy). The layout is put once; a worker fetches it only
                      when it lacks it (first refit, a restarted engine). The default on CPU.
  BroadcastTransport  a process group of trainer rank 0 + all vLLM workers (rank 0 = source),
                      rendezvous through a TCP store on rank 0's node; NCCL on cuda (as upstream),
                      gloo on CPU (how the same code path is tested here). The layout goes in-band
                      the first time. `control.connect()` sets it up once, from the driver.

send(mode, kind, named, groups, dim, alpha, bucket_bytes) -> RefitPayload (sender_s left to the caller).
receive(spec, layouts) -> (layout, lazy (name, tensor) stream, whether the layout was received now);
`layouts` is the receiver's cache (kind -> layout), updated in place. Buckets are fetched one at a
time as the stream is consumed, so at most one bucket is resident beyond what the consumer keeps.
A sender's transport remembers the layouts it has sent (kind -> layout); a new instance starts fresh.
"""

from __future__ import annotations

import json
import warnings
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch

from workers.refit.wire import (RefitLayout, RefitPayload, TensorMeta, aligned, kind_of, pack_bucket,
                                unpack_bucket, unpack_tensors)

BROADCAST_BACKENDS = ("nccl", "gloo")


class _Transport:
    name: str

    def __init__(self):
        self._sent: dict[str, tuple[RefitLayout, Any]] = {}  # sender side: kind -> (layout, its handle)

    def receive(self, spec: dict, layouts: dict[str, RefitLayout]
                ) -> tuple[RefitLayout, Iterator[tuple[str, torch.Tensor]], bool]:
        layout, received = self._receive_layout(kind_of(spec["mode"]), spec, layouts)
        buffers = self._receive_buckets(spec, layout)

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket, buf in zip(layout.buckets, buffers):
                yield from (unpack_tensors(buf, bucket, layout) if isinstance(buf, list)
                            else unpack_bucket(buf, bucket, layout))

        return layout, stream(), received

    def _receive_layout(self, kind: str, spec: dict, layouts: dict) -> tuple[RefitLayout, bool]:
        raise NotImplementedError

    def _receive_buckets(self, spec: dict, layout: RefitLayout) -> Iterator[torch.Tensor]:
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
             dim: int, alpha: float, bucket_bytes: int) -> RefitPayload:
        """Stream: tensors join the open bucket until it would overflow, then it is ray.put."""
        import ray

        metas: list[TensorMeta] = []
        refs, pending, pending_end = [], [], 0

        def flush():
            nonlocal pending, pending_end
            if pending:
                # one array per tensor, no staging buffer: ray.put copies each once, into the store
                refs.append(ray.put([_bytes_of(t) for _, t in pending]))
                pending, pending_end = [], 0

        for name, tensor in named:
            meta = TensorMeta.of(name, tensor)
            offset = aligned(pending_end)
            if pending and offset + meta.nbytes > bucket_bytes:
                flush()
                offset = 0
            pending.append((meta, tensor))
            pending_end = offset + meta.nbytes
            metas.append(meta)
        flush()
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

    def _receive_layout(self, kind: str, spec: dict, layouts: dict) -> tuple[RefitLayout, bool]:
        import ray

        layout, received = layouts.get(kind), False
        if layout is None or layout.key != spec["layout_key"]:  # first refit here, or the layout changed
            layout = layouts[kind] = RefitLayout.from_plain(ray.get(spec["layout_ref"]))
            received = True
            if layout.key != spec["layout_key"]:
                raise RuntimeError("refit layout does not match its key")
        if len(spec["buckets"]) != len(layout.buckets):
            raise RuntimeError("refit payload and layout disagree on the number of buckets")
        return layout, received

    def _receive_buckets(self, spec: dict, layout: RefitLayout) -> Iterator[torch.Tensor]:
        import ray

        for ref in spec["buckets"]:
            obj = ray.get(ref)
            yield [_as_uint8_tensor(a) for a in obj] if isinstance(obj, list) else _as_uint8_tensor(obj)


# ------------------------------------------------------------------------------------ broadcast group


class BroadcastGroup:
    """A process group outside torch.distributed's default group: trainer rank 0 + vLLM workers.

    Built from a TCPStore on rank 0's node (rank 0 hosts it), so neither Megatron's nor vLLM's
    own default groups are touched. backend "nccl" on cuda, "gloo" on CPU.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
                 timeout_s: float = 600.0, device: torch.device | str | None = None):
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
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self._store = store  # keep the rendezvous alive as long as the group

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def send_bytes(self, data: bytes) -> None:
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(n)
        if data:
            self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def recv_bytes(self) -> bytes:
        n = self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        size = int(n.item())
        if not size:
            return b""
        return self.broadcast(torch.empty(size, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes()


class BroadcastTransport(_Transport):
    """Over a BroadcastGroup: rank 0 hosts it (`host`), every vLLM worker joins it (`join`)."""

    name = "broadcast"

    def __init__(self, group: BroadcastGroup):
        super().__init__()
        self.group = group

    @classmethod
    def host(cls, host: str, port: int, world_size: int, backend: str = "nccl",
             timeout_s: float = 600.0) -> "BroadcastTransport":
        """Trainer rank 0: host the group (blocks until every vLLM worker has joined)."""
        return cls(BroadcastGroup(host, port, 0, world_size, backend, timeout_s))

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
             timeout_s: float = 600.0, device: torch.device | str | None = None) -> "BroadcastTransport":
        """A vLLM worker: join rank 0's group as `rank` (blocks until all have joined)."""
        return cls(BroadcastGroup(host, port, rank, world_size, backend, timeout_s, device))

    @classmethod
    def expect(cls, mode: str) -> RefitPayload:
        """What generators get when the data comes over the broadcast group (layout in-band)."""
        kind_of(mode)
        return RefitPayload(mode=mode, transport=cls.name)

    def send(self, mode: str, kind: str, named: Iterable[tuple[str, torch.Tensor]], groups: tuple,
             dim: int, alpha: float, bucket_bytes: int) -> RefitPayload:
        """Header (layout bytes, empty when unchanged), then the buckets in plan order."""
        group = self.group
        known, _ = self._sent.get(kind, (None, None))
        if known is None or known.bucket_bytes != bucket_bytes:
            named = list(named)  # first refit of this kind: the layout must precede the data
            layout = RefitLayout(kind, tuple(TensorMeta.of(n, t) for n, t in named), bucket_bytes, groups, dim, alpha)
            header = json.dumps(layout.to_plain()).encode()
            self._sent[kind] = (layout, None)
        else:
            layout, header = known, b""
        group.send_bytes(header)
        it = iter(named)
        for bucket in layout.buckets:
            chunk = []
            for meta in layout.tensors[bucket.start:bucket.stop]:
                name, tensor = next(it)
                if TensorMeta.of(name, tensor) != meta:
                    raise RuntimeError(f"refit layout changed ({name}); reopen the refit group")
                chunk.append(tensor.to(group.device))
            group.broadcast(pack_bucket(chunk, bucket))
        if next(it, None) is not None:
            raise RuntimeError("refit layout changed (more tensors than announced); reopen the refit group")
        return RefitPayload(mode=mode, transport=self.name, layout_key=layout.key, bytes=layout.nbytes,
                            layout_bytes=len(header), tensors=len(layout.tensors))

    def _receive_layout(self, kind: str, spec: dict, layouts: dict) -> tuple[RefitLayout, bool]:
        header, received = self.group.recv_bytes(), False
        if header:
            layouts[kind] = RefitLayout.from_plain(json.loads(header))
            received = True
        layout = layouts.get(kind)
        if layout is None:
            raise RuntimeError("broadcast refit without a layout")
        return layout, received

    def _receive_buckets(self, spec: dict, layout: RefitLayout) -> Iterator[torch.Tensor]:
        group = self.group
        for bucket in layout.buckets:
            yield group.broadcast(torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device))
