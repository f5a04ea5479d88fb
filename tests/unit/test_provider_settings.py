"""The trainer's settings on Megatron-Bridge's real provider (workers/trainer/provider_settings.py) as
megatron-core accepts them (`finalize()` runs its TransformerConfig checks): the shared expert
overlap off, activation recompute, the attention backend. For the reference recipe (the
`ultra_6n4g` topology's train section) on Nemotron 3 Ultra's published config.json, as a CUDA
node with Transformer Engine builds it and as this CPU machine would; none / full on the tiny
Nemotron-H and a dense llama.

Megatron is imported in a child process (as the trainer does; it changes how tensors pickle in
the process that imports it). No model is built: the provider, from config.json alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.config.compose import compose
from launcher.config.schema import RECOMPUTE_MODULES
from tests.helpers import nemotron3_ultra

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
cpu_shim.apply("cpu")
from megatron.bridge import AutoBridge
from workers.trainer import provider_settings
from workers.trainer.config import TrainerConfig
# a CUDA node with Transformer Engine: the experts' grouped GEMM (TE) on; the other fusions need TE at finalize
TE_NODE = lambda need: "ok" if need == "transformer_engine.pytorch" else "absent"
out = []
for case in json.loads(sys.argv[2]):
    bridge = AutoBridge.from_hf_pretrained(case["dir"])
    provider = bridge.to_megatron_provider(load_weights=False)
    bridge_alone = getattr(provider, "moe_shared_expert_overlap", None)
    cfg = TrainerConfig.from_sections(case["dir"], parallel=case["train"], device=case["device"], dtype="bfloat16")
    cuda = case["device"] == "cuda"
    cfg.generation_ssm_cache_dtype = case.get("generation_ssm", "auto")
    old_mamba_ssm = case.get("old_mamba_ssm", False)
    try:
        notes = provider_settings.apply(provider, cfg, is_cpu=not cuda, have_te=cuda, probe=TE_NODE,
                                        hf_config=bridge.hf_pretrained.config,
                                        state_dtype_ok=lambda: not old_mamba_ssm)
    except ValueError as e:
        out.append({"error": str(e)})
        continue
    provider.finalize()
    out.append({"bridge_alone": bridge_alone, "overlap": getattr(provider, "moe_shared_expert_overlap", None),
                "latent": getattr(provider, "moe_latent_size", None),
                "granularity": provider.recompute_granularity, "method": provider.recompute_method,
                "num_layers": provider.recompute_num_layers, "modules": provider.recompute_modules,
                "backend": provider.attention_backend.name, "sequence_parallel": provider.sequence_parallel,
                "tp": provider.tensor_model_parallel_size, "ep": provider.expert_model_parallel_size,
                "ssm_states": str(getattr(provider, "mamba_training_ssm_states_dtype", None)), "notes": notes})
print(json.dumps(out))
"""


def probe(cases: list[dict]) -> list[dict]:
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO), json.dumps(cases)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def ultra_train(*overrides: str) -> dict:
    """The reference recipe's topology.train section, as composed."""
    return OmegaConf.to_container(compose(["topology=ultra_6n4g", *overrides]).topology.train, resolve=True)


@pytest.fixture(scope="module")
def ultra(tmp_path_factory):
    return str(nemotron3_ultra.write(tmp_path_factory.mktemp("ultra") / "NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16"))


def _with_config(model: str, into: Path, **changes) -> str:
    """A copy of the model folder whose config.json has `changes`."""
    import shutil

    dest = Path(shutil.copytree(model, into / Path(model).name))
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
    return str(dest)


@pytest.fixture(scope="module")
def probed(ultra, tiny_model, tmp_path_factory):
    nemotron_h, llama = str(tiny_model("tiny_nemotron_h")), str(tiny_model())
    cases = {
        "ultra cuda": {"dir": ultra, "train": ultra_train(), "device": "cuda"},
        "ultra cpu": {"dir": ultra, "train": ultra_train(), "device": "cpu"},
        "ultra cuda flash": {"dir": ultra, "train": ultra_train("topology.train.attention_backend=flash"),
                             "device": "cuda"},
        "nemotron_h none": {"dir": nemotron_h, "train": {"recompute": "none"}, "device": "cpu"},
        "nemotron_h full": {"dir": nemotron_h, "train": {"recompute": "full"}, "device": "cpu"},
        "llama selective": {"dir": llama, "train": {"recompute": "selective"}, "device": "cpu"},
        "nemotron_h bf16 states": {"dir": nemotron_h, "train": {"mamba_ssm_states_dtype": "bfloat16"},
                                   "device": "cpu"},
        "nemotron_h generation bf16": {"dir": nemotron_h, "train": {}, "device": "cpu", "generation_ssm": "bfloat16"},
        "nemotron_h config bf16": {"dir": _with_config(nemotron_h, tmp_path_factory.mktemp("bf16_state"),
                                                       mamba_ssm_cache_dtype="bfloat16"), "train": {}, "device": "cpu"},
        "ultra cuda old mamba_ssm": {"dir": ultra, "train": ultra_train(), "device": "cuda", "old_mamba_ssm": True},
        "ultra cuda old mamba_ssm float32": {"dir": ultra, "train": ultra_train(
            "topology.train.mamba_ssm_states_dtype=float32"), "device": "cuda", "old_mamba_ssm": True},
    }
    return dict(zip(cases, probe(list(cases.values()))))


