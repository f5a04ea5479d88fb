"""The model's facts, resolved once: read from model.path's config.json (or the built-in recipe),
written into the run's `model:` section, and the only architecture numbers anything reads.

`apply(raw)` runs inside launcher.config.compose, before interpolations resolve: it replaces the
`model:` section's facts (FACT_KEYS: family, shape, experts, tied embeddings, q/k/v bias, q/k
norm, rope) by what the checkpoint's config.json says (`model.path`), or what the built-in
recipe builds (`model.builtin`), names the run's model after the checkpoint directory, and
returns one note per number the conf had differently (a disagreement is a note; the conf's value
is gone). The run's config.yaml then holds the facts; the trainer (Bridge build, refit layout),
the driver, validation and the exporter read them there, and the job checks at start that the
checkpoint still says the same (`differences`). Where model.path is not on this machine (a dry
run planning for a cluster) the facts are whatever the chosen `model=` group states, possibly
nothing; a submission needs the checkpoint here, so a submitted run always has resolved facts.

Reading is HF's: `read_hf` takes a config.json as transformers writes it (both the older
`rope_scaling` + `rope_theta` spelling of the Hub's files and transformers 5's
`rope_parameters`), fills what the family's HF class assumes for an absent key (`FAMILIES`), and
normalises rope scaling to {rope_type, every parameter with HF's default filled in}. A family
adds its own facts with a `Family.read` (kept under `model.family_facts`); what the training
stack cannot honour is refused by launcher.config.model_rules. Nemotron-H's own facts: its layer
pattern (either spelling: `hybrid_override_pattern`, or transformers 5's `layers_block_type`; it
counts the layers, and only E layers have experts), Mamba-2 heads, head dim, groups and state, its
shared expert, LatentMoE's `moe_latent_size` (0: none), the routing scale, the MTP depth
`num_nextn_predict_layers` (0: none) and pattern `mtp_hybrid_override_pattern` ("": none; or
transformers 5's `mtp_layers_block_type`) and the norms' epsilon; the pattern, the sizes and the
latent width are shape facts too (`shape_keys`).

No key is dropped silently: the reader remembers every config.json key it looked at, and a key it did
not read is compared with the default of the family's transformers config class
(launcher.config.hf_classes, read from transformers' source): a value other than the default changes
what the model computes and is refused, one line naming each such key (`unread_differences`). Keys
the class does not define (its model reads none of them), its base class's (output flags, dtype,
labels) and INERT_KEYS (token ids, initialisation, caches, schedules: the project's small table) are
not compared.

The family is HF's `model_type`. It is supported when (a) Megatron-Bridge registers a bridge for
one of the checkpoint's `architectures` and (b) our LoRA layout knows the family
(launcher.config.schema.LORA_MODULES, the Megatron modules LoRA may wrap per family).

(a) is read statically: the launcher must stay torch-free and fast (a dry run plans for a cluster
and imports neither torch nor megatron), so instead of importing megatron.bridge (seconds, and
torch) we parse the installed Megatron-Bridge's sources (`ast`, about 0.25 s, cached) for its own
registrations, `@MegatronModelBridge.register_bridge(source=..., model_type=...)` and
`register_bridge_implementation(source=...)`: the same calls that fill the dispatch table
`AutoBridge` looks the architecture up in. The trainer then dispatches through the real
registry (AutoBridge.from_hf_pretrained); a registration this reading missed would fail there.
Where Megatron-Bridge is not installed (a laptop planning a cluster run), (a) is not checked.

A quantized checkpoint (config.json's `quantization_config`, NVIDIA ModelOpt's `hf_quant_config.json`:
FP8, NVFP4, compressed-tensors, AWQ, GPTQ, bitsandbytes, MXFP4, ...) is refused before its facts are read,
one line naming the file, the kind and the BF16 alternative (`check_unquantized`): LoRA training here
needs unquantized weights.

Robust reading: a config.json that is not a JSON object, a missing key or a value of the wrong
type is one ConfigError naming the file and the key. Torch-free: the workers import it too (the
one reader of a checkpoint's facts).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launcher.config.schema import BUILTIN_COMMON, BUILTIN_MODELS, FAMILIES, ConfigError

# HF names differ per family for the expert numbers; these are the names Megatron-Bridge's
# CONFIG_MAPPING reads.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class ModelFacts:
    """What a checkpoint is, in the `model:` section's names (every field is a key there)."""

    family: str                      # HF model_type
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int            # num_key_value_heads
    head_dim: int                    # heads * head_dim may differ from hidden_size
    num_experts: int                 # 0: dense
    moe_router_topk: int             # experts per token (0: dense)
    ffn_hidden_size: int             # intermediate_size (the dense MLP's)
    moe_ffn_hidden_size: int         # moe_intermediate_size (one expert's; 0: dense)
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool                    # RMSNorm on every query and key head (Qwen3)
    rope_theta: Optional[float]      # None: no rotary embedding
    rope_scaling: dict               # {}: plain RoPE (or none); else {"rope_type": ..., parameters}
    max_position_embeddings: Optional[int]
    family_facts: dict = field(default_factory=dict)   # the family's own (Family.read)

    def as_section(self) -> dict:
        return asdict(self)


FACT_KEYS = tuple(f.name for f in fields(ModelFacts))
# the facts that decide tensor shapes (what an adapter must match); rope, biases and norms change the
# function, not the shapes
SHAPE_KEYS = ("family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
              "num_experts", "moe_router_topk", "ffn_hidden_size", "moe_ffn_hidden_size")


