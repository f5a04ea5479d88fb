"""The trainer on one CUDA node: what the CPU suite cannot run (docs/gpu.md).

A Megatron-Bridge LoRA model of a tiny recipe in bf16 on cuda:0 (NCCL process group of one rank,
the distributed optimizer), in this process, no Ray and no vLLM needed:
  - reference logprobs equal those of the HF model (bf16 on the same GPU), within bf16 tolerance
  - a GRPO train step: finite loss, the LoRA factors move, the frozen base does not
  - checkpoint save / load (torch_dist, distributed optimizer): after further steps, loading
    restores adapters, the next step's loss, and the CUDA RNG state and megatron's CUDA RNG
    tracker states bit for bit
  - the merged export loads into the HF model and gives the trainer's logprobs
  - with two GPUs: the NCCL refit group (workers.refit BroadcastTransport) between this process
    (trainer rank 0, cuda:0) and a receiver process on cuda:1 delivers the merged weights exactly

Skipped, not failed, without CUDA. Run:  python -m pytest tests/gpu -v   or   python tests/gpu/test_trainer_cuda.py
Recipe: GPU_CHECK_RECIPE (default tiny_llama; the script runs tiny_llama and tiny_qwen2, one process each:
megatron's parallel state is per process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# GPU_CHECK_DEVICE=cpu: a developer's dry run of this module on CPU (float32, gloo, no distributed
# optimizer, no CUDA RNG / NCCL parts), to catch API mistakes before GPU time is spent
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
if __name__ != "__main__" and ON_CUDA and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (tests/gpu runs on a GPU node; docs/gpu.md)", allow_module_level=True)
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32

REPO = Path(__file__).resolve().parents[2]
RECIPE = os.environ.get("GPU_CHECK_RECIPE", "tiny_llama")
RECIPES = ("tiny_llama", "tiny_qwen2")
PEFT = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "dim": 8,
        "alpha": 16, "dropout": 0.0, "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}
OPTIM = {"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-2, "clip_grad": 1.0, "lr_decay_style": "constant",
         "use_distributed_optimizer": ON_CUDA}
LOSS = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.01, "token_level_loss": True}
# bf16 logprobs of a 2-layer model: a few 1e-2 apart between two implementations is normal
BF16_MAX, BF16_MEAN = 0.15, 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers import tiny_models

    return tiny_models.build(tmp_path_factory.mktemp("models") / RECIPE, RECIPE, seed=0)


@pytest.fixture(scope="module")
def trainer(model_dir):
    try:
        import workers.trainer.actor as actor_mod
    except ModuleNotFoundError as e:  # e.g. ray: workers/trainer/actor.py imports it at module level
        pytest.fail(f"cannot import the trainer: {e} (install it into this environment)", pytrace=False)
    from workers.trainer.actor import MegatronTrainer
    from workers.trainer.config import TrainerConfig

    try:  # info() resolves this host's name; an offline node may not resolve it
        socket.gethostbyname(socket.gethostname())
    except OSError:
        actor_mod.node_address = lambda: ("127.0.0.1", _free_port())
    cfg = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=PEFT, optim=OPTIM,
                                      loss=LOSS, device=DEVICE, dtype="bfloat16" if ON_CUDA else "float32",
                                      seed=7, max_num_steps=20)
    assert cfg.use_distributed_optimizer == ON_CUDA
    t = MegatronTrainer(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 250, (4, 16), generator=g)
    mask = torch.zeros(4, 16)
    for row, (start, end) in enumerate([(4, 16), (5, 10), (6, 13), (4, 8)]):
        mask[row, start:end] = 1
        ids[row, end:] = 0
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.tensor([1.0, -0.8, 0.5, -0.6])}


def hf_logprobs(model_dir, input_ids, state=None) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPE).to(DEVICE).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict({k: v.to(DTYPE) for k, v in state.items()}, strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in m or "lm_head" in m for m in missing), missing
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids.to(DEVICE)).logits.float(), dim=-1).cpu()
    out = torch.zeros(input_ids.shape)
    out[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    return out


def close_bf16(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    a, b = a.float().cpu(), b.float().cpu()
    m = mask.bool().clone()
    m[:, 0] = False
    diff = (a - b).abs()[m]
    assert diff.max().item() <= BF16_MAX and diff.mean().item() <= BF16_MEAN, \
        f"{what}: max {diff.max().item():.3e} mean {diff.mean().item():.3e}"


def full_batch(trainer, batch) -> dict:
    b = dict(batch)
    b["prev_logprobs"] = trainer.logprobs(batch).float().cpu()
    b["generation_logprobs"] = b["prev_logprobs"] * (batch["loss_mask"] > 0)
    b["reference_logprobs"] = trainer.logprobs(batch, adapters=False).float().cpu()
    return b


def adapters(trainer) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in trainer.adapter_state().items()}


# ----------------------------------------------------------------------------------------- tests
def test_bf16_lora_model_on_cuda(trainer):
    info = trainer.info()
    assert info["device"] == DEVICE and info["num_parameters"]["trainable"] > 0
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    assert all(p.is_cuda == ON_CUDA for p in params)
    assert {p.dtype for p in params if not p.requires_grad} == {DTYPE}
    assert trainer.adapter_state(), "no LoRA factors"


def test_reference_logprobs_match_hf(trainer, model_dir, batch):
    ours = trainer.logprobs(batch, adapters=False)
    close_bf16(ours, hf_logprobs(model_dir, batch["input_ids"]), batch["loss_mask"], "reference vs HF")
    # lora_B starts at zero: with adapters the policy is still the base model
    close_bf16(trainer.logprobs(batch), ours, batch["loss_mask"], "policy vs reference at step 0")


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
    close_bf16(hf_logprobs(model_dir, batch["input_ids"], merged), trainer.logprobs(batch), batch["loss_mask"],
               "HF with the merged export vs the trainer")


RECEIVER = """
import json, sys, torch
from safetensors.torch import save_file
from workers.refit.transports import BroadcastTransport
host, port, out, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if backend == "nccl":
    torch.cuda.set_device(0)
