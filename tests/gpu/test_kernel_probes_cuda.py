"""The preflight's kernel probes (launcher/cluster/kernel_probes.py) for real on this node's GPU: every
probe the preflight can choose must pass with the kernels this image has (a forward checked against
torch, a backward with finite gradients); one whose library is not installed here is skipped, naming
it. Each runs in a process of its own, as in the preflight: Transformer Engine picks its attention
backend from the NVTE_* variables once per process and keeps it. Also prints this node's NVLink
fabric clique as the preflight reads it (`nvidia-smi -q`).

CUDA only (the probes are CUDA kernels: no GPU_CHECK_DEVICE=cpu dry run); skipped without CUDA
(docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from launcher.cluster import kernel_probes
from tests.helpers.gpu_check import ON_CUDA, REPO, needs_device, vllm_for_device

pytestmark = [needs_device, pytest.mark.skipif(not ON_CUDA, reason="the kernel probes are CUDA kernels")]
PROBES = [*(f"te_attention:{b}" for b in kernel_probes.ATTENTION_ENV), "mamba_chunk_scan", "causal_conv1d",
          "te_grouped_linear", "vllm_fused_moe:relu2_no_mul", "vllm_fused_moe:silu"]
RUN = "import sys; from launcher.cluster import kernel_probes as k; k.run(sys.argv[1]); print(k.arch(), 'ok')"


def missing(name: str) -> str | None:
    """Why this node cannot run the probe (its library is not installed), or None."""
    if name.startswith("vllm_"):
        return vllm_for_device()
    needs = [kernel_probes.requires(name)] + (["flash_attn"] if name == "te_attention:flash" else [])
    absent = [n for n in needs if n and importlib.util.find_spec(n.partition(".")[0]) is None]
    return f"{', '.join(absent)} not installed here (docs/gpu.md)" if absent else None


@pytest.mark.parametrize("name", PROBES)
def test_each_kernel_probe_passes_on_this_gpu(name):
    if missing(name):
        pytest.skip(missing(name))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", RUN, name], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    print(f"{name}: {out.stdout.strip() or out.stderr.strip().splitlines()[-1:]}")
    assert out.returncode == 0 and out.stdout.strip().endswith(" ok"), out.stdout + out.stderr


def test_this_nodes_nvlink_clique_as_the_preflight_reads_it():
    from launcher.cluster import preflight

    fabric = preflight._fabric()
    print(f"NVLink fabric: {fabric}")
    assert set(fabric) == {"clique", "why"} and (fabric["clique"] is None) == bool(fabric["why"])
