"""The run's model facts on Megatron-Bridge's provider: applied where the Bridge's mapping is
partial, then checked, so the Megatron model is the one the facts describe (and vLLM loads).

The facts are the resolved `model:` section (launcher.config.model_facts, saved in the run's
config.yaml). Megatron-Bridge builds its provider from the same config.json, but maps only part
of some facts: for YaRN it copies the rope_scaling keys the file states and leaves the rest None
(megatron-core then fails on `None * int` at start-up, or rounds the correction range differently
from HF where `truncate` is absent); its mscale test differs from HF's (`is not None` against
truthiness). `apply` sets the provider's rope from the facts, whose parameters carry HF's
defaults. `check` compares every fact with the provider after `finalize()` and names each that
differs: a checkpoint changed since submission, or a Bridge mapping this module does not know,
stops the trainer at start-up instead of training another model than vLLM generates with.

`PROVIDER_KEYS` says which provider attribute holds each fact, per family (a family's own facts as
`family_facts.<key>`; `not <attr>` where the provider holds the opposite); a family that is not listed
is checked on nothing but its rope.

MTP layers (Nemotron 3 Super/Ultra: `num_nextn_predict_layers`, `mtp_hybrid_override_pattern`): the
bridge builds them from config.json and megatron then adds their loss (0.3 x the cross-entropy of the
next tokens over every position, prompt and padding included) to the gradient, which reaches the LoRA
adapters: another objective than GRPO's. The trainer builds none (`without_mtp`, before the provider is
made: docs/nemotron_h.md), and `check` names a provider that would.
"""

from __future__ import annotations

from typing import Any

from launcher.config import model_facts
from launcher.config.model_facts import ModelFacts

GPT_KEYS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
            "num_query_groups": "num_query_groups", "head_dim": "kv_channels", "ffn_hidden_size": "ffn_hidden_size",
            "tie_word_embeddings": "share_embeddings_and_output_weights", "qkv_bias": "add_qkv_bias",
            "qk_norm": "qk_layernorm", "rope_theta": "rotary_base", "family_facts.rms_norm_eps": "layernorm_epsilon"}
MOE_KEYS = {"num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
            "moe_ffn_hidden_size": "moe_ffn_hidden_size",
            "family_facts.moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
            # LatentMoE's width (0: none; megatron's None) and the routing scale (Nemotron-H)
            "family_facts.moe_latent_size": "moe_latent_size",
            "family_facts.routed_scaling_factor": "moe_router_topk_scaling_factor"}
# Nemotron-H (HybridModelProvider): no rotary embedding (its provider keeps a rotary_base it never
# uses), the layer pattern and the Mamba-2 sizes (Megatron-Bridge's NemotronHBridge.CONFIG_MAPPING)
MAMBA_KEYS = {"family_facts.mamba_num_heads": "mamba_num_heads", "family_facts.mamba_head_dim": "mamba_head_dim",
              "family_facts.n_groups": "mamba_num_groups", "family_facts.ssm_state_size": "mamba_state_dim"}
HYBRID_KEYS = {**{k: v for k, v in GPT_KEYS.items() if k not in ("rope_theta", "family_facts.rms_norm_eps")},
               **MOE_KEYS, **MAMBA_KEYS, "family_facts.hybrid_override_pattern": "hybrid_layer_pattern",
               "family_facts.layer_norm_epsilon": "layernorm_epsilon"}
QWEN3_MOE_KEYS = {**GPT_KEYS, **MOE_KEYS,
                  # Qwen3-MoE renormalises the top-k probabilities where megatron's router does not
                  # take the softmax before the top-k (Megatron-Bridge's Qwen3MoeBridge)
                  "family_facts.norm_topk_prob": "not moe_router_pre_softmax"}
PROVIDER_KEYS: dict[str, dict[str, str]] = {"llama": GPT_KEYS, "qwen2": GPT_KEYS, "qwen3": GPT_KEYS,
                                            "qwen3_moe": QWEN3_MOE_KEYS, "nemotron_h": HYBRID_KEYS}