t = BroadcastTransport.join(host, port, rank=1, world_size=2, backend=backend, timeout_s=120,
                            device="cuda:0" if backend == "nccl" else None)
incoming = t.receive({"mode": "merged"}, {})
save_file({n: x.cpu().contiguous() for n, x in incoming.stream}, out)
print(json.dumps({"received_layout": incoming.layout_received, "tensors": len(incoming.layout.tensors)}))
"""


@pytest.mark.skipif(ON_CUDA and (not torch.cuda.is_available() or torch.cuda.device_count() < 2),
                    reason="needs 2 GPUs")
def test_nccl_refit_group_between_two_processes(trainer, tmp_path):
    from safetensors.torch import load_file

    port, out = _free_port(), tmp_path / "received.safetensors"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(_second_gpu()), "PYTHONPATH": f"{REPO}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    backend = "nccl" if ON_CUDA else "gloo"          # gloo: the CPU dry run of the same plumbing
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), str(out), backend], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        trainer.open_refit_group("127.0.0.1", port, world_size=2, backend=backend)
        payload = trainer.refit_payload("merged", bucket_mb=1)
        stdout, stderr = rx.communicate(timeout=180)
    finally:
        if rx.poll() is None:
            rx.kill()
        trainer.close_refit_group()
    assert rx.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    got = load_file(str(out))
    sent = {name: t.detach().cpu() for name, t in trainer.export_merged()}
    assert report["received_layout"] and report["tensors"] == len(sent) == payload.tensors
    assert sorted(got) == sorted(sent)
    assert all(torch.equal(got[n], sent[n]) for n in sent), "refit over NCCL changed a tensor"


def _second_gpu() -> str:
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[1] if len(visible) > 1 else "1"


def main() -> int:
    """Every recipe in its own pytest process (megatron's parallel state is per process)."""
    if not torch.cuda.is_available():
        print("tests/gpu: no CUDA device visible to torch: nothing to check (docs/gpu.md)")
        return 0
    rc = 0
    for recipe in RECIPES:
        print(f"== {recipe}", flush=True)
        rc |= subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__)), "-v", "-rs", "-p", "no:cacheprovider"],
                             cwd=REPO, env={**os.environ, "GPU_CHECK_RECIPE": recipe}).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
