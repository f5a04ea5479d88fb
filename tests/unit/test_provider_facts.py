"""The run's model facts on Megatron-Bridge's real provider (workers/trainer/provider_facts.py), for
the published shapes: what the Bridge maps alone, what `apply` completes, what `check` catches.

Megatron is imported in a child process (as the trainer does; it changes how tensors pickle in
the process that imports it). No model is built: the provider, from the checkpoint's config.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import published_models

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
cpu_shim.apply("cpu")
from megatron.bridge import AutoBridge
from launcher.config import model_facts
from workers.trainer import provider_facts
out = {}
for d in sys.argv[2:]:
    facts, _ = model_facts.read(d)
    bridge = AutoBridge.from_hf_pretrained(d)
    mtp_alone = provider_facts.check(bridge.to_megatron_provider(load_weights=False), facts)   # MTP as it is
    registry = bridge._model_bridge.mapping_registry()
    from safetensors import safe_open
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        mtp = [k for k in f.keys() if k.startswith("mtp.")]
    import re   # the registry's HF patterns of its MTP mappings (its reverse lookup cannot resolve q/k/v there)
    patterns = [(re.compile(registry._convert_pattern_to_regex(h) + "$"), m.megatron_param) for m in registry.mappings
                for h in (m.hf_param.values() if isinstance(m.hf_param, dict) else [m.hf_param])
                if isinstance(h, str) and h.startswith("mtp.")]
    matched = {k: [mg for rx, mg in patterns if rx.match(k)] for k in mtp}
    mtp_names = {"count": len(mtp), "unmapped": sorted(k for k, m in matched.items() if not m),
                 "megatron": sorted({mg.split(".", 3)[-1] for m in matched.values() for mg in m})}
    provider_facts.without_mtp(bridge)   # as workers.trainer.build does
    provider = bridge.to_megatron_provider(load_weights=False)
    bridge_alone = provider_facts.check(provider, facts)
    provider_facts.apply(provider, facts)
    for flag in ("apply_rope_fusion", "persist_layer_norm", "bias_activation_fusion", "masked_softmax_fusion",
                 "bias_dropout_fusion", "gradient_accumulation_fusion", "moe_permute_fusion", "moe_grouped_gemm"):
        setattr(provider, flag, False)  # CPU: as workers.trainer.build does
    provider.finalize()
    other = dataclasses.replace(facts, num_query_groups=1, qk_norm=not facts.qk_norm, rope_theta=10000.0)
    if facts.family == "nemotron_h":  # its own facts: the layer pattern and the Mamba groups
        other = dataclasses.replace(other, family_facts={**facts.family_facts, "n_groups": 1,
                                                         "hybrid_override_pattern": "M" * facts.num_layers,
                                                         "moe_latent_size": 2 * facts.family_facts["moe_latent_size"]})
    out[d.rsplit("/", 1)[1]] = {"bridge_alone": bridge_alone, "applied": provider_facts.check(provider, facts),
                                "other": provider_facts.check(provider, other), "mtp_alone": mtp_alone,
                                "mtp_names": mtp_names}
print(json.dumps(out))
"""


RECIPES_H = ("tiny_nemotron_h-s0", "tiny_nemotron_h_dense-s0", "tiny_nemotron3-s0")
NEMOTRON_H = (*(n for n, f in published_models.FAMILY.items() if f == "nemotron_h"), *RECIPES_H)


@pytest.fixture(scope="module")
def probed(model_cache, tiny_model):
    dirs = [str(published_models.build(n, model_cache / "published")) for n in published_models.PUBLISHED]
    dirs += [str(tiny_model(recipe.removesuffix("-s0"))) for recipe in RECIPES_H]
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO), *dirs], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


YARN_LEFT_UNSET = ["rope_scaling: the run's yarn_beta_fast 32.0, Megatron's None",
                   "rope_scaling: the run's yarn_beta_slow 1.0, Megatron's None",
                   "rope_scaling: the run's yarn_correction_range_round_to_int True, Megatron's None"]


