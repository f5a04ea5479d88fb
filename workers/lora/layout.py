"""Megatron LoRA factors -> HF module names and shapes, per model family, without a Megatron model.

Megatron-Bridge LoRA wraps Megatron's fused linears, so one adapter can cover several HF modules:
  linear_qkv  -> q_proj, k_proj, v_proj   rows of B interleaved per query group:
                 [num_query_groups, heads_per_group + 2, head_dim, r] = [q heads | k | v] per group
  linear_fc1  -> gate_proj, up_proj       (gated MLP: rows of B are [gate; up]) or up_proj alone
  linear_proj -> o_proj,  linear_fc2 -> down_proj
A (linear_in, [r, in]) is shared by every HF module of a fused linear; B (linear_out, [out, r])
is split by rows. Used by `refit` (merged_delta and adapter modes) and by the offline adapter
exporter, which reads a checkpoint and has no Megatron model: everything here needs only
`ModelLayout` (family + attention numbers; heads * head_dim need not equal hidden_size).

Which HF modules a Megatron linear maps to comes from Megatron-Bridge's own mapping registry
(the family's bridge, dispatched as AutoBridge dispatches, `.mapping_registry()`), and the QKV split/fuse from its `split_qkv_weights` /
`merge_qkv_weights`, so the layouts are the ones the Bridge uses for base weights, not re-derived.
One correction: the Bridge names Nemotron-H modules `backbone.layers.N.mixer.*` (HF remote code);
transformers v5 and vLLM name them `model.layers.N.mixer.*`, and vLLM silently ignores adapter
weights whose module path does not exist, so the prefix is rewritten here (`HF_PREFIXES`; every
other place that matches HF names against a checkpoint asks `hf_name_candidates`).

`merge_lora_weight` is the merge arithmetic of the Bridge's merged export (LoRAMerge under
`_merge_single_adapter_weight`): float32, scale * (B @ A), then base + that, cast back. The
generator uses it for `merged_delta`, so that mode writes weights bitwise equal to `merged`.

Megatron imports are lazy (first use) and go through `workers.cpu_shim` on machines without CUDA.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from launcher.config import model_facts
from launcher.config.model_facts import ModelFacts
from launcher.config.schema import FAMILIES, ConfigError
from workers import cpu_shim
from workers.lora.checkpoint import LORA_A_SUFFIX, LORA_B_SUFFIX

# The families this module lays out are launcher.config.schema.FAMILIES; each one's Megatron-Bridge
# class is found the way AutoBridge finds it (see _registry), not listed here.

# family -> (prefix in the Bridge's registry and HF remote-code checkpoints, prefix transformers v5 / vLLM use)
HF_PREFIXES: dict[str, tuple[str, str]] = {"nemotron_h": ("backbone.", "model.")}


def hf_name_candidates(name: str, family: str | None = None) -> list[str]:
    """`name` first, then its other spellings in HF checkpoints (`model.` <-> `backbone.` for Nemotron-H).

    With `family`, only that family's renames; without, every known one (for callers that only
    have a checkpoint, such as the vLLM worker reading base weights).
    """
    renames = [HF_PREFIXES[family]] if family in HF_PREFIXES else [] if family else list(HF_PREFIXES.values())
    out = [name]
    for registry, hf in renames:
        for a, b in ((hf, registry), (registry, hf)):
            if name.startswith(a):
                out.append(b + name[len(a):])
    return out


@dataclass(frozen=True)
class ModelLayout:
    """The numbers that decide LoRA layouts. head_dim * num_attention_heads may differ from hidden."""

    family: str
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    hidden_size: int

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r} (known: {sorted(FAMILIES)})")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.num_attention_heads} heads do not split into "
                             f"{self.num_query_groups} query groups")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_facts(cls, facts: ModelFacts) -> "ModelLayout":
        """From the run's model facts (launcher.config.model_facts): the numbers every consumer reads."""
        return cls.from_model_section(facts.as_section())

    @classmethod
    def from_model_section(cls, model: Mapping[str, Any]) -> "ModelLayout":
        """From the config's `model:` section (family, num_attention_heads, num_query_groups, ...)."""
        return cls(family=model["family"], num_attention_heads=int(model["num_attention_heads"]),
                   num_query_groups=int(model["num_query_groups"]), head_dim=int(model["head_dim"]),
                   hidden_size=int(model["hidden_size"]))

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelLayout":
        """From an HF config (a checkpoint directory, a config.json path, a dict or a PretrainedConfig),
        read by launcher.config.model_facts like every other reader of a checkpoint."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            try:
                facts = model_facts.read(path if path.is_dir() else path.parent)[0]
            except ConfigError as e:
                raise ValueError(e.message) from None
            return cls.from_facts(facts)
        hf = dict(config) if isinstance(config, Mapping) else config.to_dict()
        try:
            return cls.from_facts(model_facts.read_hf(hf, "the HF config")[0])
        except ConfigError as e:
            raise ValueError(e.message) from None

    def bridge_config(self, feature_dim: int | None = None) -> SimpleNamespace:
        """The attributes Bridge's split/merge_qkv_weights read from a TransformerConfig.

        `feature_dim` replaces hidden_size as the trailing dimension (merge_qkv_weights reshapes
        with provider.hidden_size, so a LoRA-B of r columns needs hidden_size=r there).
        """
        return SimpleNamespace(num_attention_heads=self.num_attention_heads,
                               num_query_groups=self.num_query_groups, kv_channels=self.head_dim,
                               hidden_size=feature_dim or self.hidden_size, attention_output_gate=False)


@dataclass(frozen=True)
class ModuleMap:
    """One Megatron linear and the HF modules it covers (in the order B's rows are split into)."""

    megatron_module: str          # decoder.layers.0.self_attention.linear_qkv
    kind: str                     # "qkv" | "gated" | "single"
    hf_modules: tuple[str, ...]   # model.layers.0.self_attn.q_proj, ...k_proj, ...v_proj


@dataclass
class HfLoraGroup:
    """LoRA factors of one Megatron linear in HF layout: A shared, one B per HF module."""

    megatron_module: str
    hf_modules: tuple[str, ...]
    lora_a: torch.Tensor                 # [r, in]
    lora_b: tuple[torch.Tensor, ...]     # [out_i, r] per HF module


# --------------------------------------------------------------------------------------------
# Megatron-Bridge access (lazy: importing megatron costs seconds and needs the CPU shim)


def _ensure_megatron_importable() -> None:
    cpu_shim.apply("cuda" if torch.cuda.is_available() else "cpu")


@lru_cache(maxsize=None)
def _registry(family: str):
    """Megatron-Bridge's mapping registry of `family` (an HF model_type), dispatched as AutoBridge does:
    transformers' causal-LM class of the model_type, looked up in the bridge's dispatch table."""
    _ensure_megatron_importable()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import megatron.bridge  # noqa: F401  (imports every bridge: that registers them)
    from megatron.bridge.models.conversion import model_bridge

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    source = getattr(transformers, architecture, architecture)  # registered by class or by class name
    return model_bridge.get_model_bridge(source).mapping_registry()


def _qkv_helpers():
    _ensure_megatron_importable()
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping.split_qkv_weights, param_mapping.merge_qkv_weights


def _hf_module_name(family: str, hf_param: str) -> str:
    name = hf_param[: -len(".weight")] if hf_param.endswith(".weight") else hf_param
    registry, hf = HF_PREFIXES.get(family, ("", ""))
    return hf + name[len(registry):] if registry and name.startswith(registry) else name


@lru_cache(maxsize=4096)
def module_map(family: str, megatron_module: str) -> ModuleMap:
    """HF modules of `megatron_module` (e.g. decoder.layers.3.mlp.linear_fc1), from Bridge's registry."""
    mapping = _registry(family).megatron_to_hf_lookup(megatron_module + ".weight")
    if mapping is None:
        raise KeyError(f"{family}: Megatron-Bridge has no HF mapping for {megatron_module}.weight")
    kind_name = type(mapping).__name__
    hf = mapping.hf_param
    if kind_name == "QKVMapping":
        return ModuleMap(megatron_module, "qkv", tuple(_hf_module_name(family, hf[k]) for k in ("q", "k", "v")))
    if kind_name == "GatedMLPMapping":
        return ModuleMap(megatron_module, "gated", tuple(_hf_module_name(family, hf[k]) for k in ("gate", "up")))
    # MambaInProjMapping: one HF in_proj; the TP-gathered LoRA-B has its rows (z, x, B, C, dt) in HF order
    # (workers.trainer.gather joins TP shards block by block; checkpoints store the blocks apart)
    if isinstance(hf, str) and kind_name in ("AutoMapping", "ColumnParallelMapping", "RowParallelMapping",
                                             "ReplicatedMapping", "MambaInProjMapping"):
        return ModuleMap(megatron_module, "single", (_hf_module_name(family, hf),))
    raise NotImplementedError(f"{family}: LoRA on {megatron_module} ({kind_name}) is not supported")


# --------------------------------------------------------------------------------------------
# B split / fuse


def split_lora_b(layout: ModelLayout, mm: ModuleMap, lora_b: torch.Tensor,
                 fc1_tp_shards: int = 1) -> tuple[torch.Tensor, ...]:
    """Rows of a fused LoRA-B -> one B per HF module of `mm` (views where possible).

    fc1_tp_shards: a gated fc1 B gathered by concatenating TP shards holds [gate_i; up_i] per
    shard (that is how Megatron shards it); give the shard count to undo that. QKV needs no such
    argument: TP shards hold whole query groups, so their concatenation is the TP=1 layout.
    """
    if mm.kind == "qkv":
        split_qkv_weights, _ = _qkv_helpers()
        return tuple(split_qkv_weights(layout.bridge_config(), lora_b, feature_dim=lora_b.shape[-1]))
    if mm.kind == "gated":
        if fc1_tp_shards == 1:
            return tuple(torch.chunk(lora_b, 2, dim=0))
        halves = [torch.chunk(shard, 2, dim=0) for shard in torch.chunk(lora_b, fc1_tp_shards, dim=0)]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    return (lora_b,)


# --------------------------------------------------------------------------------------------
# adapter state (Megatron names) -> HF groups (PEFT files from them: workers.lora.peft)


_LAYER_NUMBER = re.compile(r"\.layers\.(\d+)\.")


def _canonical_order(module: str):
    m = _LAYER_NUMBER.search(module)
    return (int(m.group(1)) if m else -1, module)


def megatron_lora_modules(adapter_state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{megatron module: (A, B)} from adapter_state names, in canonical (layer, name) order."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter_state.items():
        name = key[len("module."):] if key.startswith("module.") else key
        if name.endswith(LORA_A_SUFFIX):
            factors.setdefault(name[: -len(LORA_A_SUFFIX)], {})["A"] = tensor
        elif name.endswith(LORA_B_SUFFIX):
            factors.setdefault(name[: -len(LORA_B_SUFFIX)], {})["B"] = tensor
        elif ".adapter." in name:
            raise NotImplementedError(f"adapter tensor {key!r} is not plain LoRA (linear_in/linear_out)")
    out = {}
    for module in sorted(factors, key=_canonical_order):
        pair = factors[module]
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{module}: LoRA needs both linear_in and linear_out, got {sorted(pair)}")
        if pair["A"].shape[0] != pair["B"].shape[1]:
            raise ValueError(f"{module}: rank of A {tuple(pair['A'].shape)} != rank of B {tuple(pair['B'].shape)}")
        out[module] = (pair["A"], pair["B"])
    return out


def hf_lora_groups(layout: ModelLayout, adapter_state: Mapping[str, torch.Tensor],
                   fc1_tp_shards: int = 1) -> list[HfLoraGroup]:
    """Trainer adapter_state() -> LoRA factors per HF module, grouped by Megatron linear."""
    groups = []
    for module, (a, b) in megatron_lora_modules(adapter_state).items():
        mm = module_map(layout.family, module)
        groups.append(HfLoraGroup(module, mm.hf_modules, a, split_lora_b(layout, mm, b, fc1_tp_shards)))
    return groups


# --------------------------------------------------------------------------------------------
# the merge


def lora_numbers(lora_config: Any) -> tuple[int, float]:
    """(dim, alpha) from the trainer's lora_config(): a mapping or an object with dim/alpha."""
    get = lora_config.get if isinstance(lora_config, Mapping) else (lambda k: getattr(lora_config, k, None))
    dim, alpha = get("dim"), get("alpha")
    if dim is None or alpha is None:
        raise ValueError(f"lora_config needs dim and alpha, got {lora_config!r}")
    return int(dim), alpha


def merge_lora_weight(base: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor,
                      alpha: float, dim: int, out: torch.Tensor | None = None,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """W = base + (alpha / dim) * (B @ A), with the Bridge's merged export's dtypes and order.

    Megatron-Bridge (_merge_single_adapter_weight -> LoRAMerge.merge, TP=1 after gathering):
    float32 copies of all three, lora = scale * (B @ A) with scale the Python float alpha / dim,
    merged = base + lora, cast back to base's dtype. Same inputs, same device kind -> same bits.

    out (base's shape and dtype) receives W and is returned; scratch (base's shape, float32) holds
    the float32 sum when base is not float32 (else out does). With them nothing is allocated but
    the float32 copies of the small factors, and B @ A is written once (matmul out=), scaled and
    added in place: the same roundings as the three full-size temporaries of the Bridge's merge.
    When the scale is a power of two >= 1 (alpha = 2 * dim, the common choice), scale * (B @ A) is
    exact, so base + scale * (B @ A) is one pass (torch.add's alpha; rounded once, as the Bridge
    rounds the sum) instead of two.
    """
    scale = alpha / dim
    b32 = lora_b.to(device=base.device, dtype=torch.float32)
    a32 = lora_a.to(device=base.device, dtype=torch.float32)
    if out is None:
        return (base.float() + scale * (b32 @ a32)).to(base.dtype)
    total = out if base.dtype == torch.float32 else scratch
    if total is None:
        total = torch.empty(base.shape, dtype=torch.float32, device=base.device)
    torch.matmul(b32, a32, out=total)
    if scale >= 1 and math.frexp(scale)[0] == 0.5:   # 2**k, k >= 0: scale * x is exact in float32
        torch.add(base, total, alpha=scale, out=total)
    else:
        total.mul_(scale)
        total.add_(base)   # base + lora: addition commutes bitwise
    if total is not out:
        out.copy_(total)   # float32 -> base's dtype, as .to(base.dtype) rounds
    return out
