"""Activation recompute changes memory, not results: one GRPO training step of the real trainer
(megatron-core + Megatron-Bridge on CPU, float32) with `topology.train.recompute` selective and
full gives the loss and the gradient of every trained weight that it gives with none.

Full fine-tuning (peft.enabled=false), so that every module's backward runs through the recomputed
activations and has a gradient to compare: the tiny Nemotron 3 (Mamba-2, attention and LatentMoE
layers with a shared expert: moe, shared_experts, layernorm and core_attn have something to
recompute; the hybrid stack's full recompute; its MTP layers are not built) and the tiny llama
(its MLP for `mlp`, the transformer block's full recompute). The loss has
a KL term against fixed reference logprobs, so that its value depends on the model's logprobs (the
clipped ratio term alone is the same at step 0 whatever the weights). On CPU
selective leaves out `moe_act` (megatron-core allows it only with grouped GEMM experts, a
Transformer Engine kernel: tests/unit/test_provider_settings.py). tests/gpu checks the same on CUDA.

One child process builds the six trainers (megatron is imported there, not in pytest's process,
and its parallel state is per process): about half a minute here, no Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, socket, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch
from workers.trainer.actor import MegatronTrainer
from workers.trainer.config import TrainerConfig

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

g = torch.Generator().manual_seed(3)
ids = torch.randint(4, 250, (3, 24), generator=g)
mask = torch.zeros(3, 24)
for row, (start, end) in enumerate([(4, 24), (5, 17), (6, 20)]):
    mask[row, start:end] = 1
batch = {"input_ids": ids, "loss_mask": mask, "advantages": torch.tensor([1.0, -0.8, 0.5])}
out, addr = {}, port()
for name, path in json.loads(sys.argv[2]).items():
    for recompute in ("none", "selective", "full"):
        cfg = TrainerConfig.from_sections(path, parallel={"recompute": recompute}, peft={"enabled": False},
                                          optim={"lr": 1e-3, "min_lr": 1e-3},
                                          loss={"reference_policy_kl_penalty": 0.1}, device="cpu", seed=11,
                                          max_num_steps=5)
        t = MegatronTrainer(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=addr)
        b = dict(batch)
        b["prev_logprobs"] = t.logprobs(batch) + 0.05 * torch.randn(ids.shape,
                                                                   generator=torch.Generator().manual_seed(5))
        b["reference_logprobs"] = torch.full(ids.shape, -5.0)  # the KL term makes the loss depend on the logprobs
        metrics = t.train(b)
        grads = {n: p.main_grad.detach().clone() for n, p in t._module.named_parameters() if p.requires_grad}
        out[f"{name} {recompute}"] = {"loss": metrics["loss"], "granularity": t.provider.recompute_granularity,
                                      "modules": t.provider.recompute_modules, "grads": grads}
report = {}
for key, r in out.items():
    name, recompute = key.split()
    base = out[f"{name} none"]
    report[key] = {"loss": r["loss"], "granularity": r["granularity"], "modules": r["modules"],
                   "params": len(r["grads"]), "names_equal": list(r["grads"]) == list(base["grads"]),
                   "nonzero": sum(int(g.abs().sum() > 0) for g in r["grads"].values()),
                   "max_grad_diff": max((r["grads"][n] - base["grads"][n]).abs().max().item() for n in base["grads"]),
                   "max_grad": max(g.abs().max().item() for g in base["grads"].values())}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tiny_model):
    paths = {"nemotron3": str(tiny_model("tiny_nemotron3")), "llama": str(tiny_model())}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO), json.dumps(paths)], capture_output=True, text=True,
                       timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["nemotron3", "llama"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_loss_and_gradients_of_none(report, model, recompute):
    got, base = report[f"{model} {recompute}"], report[f"{model} none"]
    assert got["granularity"] == recompute and base["granularity"] is None
    if recompute == "selective":
        assert got["modules"] == ["moe", "mlp", "shared_experts", "layernorm", "core_attn"]
    assert got["names_equal"] and got["params"] == base["params"] > 10
    assert got["nonzero"] == base["nonzero"] >= base["params"] - 2  # every weight got a gradient (a few may be 0)
    assert got["loss"] == pytest.approx(base["loss"], rel=1e-6, abs=1e-7)
    assert got["max_grad_diff"] <= 1e-6 * max(1.0, base["max_grad"]), got
