"""CUDA graphs stay valid across refits (vllm.enforce_eager defaults to false on cuda).

vLLM captures its decode steps as CUDA graphs when the engine starts, before any refit; a graph
replays its kernels on the addresses it captured. Two TP1 engines in processes of their own
(tests/helpers/gpu_engine.py), one after the other on this GPU, each joined to the trainer's refit
group: one with CUDA graphs (`enforce_eager: auto`, the default), one eager. Both receive the same
merged refit, then the same merged_delta one, from the trainer after a GRPO step (LoRA B != 0, so
the refits change what the engines generate). After each refit the graphs engine must generate
what the eager one does (equal greedy tokens, logprobs within bf16 tolerance) and no tensor of its
model may have moved (tests.helpers.refit.model_tensors). A refit that replaced a weight would leave
the graphs reading the old one: the tokens of the graphs engine would stay those of the base model.

The module sorts after the trainer's (test_trainer_*): its GRPO step moves the session's trainer,
which test_trainer_cuda.py expects to find at its start. Skipped without CUDA or without a CUDA
build of vLLM (the lent GPU machine has no vLLM: this runs on a user's GPU node, `python -m pytest
tests/gpu -v`; docs/gpu.md). GPU_CHECK_DEVICE=cpu runs the same plumbing on CPU with two eager
engines (no graphs there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.gpu_check import (BF16_MAX, BF16_MEAN, DEVICE, FP32_MAX, ON_CUDA, REPO, free_port, full_batch,
                                     needs_device, vllm_for_device)

pytestmark = [needs_device, pytest.mark.skipif(vllm_for_device() is not None, reason=str(vllm_for_device()))]
PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 64, 8, 200, 31, 11], [77, 21], [9, 9, 9, 9, 250, 4]]
MODES = ["merged", "merged_delta"]


def engine_report(trainer, model_dir, out, enforce_eager) -> dict:
    port = free_port()
    out.mkdir()
    spec = {"model": str(model_dir), "device": DEVICE, "dtype": "bfloat16" if ON_CUDA else "float32", "port": port,
            "backend": "gloo",
            "modes": MODES, "prompts": PROMPTS, "out": str(out), "enforce_eager": enforce_eager}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    log = (out / "engine.log").open("w")
    engine = subprocess.Popen([sys.executable, "-m", "tests.helpers.gpu_engine", json.dumps(spec)], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        trainer.open_refit_group("127.0.0.1", port, world_size=2, backend="gloo", timeout_s=900)  # waits for vLLM
        for mode in MODES:
            trainer.refit_payload(mode, 0.05)
        assert engine.wait(timeout=900) == 0, (out / "engine.log").read_text()[-4000:]
    finally:
        if engine.poll() is None:
            engine.kill()
        trainer.close_refit_group()
    return json.loads((out / "report.json").read_text())


def test_generation_with_cuda_graphs_after_refits_equals_eager(trainer, batch, model_dir, tmp_path):
    trainer.train(full_batch(trainer, batch))
    graphs = engine_report(trainer, model_dir, tmp_path / "graphs", "auto")
    eager = engine_report(trainer, model_dir, tmp_path / "eager", True)
    if ON_CUDA:  # the CPU dry run (GPU_CHECK_DEVICE=cpu) has no graphs: "auto" is eager there
        assert not graphs["eager"] and graphs["cudagraph_mode"] != "NONE", graphs["cudagraph_mode"]
    assert eager["eager"] and eager["cudagraph_mode"] == "NONE", eager["cudagraph_mode"]
    assert graphs["moved"] == [] and graphs["storage"] > 10, graphs["moved"]
    most, mean = (BF16_MAX, BF16_MEAN) if ON_CUDA else (FP32_MAX, FP32_MAX)
    for mode in MODES:
        g, e = graphs["modes"][mode]["generations"], eager["modes"][mode]["generations"]
        assert [toks for toks, _ in g] == [toks for toks, _ in e], f"{mode}: CUDA graphs vs eager tokens"
        diff = torch.tensor([a - b for (_, la), (_, lb) in zip(g, e) for a, b in zip(la, lb)]).abs()
        assert diff.max() <= most and diff.mean() <= mean, (mode, diff.max(), diff.mean())
        print(f"\n{mode}: graphs vs eager logprobs max |diff| {diff.max():.3g}, mean {diff.mean():.3g}")
    # the refits mattered: what the engines generate after them is not what the base model generates
    assert [lp for _, lp in graphs["modes"]["merged"]["generations"]] != [lp for _, lp in graphs["base"]]