def test_the_reference_recipe_asks_for_micro_batch_1_and_selective_recompute():
    train = ultra_train()
    assert (train["micro_batch_size"], train["recompute"], train["attention_backend"]) == (1, "selective", "fused")


def test_the_reference_recipe_on_a_cuda_node_is_the_bridge_ultra_lora_recipes(probed):
    """Megatron-Bridge's nemotron_3_ultra_peft recipe: overlap off, selective recompute of moe, moe_act, mlp,
    shared_experts, layernorm, core_attn, attention fused; the Bridge alone turns the overlap on, with which
    megatron-core's MoELayer asserts on a latent MoE (Ultra's moe_latent_size 2048)."""
    got = probed["ultra cuda"]
    assert got["bridge_alone"] is True and got["latent"] == 2048
    assert got["overlap"] is False
    assert (got["granularity"], got["method"], got["num_layers"]) == ("selective", None, None)
    assert got["modules"] == ["moe", "moe_act", "mlp", "shared_experts", "layernorm", "core_attn"] \
        == list(RECOMPUTE_MODULES)
    assert got["backend"] == "fused" and probed["ultra cuda flash"]["backend"] == "flash"
    assert (got["tp"], got["ep"], got["sequence_parallel"]) == (2, 16, True)


def test_on_cpu_the_same_recipe_runs_what_megatron_can_there(probed):
    """No grouped GEMM on CPU: megatron-core refuses moe_act recompute without it; megatron's own attention."""
    got = probed["ultra cpu"]
    assert got["overlap"] is False
    assert got["modules"] == ["moe", "mlp", "shared_experts", "layernorm", "core_attn"]
    assert got["backend"] == "local"


def test_none_and_full_recompute_and_a_dense_model(probed):
    assert [probed["nemotron_h none"][k] for k in ("granularity", "method", "num_layers")] == [None, None, None]
    assert [probed["nemotron_h full"][k] for k in ("granularity", "method", "num_layers")] == ["full", "uniform", 1]
    assert probed["nemotron_h none"]["overlap"] is probed["nemotron_h full"]["overlap"] is False
    dense = probed["llama selective"]
    assert dense["granularity"] == "selective" and "moe_act" not in dense["modules"] and dense["backend"] == "local"


def test_mamba_training_states_follow_what_vllm_keeps_its_ssm_state_in(probed):
    """Issue 44: megatron's default follows the activations (bf16) while vLLM keeps Nemotron-H's SSM state in
    float32 (config.json's mamba_ssm_cache_dtype; vLLM's NemotronH default and transformers' too)."""
    assert probed["ultra cuda"]["ssm_states"] == probed["ultra cpu"]["ssm_states"] == "torch.float32"
    assert probed["nemotron_h none"]["ssm_states"] == "torch.float32"   # the tiny model's config.json says none
    assert probed["nemotron_h config bf16"]["ssm_states"] == "torch.bfloat16"      # auto: config.json's, as vLLM
    assert probed["nemotron_h bf16 states"]["ssm_states"] == "torch.bfloat16"      # the key, said
    assert probed["nemotron_h generation bf16"]["ssm_states"] == "torch.bfloat16"  # auto: vLLM's, as configured
    assert probed["llama selective"]["ssm_states"] == "None"                       # no Mamba layers
    # a mamba_ssm whose scans take no state_dtype (megatron refuses the setting): auto leaves it, with a note;
    # the key said explicitly is an error naming it
    old = probed["ultra cuda old mamba_ssm"]
    assert old["ssm_states"] == "None" and any("takes no state_dtype" in n and "float32" in n for n in old["notes"])
    assert probed["ultra cuda old mamba_ssm float32"]["error"].startswith(
        "topology.train.mamba_ssm_states_dtype=float32: the installed mamba_ssm's scans take no state_dtype")