def _count_layers(r: "_Reader") -> int:
    # hybrid models (Nemotron-H in transformers 5) list their blocks instead of counting them
    blocks = r.hf.get("layers_block_type")
    if isinstance(blocks, list) and blocks and r.hf.get("num_hidden_layers") is None:
        return len(blocks)
    return r.positive("num_hidden_layers")


@dataclass(frozen=True)
class Family:
    """What the family's HF class assumes where config.json is silent, and its own facts."""

    qkv_bias: Callable[["_Reader"], bool] = lambda r: r.flag("attention_bias", False)
    qk_norm: bool = False
    rope: bool = True                                   # False: the family has no rotary embedding
    read: Callable[["_Reader"], dict] = lambda r: {}    # -> family_facts
    adjust: Callable[["_Reader", dict], dict] = lambda r, common: common   # the common facts, as the family means them
    layers: Callable[["_Reader"], int] = _count_layers  # num_layers
    shapes: tuple[str, ...] = ()    # the family_facts that decide tensor shapes too (shape_keys)


def _llama(r: "_Reader") -> dict:
    return {"mlp_bias": r.flag("mlp_bias", False), "rms_norm_eps": r.number("rms_norm_eps", default=1e-6)}


def _qwen(r: "_Reader") -> dict:
    """use_sliding_window (refused when true: launcher.config.model_rules); the window's size and layers
    matter only with it, and transformers 5 saves the per-layer attention kinds (layer_types) it implies."""
    sliding = r.flag("use_sliding_window", False)
    r.covers("sliding_window", "max_window_layers")
    kinds = r.hf.get("layer_types")
    if not sliding and kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
        raise r.error("layer_types", f"must be full_attention on every layer without use_sliding_window, got {kinds!r}")
    return {"use_sliding_window": sliding, "rms_norm_eps": r.number("rms_norm_eps", default=1e-6)}


def _qwen3_moe(r: "_Reader") -> dict:
    """norm_topk_prob: the routed top-k probabilities renormalised to 1 (Megatron-Bridge maps it to the
    router's pre-softmax); Qwen3MoeConfig's default is false, the published checkpoints say true."""
    return {**_qwen(r), "decoder_sparse_step": r.positive("decoder_sparse_step", default=1),
            "mlp_only_layers": r.int_list("mlp_only_layers"), "norm_topk_prob": r.flag("norm_topk_prob", False)}


# Nemotron-H (hybrid): one symbol per layer, megatron's and the published hybrid_override_pattern's
# (M Mamba-2, * attention, - MLP, E MoE); transformers 5 writes layers_block_type instead, with these
# names (and their older spellings)
HYBRID_SYMBOLS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
_BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                  "moe": "E"}
# the MTP depth and pattern add tensors (mtp.layers.*) but change no shape the trainer builds or an adapter
# holds (the trainer builds no MTP layers: docs/nemotron_h.md), so they are facts but not shape facts
NEMOTRON_H_SHAPES = ("hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                     "moe_shared_expert_intermediate_size", "moe_latent_size")
# what NemotronHConfig defines for its E layers only, and for its M layers only: nothing where the
# pattern has none (transformers writes them for every model)
_NEMOTRON_H_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                        "moe_shared_expert_intermediate_size", "moe_latent_size", "routed_scaling_factor", "n_group",
                        "topk_group", "norm_topk_prob", "moe_shared_expert_overlap")
_NEMOTRON_H_MAMBA_KEYS = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "expand",
                          "mamba_hidden_act", "use_conv_bias", "mamba_proj_bias", "chunk_size", "time_step_min",
                          "time_step_max", "time_step_limit", "time_step_floor", "mamba_ssm_cache_dtype")
# NemotronHConfig's MTP layers when config.json names none (its mtp_layers_block_type default)
NEMOTRON_H_MTP_DEFAULT = "*E"


def _hybrid_pattern(r: "_Reader", pattern_key: str = "hybrid_override_pattern",
                    list_key: str = "layers_block_type", default: Optional[str] = None) -> str:
    """The layer pattern, from either spelling (it also counts the layers); the MTP layers' pattern with
    the MTP keys (`default`: what transformers assumes where both are absent)."""
    pattern, blocks = r.hf.get(pattern_key), r.hf.get(list_key)
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(HYBRID_SYMBOLS):
            raise r.error(pattern_key, f"must be a string of {''.join(HYBRID_SYMBOLS)} (one per "
                                       f"layer), got {_short(pattern)}")
        return pattern
    if blocks is None:
        if default is not None:
            return default
        raise r.error(pattern_key, f"is missing (a Nemotron-H config.json names its layers: "
                                   f"{pattern_key} or {list_key})")
    if not isinstance(blocks, list) or not blocks or not all(isinstance(b, str) and b in _BLOCK_SYMBOLS
                                                             for b in blocks):
        raise r.error(list_key, f"must be a list of {', '.join(sorted(_BLOCK_SYMBOLS))}, got "
                                f"{_short(blocks)}")
    return "".join(_BLOCK_SYMBOLS[b] for b in blocks)


