"""The trainer on one CUDA node: what the CPU suite cannot run (docs/gpu.md).

A Megatron-Bridge LoRA model of a tiny recipe in bf16 on cuda:0 (NCCL process group of one rank,
the distributed optimizer), in this process, no Ray and no vLLM needed (tests/gpu/conftest.py):
  - the build: which layer spec (Transformer Engine or megatron's local one) and which fusions it
    got, each fusion on exactly where its kernel imports (a TE image without APEX included)
  - reference logprobs equal those of the HF model (bf16 on the same GPU), within bf16 tolerance
  - a GRPO train step: finite loss, the LoRA factors move, the frozen base does not
  - checkpoint save / load (torch_dist, distributed optimizer): after further steps, loading
    restores adapters, the next step's loss, and the CUDA RNG state and megatron's CUDA RNG
    tracker states bit for bit
  - the merged export loads into the HF model and gives the trainer's logprobs
Refit on the device: tests/gpu/test_trainer_refit_cuda.py.

Each test is skipped, not failed, without CUDA. Run:  python -m pytest tests/gpu -v   or
python tests/gpu/test_trainer_cuda.py (every recipe of gpu_check.RECIPES, one process each:
megatron's parallel state is per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers.gpu_check import (DEVICE, DTYPE, ON_CUDA, RECIPES, REPO, adapters, close, full_batch, hf_logprobs,
                                     needs_device)

pytestmark = needs_device


def test_the_build_uses_transformer_engine_where_it_imports_and_each_fusion_where_its_kernel_does(trainer):
    """What this node built, printed: which layer spec and which fusions (workers.trainer.kernels)."""
    from workers.trainer import build, kernels

    off = kernels.settings(not ON_CUDA)
    provider = trainer.provider
    for flag in kernels.FUSION_KERNELS:
        if hasattr(provider, flag) and flag in off:
            assert getattr(provider, flag) is False, flag
    te = ON_CUDA and build._have_transformer_engine()
    te_modules = sorted({type(m).__name__ for chunk in trainer.model for m in chunk.modules()
                         if type(m).__module__.startswith("megatron.core.extensions.transformer_engine")})
    assert bool(te_modules) == te, te_modules
    print(f"\nbuild on {DEVICE}: layer spec {'Transformer Engine' if te else 'local'} {te_modules[:4]}; fusions "
          + ", ".join(f"{f}={getattr(provider, f)}" for f in kernels.FUSION_KERNELS if hasattr(provider, f))
          + "; kernels " + ", ".join(f"{k}: {'ok' if v == 'ok' else 'absent'}" for k, v in kernels.report().items()))


def test_bf16_lora_model_on_cuda(trainer):
    info = trainer.info()
    assert info["device"] == DEVICE and info["num_parameters"]["trainable"] > 0
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    assert all(p.is_cuda == ON_CUDA for p in params)
    assert {p.dtype for p in params if not p.requires_grad} == {DTYPE}
    assert trainer.adapter_state(), "no LoRA factors"


def test_reference_logprobs_match_hf(trainer, model_dir, batch):
    ours = trainer.logprobs(batch, adapters=False)
    close(ours, hf_logprobs(model_dir, batch["input_ids"]), batch["loss_mask"], "reference vs HF")
    # lora_B starts at zero: with adapters the policy is still the base model
    close(trainer.logprobs(batch), ours, batch["loss_mask"], "policy vs reference at step 0")


def test_grpo_step_moves_only_the_adapters(trainer, batch):
    frozen = {n: p.detach().float().cpu().clone() for chunk in trainer.model for n, p in chunk.named_parameters()
              if not p.requires_grad}
    before = adapters(trainer)
    metrics = trainer.train(full_batch(trainer, batch))
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values() if isinstance(v, (int, float))), metrics
    after = adapters(trainer)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0, "LoRA factors did not move"
    now = {n: p.detach().float().cpu() for chunk in trainer.model for n, p in chunk.named_parameters()
           if not p.requires_grad}
    assert all(torch.equal(frozen[n], now[n]) for n in frozen), "a frozen base weight changed"


def test_checkpoint_round_trip_with_distributed_optimizer_and_cuda_rng(trainer, batch, tmp_path):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    ckpt = tmp_path / "step"
    if ON_CUDA:
        torch.cuda.manual_seed(123)
        saved_rng = torch.cuda.get_rng_state().clone()
        saved_tracker = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
        assert saved_tracker, "megatron's CUDA RNG tracker holds no state"
    saved_cpu_rng = torch.get_rng_state().clone()
    saved_adapters = adapters(trainer)
    trainer.save_state(str(ckpt))
    fb = full_batch(trainer, batch)
    first = trainer.train(fb)
    torch.randn(1000)                                # moves the CPU RNG on
    if ON_CUDA:
        torch.randn(1000, device="cuda")             # moves the CUDA RNG on
        with get_cuda_rng_tracker().fork():
            torch.randn(1000, device="cuda")         # moves the tracker's model-parallel state on
        assert not torch.equal(torch.cuda.get_rng_state(), saved_rng)
    trainer.train(full_batch(trainer, batch))
    loaded = trainer.load_state(str(ckpt))
    assert loaded["rng_restored"] is True
    assert torch.equal(torch.get_rng_state(), saved_cpu_rng), "CPU RNG state not restored"
    if ON_CUDA:
        assert torch.equal(torch.cuda.get_rng_state(), saved_rng), "CUDA RNG state not restored"
        now_tracker = get_cuda_rng_tracker().get_states()
        assert set(now_tracker) == set(saved_tracker)
        assert all(torch.equal(now_tracker[k].cpu(), saved_tracker[k].cpu()) for k in saved_tracker), "RNG tracker"
    restored = adapters(trainer)
    assert all(torch.equal(restored[k], saved_adapters[k]) for k in saved_adapters), "adapters not restored"
    again = trainer.train(fb)                          # same state, same batch: same step
    assert abs(float(again["loss"]) - float(first["loss"])) <= 1e-3 * max(1.0, abs(float(first["loss"]))), \
        (again["loss"], first["loss"])


def test_merged_export_loads_into_hf(trainer, model_dir, batch):
    merged = {name: t.detach().cpu() for name, t in trainer.export_merged()}
    assert merged and all(t.is_floating_point() for t in merged.values())
    close(hf_logprobs(model_dir, batch["input_ids"], merged), trainer.logprobs(batch), batch["loss_mask"],
               "HF with the merged export vs the trainer")


def main() -> int:
    """Every recipe in its own pytest process (megatron's parallel state is per process)."""
    if ON_CUDA and not torch.cuda.is_available():
        print("tests/gpu: no CUDA device visible to torch: nothing to check (docs/gpu.md)")
        return 0
    rc = 0
    for recipe in RECIPES:
        print(f"== {recipe}", flush=True)
        rc |= subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).parent), "-v", "-rs", "-s",
                              "-p", "no:cacheprovider"],
                             cwd=REPO, env={**os.environ, "GPU_CHECK_RECIPE": recipe}).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
