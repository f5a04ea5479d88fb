"""Refit: trainer weights -> vLLM generators, in buckets, over one transport seam.

Modes (config `refit.mode`):
  merged        HF-named weights with LoRA merged in (trainer.export_merged(): Megatron-Bridge
                export_hf_weights(merge_adapter_weights=True)); names guarded against
                `.base_layer` / `.adapter` / `.lora_` (vLLM cannot load unmerged PEFT names).
  merged_delta  only the LoRA factors travel (A once per fused Megatron linear, one B per HF
                module, split by `lora_layout`); each generator worker keeps the base tensors of
                the targeted modules and writes W = W_base + (alpha/r) B A itself, with the same
                arithmetic as the Bridge's merge, so the weights are bitwise those of `merged`.
  adapter       the same factors; the generator writes a PEFT adapter and serves it with vLLM's
                native LoRA (a new adapter id per refit).

What travels: a `RefitLayout` (the (name, shape, dtype) of every tensor in a fixed order, the
bucket size and, for LoRA, the module groups and alpha/dim) once, then per refit only uint8
buckets of at most `bucket_mb` (a single tensor larger than that travels alone in its own
bucket). Both sides derive the bucket boundaries from the layout with `plan_buckets`, so they
iterate the same order. The generator side lives in `workers.refit.vllm_extension` (per vLLM worker).

Transports (one seam: how a bucket gets from trainer rank 0 to every vLLM worker):
  ray        buckets are `ray.put` by trainer rank 0 as numpy uint8 arrays; workers `ray.get`
             them (zero-copy). The layout is put once; a worker fetches it only when it lacks
             it (first refit, a restarted engine). The default on CPU.
  broadcast  a process group of trainer rank 0 + all vLLM workers (rank 0 = source), rendezvous
             through a TCP store on rank 0's node; NCCL on cuda (as upstream), gloo on CPU (how the
             same code path is tested here). The layout goes in-band the first time.
             `connect()` sets it up once, from the driver.

Reports: the sender returns bytes and seconds in its payload, the generators their own seconds;
`run_refit` adds the driver's wall time as `transfer_and_update_weights`.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from workers.lora import layout as lora_layout

MODES = ("merged", "merged_delta", "adapter")
FORBIDDEN_NAME_PARTS = (".base_layer", ".adapter", ".lora_")
ALIGN = 64  # byte alignment of every tensor inside a bucket (dtype views need aligned offsets)


def kind_of(mode: str) -> str:
    """'weights' for merged, 'lora' for merged_delta and adapter (same payload, different use)."""
    if mode not in MODES:
        raise ValueError(f"unknown refit mode {mode!r} (one of {', '.join(MODES)})")
    return "weights" if mode == "merged" else "lora"


class RefitGuardError(RuntimeError, ValueError):
    """An exported weight name that vLLM cannot load: LoRA was not merged."""


def guard_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) through; raise on a name vLLM cannot load (LoRA not merged). The one
    guard: the trainer's export_merged() applies it, and so does the vLLM side on receipt."""
    for name, tensor in named:
        bad = [part for part in FORBIDDEN_NAME_PARTS if part in name]
        if bad:
            raise RefitGuardError(f"refit guard: {name!r} contains {bad[0]!r}: the export did not merge LoRA "
                             "(merged refit needs merge_adapter_weights=True)")
        yield name, tensor