def _mtp(r: "_Reader") -> tuple[int, str]:
    """(MTP depth, the pattern of one MTP step; "" without MTP). Published configs spell the pattern
    mtp_hybrid_override_pattern, transformers 5 saves mtp_layers_block_type (written for every model,
    MTP or not); NemotronHConfig assumes attention + MoE where the depth is > 0 and both are absent."""
    depth = r.count("num_nextn_predict_layers")
    if not depth:
        r.covers("mtp_hybrid_override_pattern", "mtp_layers_block_type")
        return 0, ""
    return depth, _hybrid_pattern(r, "mtp_hybrid_override_pattern", "mtp_layers_block_type", NEMOTRON_H_MTP_DEFAULT)


def _nemotron_h_facts(r: "_Reader") -> dict:
    """The layer pattern, Mamba-2 heads / head dim / groups / state (where it has M layers; n_groups as
    NemotronHConfig defaults it), shared experts (where it has E layers: transformers builds one
    shared expert of moe_shared_expert_intermediate_size per MoE layer), LatentMoE's latent width (0:
    none), the routing scale, the MTP depth and pattern (0, "": none), the norms' epsilon."""
    pattern = _hybrid_pattern(r)
    depth, mtp_pattern = _mtp(r)
    every = pattern + mtp_pattern   # the MTP layers are built from the same numbers
    heads = r.positive("mamba_num_heads") if "M" in every else 0
    if not heads:
        r.covers(*_NEMOTRON_H_MAMBA_KEYS)
    groups = r.positive("n_groups", default=8) if heads else 0
    if heads and heads % groups:
        raise r.error("n_groups", f"{groups} must divide mamba_num_heads {heads}")
    moe = "E" in every
    if not moe:
        r.covers(*_NEMOTRON_H_MOE_KEYS)
    return {"hybrid_override_pattern": pattern, "mamba_num_heads": heads,
            "mamba_head_dim": r.positive("mamba_head_dim") if heads else 0, "n_groups": groups,
            "ssm_state_size": r.positive("ssm_state_size") if heads else 0,
            "n_shared_experts": r.count("n_shared_experts", default=1) if moe else 0,
            "moe_shared_expert_intermediate_size":
                r.positive("moe_shared_expert_intermediate_size", default=7688) if moe else 0,
            # LatentMoE: the routed experts compute in this width, between fc1_latent_proj and fc2_latent_proj
            "moe_latent_size": r.count("moe_latent_size") if moe else 0,
            "routed_scaling_factor": float(r.number("routed_scaling_factor", default=1.0)) if moe else 1.0,
            "num_nextn_predict_layers": depth, "mtp_hybrid_override_pattern": mtp_pattern,
            "layer_norm_epsilon": float(r.number("layer_norm_epsilon", default=1e-5))}


def _nemotron_h(r: "_Reader", common: dict) -> dict:
    """Nemotron-H's config.json carries MoE numbers (transformers' defaults) whether or not a block is
    MoE: only a pattern with MoE blocks (E) has experts, and then they route to 1..n_routed_experts -
    the MTP layers' E blocks too (vLLM builds them from the same numbers), though the trained network,
    whose numbers these facts are, has experts only where the main pattern has E."""
    pattern, (_, mtp_pattern) = _hybrid_pattern(r), _mtp(r)
    where = " and ".join(f"{p!r}" for p in (pattern, mtp_pattern) if "E" in p)
    if where and not 1 <= common["moe_router_topk"] <= common["num_experts"]:
        raise r.error("num_experts_per_tok", f"must be in [1, n_routed_experts = {common['num_experts']}] for the "
                                             f"E layers of {where}, got {common['moe_router_topk']}")
    if "E" not in pattern:
        common.update(num_experts=0, moe_router_topk=0, moe_ffn_hidden_size=0)
    return common


FAMILY_FACTS: dict[str, Family] = {
    "llama": Family(read=_llama),
    "qwen2": Family(qkv_bias=lambda r: True, read=_qwen),   # Qwen2Attention: q/k/v always biased, o_proj never
    "qwen3": Family(qk_norm=True, read=_qwen),
    "qwen3_moe": Family(qk_norm=True, read=_qwen3_moe),
    "nemotron_h": Family(rope=False, read=_nemotron_h_facts, adjust=_nemotron_h,
                         layers=lambda r: len(_hybrid_pattern(r)), shapes=NEMOTRON_H_SHAPES),
}

# rope scaling parameters per type, with the default transformers' rope functions use for an
# absent one (modeling_rope_utils: _compute_yarn_parameters, _compute_llama3_parameters, ...);
# None: required. original_max_position_embeddings defaults to max_position_embeddings (HF's
# standardize_rope_params).
ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    "linear": {"factor": None},
    "dynamic": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": "max_position_embeddings"},
    "yarn": {"factor": None, "original_max_position_embeddings": "max_position_embeddings", "beta_fast": 32.0,
             "beta_slow": 1.0, "truncate": True, "mscale": None, "mscale_all_dim": None,
             "attention_factor": None},
}


def read(path: str | Path) -> tuple[ModelFacts, list[str]]:
    """(facts, architectures) of the HF checkpoint directory `path`; ConfigError on a bad config.json."""
    cfg_file = Path(path) / "config.json"
    return read_hf(config_json(cfg_file), str(cfg_file))


def config_json(cfg_file: Path) -> dict:
    """The content of a checkpoint's config.json (a JSON object); ConfigError naming the file otherwise."""
    from launcher.config import bounded

    try:  # the one bounded reader: a size and depth limit, infinities as transformers reads them
        hf = bounded.model_json(cfg_file, "model config")
    except bounded.FileError as e:
        raise ConfigError("model.path", str(e)) from None
    if not isinstance(hf, dict):
        raise ConfigError("model.path", f"{cfg_file} must hold a JSON object, got {type(hf).__name__}")
    return hf


