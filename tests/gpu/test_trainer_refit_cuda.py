"""Refit on one CUDA node: what the CPU suite proves only by structure (docs/gpu.md).

After one GRPO step of the tests/gpu trainer (LoRA B != 0, so merged weights differ from the base):
  - one-rank NCCL group: trainer rank 0 sends a merged refit through workers.refit's
    BroadcastTransport over NCCL (the group of a run, without receivers): the export stays on the
    GPU, the sender holds at most one bucket's worth of exported tensors at once (weak references),
    and the GPU memory the refit adds is printed and bounded by buckets and single tensors
  - two GPUs: a receiver process on the second GPU gets the merged weights bitwise over NCCL
  - a CUDA vLLM importable here: one TP1 engine in a process of its own (tests/helpers/gpu_engine.py)
    joins the trainer's refit group; a merged refit, then a merged_delta one: merged_delta writes
    bitwise what merged writes, merged writes bitwise what the trainer exports, the engine's greedy
    logprobs agree with the trainer's on the same tokens, and each refit's added peak GPU memory is
    printed

Each test is skipped, not failed, where its hardware or vLLM is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.gpu_check import (DEVICE, ON_CUDA, REPO, CountedExport, close, free_port, full_batch, needs_device,
                                     needs_two_gpus, vllm_for_device)

pytestmark = needs_device
BACKEND = "nccl" if ON_CUDA else "gloo"   # gloo: the CPU dry run of the same plumbing
PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 64, 8, 200, 31, 11], [77, 21]]


@pytest.fixture(scope="module")
def stepped(trainer, batch):
    """One GRPO step: LoRA B moves away from its zero start (merged != base)."""
    trainer.train(full_batch(trainer, batch))
    return trainer


def test_refit_over_a_one_rank_nccl_group_streams_on_the_device(stepped, monkeypatch):
    trainer, bucket_mb = stepped, 0.05
    bucket = int(bucket_mb * 2**20)
    total = sum(t.numel() * t.element_size() for _, t in trainer.export_merged())
    trainer.open_refit_group("127.0.0.1", free_port(), world_size=1, backend=BACKEND, timeout_s=120)
    try:
        for first in (True, False):  # the first refit of the kind (layout in the bucket headers), then another
            counted = CountedExport(trainer)
            monkeypatch.setattr(trainer, "export_merged", counted)
            if ON_CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            payload = trainer.refit_payload("merged", bucket_mb)
            added = torch.cuda.max_memory_allocated() - before if ON_CUDA else None
            monkeypatch.undo()
            assert payload.transport == "broadcast" and (payload.layout_bytes > 0) == first
            assert payload.bytes >= total > 4 * bucket  # many buckets
            assert max(counted.alive_bytes) <= max(bucket, counted.largest), (counted.alive_bytes, bucket)
            if ON_CUDA:  # the packing buffer, the open bucket's tensors, the export's own temporaries
                assert added <= 3 * bucket + 4 * counted.largest + 2**20, (added, bucket, counted.largest)
            print(f"\nrefit over {BACKEND} (one rank, {'first' if first else 'known layout'}): {payload.bytes} bytes in "
                  f"{payload.sender_s:.3f}s; exported tensors alive at most {max(counted.alive_bytes)} bytes (bucket "
                  f"{bucket}, largest tensor {counted.largest}); GPU memory added {added}")
    finally:
        trainer.close_refit_group()


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


@needs_two_gpus
def test_nccl_refit_group_between_two_processes(stepped, tmp_path):
    from safetensors.torch import load_file

    trainer = stepped
    port, out = free_port(), tmp_path / "received.safetensors"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(_second_gpu()),
           "PYTHONPATH": f"{REPO}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), str(out), BACKEND], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        trainer.open_refit_group("127.0.0.1", port, world_size=2, backend=BACKEND)
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


@pytest.mark.skipif(vllm_for_device() is not None, reason=str(vllm_for_device()))
def test_engine_refit_merged_delta_bitwise_and_logprobs_against_the_trainer(stepped, model_dir, tmp_path):
    from safetensors.torch import load_file

    trainer, port = stepped, free_port()
    spec = {"model": str(model_dir), "device": DEVICE, "dtype": "bfloat16" if ON_CUDA else "float32", "port": port,
            "backend": "gloo", "modes": ["merged", "merged_delta"], "prompts": PROMPTS, "out": str(tmp_path)}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    log = (tmp_path / "engine.log").open("w")
    engine = subprocess.Popen([sys.executable, "-m", "tests.helpers.gpu_engine", json.dumps(spec)], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        trainer.open_refit_group("127.0.0.1", port, world_size=2, backend="gloo", timeout_s=600)  # waits for vLLM
        payloads = [trainer.refit_payload(mode, 0.05) for mode in spec["modes"]]
        assert engine.wait(timeout=600) == 0, (tmp_path / "engine.log").read_text()[-4000:]
    finally:
        if engine.poll() is None:
            engine.kill()
        trainer.close_refit_group()
    report = json.loads((tmp_path / "report.json").read_text())
    merged, delta = (load_file(str(tmp_path / f"{m}.safetensors")) for m in spec["modes"])
    exported = {n: t.detach().cpu() for n, t in trainer.export_merged()}
    assert merged.keys() == exported.keys() and all(torch.equal(merged[n], exported[n]) for n in exported)
    from workers.lora.layout import ModelLayout, hf_lora_groups

    wrapped = {m for g in hf_lora_groups(ModelLayout.from_facts(trainer.cfg.facts), trainer.adapter_state())
               for m in g.hf_modules}   # e.g. q, k, v, o, gate, up, down of every layer of a llama
    assert len(delta) == len(wrapped) and all(n.removesuffix(".weight").split(".", 1)[1] in
                                              {m.split(".", 1)[1] for m in wrapped} for n in delta), sorted(delta)
    # merged_delta names the HF modules as transformers' model does in memory (Nemotron-H: model.layers,
    # which its files spell backbone.layers)
    merged = {("model." + n[len("backbone."):] if n.startswith("backbone.") else n): t for n, t in merged.items()}
    assert all(torch.equal(t, merged[n]) for n, t in delta.items()), "merged_delta differs from merged"
    assert payloads[1].bytes < payloads[0].bytes / 3
    for mode in spec["modes"]:  # the engine's greedy tokens and logprobs, the trainer's logprobs of them
        gens = report["modes"][mode]["generations"]
        rows = [p + toks for p, (toks, _) in zip(PROMPTS, gens)]
        width = max(map(len, rows))
        ids, mask, engine_lp = (torch.zeros(len(rows), width, dtype=torch.int64), torch.zeros(len(rows), width),
                                torch.zeros(len(rows), width))
        for i, (p, (toks, lps)) in enumerate(zip(PROMPTS, gens)):
            ids[i, :len(rows[i])] = torch.tensor(rows[i])
            mask[i, len(p):len(rows[i])] = 1
            engine_lp[i, len(p):len(rows[i])] = torch.tensor(lps)
        close(engine_lp, trainer.logprobs({"input_ids": ids}), mask, f"vLLM after a {mode} refit vs the trainer")
        r = report["modes"][mode]
        print(f"\n{mode} refit into vLLM ({report['executor']}, started in {report['engine_start_s']}s): {r['bytes']} "
              f"bytes in {r['buckets']} buckets, {r['seconds']}s; GPU memory the refit added: {r['peak_bytes']}")