# ------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class LoraGroupMeta:
    """One fused Megatron linear: tensor `first` is A, the next len(modules) tensors its Bs."""

    megatron_module: str
    first: int
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Bucket:
    start: int                 # index of the first tensor
    offsets: tuple[int, ...]   # byte offset of each tensor in the bucket
    nbytes: int

    @property
    def stop(self) -> int:
        return self.start + len(self.offsets)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving packing: a bucket closes when the next tensor would overflow it."""
    buckets, start, offsets, end = [], 0, [], 0
    for i, size in enumerate(sizes):
        offset = _aligned(end)
        if offsets and offset + size > bucket_bytes:
            buckets.append(Bucket(start, tuple(offsets), end))
            start, offsets, offset = i, [], 0
        offsets.append(offset)
        end = offset + size
    if offsets:
        buckets.append(Bucket(start, tuple(offsets), end))
    return buckets


@dataclass(frozen=True)
class RefitLayout:
    """What is sent once: every tensor's (name, shape, dtype) in order, the bucket size, LoRA groups."""

    kind: str
    tensors: tuple[TensorMeta, ...]
    bucket_bytes: int
    groups: tuple[LoraGroupMeta, ...] = ()
    dim: int = 0
    alpha: float = 0.0

    @cached_property
    def key(self) -> str:
        return hashlib.sha1(json.dumps(self.to_plain(), sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def buckets(self) -> list[Bucket]:
        return plan_buckets([t.nbytes for t in self.tensors], self.bucket_bytes)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_plain(self) -> dict:
        """Plain lists/str/int only (crosses msgpack RPC and goes in-band over a process group)."""
        d = asdict(self)
        d["tensors"] = [[t.name, list(t.shape), t.dtype] for t in self.tensors]
        d["groups"] = [[g.megatron_module, g.first, list(g.modules)] for g in self.groups]
        return d

    @classmethod
    def from_plain(cls, d: dict) -> "RefitLayout":
        return cls(kind=d["kind"], bucket_bytes=int(d["bucket_bytes"]), dim=int(d["dim"]), alpha=d["alpha"],
                   tensors=tuple(TensorMeta(n, tuple(s), dt) for n, s, dt in d["tensors"]),
                   groups=tuple(LoraGroupMeta(m, int(f), tuple(mods)) for m, f, mods in d["groups"]))


# ------------------------------------------------------------------------------------ buckets


def pack_bucket(tensors: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """Copy tensors into one uint8 buffer at the planned offsets (on the tensors' device)."""
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=tensors[0].device)
    for t, off in zip(tensors, bucket.offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[off:off + raw.numel()].copy_(raw)
    return buf


def unpack_bucket(buf: torch.Tensor, bucket: Bucket, layout: RefitLayout) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (no copies), in layout order."""
    out = []
    for meta, off in zip(layout.tensors[bucket.start:bucket.stop], bucket.offsets):
        raw = buf[off:off + meta.nbytes]
        out.append((meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)))
    return out


def _as_uint8_tensor(obj) -> torch.Tensor:
    """A bucket fetched from the object store (read-only numpy) as a torch uint8 tensor, no copy."""
    if isinstance(obj, torch.Tensor):
        return obj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        return torch.from_numpy(obj)


# ------------------------------------------------------------------------------------ payloads


@dataclass
class RefitPayload:
    """What the driver hands to GeneratorGroup.apply_refit."""

    mode: str
    transport: str                       # "ray" | "broadcast"
    layout_key: str | None = None
    layout_ref: Any = None               # ray: ObjectRef of the layout, put once; fetched by a
                                         # receiver only when it does not hold layout_key yet
    buckets: list = field(default_factory=list)  # ObjectRefs (ray transport)
    bytes: int = 0                       # bucket bytes
    layout_bytes: int = 0                # layout bytes, when it was produced this time (else 0)
    tensors: int = 0
    sender_s: float = 0.0

    @classmethod
    def expect_broadcast(cls, mode: str) -> "RefitPayload":
        """What generators get when the data comes over the broadcast group (layout in-band)."""
        kind_of(mode)
        return cls(mode=mode, transport="broadcast")

    def to_spec(self) -> dict:
        """The dict vLLM workers receive through collective_rpc (ObjectRefs only on the ray path)."""
        return {"mode": self.mode, "transport": self.transport, "layout_key": self.layout_key,
                "layout_ref": self.layout_ref, "buckets": list(self.buckets)}


@dataclass
class RefitReport:
    mode: str
    transport: str
    bytes: int
    tensors: int
    buckets: int
    sender_s: float
    receiver_s: float
    transfer_and_update_weights_s: float


# ------------------------------------------------------------------------------------ broadcast group


class BroadcastGroup:
    """A process group outside torch.distributed's default group: trainer rank 0 + vLLM workers.

    Built from a TCPStore on rank 0's node (rank 0 hosts it), so neither Megatron's nor vLLM's
    own default groups are touched. backend "nccl" on cuda, "gloo" on CPU.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
                 timeout_s: float = 600.0, device: torch.device | str | None = None):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        store = dist.PrefixStore("refit", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self.device = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        else:
            raise ValueError(f"unknown broadcast backend {backend!r} (nccl | gloo)")
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


_SENDER_GROUP: BroadcastGroup | None = None
_SENT_LAYOUTS: dict[str, tuple[RefitLayout, Any]] = {}  # kind -> (layout, its ObjectRef or None)


def open_sender_group(host: str, port: int, world_size: int, backend: str = "nccl",
                      timeout_s: float = 600.0) -> None:
    """On trainer rank 0: host the refit group (blocks until every vLLM worker has joined).

    Once open, trainer_payload sends over it instead of the object store.
    """
    global _SENDER_GROUP
    _SENDER_GROUP = BroadcastGroup(host, port, 0, world_size, backend, timeout_s)
    _SENT_LAYOUTS.clear()


def close_sender_group() -> None:
    global _SENDER_GROUP
    _SENDER_GROUP = None
    _SENT_LAYOUTS.clear()


# ------------------------------------------------------------------------------------ sender


def _model_layout(trainer) -> lora_layout.ModelLayout:
    """Attention numbers from lora_config(); the family from it or from the HF config."""
    cfg = dict(trainer.lora_config())
    if "family" not in cfg:
        return lora_layout.ModelLayout.from_hf_config(trainer.cfg.model_path)
    return lora_layout.ModelLayout.from_model_section(cfg)


def lora_stream(groups: Sequence[lora_layout.HfLoraGroup]) -> tuple[list[tuple[str, torch.Tensor]], list[LoraGroupMeta]]:
    """HF LoRA groups -> the ordered (name, tensor) list that travels: A once, then one B per module."""
    named, metas = [], []
    for g in groups:
        metas.append(LoraGroupMeta(g.megatron_module, len(named), tuple(g.hf_modules)))
        named.append((f"{g.hf_modules[0]}.lora_A.weight", g.lora_a))
        named.extend((f"{module}.lora_B.weight", b) for module, b in zip(g.hf_modules, g.lora_b))
    return named, metas


def trainer_payload(trainer, mode: str, bucket_mb: float, *, transport: str | None = None) -> RefitPayload | None:
    """Runs on every trainer rank (the exports are collectives); rank 0 ships and returns the payload.

    trainer: has export_merged() (merged) or adapter_state() + lora_config() (LoRA modes), and
    `rank` (0 if absent). transport: "ray" | "broadcast" | None (broadcast iff open_sender_group
    was called in this process).
    """
    t0 = time.perf_counter()
    kind = kind_of(mode)
    rank = getattr(trainer, "rank", 0)
    if kind == "weights":
        named: Iterable[tuple[str, torch.Tensor]] = trainer.export_merged()  # guarded there
        groups, dim, alpha = (), 0, 0.0
        if rank != 0:
            for _ in named:  # drain: the export is collective over the model-parallel group
                pass
            return None
    else:
        state = trainer.adapter_state()
        if rank != 0:
            return None
        if not state:
            raise ValueError(f"refit mode {mode!r} needs LoRA, but the trainer has no adapter weights")
        dim, alpha = lora_layout.lora_numbers(trainer.lora_config())
        hf_groups = lora_layout.hf_lora_groups(_model_layout(trainer), state)
        named, groups = lora_stream(hf_groups)
    transport = transport or ("broadcast" if _SENDER_GROUP is not None else "ray")
    bucket_bytes = max(1, int(bucket_mb * 2**20))
    if transport == "ray":
        return _send_ray(mode, kind, named, tuple(groups), dim, alpha, bucket_bytes, t0)
    if transport == "broadcast":
        if _SENDER_GROUP is None:
            raise RuntimeError("transport 'broadcast' needs open_sender_group() on trainer rank 0 first")
        return _send_broadcast(_SENDER_GROUP, mode, kind, named, tuple(groups), dim, alpha, bucket_bytes, t0)
    raise ValueError(f"unknown refit transport {transport!r}")


def _send_ray(mode, kind, named, groups, dim, alpha, bucket_bytes, t0) -> RefitPayload:
    """Stream: tensors join the open bucket until it would overflow, then it is ray.put."""
    import ray

    metas: list[TensorMeta] = []
    refs, pending, pending_end = [], [], 0

    def flush():
        nonlocal pending, pending_end
        if pending:
            bucket = plan_buckets([m.nbytes for m, _ in pending], bucket_bytes)[0]
            refs.append(ray.put(pack_bucket([t for _, t in pending], bucket).cpu().numpy()))
            pending, pending_end = [], 0

    for name, tensor in named:
        meta = TensorMeta.of(name, tensor)
        offset = _aligned(pending_end)
        if pending and offset + meta.nbytes > bucket_bytes:
            flush()
            offset = 0
        pending.append((meta, tensor))
        pending_end = offset + meta.nbytes
        metas.append(meta)
    flush()
    layout = RefitLayout(kind, tuple(metas), bucket_bytes, groups, dim, alpha)
    assert len(layout.buckets) == len(refs), "sender and plan_buckets disagree"
    known, layout_ref = _SENT_LAYOUTS.get(kind, (None, None))
    new_layout = known is None or known.key != layout.key
    if new_layout:
        layout_ref = ray.put(layout.to_plain())
        _SENT_LAYOUTS[kind] = (layout, layout_ref)
    return RefitPayload(mode=mode, transport="ray", layout_key=layout.key, layout_ref=layout_ref,
                        buckets=refs, bytes=layout.nbytes,
                        layout_bytes=len(json.dumps(layout.to_plain())) if new_layout else 0,
                        tensors=len(metas), sender_s=time.perf_counter() - t0)


def _send_broadcast(group: BroadcastGroup, mode, kind, named, groups, dim, alpha, bucket_bytes, t0) -> RefitPayload:
    """Header (layout bytes, empty when unchanged), then the buckets in plan order."""
    known, _ = _SENT_LAYOUTS.get(kind, (None, None))
    if known is None or known.bucket_bytes != bucket_bytes:
        named = list(named)  # first refit of this kind: the layout must precede the data
        layout = RefitLayout(kind, tuple(TensorMeta.of(n, t) for n, t in named), bucket_bytes, groups, dim, alpha)
        header = json.dumps(layout.to_plain()).encode()
        _SENT_LAYOUTS[kind] = (layout, None)
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
    return RefitPayload(mode=mode, transport="broadcast", layout_key=layout.key, bytes=layout.nbytes,
                        layout_bytes=len(header), tensors=len(layout.tensors), sender_s=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------ receiver


def receive_named(spec: dict, layouts: dict[str, RefitLayout], group: BroadcastGroup | None,
                  ) -> tuple[RefitLayout, Iterator[tuple[str, torch.Tensor]], bool]:
    """Generator-side: (layout, lazy (name, tensor) stream, whether the layout was received now)
    for one refit spec (see to_spec).

    `layouts` is the receiver's cache (kind -> layout), updated in place. Buckets are fetched one
    at a time as the stream is consumed, so at most one bucket is resident beyond what the
    consumer keeps.
    """
    kind = kind_of(spec["mode"])
    received = False
    if spec["transport"] == "ray":
        import ray

        layout = layouts.get(kind)
        if layout is None or layout.key != spec["layout_key"]:  # first refit here, or the layout changed
            layout = layouts[kind] = RefitLayout.from_plain(ray.get(spec["layout_ref"]))
            received = True
            if layout.key != spec["layout_key"]:
                raise RuntimeError("refit layout does not match its key")
        if len(spec["buckets"]) != len(layout.buckets):
            raise RuntimeError("refit payload and layout disagree on the number of buckets")

        def fetch() -> Iterator[torch.Tensor]:
            for ref in spec["buckets"]:
                yield _as_uint8_tensor(ray.get(ref))
    elif spec["transport"] == "broadcast":
        if group is None:
            raise RuntimeError("broadcast refit, but this worker joined no refit group")
        header = group.recv_bytes()
        if header:
            layouts[kind] = RefitLayout.from_plain(json.loads(header))
            received = True
        layout = layouts.get(kind)
        if layout is None:
            raise RuntimeError("broadcast refit without a layout")

        def fetch() -> Iterator[torch.Tensor]:
            for bucket in layout.buckets:
                yield group.broadcast(torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device))
    else:
        raise ValueError(f"unknown refit transport {spec['transport']!r}")

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, buf in zip(layout.buckets, fetch()):
            yield from unpack_bucket(buf, bucket, layout)

    return layout, stream(), received


def lora_groups_from_stream(layout: RefitLayout, named: Iterator[tuple[str, torch.Tensor]]
                            ) -> Iterator[lora_layout.HfLoraGroup]:
    """Regroup a LoRA stream (A, then the Bs) into HfLoraGroups, one group at a time."""
    for g in layout.groups:
        (_, a), *bs = [next(named) for _ in range(1 + len(g.modules))]
        yield lora_layout.HfLoraGroup(g.megatron_module, g.modules, a, tuple(b for _, b in bs))


# ------------------------------------------------------------------------------------ driver


def resolve_transport(transport: str, device: str) -> str:
    """Config `refit.transport` -> "ray" | "gloo" | "nccl" (auto: nccl on cuda, ray on cpu)."""
    if transport == "auto":
        return "nccl" if str(device).startswith("cuda") else "ray"
    if transport not in ("ray", "gloo", "nccl"):
        raise ValueError(f"unknown refit transport {transport!r} (auto | ray | gloo | nccl)")
    return transport


def connect(trainers, generators, transport: str, device: str, timeout_s: float = 600.0) -> str:
    """Driver, once after start-up: set up the transport; returns the resolved name.

    For gloo/nccl, trainer rank 0 hosts the broadcast group on its node (IP and free port from its
    `node_address()`) and every vLLM worker joins; the rendezvous blocks until all have arrived.
    trainers: a TrainerGroup (its `actors`, rank 0 first); generators: a GeneratorGroup.
    """
    import ray

    resolved = resolve_transport(transport, device)
    if resolved == "ray":
        return resolved
    host, port = ray.get(trainers.actors[0].node_address.remote())
    world_size, joins = generators.open_refit_group(host, port, backend=resolved, timeout_s=timeout_s)
    ray.get([trainers.actors[0].open_refit_group.remote(host, port, world_size, resolved)] + joins)
    return resolved


def run_refit(start_sender: Callable[[], list], generators, mode: str) -> RefitReport:
    """Driver: one refit. start_sender() launches trainer_payload on every trainer rank and returns
    their ObjectRefs, rank 0 first (e.g. `lambda: [a.refit_payload.remote(mode, mb) for a in actors]`).
    """
    import ray

    t0 = time.perf_counter()
    refs = start_sender()
    if getattr(generators, "transport", "ray") == "broadcast":
        received = generators.apply_refit(RefitPayload.expect_broadcast(mode))  # runs while rank 0 sends
        payload = ray.get(refs)[0]
    else:
        payload = ray.get(refs)[0]
        received = generators.apply_refit(payload)
    total = time.perf_counter() - t0
    return RefitReport(mode=mode, transport=payload.transport, bytes=payload.bytes, tensors=payload.tensors,
                       buckets=received["buckets"], sender_s=payload.sender_s,
                       receiver_s=received["seconds"], transfer_and_update_weights_s=total)