# ------------------------------------------------------------------------------------------
# quantized checkpoints: refused (LoRA training here needs the unquantized weights)

HF_QUANT_CONFIG = "hf_quant_config.json"
UNQUANTIZED_ALTERNATIVE = ("LoRA training here needs unquantized weights: use the BF16 release of this model, or "
                           "dequantize it first")
# quant_method (as transformers' AUTO_QUANTIZATION_CONFIG_MAPPING and vLLM's QUANTIZATION_METHODS spell it,
# lower-cased) -> the kind as a model card names it
QUANT_KINDS: dict[str, str] = {
    "fp8": "FP8", "fbgemm_fp8": "FP8 (fbgemm)", "mxfp8": "MXFP8", "deepseek_v4_fp8": "FP8 (DeepSeek-V4)",
    "nvfp4": "NVFP4", "mxfp4": "MXFP4", "gpt_oss_mxfp4": "MXFP4",
    "modelopt": "ModelOpt", "modelopt_fp4": "NVFP4 (ModelOpt)", "modelopt_mxfp8": "MXFP8 (ModelOpt)",
    "modelopt_mixed": "mixed precision (ModelOpt)",
    "compressed-tensors": "compressed-tensors",
    "awq": "AWQ", "auto_awq": "AWQ", "awq_marlin": "AWQ", "gptq": "GPTQ", "auto_gptq": "GPTQ", "gptq_marlin": "GPTQ",
    "bitsandbytes": "bitsandbytes", "aqlm": "AQLM", "vptq": "VPTQ", "quanto": "Quanto", "eetq": "EETQ",
    "higgs": "HIGGS", "hqq": "HQQ", "torchao": "torchao", "gguf": "GGUF", "bitnet": "BitNet", "spqr": "SpQR",
    "quark": "Quark", "fp_quant": "FP-Quant", "auto-round": "AutoRound", "metal": "Metal",
    "fouroversix": "FourOverSix", "sinq": "SINQ", "gemma": "Gemma QAT", "experts_int8": "INT8 experts",
    "moe_wna16": "MoE WNA16", "inc": "Intel Neural Compressor", "humming": "Humming",
}


def check_unquantized(directory: Path, hf: Mapping[str, Any]) -> None:
    """One ConfigError (key model.path) when the checkpoint at `directory` (its config.json content `hf`)
    holds quantized weights, naming the file, the kind and the BF16 alternative.

    Where transformers and vLLM find a quantization (vllm/transformers_utils/config.py and
    model_arch_config_convertor.py): config.json's `quantization_config`, else NVIDIA ModelOpt's
    `hf_quant_config.json` beside it (`quantization.quant_algo`: what ModelOpt 0.29 and older wrote
    instead), else config.json's `compression_config` (older compressed-tensors), else
    `text_config.quantization_config` (a multimodal model's). Null or {} is no quantization; a
    quant_method nobody here knows is refused too, named as written (transformers would skip it with
    a warning and load the packed tensors as weights). No path of this project trains on quantized
    weights (the trainers build BF16 Megatron layers and read every tensor as a weight; the dry run
    counts the packed tensors as weights), so every kind is refused; a path that supports one would
    let it through here."""
    cfg_file = directory / "config.json"
    found = _quantization(hf, "quantization_config")
    where = cfg_file
    if found is None and (directory / HF_QUANT_CONFIG).is_file():
        where = directory / HF_QUANT_CONFIG
        found = _modelopt_file(where)
    if found is None:
        where = cfg_file
        found = _quantization(hf, "compression_config")
    text = hf.get("text_config")
    if found is None and isinstance(text, dict):
        found = _quantization(text, "quantization_config", "text_config.quantization_config")
    if found is not None:
        raise ConfigError("model.path", f"{where}: {found}")


def _quantization(hf: Mapping[str, Any], key: str, name: Optional[str] = None) -> Optional[str]:
    """'<field>: quantized weights, <kind>; <alternative>' for a config.json's quantization object
    `hf[key]`, or None where it is absent, null or empty."""
    name = name or key
    q = hf.get(key)
    if q is None or q == {}:
        return None
    if not isinstance(q, dict):
        return f"{name} must be an object or null, got {_short(q)}"
    method = q.get("quant_method")
    if method is None:
        if "quantization" in q:   # ModelOpt's own layout (hf_quant_config.json's), which vLLM also reads here
            return _modelopt(q, f"{name}.")
        for bits in (4, 8):   # transformers reads a config with load_in_4bit / load_in_8bit as bitsandbytes
            if q.get(f"load_in_{bits}bit") is True:
                return (f"{name}.load_in_{bits}bit true: quantized weights, bitsandbytes {bits}-bit; "
                        f"{UNQUANTIZED_ALTERNATIVE}")
        return f"{name} has no quant_method (transformers refuses such a config); {UNQUANTIZED_ALTERNATIVE}"
    if not isinstance(method, str):
        return f"{name}.quant_method must be a string, got {_short(method)}"
    normal = method.lower().replace("compressed_tensors", "compressed-tensors")   # as vLLM reads it
    kind = QUANT_KINDS.get(normal)
    field = f"{name}.quant_method {json.dumps(method)}"
    if kind is None:
        return f"{field}: quantized weights of a kind this launcher does not know; {UNQUANTIZED_ALTERNATIVE}"
    algo = q.get("quant_algo")
    if normal.startswith("modelopt") and isinstance(algo, str) and algo:
        field += f", quant_algo {json.dumps(algo)}"
        kind = f"{algo} (ModelOpt)"
    return f"{field}: quantized weights, {_detail(normal, kind, q)}; {UNQUANTIZED_ALTERNATIVE}"


