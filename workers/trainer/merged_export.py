"""The trainer's merged export: HF-named weights with the LoRA deltas merged in, without temporaries.

Megatron-Bridge's `export_hf_weights(merge_adapter_weights=True)` merges every wrapped weight in
three fresh full-size float32 tensors (B @ A, scale * that, base + that): for llama_100m with LoRA
on all linears that was most of a merged refit's trainer side (docs/benchmarks.md). Here the Bridge
exports the base weights (`merge_adapter_weights=False`: the same conversion tasks, QKV split, TP
gathering and names, a wrapped weight as `<module>.base_layer.weight`), the LoRA factors come
TP-gathered in HF layout (`workers.lora.layout.hf_lora_groups`, the split merged_delta uses), and
each wrapped weight is merged by `lora_layout.merge_lora_weight` (the Bridge's arithmetic, bitwise:
tests/unit/test_lora_layout.py against the Bridge's own merge, tests/integration/test_generator.py
against its merged export) into a buffer of a `BufferPool`. The refit sender gives the buffers back
once a bucket has been copied out (`wire.stream_buckets`' release), so later tensors and later
refits reuse the same memory: on CPU a fresh allocation costs a page fault per page, which made a
copy into new memory several times a copy into memory already touched.

Ranks other than 0 drain the base export (its gathers are collectives) and merge nothing.
LoRA on routed experts keeps the Bridge's merge (its grouped-expert export merges per expert and
does not name them `.base_layer`); a wrapped weight without factors, or factors without a wrapped
weight, is an error, never a silently unmerged weight.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from workers.lora import layout as lora_layout
from workers.refit.buffers import BufferPool

BASE_LAYER = ".base_layer"


def merges_here(lora_modules: Iterable[str]) -> bool:
    """Whether this module merges these LoRA-wrapped Megatron modules (no routed experts among them)."""
    return not any(".experts." in m for m in lora_modules)


def merged(base: Iterable[tuple[str, torch.Tensor]], groups: list[lora_layout.HfLoraGroup], alpha: float, dim: int,
           family: str, pool: BufferPool | None = None, keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The Bridge's unmerged export `base` with each `.base_layer` weight merged with its HF module's
    factors from `groups`. keep=False (ranks other than 0): the names pass with the base tensors,
    unmerged, for a caller that drops them."""
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for g in groups:
        for module, b in zip(g.hf_modules, g.lora_b):
            factors[module] = (g.lora_a, b)
    for name, tensor in base:
        if BASE_LAYER not in name:
            yield name, tensor
            continue
        hf_name = name.replace(BASE_LAYER, "")
        module = hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None
        candidates = lora_layout.hf_name_candidates(module, family) if module else []
        key = next((m for m in candidates if m in factors), None)
        if key is None:
            raise RuntimeError(f"merged export: {name!r} is wrapped by LoRA but no LoRA factors map to it "
                               f"(LoRA modules: {', '.join(sorted(factors)[:4])}, ...)")
        a, b = factors.pop(key)
        if not keep:
            yield hf_name, tensor
            continue
        out = pool.take(tensor.shape, tensor.dtype, tensor.device) if pool is not None else torch.empty_like(tensor)
        scratch = None
        if tensor.dtype != torch.float32:
            scratch = (pool.take(tensor.shape, torch.float32, tensor.device) if pool is not None
                       else torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device))
        lora_layout.merge_lora_weight(tensor, b, a, alpha, dim, out=out, scratch=scratch)
        if scratch is not None and pool is not None:
            pool.give_back([scratch])   # read into `out` already: the next weight of this shape reuses it
        del tensor
        yield hf_name, out
    if factors:
        raise RuntimeError(f"merged export: LoRA factors of {', '.join(sorted(factors)[:4])} found no wrapped "
                           f"weight in the Bridge's export")
