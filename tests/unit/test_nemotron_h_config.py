"""Nemotron-H (hybrid Mamba-2 + attention + MLP/MoE) facts and rules, before anything runs.

The published config.json below is nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's (the keys that
decide the layout, as published): its layer pattern `hybrid_override_pattern`, Mamba heads / head
dim / groups / state, attention heads, 128 routed experts top-6 and one shared expert. transformers
5 saves the same model with `layers_block_type` instead of the pattern (and no num_hidden_layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import model_facts
from launcher.config.schema import ConfigError

NANO_30B = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 2688,
            "num_hidden_layers": 52, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64,
            "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "chunk_size": 128, "n_routed_experts": 128,
            "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712, "vocab_size": 131072}
BLOCKS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def checkpoint(tmp_path: Path, config: dict, name: str = "ckpt") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_published_nemotron_h_facts(tmp_path):
    facts, _ = model_facts.read(checkpoint(tmp_path, NANO_30B))
    assert (facts.num_layers, facts.num_experts, facts.moe_router_topk, facts.moe_ffn_hidden_size) == (52, 128, 6, 1856)
    assert (facts.rope_theta, facts.rope_scaling) == (None, {})  # no rotary embedding
    assert facts.family_facts == {"hybrid_override_pattern": NANO_30B["hybrid_override_pattern"],
                                  "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
                                  "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 3712}
    pattern = facts.family_facts["hybrid_override_pattern"]
    assert (pattern.count("M"), pattern.count("E"), pattern.count("*")) == (23, 23, 6)


def test_transformers_5_layer_list_is_the_same_pattern(tmp_path):
    saved = {k: v for k, v in NANO_30B.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
    saved["layers_block_type"] = [BLOCKS[c] for c in NANO_30B["hybrid_override_pattern"]]
    saved["layers_block_type"][0] = "linear_attention"   # transformers 5's own name for a Mamba block
    assert model_facts.read_hf(saved, "t5")[0] == model_facts.read_hf(NANO_30B, "hub")[0]


def test_the_pattern_counts_the_layers_whatever_num_hidden_layers_says(tmp_path):
    """transformers derives num_hidden_layers from the pattern (a stale one is only warned about)."""
    stale = {**NANO_30B, "num_hidden_layers": 7}
    assert model_facts.read_hf(stale, "x")[0].num_layers == 52
    unstated = {k: v for k, v in NANO_30B.items() if k != "num_hidden_layers"}
    assert model_facts.read_hf(unstated, "x")[0].num_layers == 52


def test_a_dense_hybrid_has_no_experts_whatever_its_defaults(tmp_path):
    """transformers writes n_routed_experts (default 8) for a pattern without E layers: not experts."""
    dense = {**NANO_30B, "hybrid_override_pattern": "M*-M*-", "num_hidden_layers": 6, "num_experts_per_tok": 0}
    facts, _ = model_facts.read(checkpoint(tmp_path, dense))
    assert (facts.num_layers, facts.num_experts, facts.moe_router_topk, facts.moe_ffn_hidden_size) == (6, 0, 0, 0)
    assert facts.family_facts["n_shared_experts"] == facts.family_facts["moe_shared_expert_intermediate_size"] == 0


def test_absent_mamba_groups_are_what_transformers_assumes():
    """NemotronHConfig's n_groups default is 8 (what megatron's provider then gets from the Bridge)."""
    import transformers

    given = {k: v for k, v in NANO_30B.items() if k != "n_groups"}
    assert model_facts.read_hf(given, "x")[0].family_facts["n_groups"] == transformers.NemotronHConfig().n_groups == 8


@pytest.mark.parametrize("change, message", [
    ({"hybrid_override_pattern": "MXM"}, "hybrid_override_pattern must be a string of M*-E (one per layer), got 'MXM'"),
    ({"hybrid_override_pattern": None}, "hybrid_override_pattern is missing (a Nemotron-H config.json names its "
                                        "layers: hybrid_override_pattern or layers_block_type)"),
    ({"hybrid_override_pattern": None, "layers_block_type": ["mamba", "ssm"]},
     "layers_block_type must be a list of attention, full_attention, linear_attention, mamba, mlp, moe, "
     "got ['mamba', 'ssm']"),
    ({"n_groups": 3}, "n_groups 3 must divide mamba_num_heads 64"),
    ({"mamba_num_heads": None}, "mamba_num_heads is missing"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be in [1, n_routed_experts = 128] for the E layers"),
])
def test_bad_hybrid_config_is_one_line(tmp_path, change, message):
    cfg = {k: v for k, v in {**NANO_30B, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        model_facts.read(checkpoint(tmp_path, cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


def errors(*overrides: str) -> list[str]:
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.config.validate import validate

    raw = compose(list(overrides))  # resolves the model's facts, as the launcher does
    return [str(e) for e in validate(typed(raw))]


@pytest.mark.parametrize("overrides", [
    ["model=tiny_nemotron_h"], ["model=tiny_nemotron_h", "topology.train.expert_parallel=2"],
    ["model=tiny_nemotron_h_dense"], ["model=tiny_nemotron_h", "refit=merged_delta"],
    ["model=tiny_nemotron_h", "refit=adapter", "peft.target_modules=[linear_qkv,linear_proj,in_proj]"],
    ["model=tiny_nemotron_h", "refit=merged_delta", "peft.target_modules=[linear_qkv,in_proj,out_proj]"],
])
def test_nemotron_h_recipes_are_valid(overrides):
    assert errors(*overrides) == []


def test_the_reference_topologys_placement_smoke_stand_in_is_a_valid_nemotron_h(tmp_path):
    """tests/slurm/test_ultra_placement.py's model: its facts (a checkpoint's) fit ultra_6n4g."""
    from launcher.config.compose import compose
    from tests.helpers.nemotron_h import ultra_stand_in

    stand_in = ultra_stand_in(tmp_path)
    assert errors("topology=ultra_6n4g", "run.job=placement_smoke", *stand_in) == []
    m = compose(["topology=ultra_6n4g", *stand_in]).model
    assert (m.family, m.num_experts, m.num_attention_heads, m.num_query_groups, m.family_facts.mamba_num_heads,
            m.family_facts.n_groups) == ("nemotron_h", 16, 8, 8, 8, 2)
    # the facts are the checkpoint's: stated numbers do not make a stand-in (the recipe's 4 experts stay)
    assert "must divide model.num_experts = 4, got 16" in " ".join(
        errors("topology=ultra_6n4g", "run.job=placement_smoke", "model=tiny_nemotron_h", "model.num_experts=16"))


def test_tensor_parallel_must_divide_the_mamba_heads_and_groups(tmp_path):
    """Megatron's Mamba mixer gives each TP rank whole heads and whole groups (as it asserts)."""
    odd = {**NANO_30B, "hybrid_override_pattern": "M*-", "num_hidden_layers": 3, "num_key_value_heads": 8,
           "mamba_num_heads": 12, "n_groups": 6}
    d = checkpoint(tmp_path, odd)
    assert errors(f"model.path={d}", "topology.train.tensor_parallel=4", "topology.train.ranks_per_node=4") == [
        "topology.train.tensor_parallel: must divide the Mamba heads (12) and groups (6) of model ckpt, got 4"]
    assert errors(f"model.path={d}", "topology.train.tensor_parallel=2") == []


def test_adapter_refit_refuses_what_peft_cannot_hold():
    assert errors("model=tiny_nemotron_h", "refit=adapter", "peft.target_modules=[linear_qkv,out_proj]") == [
        "peft.target_modules: 'out_proj' wrap mixer.out_proj of tiny_nemotron_h, which refit.mode=adapter cannot "
        "serve: PEFT refuses LoRA on a Mamba layer's out_proj for nemotron_h "
        "(peft.tuners.tuners_utils._check_lora_target_modules_mamba); use refit.mode=merged or merged_delta, or "
        "leave it out"]


def test_the_refusal_is_peft_s_own():
    """The reason validation and the exporter give is what PEFT itself does with such an adapter."""
    import peft
    import torch
    import transformers

    cfg = transformers.NemotronHConfig(hidden_size=32, hybrid_override_pattern="M", mamba_num_heads=4, mamba_head_dim=8,
                                       n_groups=1, ssm_state_size=8, num_attention_heads=2, num_key_value_heads=1,
                                       vocab_size=16)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="out_proj"):
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["out_proj"]))
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["in_proj"]))  # in_proj is fine