def _detail(method: str, kind: str, q: Mapping[str, Any]) -> str:
    """The kind with what a model card adds to it: FP8's block size, the bits of AWQ / GPTQ / bitsandbytes,
    compressed-tensors' format."""
    block = q.get("weight_block_size")
    if method == "fp8" and isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block):
        return f"FP8 (fine-grained, {block[0]}x{block[1]} blocks)"
    if method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") or q.get("_load_in_4bit") else 8 if (
            q.get("load_in_8bit") or q.get("_load_in_8bit")) else None
        return f"bitsandbytes {bits}-bit" if bits else kind
    if kind in ("AWQ", "GPTQ") and isinstance(q.get("bits"), int) and not isinstance(q.get("bits"), bool):
        return f"{kind} {q['bits']}-bit"
    if method == "compressed-tensors" and isinstance(q.get("format"), str) and q["format"]:
        return f"{kind} ({q['format']})"
    return kind


def _modelopt_file(path: Path) -> Optional[str]:
    """What NVIDIA ModelOpt's hf_quant_config.json says is quantized (vLLM reads the file where config.json
    has no quantization_config), or None."""
    from launcher.config import bounded

    try:
        data = bounded.model_json(path, "model config", obj=True)
    except bounded.FileError as e:
        raise ConfigError("model.path", str(e)) from None
    return _modelopt(data)


def _modelopt(data: Mapping[str, Any], prefix: str = "") -> Optional[str]:
    """ModelOpt's layout, {"producer": ..., "quantization": {"quant_algo": "NVFP4" | "FP8" | ..., ...}}:
    the weights' quantization it names, or None where it names none (quant_algo null or absent: an
    export that quantizes only the KV cache)."""
    section = data.get("quantization")
    if section is None:
        return None
    if not isinstance(section, dict):
        return f"{prefix}quantization must be an object, got {_short(section)}"
    algo = section.get("quant_algo")
    if algo is None or algo == "":
        return None
    if not isinstance(algo, str):
        return f"{prefix}quantization.quant_algo must be a string, got {_short(algo)}"
    return (f"{prefix}quantization.quant_algo {json.dumps(algo)}: quantized weights, {algo} (ModelOpt); "
            f"{UNQUANTIZED_ALTERNATIVE}")