def test_the_bridge_alone_leaves_yarn_half_set(probed):
    """Megatron-Bridge copies only the rope_scaling keys config.json states: None beta_fast made megatron-core
    fail at start-up (`None * int`), None truncation would round differently from HF."""
    assert probed["Llama-3.2-1B"]["bridge_alone"] == []  # llama3 scaling: factor only, the rest fixed
    assert probed["Qwen3-0.6B"]["bridge_alone"] == []   # rope_scaling null, as published
    assert probed["Qwen3-30B-A3B"]["bridge_alone"] == YARN_LEFT_UNSET
    # no head_dim in Qwen2.5's file: kv_channels is derived at finalize()
    assert probed["Qwen2.5-0.5B-Instruct"]["bridge_alone"] == [
        "head_dim: the run's 32, Megatron's kv_channels None", *YARN_LEFT_UNSET]


@pytest.mark.parametrize("name", list(dict.fromkeys([*published_models.PUBLISHED, *NEMOTRON_H])))
def test_applied_facts_are_what_megatron_builds(probed, name):
    assert probed[name]["applied"] == []


@pytest.mark.parametrize("name", NEMOTRON_H)
def test_nemotron_h_is_checked_on_its_pattern_and_mamba_sizes_too(probed, name):
    """Nemotron-H (no rotary embedding: nothing to complete): the Bridge maps every fact, and the
    provider is checked on the layer pattern and Mamba groups as on the attention numbers."""
    pattern = {"Nemotron-H-56B-Base-8K": "M-M-M-M*-", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "MEMEM*E",
               "NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "MEMEMEM*E", "tiny_nemotron_h-s0": "M*EM*-",
               "tiny_nemotron_h_dense-s0": "M*-M*-", "tiny_nemotron3-s0": "MEM*E"}[name]
    latent = {"tiny_nemotron3-s0": ["family_facts.moe_latent_size: the run's 64, Megatron's moe_latent_size 32"],
              "NVIDIA-Nemotron-3-Super-120B-A12B-BF16": [
                  "family_facts.moe_latent_size: the run's 32, Megatron's moe_latent_size 16"]}.get(name, [])
    assert probed[name]["bridge_alone"] == []
    assert probed[name]["other"] == [
        "num_query_groups: the run's 1, Megatron's num_query_groups 2",
        "qk_norm: the run's True, Megatron's qk_layernorm False", *latent,
        "family_facts.n_groups: the run's 1, Megatron's mamba_num_groups 2",
        f"family_facts.hybrid_override_pattern: the run's {'M' * len(pattern)!r}, Megatron's hybrid_layer_pattern "
        f"{pattern!r}",
        "rope_scaling: the run's position_embedding_type 'rope', Megatron's 'none'"]  # a rope_theta: RoPE expected


def test_the_trainer_builds_no_mtp_layers_where_the_bridge_alone_would(probed):
    """Nemotron 3's MTP layers: the bridge builds them from config.json (and megatron adds their loss);
    without_mtp makes the provider MTP-free, and check names a provider that is not."""
    assert probed["tiny_nemotron3-s0"]["mtp_alone"] == [
        "MTP: the trainer builds no MTP layers (docs/nemotron_h.md), Megatron's mtp_num_layers 1"]
    assert probed["tiny_nemotron3-s0"]["applied"] == []


def test_the_recipes_mtp_tensors_are_named_as_megatron_bridge_maps_them(probed):
    """transformers builds no MTP layers, so workers.tiny_models writes them: every one is a name the Bridge's
    NemotronHBridge mapping resolves (to the MTP block it would build), none is left over."""
    names = probed["tiny_nemotron3-s0"]["mtp_names"]
    assert names["count"] == 48 and names["unmapped"] == []   # *E: attention 4 + norms, MoE 16 x 2 + ...
    assert "mtp_model_layer.layers.*.mlp.fc1_latent_proj.weight" in names["megatron"]
    assert "eh_proj.weight" in names["megatron"] and "final_layernorm.weight" in names["megatron"]


def test_facts_megatron_would_build_otherwise_are_named(probed):
    """Facts the checkpoint contradicts (it changed since submission) stop the trainer before it trains."""
    assert probed["Qwen3-0.6B"]["other"] == [
        "num_query_groups: the run's 1, Megatron's num_query_groups 2",
        "qk_norm: the run's False, Megatron's qk_layernorm True",
        "rope_theta: the run's 10000.0, Megatron's rotary_base 1000000.0"]
