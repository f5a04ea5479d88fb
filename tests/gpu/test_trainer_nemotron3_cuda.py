"""Nemotron 3 as released (LatentMoE and MTP layers) on one CUDA node: what the recipe's provider gets.

    GPU_CHECK_RECIPE=tiny_nemotron3 python -m pytest tests/gpu -v -s     # or: python tests/gpu/test_trainer_cuda.py

With the tests/gpu trainer built from the tiny_nemotron3 recipe (bf16, megatron's Transformer Engine
hybrid spec, the real mamba_ssm: Transformer Engine, mamba_ssm and causal_conv1d must be installed,
docs/gpu.md; without them these tests are skipped), besides everything test_trainer_cuda.py checks
for it (logprobs against HF, a step, checkpoints, the merged export):
  - the provider has the checkpoint's latent width and no MTP layers (the trainer builds none:
    docs/nemotron_h.md), and megatron's MoE layers hold no MTP module
  - LatentMoE's projections are Transformer Engine's TELinear on cuda (the CPU stand-in, LatentLinear,
    only on CPU), and moe_shared_expert_overlap is off: megatron's MoELayer refuses to train a latent
    layer with it on ("Shared expert overlap with MoE latent projections is not supported during
    training")
  - a GRPO step through the latent layers is finite and moves the adapters; the merged export holds
    the latent projections and no mtp.* weight
Skipped unless GPU_CHECK_RECIPE is tiny_nemotron3 (the trainer of a run is one recipe per process).
`GPU_CHECK_DEVICE=cpu GPU_CHECK_RECIPE=tiny_nemotron3 python -m pytest tests/gpu` is the dry run on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu_check import ON_CUDA, RECIPE, adapters, full_batch, needs_device

pytestmark = [needs_device, pytest.mark.skipif(RECIPE != "tiny_nemotron3",
                                               reason="GPU_CHECK_RECIPE=tiny_nemotron3 runs these")]


def test_the_provider_has_the_latent_width_no_mtp_and_no_shared_expert_overlap(trainer):
    provider = trainer.provider
    assert provider.moe_latent_size == 32
    assert not provider.mtp_num_layers and not provider.mtp_hybrid_override_pattern
    assert not [n for chunk in trainer.model for n, _ in chunk.named_parameters() if "mtp" in n]
    assert provider.moe_shared_expert_overlap is False
    print(f"\nprovider: moe_latent_size {provider.moe_latent_size}, mtp_num_layers {provider.mtp_num_layers}, "
          f"moe_shared_expert_overlap {provider.moe_shared_expert_overlap}, moe_grouped_gemm "
          f"{provider.moe_grouped_gemm}, moe_token_dispatcher_type {provider.moe_token_dispatcher_type}, "
          f"attention_backend {getattr(provider, 'attention_backend', None)}, recompute "
          f"{getattr(provider, 'recompute_granularity', None)} {getattr(provider, 'recompute_modules', None)}")


def test_the_latent_projections_are_transformer_engines_on_cuda(trainer):
    kinds = {type(m.fc1_latent_proj).__name__ for chunk in trainer.model for m in chunk.modules()
             if hasattr(m, "fc1_latent_proj")}
    assert kinds == ({"TELinear"} if ON_CUDA else {"LatentLinear"}), kinds


def test_a_grpo_step_through_the_latent_layers(trainer, batch):
    before = adapters(trainer)
    metrics = trainer.train(full_batch(trainer, batch))
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values() if isinstance(v, (int, float)))
    after = adapters(trainer)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0
    names = [name for name, _ in trainer.export_merged()]
    assert "backbone.layers.1.mixer.fc1_latent_proj.weight" in names and not [n for n in names if n.startswith("mtp.")]
