"""Nemotron-H (hybrid Mamba-2 + attention + MLP/MoE) facts and rules, before anything runs.

NANO_30B is nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json as published (tests/fixtures/
published): its layer pattern `hybrid_override_pattern`, Mamba heads / head dim / groups / state,
attention heads, 128 routed experts top-6, one shared expert, routing scale 2.5. transformers 5 saves
the same model with `layers_block_type` instead of the pattern (and no num_hidden_layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config import model_facts
from launcher.config.schema import ConfigError
from tests.helpers import published_models

NANO_30B = published_models.published("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
BLOCKS = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16's config.json as published, its first 9 layers
# ("MEMEMEM*E": Mamba and MoE alternating, then attention): LatentMoE (moe_latent_size 1024 of hidden
# 4096, 512 routed experts top-22 of width 2688, a shared expert of 5376, routing scale 5.0) and one MTP
# step of an attention and an MoE layer (num_nextn_predict_layers 1, mtp_hybrid_override_pattern "*E")
SUPER_120B = published_models.scaled("nvidia__NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 9)


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
                                  "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 3712,
                                  "moe_latent_size": 0, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0,
                                  "mtp_hybrid_override_pattern": "", "layer_norm_epsilon": 1e-5}
    pattern = facts.family_facts["hybrid_override_pattern"]
    assert (pattern.count("M"), pattern.count("E"), pattern.count("*")) == (23, 23, 6)


def test_latent_moe_and_mtp_of_the_released_architecture_are_facts(tmp_path):
    facts, _ = model_facts.read(checkpoint(tmp_path, SUPER_120B))
    f = facts.family_facts
    assert (f["moe_latent_size"], f["num_nextn_predict_layers"], f["mtp_hybrid_override_pattern"]) == (1024, 1, "*E")
    assert (f["routed_scaling_factor"], facts.num_experts, facts.moe_router_topk, facts.num_layers) == (5.0, 512, 22, 9)
    # the latent width decides the routed experts' shapes; the MTP layers no shape the trainer builds
    assert "family_facts.moe_latent_size" in model_facts.shape_keys("nemotron_h")
    assert "family_facts.num_nextn_predict_layers" not in model_facts.shape_keys("nemotron_h")


def test_mtp_pattern_in_each_spelling_and_transformers_default():
    """transformers 5 saves mtp_layers_block_type (for every model, MTP or not); NemotronHConfig assumes an
    attention and an MoE layer where the depth is > 0 and neither spelling is there."""
    import transformers

    saved = {k: v for k, v in SUPER_120B.items() if k != "mtp_hybrid_override_pattern"}
    listed = {**saved, "mtp_layers_block_type": ["attention", "moe", "moe"]}
    assert model_facts.read_hf(listed, "t5")[0].family_facts["mtp_hybrid_override_pattern"] == "*EE"
    assert model_facts.read_hf(saved, "x")[0].family_facts["mtp_hybrid_override_pattern"] == "*E" \
        == transformers.NemotronHConfig(num_nextn_predict_layers=1).mtp_hybrid_override_pattern
    without = {**saved, "num_nextn_predict_layers": 0, "mtp_layers_block_type": ["full_attention", "moe"]}
    f = model_facts.read_hf(without, "x")[0].family_facts
    assert (f["num_nextn_predict_layers"], f["mtp_hybrid_override_pattern"]) == (0, "")


def test_no_latent_size_is_zero_and_a_dense_hybrid_ignores_one():
    nano = model_facts.read_hf(NANO_30B, "x")[0].family_facts
    assert nano["moe_latent_size"] == 0 and nano["num_nextn_predict_layers"] == 0
    dense = {**SUPER_120B, "hybrid_override_pattern": "M*-", "mtp_hybrid_override_pattern": "*-"}
    assert model_facts.read_hf(dense, "x")[0].family_facts["moe_latent_size"] == 0   # no E layer computes in it


@pytest.mark.parametrize("change, message", [
    # NemotronHConfig defines them, the project reads none of them: a value other than the default is refused
    ({"mamba_proj_bias": True}, "mamba_proj_bias true (NemotronHConfig's default false)"),
    ({"norm_topk_prob": False}, "norm_topk_prob false (NemotronHConfig's default true)"),
    ({"use_conv_bias": False, "n_group": 4}, "n_group 4 (NemotronHConfig's default 1); use_conv_bias false "
                                             "(NemotronHConfig's default true): this project does not read these keys"),
    # a legacy spelling transformers still renames is read as its field, and the project reads n_groups only
    ({"mamba_n_groups": 4}, "mamba_n_groups 4 (NemotronHConfig's default 8, another name of n_groups)"),
    ({"time_step_limit": [0.001, 100.0]}, "time_step_limit [0.001, 100.0] (NemotronHConfig's default [0.0, Infinity])"),
    ({"mtp_hybrid_override_pattern": "*X"}, "mtp_hybrid_override_pattern must be a string of M*-E (one per layer)"),
    ({"moe_latent_size": -1}, "moe_latent_size must be an integer >= 0, got -1"),
])
def test_an_unknown_key_that_changes_the_model_is_refused_in_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError) as e:
        model_facts.read(checkpoint(tmp_path, {**SUPER_120B, **change}))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"model.path: {tmp_path / 'ckpt' / 'config.json'}: ")


@pytest.mark.parametrize("change", [
    {"time_step_limit": [0.0, {"__float__": "Infinity"}]},   # the default, as transformers writes infinity
    {"initializer_range": 0.5, "rescale_prenorm_residual": False, "time_step_min": 0.01, "chunk_size": 64,
     "bos_token_id": 7, "use_cache": False, "moe_shared_expert_overlap": False},   # they change no function
    {"rope_theta": 500000.0, "auto_map": {"AutoConfig": "x"}, "torch_dtype": "bfloat16"},   # not NemotronHConfig's
    {"mamba_proj_bias": False, "conv_kernel": 4, "residual_in_fp32": False},   # transformers' defaults
    {"hybrid_override_pattern": "M*-", "moe_latent_size": 64, "n_group": 8, "norm_topk_prob": False,
     "mtp_hybrid_override_pattern": "*-"},   # MoE numbers of a model without E layers change nothing
])
def test_keys_that_change_nothing_are_accepted(change):
    model_facts.read_hf({**SUPER_120B, **change}, "x")


def test_the_launcher_resolves_latent_and_mtp_facts_by_model_path(tmp_path):
    from launcher.config.compose import compose

    d = checkpoint(tmp_path, SUPER_120B)
    m = compose([f"model.path={d}"]).model
    assert (m.family_facts.moe_latent_size, m.family_facts.num_nextn_predict_layers,
            m.family_facts.mtp_hybrid_override_pattern) == (1024, 1, "*E")


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
    ["model=tiny_nemotron3"], ["model=tiny_nemotron3", "topology.train.expert_parallel=2"],
    ["model=tiny_nemotron3", "refit=adapter", "peft.target_modules=[linear_qkv,linear_proj,in_proj,"
                                              "decoder.layers.*.mlp.shared_experts.linear_fc1]"],
    ["model=tiny_nemotron_h"], ["model=tiny_nemotron_h", "topology.train.expert_parallel=2"],
    ["model=tiny_nemotron_h_dense"], ["model=tiny_nemotron_h", "refit=merged_delta"],
    ["model=tiny_nemotron_h", "refit=adapter", "peft.target_modules=[linear_qkv,linear_proj,in_proj]"],
    ["model=tiny_nemotron_h", "refit=merged_delta", "peft.target_modules=[linear_qkv,in_proj,out_proj]"],
])
def test_nemotron_h_recipes_are_valid(overrides):
    assert errors(*overrides) == []


def test_the_reference_topologys_placement_smoke_stand_in_is_a_valid_nemotron_h():
    """tests/slurm/test_ultra_placement.py's model, the released architecture's recipe: its facts fit ultra_6n4g."""
    from launcher.config.compose import compose
    from tests.helpers.nemotron_h import ULTRA_STAND_IN

    assert errors("topology=ultra_6n4g", "run.job=placement_smoke", *ULTRA_STAND_IN) == []
    m = compose(["topology=ultra_6n4g", *ULTRA_STAND_IN]).model
    assert (m.family, m.num_experts, m.num_attention_heads, m.num_query_groups, m.family_facts.mamba_num_heads,
            m.family_facts.n_groups) == ("nemotron_h", 16, 8, 2, 8, 2)
    assert (m.family_facts.moe_latent_size, m.family_facts.num_nextn_predict_layers,
            m.family_facts.mtp_hybrid_override_pattern) == (32, 1, "*E")
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


@pytest.mark.parametrize("targets", ["[linear_qkv,fc1_latent_proj]", "[fc2_latent_proj]", "[decoder.layers.*.mlp.*]"])
def test_lora_on_the_latent_projections_is_refused_in_one_line(targets):
    """No half of the stack carries an adapter on LatentMoE's projections the same (validate._latent_lora)."""
    found = errors("model=tiny_nemotron3", f"peft.target_modules={targets}")
    assert len(found) == 1 and found[0].startswith("peft.target_modules: ") and \
        "wrap LatentMoE's projections (fc1_latent_proj, fc2_latent_proj) of tiny_nemotron3: LoRA on them is not " \
        "supported" in found[0]
    # without a latent width the names are no module at all
    assert "matches no module of model tiny_nemotron_h" in errors("model=tiny_nemotron_h",
                                                                  "peft.target_modules=[fc1_latent_proj]")[0]


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