def read_hf(hf: Mapping[str, Any], where: str) -> tuple[ModelFacts, list[str]]:
    """(facts, architectures) of a config.json's content; `where` names it in errors. Infinities and
    NaN read as transformers reads them (both spellings) and allowed only where the family's class
    has the same value by default (`non_finite`)."""
    from launcher.config import bounded

    hf = bounded.special_floats(dict(hf))
    reader = _Reader(hf, where)
    family = reader.string("model_type")
    wrong = non_finite(hf, family)
    if wrong:
        raise ConfigError("model.path", f"{where}: {wrong[0]}")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError("model.path", f"{where}: architectures must be a list of strings, got "
                                        f"{_short(architectures)}")
    kind = FAMILY_FACTS.get(family, Family())
    heads = reader.positive("num_attention_heads")
    hidden = reader.positive("hidden_size")
    groups = reader.positive("num_key_value_heads", default=heads)
    # no head_dim: the class's literal default (Qwen3's and Nemotron-H's 128, whatever the widths), else
    # hidden / heads (Llama's and Qwen3-MoE's computed one)
    head_default = _class_default(family, "head_dim")
    if hf.get("head_dim") is None and not isinstance(head_default, int) and hidden % heads:
        raise ConfigError("model.path", f"{where}: has no head_dim and hidden_size {hidden} is not a "
                                        f"multiple of num_attention_heads {heads}")
    head_dim = reader.positive("head_dim", default=head_default if isinstance(head_default, int) else hidden // heads)
    if heads % groups:
        raise ConfigError("model.path", f"{where}: num_key_value_heads {groups} must divide "
                                        f"num_attention_heads {heads}")
    experts = reader.first_count(EXPERT_KEYS)
    topk = reader.first_count(TOPK_KEYS) if experts else 0
    layers = kind.layers(reader)
    max_positions = reader.positive("max_position_embeddings", default=0) or None
    theta, scaling = _rope(reader, max_positions) if kind.rope else (None, {})
    common = dict(
        family=family, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        head_dim=head_dim, num_experts=experts, moe_router_topk=topk,
        ffn_hidden_size=reader.positive("intermediate_size", default=0),
        moe_ffn_hidden_size=reader.positive("moe_intermediate_size", default=0) if experts else 0,
        tie_word_embeddings=reader.flag("tie_word_embeddings", False), qkv_bias=kind.qkv_bias(reader),
        qk_norm=kind.qk_norm, rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_positions)
    common = kind.adjust(reader, common)
    experts, topk = common["num_experts"], common["moe_router_topk"]
    if experts and not 1 <= topk <= experts:
        raise ConfigError("model.path", f"{where}: an MoE model needs num_experts_per_tok in "
                                        f"[1, {experts}], got {topk}")
    facts = ModelFacts(**common, family_facts=kind.read(reader))
    unread = unread_differences(reader.hf, family)
    if unread:
        one = len(unread) == 1
        raise ConfigError("model.path", f"{where}: {'; '.join(unread)}: this project does not read "
                                        f"{'this key' if one else 'these keys'}, and a value other than transformers' "
                                        f"default changes what the model computes (supported: the default)")
    return facts, architectures


# Keys of a family's config class that change nothing the trainer or vLLM compute from the weights (each
# with why); the project's own table, kept small: transformers' base class's fields (output flags, dtype,
# labels: launcher.config.hf_classes.generic_fields) and keys its class does not define need no entry.
INERT_KEYS: dict[str, str] = {
    "bos_token_id": "a token id (tokenizer and generation)", "eos_token_id": "a token id (tokenizer and generation)",
    "pad_token_id": "a token id (tokenizer and generation)", "use_cache": "generation's KV cache",
    "num_logits_to_keep": "how many logits generation computes", "vocab_size": "the embedding's rows: every part "
                                                                               "reads the weights' shapes",
    "initializer_range": "initialisation (the weights are loaded)",
    "rescale_prenorm_residual": "initialisation (the weights are loaded)",
    "time_step_max": "initialisation of Mamba's step sizes", "time_step_floor": "initialisation of Mamba's step sizes",
    "time_step_min": "initialisation of Mamba's step sizes (transformers also clamps at it: docs/nemotron_h.md)",
    "chunk_size": "the Mamba scan's block size: the same function computed in other blocks",
    "use_mamba_kernels": "no effect in transformers 5", "mamba_ssm_cache_dtype": "generation's Mamba state cache",
    "moe_shared_expert_overlap": "a schedule (the shared expert on a side stream); the trainer sets it",
    "output_router_logits": "an extra output", "router_aux_loss_coef": "a training loss term (the trainer turns "
                                                                        "the load-balancing loss off with LoRA)",
}


def unread_differences(hf: Mapping[str, Any], family: str) -> list[str]:
    """'key value (transformers' default D)' for each key of `hf` (a `_Seen` after reading, or any config.json
    content: then every key counts as unread) that the family's transformers class defines, the project did
    not read, INERT_KEYS does not list, and whose value is not the class's default."""
    from launcher.config import hf_classes

    cls = hf_classes.hf_class(family)
    if cls is None:
        return []  # transformers is not installed here (a laptop planning a cluster run), or no such class
    seen = getattr(hf, "seen", set())
    generic = hf_classes.generic_fields()
    values, out = dict(hf), []
    for key in sorted(values):
        name = cls.field_of(key)
        if key in seen or key in INERT_KEYS or key in generic or name is None or name in INERT_KEYS:
            continue
        default = cls.defaults[name]
        if default is hf_classes.COMPUTED or hf_classes.same(values[key], default):
            continue
        spelled = "" if name == key else f", another name of {name}"
        out.append(f"{key} {json.dumps(values[key])} ({cls.name}'s default {json.dumps(default)}{spelled})")
    return out


def _class_default(family: str, key: str) -> Any:
    """The default of `key` in the family's transformers class (hf_classes.COMPUTED where it has none
    that is a literal, or there is no class)."""
    from launcher.config import hf_classes

    cls = hf_classes.hf_class(family)
    name = cls.field_of(key) if cls is not None else None
    return cls.defaults[name] if name is not None else hf_classes.COMPUTED


def non_finite(hf: Mapping[str, Any], family: str) -> list[str]:
    """'key value: ...' for each number of `hf` that is not finite (an infinite epsilon, a NaN rope factor)
    where the family's transformers class does not have that same value by default (Nemotron-H's
    time_step_limit [0.0, Infinity] is the one published case); without the class, every one."""
    from launcher.config import hf_classes

    cls = hf_classes.hf_class(family)
    out = []
    for key in hf:
        todo = [(str(key), hf[key], _class_default(family, str(key)))]
        while todo:
            at, value, there = todo.pop()
            if isinstance(value, dict):
                todo.extend((f"{at}.{k}", v, hf_classes.COMPUTED) for k, v in value.items())
            elif isinstance(value, list):
                theirs = list(there) if isinstance(there, (list, tuple)) and len(there) == len(value) else None
                todo.extend((f"{at}[{i}]", v, theirs[i] if theirs else hf_classes.COMPUTED)
                            for i, v in enumerate(value))
            elif isinstance(value, float) and not math.isfinite(value):
                if isinstance(there, float) and (there == value or math.isnan(there) and math.isnan(value)):
                    continue
                whose = (f"{cls.name}'s default {json.dumps(there)}" if there is not hf_classes.COMPUTED
                         else "allowed only where transformers' class of the family has it by default")
                out.append(f"{at} {json.dumps(value)} must be a finite number ({whose})")
    return out


def _rope(r: "_Reader", max_positions: Optional[int]) -> tuple[float, dict]:
    """(rope_theta, normalised rope scaling or {}) from either spelling of config.json."""
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5's spelling first; each an object or null
        given = r.hf.get(key)
        if given is not None and not isinstance(given, dict):
            raise r.error(key, f"must be an object or null, got {_short(given)}")
    key = "rope_parameters" if isinstance(r.hf.get("rope_parameters"), dict) else "rope_scaling"
    given = r.hf.get(key)
    params = dict(given or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None)
    theta = float(r.number("rope_theta", default=10000.0) if theta is None else r.number(f"{key}.rope_theta", theta))
    if not isinstance(rope_type, str):
        raise r.error(f"{key}.rope_type", f"must be a string, got {_short(rope_type)}")
    if rope_type == "default":
        return theta, {}
    out: dict[str, Any] = {"rope_type": rope_type}
    defaults = ROPE_PARAMETERS.get(rope_type, {})
    for name in sorted(set(params) | set(defaults)):
        value = params.get(name)
        if value is None:
            value = defaults.get(name)
            if value == "max_position_embeddings":
                value = max_positions
        if value is None:
            continue  # an optional parameter left out (yarn's mscale, attention_factor)
        out[name] = value if name == "truncate" or isinstance(value, list) else r.number(f"{key}.{name}", value)
    return theta, out


class _Seen(dict):
    """config.json's content, remembering every key the reader looked at (launcher.config.model_facts reads
    a key -> a fact, checked by the rules; a key nothing looked at is compared with transformers' default)."""

    def __init__(self, hf: Mapping[str, Any]):
        super().__init__(hf)
        self.seen: set[str] = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    def __init__(self, hf: Mapping[str, Any], where: str):
        self.hf, self.where = _Seen(hf), where

    def covers(self, *keys: str) -> None:
        """`keys` are accounted for without being read: they change nothing in this model (e.g. the MoE
        numbers of a Nemotron-H without E layers)."""
        self.hf.seen.update(keys)

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError("model.path", f"{self.where}: {key} {what}")

    def string(self, key: str) -> str:
        value = self.hf.get(key)
        if value is None:
            raise self.error(key, "is missing (a transformers config.json names its model_type)")
        if not isinstance(value, str) or not value:
            raise self.error(key, f"must be a non-empty string, got {_short(value)}")
        return value

    def positive(self, key: str, default: Optional[int] = None) -> int:
        value = self.hf.get(key)
        if value is None:
            if default is None:
                raise self.error(key, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(key, f"must be a positive integer, got {_short(value)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_short(value)}")
        return value

    def number(self, key: str, value: Any = None, default: Optional[float] = None) -> float:
        value = self.hf.get(key) if value is None else value
        if value is None:
            return default  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, got {_short(value)}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.hf.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.error(key, f"must be a list of integers, got {_short(value)}")
        return value

    def count(self, key: str, default: int = 0) -> int:
        """`key`: an integer >= 0 (`default` when absent or null)."""
        value = self.hf.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(key, f"must be an integer >= 0, got {_short(value)}")
        return value

    def first_count(self, keys: tuple[str, ...]) -> int:
        """The first of `keys` present (0 when none is, or it is null): a count, 0 or more."""
        for key in keys:
            value = self.hf.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self.error(key, f"must be an integer >= 0, got {_short(value)}")
            return value
        return 0


def builtin_facts(recipe: str) -> ModelFacts:
    """The facts of a built-in recipe (launcher.config.schema.BUILTIN_MODELS), as workers.tiny_models
    builds it: the recipe's numbers plus BUILTIN_COMMON, read like any config.json."""
    spec = dict(BUILTIN_MODELS[recipe])
    family = spec.pop("family")
    return read_hf({"model_type": family, **BUILTIN_COMMON, **spec}, f"the built-in recipe {recipe}")[0]


# ------------------------------------------------------------------------------------------
# Megatron-Bridge's registry, read from its sources (no import)


@dataclass(frozen=True)
class Registration:
    architecture: str            # e.g. Qwen3MoeForCausalLM
    model_type: Optional[str]    # as given to register_bridge (None for some, e.g. Mistral)
    module: str                  # megatron.bridge.models.qwen.qwen3_moe_bridge


@lru_cache(maxsize=1)
def bridge_registrations() -> Optional[tuple[Registration, ...]]:
    """Every (architecture, model_type) Megatron-Bridge registers, or None where it is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron")  # a namespace package: nothing is executed
    except (ImportError, ValueError):
        return None
    roots = [Path(p) / "bridge" for p in (spec.submodule_search_locations or [])] if spec else []
    roots = [r for r in roots if r.is_dir()]
    if not roots:
        return None
    out = []
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            text = file.read_text(errors="replace")
            if "register_bridge" in text:
                module = "megatron.bridge." + ".".join(file.relative_to(root).with_suffix("").parts)
                out += _registrations_in(text, module)
    return tuple(out)


def _registrations_in(text: str, module: str) -> list[Registration]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def name_of(value: ast.AST) -> Optional[str]:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
        if isinstance(value, ast.Name):
            return constants.get(value.id, value.id)  # a class imported from transformers, or a constant
        if isinstance(value, ast.Attribute):
            return value.attr
        return None

    out = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        called = getattr(func, "attr", None) or getattr(func, "id", None)
        if not isinstance(node, ast.Call) or called not in ("register_bridge", "register_bridge_implementation"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        arch = name_of(kw["source"]) if "source" in kw else None
        if not arch or arch == "source" or arch.startswith("_"):
            continue  # the definition of register_bridge itself, or a value computed at run time
        model_type = name_of(kw["model_type"]) if "model_type" in kw else None
        out.append(Registration(arch, model_type, module))
    return out


def bridge_architectures() -> Optional[set[str]]:
    regs = bridge_registrations()
    return None if regs is None else {r.architecture for r in regs}


# ------------------------------------------------------------------------------------------
# the supported families, and the config


def lora_families() -> tuple[str, ...]:
    return tuple(FAMILIES)


def supported_families() -> tuple[str, ...]:
    """Families our LoRA layout knows that Megatron-Bridge registers (all of ours where it is absent)."""
    regs = bridge_registrations()
    if regs is None:
        return lora_families()
    bridged = {r.model_type for r in regs} | {_family_of_architecture(r.architecture) for r in regs}
    return tuple(f for f in lora_families() if f in bridged)


def _family_of_architecture(arch: str) -> str:
    """MistralForCausalLM -> mistral (for registrations without model_type): lower-case, CamelCase -> _."""
    import re

    base = re.sub(r"(ForCausalLM|ForConditionalGeneration)$", "", arch)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def check_supported(facts: ModelFacts, architectures: list[str], where: str) -> None:
    """One ConfigError naming the supported families when the bridge or our LoRA layout lacks this one."""
    supported = ", ".join(supported_families())
    known = bridge_architectures()
    if known is not None and not any(a in known for a in architectures):
        shown = ", ".join(architectures) or "no architectures"
        raise ConfigError("model.path", f"{where} is {facts.family} ({shown}): Megatron-Bridge has no bridge for "
                                        f"it; supported families: {supported}")
    if facts.family not in lora_families():
        raise ConfigError("model.path", f"{where} is model_type {facts.family!r}: no LoRA layout for it; "
                                        f"supported families: {supported}")


def checkpoint_name(directory: str | Path) -> str:
    """The run's name for a checkpoint directory: its name (a Hub cache snapshot, .../models--Org--Name/
    snapshots/<hash>, is called Name), with characters a run name cannot hold replaced by '-'."""
    parts = Path(directory).parts
    name = parts[-1] if parts else "model"
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        name = parts[-3].split("--")[-1]
    return re.sub(r"[^A-Za-z0-9._+-]", "-", name).strip("-._+")[:100] or "model"


def apply(raw: Any, explicit: Any = ()) -> list[str]:
    """Resolve the facts of raw.model (a composed DictConfig, before its interpolations resolve) in
    place; return the notes. `explicit`: the keys the command line set (`model.name` is kept then).

    model.path: made absolute, names the model (model.name, so run.name's default follows), drops
    model.builtin, and when its config.json is here, gives every fact. model.builtin (path null):
    the recipe gives every fact. `model.facts_from` says which (null: not resolved, a dry run)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

    model = raw.get("model") if hasattr(raw, "get") else None
    if model is None:
        return []
    path, builtin = model.get("path"), model.get("builtin")
    if path:
        from launcher.paths import absolute

        directory = absolute(str(path))
        with open_dict(model):
            model["path"], model["builtin"] = str(directory), None
            if "model.name" not in explicit:
                model["name"] = checkpoint_name(directory)
        if not (directory / "config.json").is_file():
            return []  # not on this machine: a dry run plans with the conf's numbers, a submission refuses
        hf = config_json(directory / "config.json")
        check_unquantized(directory, hf)   # before the facts: a quantized file's are not the weights' shapes
        source = str(directory / "config.json")
        facts, architectures = read_hf(hf, source)
        check_supported(facts, architectures, source)
        says, whose = f"{source} says", "the checkpoint's"
    elif isinstance(builtin, str) and builtin in BUILTIN_MODELS:
        facts, source = builtin_facts(builtin), f"builtin:{builtin}"
        says, whose = f"the built-in recipe {builtin} has", "the recipe's"
    else:
        return []  # validation names the unknown recipe
    differ = []
    with open_dict(model):
        for key in FACT_KEYS:
            value = getattr(facts, key)
            conf = model.get(key)
            if isinstance(conf, (DictConfig, ListConfig)):
                conf = OmegaConf.to_container(conf, resolve=True)
            if conf not in (None, {}) and conf != value:
                differ.append(f"{key}={value} (conf: {conf})")
            model[key] = value
        model["facts_from"] = source
    return [f"model: {says} {', '.join(differ)}; using {whose} numbers"] if differ else []


def of_section(model: Mapping[str, Any]) -> Optional[ModelFacts]:
    """The resolved facts of a `model:` section (plain data), or None where they were not resolved."""
    if not model.get("facts_from") or any(k not in model for k in FACT_KEYS):
        return None
    return ModelFacts(**{k: model[k] for k in FACT_KEYS})


def shape_keys(family: Optional[str]) -> tuple[str, ...]:
    """The facts that decide tensor shapes: SHAPE_KEYS and the family's own (`family_facts.<key>`)."""
    return SHAPE_KEYS + tuple(f"family_facts.{k}" for k in FAMILY_FACTS.get(family or "", Family()).shapes)


def fact(facts: ModelFacts, key: str) -> Any:
    """A fact by its key; `family_facts.<key>` for a family's own (None where it has none such)."""
    if key.startswith("family_facts."):
        return facts.family_facts.get(key.partition(".")[2])
    return getattr(facts, key)


def differences(expected: ModelFacts, found: ModelFacts, keys: tuple[str, ...] = FACT_KEYS) -> list[str]:
    """'key X -> Y' (expected, found) for every fact of `keys` that differs."""
    return [f"{k} {fact(expected, k)!r} -> {fact(found, k)!r}" for k in keys if fact(expected, k) != fact(found, k)]


def shape_differences(expected: ModelFacts, found: ModelFacts) -> list[str]:
    """differences() in the facts that decide tensor shapes (an adapter trained on one fits the other)."""
    return differences(expected, found, shape_keys(expected.family))
