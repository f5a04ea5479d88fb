"""The reference recipe's provider settings on one CUDA node (docs/gpu.md): the MoE shared expert
overlap off, activation recompute (none / selective / full) and the attention backend, as
workers/trainer/provider_settings.py sets them, on a tiny Nemotron 3 as released (LatentMoE with a
shared expert, MTP layers in the checkpoint that the trainer does not build) where this node can
build one (Transformer Engine and mamba_ssm import), else on the tiny Qwen3-MoE (experts, no Mamba).

For each recompute setting one trainer rank (bf16, the reference recipe's attention backend, full
fine-tuning so that every weight has a gradient) runs one GRPO step on the same batch: selective
and full give none's loss and gradients (bf16: within a few per cent of the largest gradient; TE's
fused attention backward need not be bitwise deterministic), and the step's peak GPU memory is
printed for each. `GPU_CHECK_DEVICE=cpu` runs the same on CPU (float32, the local spec).

The trainers share this process's megatron state with tests/gpu/conftest.py's (one NCCL group of
one rank); they use the attention backend that one uses (megatron pins it in NVTE_* variables per
process).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from launcher.config.schema import RECOMPUTE_MODULES
from tests.helpers.gpu_check import DEVICE, ON_CUDA, free_port, needs_device

pytestmark = needs_device


def _model() -> str:
    """tiny_nemotron3 where this node builds a hybrid (on cuda: TE's hybrid spec and mamba_ssm's kernels)."""
    if not ON_CUDA:
        return "tiny_nemotron3"
    have = all(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "mamba_ssm", "causal_conv1d"))
    return "tiny_nemotron3" if have else "tiny_qwen3_moe"


MODEL = _model()


@pytest.fixture(scope="module")
def stepped(tmp_path_factory, batch):
    """recompute -> (trainer, loss, {name: gradient}, peak GPU bytes of the step)."""
    from workers import tiny_models
    from workers.trainer.actor import MegatronTrainer
    from workers.trainer.config import TrainerConfig

    model_dir = tiny_models.build(tmp_path_factory.mktemp("models") / MODEL, MODEL, seed=0)
    out = {}
    for recompute in ("none", "selective", "full"):
        cfg = TrainerConfig.from_sections(
            str(model_dir), parallel={"tensor_parallel": 1, "recompute": recompute, "micro_batch_size": 1},
            peft={"enabled": False}, optim={"lr": 1e-4, "min_lr": 1e-4, "use_distributed_optimizer": False},
            loss={"reference_policy_kl_penalty": 0.1}, device=DEVICE, dtype="bfloat16" if ON_CUDA else "float32",
            seed=7, max_num_steps=5)
        trainer = MegatronTrainer(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
        b = dict(batch)
        b["prev_logprobs"] = trainer.logprobs(batch).float().cpu()
        b["generation_logprobs"] = b["prev_logprobs"] * (batch["loss_mask"] > 0)
        b["reference_logprobs"] = torch.full_like(b["prev_logprobs"], -5.0)  # the KL term: the loss depends on them
        if ON_CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        metrics = trainer.train(b)
        peak = torch.cuda.max_memory_allocated() - before if ON_CUDA else 0
        grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in trainer._module.named_parameters()
                 if p.requires_grad}
        out[recompute] = (trainer, float(metrics["loss"]), grads, peak)
    print(f"\n{MODEL} on {DEVICE}: step peak GPU memory " + ", ".join(
        f"{r} {v[3] / 2**20:.1f} MiB" for r, v in out.items()) + "; loss " + ", ".join(
        f"{r} {v[1]:.6f}" for r, v in out.items()))
    return out


def test_the_provider_has_the_recipes_settings(stepped):
    from workers.trainer import build

    te = ON_CUDA and build._have_transformer_engine()
    for recompute, (trainer, *_rest) in stepped.items():
        p = trainer.provider
        assert getattr(p, "moe_shared_expert_overlap", False) is False
        assert p.attention_backend.name == ("fused" if te else "local")
        expected = {"none": (None, None, None), "selective": ("selective", None, None), "full": ("full", "uniform", 1)}
        assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == expected[recompute]
        if recompute == "selective":
            assert p.recompute_modules == [m for m in RECOMPUTE_MODULES if m != "moe_act" or p.moe_grouped_gemm]
        if MODEL == "tiny_nemotron3":
            assert p.moe_latent_size == 32 and not p.mtp_num_layers   # LatentMoE built, MTP layers not
    print(f"\nproviders: attention {p.attention_backend.name}, grouped GEMM {p.moe_grouped_gemm}, selective "
          f"recomputes {stepped['selective'][0].provider.recompute_modules}")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_loss_and_gradients_of_none(stepped, recompute):
    _, loss, grads, _ = stepped[recompute]
    _, base_loss, base, _ = stepped["none"]
    assert list(grads) == list(base) and len(base) > 10
    tol = 2e-2 if ON_CUDA else 1e-6
    assert abs(loss - base_loss) <= tol * max(1.0, abs(base_loss)), (loss, base_loss)
    largest = max(g.abs().max().item() for g in base.values())
    worst = max((grads[n] - base[n]).abs().max().item() for n in base)
    assert largest > 0 and worst <= tol * largest, f"{recompute}: gradients differ by {worst:.3e} (of {largest:.3e})"
