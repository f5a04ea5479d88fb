"""Refit wire format: what travels from trainer rank 0 to every vLLM worker, whatever the transport.

Modes (config `refit.mode`, allowed values `schema.REFIT_MODES`):
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
bucket). The sender closes buckets as the tensors arrive (`stream_buckets`), so the layout is
known only at the end of the first refit of a kind: the Ray transport puts it after the last
bucket, the broadcast transport sends each bucket's part of it with the bucket. Both sides derive
the bucket boundaries with the same rule (`plan_buckets`), so they iterate the same order.

The rest of refit, one module per process side:
  transports.py      how buckets get there: one class per transport (Ray object store, broadcast group)
  sender.py          trainer rank 0: the trainer's tensors -> a transport -> RefitPayload
  vllm_extension.py  every vLLM worker: a transport -> tensors -> the engine's weights
  control.py         the driver: one refit object per transport (connect, push, take/deliver), RefitReport
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from launcher.config.schema import REFIT_MODES
from workers.lora import layout as lora_layout

MODES = REFIT_MODES
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


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving packing: a bucket closes when the next tensor would overflow it."""
    buckets, start, offsets, end = [], 0, [], 0
    for i, size in enumerate(sizes):
        offset = aligned(end)
        if offsets and offset + size > bucket_bytes:
            buckets.append(Bucket(start, tuple(offsets), end))
            start, offsets, offset = i, [], 0
        offsets.append(offset)
        end = offset + size
    if offsets:
        buckets.append(Bucket(start, tuple(offsets), end))
    return buckets


def stream_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   release: Callable[[list[torch.Tensor]], None] | None = None
                   ) -> Iterator[tuple[Bucket, list[tuple[TensorMeta, torch.Tensor]]]]:
    """plan_buckets' rule applied while the tensors arrive: yields each bucket as soon as it is
    closed, with its (meta, tensor) pairs, so a sender holds one bucket's tensors (plus the one
    that closed it) and never the whole stream. The list it yields is its own: a consumer that
    clears it once the bucket is packed releases those tensors before asking for the next.
    `release(tensors)` is called with a bucket's tensors when the consumer asks for what follows
    it (it has copied them out by then): the export's buffer pool takes its buffers back."""
    start, pending, offsets, end = 0, [], [], 0
    for name, tensor in named:
        meta = TensorMeta.of(name, tensor)
        offset = aligned(end)
        if pending and offset + meta.nbytes > bucket_bytes:
            closed, pending = pending, []
            done = [t for _, t in closed] if release is not None else []
            yield Bucket(start, tuple(offsets), end), closed
            del closed
            if done:
                release(done)
            del done
            start, offsets, offset = start + len(offsets), [], 0
        pending.append((meta, tensor))
        offsets.append(offset)
        end = offset + meta.nbytes
        del tensor  # the pending list is the only reference this generator keeps
    if pending:
        done = [t for _, t in pending] if release is not None else []
        yield Bucket(start, tuple(offsets), end), pending
        if done:
            release(done)


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


def pack_bucket(tensors: Sequence[torch.Tensor], bucket: Bucket, device: torch.device | str | None = None
                ) -> torch.Tensor:
    """Copy tensors into one uint8 buffer at the planned offsets, on `device` (default: the first
    tensor's; each tensor is copied straight into the buffer, never staged on `device` first); only
    the alignment gaps are zeroed (no memset of the whole buffer before it is overwritten)."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device if device is not None else tensors[0].device)
    end = 0
    for t, off in zip(tensors, bucket.offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[end:off].zero_()
        buf[off:off + raw.numel()].copy_(raw)
        end = off + raw.numel()
    buf[end:].zero_()
    return buf


def unpack_tensors(raws: Sequence[torch.Tensor], bucket: Bucket, layout: RefitLayout) -> list[tuple[str, torch.Tensor]]:
    """The same views from one flat uint8 tensor per tensor (the Ray transport's bucket, unpacked)."""
    metas = layout.tensors[bucket.start:bucket.stop]
    if len(raws) != len(metas):
        raise RuntimeError(f"refit bucket holds {len(raws)} tensors, its layout {len(metas)}")
    return [(m.name, raw.view(getattr(torch, m.dtype)).view(m.shape)) for m, raw in zip(metas, raws)]


def unpack_bucket(buf: torch.Tensor, bucket: Bucket, layout: RefitLayout) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (no copies), in layout order."""
    return unpack_metas(buf, bucket, layout.tensors[bucket.start:bucket.stop])


def unpack_metas(buf: torch.Tensor, bucket: Bucket, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (no copies) of the tensors `metas` describes, at the bucket's offsets."""
    out = []
    for meta, off in zip(metas, bucket.offsets):
        raw = buf[off:off + meta.nbytes]
        out.append((meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)))
    return out


def bucket_of(metas: Sequence[TensorMeta], start: int = 0) -> Bucket:
    """The one bucket that holds `metas` in order (what plan_buckets gives a bucket of them)."""
    offsets, end = [], 0
    for meta in metas:
        offsets.append(aligned(end) if offsets else 0)
        end = offsets[-1] + meta.nbytes
    return Bucket(start, tuple(offsets), end)


# ------------------------------------------------------------------------------------ LoRA stream


def lora_stream(groups: Sequence[lora_layout.HfLoraGroup]) -> tuple[list[tuple[str, torch.Tensor]], list[LoraGroupMeta]]:
    """HF LoRA groups -> the ordered (name, tensor) list that travels: A once, then one B per module."""
    named, metas = [], []
    for g in groups:
        metas.append(LoraGroupMeta(g.megatron_module, len(named), tuple(g.hf_modules)))
        named.append((f"{g.hf_modules[0]}.lora_A.weight", g.lora_a))
        named.extend((f"{module}.lora_B.weight", b) for module, b in zip(g.hf_modules, g.lora_b))
    return named, metas


def lora_groups_from_stream(layout: RefitLayout, named: Iterator[tuple[str, torch.Tensor]]
                            ) -> Iterator[lora_layout.HfLoraGroup]:
    """Regroup a LoRA stream (A, then the Bs) into HfLoraGroups, one group at a time (lora_stream's inverse)."""
    for g in layout.groups:
        (_, a), *bs = [next(named) for _ in range(1 + len(g.modules))]
        yield lora_layout.HfLoraGroup(g.megatron_module, g.modules, a, tuple(b for _, b in bs))


# ------------------------------------------------------------------------------------ payloads


@dataclass
class RefitPayload:
    """What the driver hands to GeneratorGroup.apply_refit."""

    mode: str
    transport: str                       # the transport's name: "ray" | "broadcast"
    layout_key: str | None = None
    layout_ref: Any = None               # ray: ObjectRef of the layout, put once; fetched by a
                                         # receiver only when it does not hold layout_key yet
    buckets: list = field(default_factory=list)  # ObjectRefs (ray transport)
    bytes: int = 0                       # bucket bytes
    layout_bytes: int = 0                # layout bytes, when it was produced this time (else 0)
    tensors: int = 0
    sender_s: float = 0.0

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
