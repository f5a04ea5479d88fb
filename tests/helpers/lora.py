"""The inverse of workers.lora.layout.split_lora_b (TP=1 layout), for tests that check the split
round-trips through Megatron-Bridge's own merge: the exporter never fuses, so this is not in workers/."""

from __future__ import annotations

from typing import Iterable

import torch

from workers.lora.layout import ModelLayout, ModuleMap, _qkv_helpers


def fuse_lora_b(layout: ModelLayout, mm: ModuleMap, parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """Inverse of split_lora_b (TP=1 layout): per-HF-module Bs -> the fused Megatron LoRA-B."""
    parts = tuple(parts)
    if mm.kind == "qkv":
        _, merge_qkv_weights = _qkv_helpers()
        return merge_qkv_weights(layout.bridge_config(feature_dim=parts[0].shape[-1]), *parts)
    if mm.kind == "gated":
        return torch.cat(parts, dim=0)
    (b,) = parts
    return b