@pytest.mark.parametrize("spelling", ["literal", "transformers 5"])
def test_time_step_limit_infinity_as_published_is_read(tmp_path, spelling):
    """Every Nemotron-H config.json saved by Python's json (the published ones) holds
    `"time_step_limit": [0.0, Infinity]`; transformers 5 writes `{"__float__": "Infinity"}`."""
    import math

    limit = [0.0, math.inf] if spelling == "literal" else [0.0, {"__float__": "Infinity"}]
    d = checkpoint(tmp_path, {**SUPER_120B, "time_step_limit": limit})
    assert ("Infinity]" in (d / "config.json").read_text()) == (spelling == "literal")
    assert model_facts.read(d)[0] == model_facts.read_hf(SUPER_120B, "x")[0]


@pytest.mark.parametrize("change, message", [
    ({"layer_norm_epsilon": float("inf")}, "layer_norm_epsilon Infinity must be a finite number (NemotronHConfig's "
                                           "default 1e-05)"),
    ({"layer_norm_epsilon": {"__float__": "NaN"}}, "layer_norm_epsilon NaN must be a finite number"),
    ({"time_step_limit": [float("-inf"), float("inf")]}, "time_step_limit[0] -Infinity must be a finite number "
                                                         "(NemotronHConfig's default 0.0)"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor NaN must be a finite number"),
])
def test_a_non_finite_value_elsewhere_is_refused_naming_its_key(tmp_path, change, message):
    with pytest.raises(ConfigError) as e:
        model_facts.read(checkpoint(tmp_path, {**SUPER_120B, **change}))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_moe_numbers_of_mtp_layers_are_read_and_checked_where_the_main_pattern_has_no_moe():
    """Main pattern without E, MTP step `*E`: vLLM builds the MTP's MoE layer from n_routed_experts and
    num_experts_per_tok, so they are checked; the trained network itself has no experts."""
    mtp_only = {**SUPER_120B, "hybrid_override_pattern": "M*-M*-", "mtp_hybrid_override_pattern": "*E"}
    facts = model_facts.read_hf(mtp_only, "x")[0]
    assert (facts.num_experts, facts.family_facts["moe_latent_size"], facts.family_facts["n_shared_experts"]) == (
        0, 1024, 1)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok must be in \[1, n_routed_experts = 512\] for the E "
                                          r"layers of '\*E', got 600"):
        model_facts.read_hf({**mtp_only, "num_experts_per_tok": 600}, "x")
    model_facts.read_hf({**mtp_only, "num_experts_per_tok": 600, "mtp_hybrid_override_pattern": "*-"}, "x")
