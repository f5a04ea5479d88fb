"""vLLM's LoRA filter for a checkpoint with MoE experts: the linears outside the experts, read from the
checkpoint's weight names (vLLM CPU would otherwise put every MoE layer on its Triton LoRA backend)."""

from __future__ import annotations

from workers.generator.actor import GeneratorConfig
from workers.hf_checkpoint import lora_targets_outside_experts


def test_an_moe_checkpoint_gets_the_linears_outside_its_experts(tiny_model):
    moe = str(tiny_model("tiny_qwen3_moe"))
    assert lora_targets_outside_experts(moe) == ["gate", "k_proj", "o_proj", "q_proj", "v_proj"]
    kw = GeneratorConfig(model=moe, enable_lora=True).engine_kwargs()
    assert kw["lora_target_modules"] == ["gate", "k_proj", "o_proj", "q_proj", "v_proj"]
    assert "lora_target_modules" not in GeneratorConfig(model=moe).engine_kwargs()  # no LoRA: no filter


def test_a_dense_checkpoint_keeps_vllms_default(tiny_model):
    dense = str(tiny_model("tiny_llama"))
    assert lora_targets_outside_experts(dense) is None
    assert "lora_target_modules" not in GeneratorConfig(model=dense, enable_lora=True).engine_kwargs()


def test_a_nemotron_h_checkpoint_keeps_its_shared_expert_and_mamba_linears(tiny_model):
    """Nemotron-H: the routed experts (mixer.experts.N) are left out; the shared expert's up/down_proj,
    the Mamba in/out_proj and the router (gate) are linears outside them; conv1d is not a linear."""
    assert lora_targets_outside_experts(str(tiny_model("tiny_nemotron_h"))) == [
        "down_proj", "gate", "in_proj", "k_proj", "o_proj", "out_proj", "q_proj", "up_proj", "v_proj"]