def without_mtp(bridge: Any) -> None:
    """No MTP layers in what `bridge` (an AutoBridge) builds and maps: their depth is 0 on the HF config it
    reads (Megatron-Bridge's own switch for a model built without them: the provider gets mtp_num_layers 0
    and no MTP pattern, the mapping registry no mtp.* entries). The checkpoint keeps them for vLLM."""
    config = bridge.hf_pretrained.config
    if getattr(config, "num_nextn_predict_layers", 0):
        config.num_nextn_predict_layers = 0


def apply(provider: Any, facts: ModelFacts) -> None:
    """The rope of `facts` onto `provider` (before finalize)."""
    rope = facts.rope_scaling or {}
    kind = rope.get("rope_type")
    if facts.rope_theta is not None and hasattr(provider, "rotary_base"):
        provider.rotary_base = facts.rope_theta
    if kind == "yarn":
        both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))  # HF uses the pair only then
        for attr, value in (("position_embedding_type", "yarn"), ("yarn_rotary_scaling_factor", rope["factor"]),
                            ("yarn_original_max_position_embeddings", rope["original_max_position_embeddings"]),
                            ("yarn_beta_fast", rope["beta_fast"]), ("yarn_beta_slow", rope["beta_slow"]),
                            ("yarn_mscale", rope.get("mscale") if both else None),
                            ("yarn_mscale_all_dim", rope.get("mscale_all_dim") if both else None),
                            ("yarn_correction_range_round_to_int", bool(rope.get("truncate", True)))):
            setattr(provider, attr, value)
    elif kind == "llama3":
        provider.rope_scaling, provider.rope_scaling_factor = True, rope["factor"]


def expected_rope(facts: ModelFacts) -> dict[str, Any]:
    """The provider attributes `facts`' rope must have given (after `apply`)."""
    rope = facts.rope_scaling or {}
    kind = rope.get("rope_type")
    if kind == "yarn":
        return {"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": rope["factor"],
                "yarn_original_max_position_embeddings": rope["original_max_position_embeddings"],
                "yarn_beta_fast": rope["beta_fast"], "yarn_beta_slow": rope["beta_slow"],
                "yarn_correction_range_round_to_int": bool(rope.get("truncate", True))}
    if kind == "llama3":
        return {"position_embedding_type": "rope", "rope_scaling": True, "rope_scaling_factor": rope["factor"],
                "seq_len_interpolation_factor": None}
    return {"position_embedding_type": "rope", "rope_scaling": False, "seq_len_interpolation_factor": None}


def check(provider: Any, facts: ModelFacts) -> list[str]:
    """'fact: the run's X, Megatron's Y' for every fact the provider holds differently."""
    out = []
    for fact, attr in PROVIDER_KEYS.get(facts.family, {}).items():
        want, got = model_facts.fact(facts, fact), _provider_value(provider, attr)
        if fact in MOE_KEYS and not facts.num_experts:
            continue  # a dense model: Megatron's MoE fields are unused
        if fact in MAMBA_KEYS and not facts.family_facts.get("mamba_num_heads"):
            continue  # no Mamba layers: Megatron's Mamba fields are unused
        if not _same(want, got):
            out.append(f"{fact}: the run's {want!r}, Megatron's {attr} {got!r}")
    if getattr(provider, "mtp_num_layers", None):
        out.append(f"MTP: the trainer builds no MTP layers (docs/nemotron_h.md), Megatron's mtp_num_layers "
                   f"{provider.mtp_num_layers!r}")
    if facts.rope_theta is not None:
        for attr, want in expected_rope(facts).items():
            got = getattr(provider, attr, None)
            if not _same(want, got):
                out.append(f"rope_scaling: the run's {attr} {want!r}, Megatron's {got!r}")
    return out


def _provider_value(provider: Any, attr: str) -> Any:
    if attr.startswith("not "):
        return not getattr(provider, attr[4:], None)
    value = getattr(provider, attr, None)
    if attr == "hybrid_layer_pattern" and isinstance(value, str):
        return value.split("/")[0]  # finalize() appends the MTP layers' pattern after megatron's "/"
    if attr == "moe_latent_size":
        return value or 0           # megatron's None: no latent projections
    return value


def _same(want: Any, got: Any) -> bool:
    if isinstance(want, bool) or want is None:
        return bool(want) == bool(got)
    if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return float(want) == float(got)
    return want == got
