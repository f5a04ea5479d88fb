"""Megatron fusions that need an optional kernel are on only where the kernel imports
(workers.trainer.kernels): a CUDA image with Transformer Engine but without APEX must not ask
ColumnParallelLinear for APEX's fused_weight_gradient_mlp_cuda. Probed on CPU with stand-in
probes, and the real probes checked against megatron-core's own availability flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from workers.trainer import kernels

REPO = Path(__file__).resolve().parents[2]
APEX = ("fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
        "apex.contrib.layer_norm.layer_norm:FastLayerNormFN")


def probe_with(present: set[str]):
    return lambda need: "ok" if need in present else f"ModuleNotFoundError: No module named {need!r}"


def te_needs() -> set[str]:
    return {n for ns in kernels.FUSION_KERNELS.values() for n in ns if n not in APEX}


def test_transformer_engine_without_apex_turns_off_exactly_the_apex_fusions():
    off = kernels.settings(is_cpu=False, probe=probe_with(te_needs()))
    assert off == {"gradient_accumulation_fusion": False, "masked_softmax_fusion": False, "persist_layer_norm": False}


def test_apex_without_transformer_engine_turns_off_the_te_fusions():
    off = kernels.settings(is_cpu=False, probe=probe_with(set(APEX)))
    assert off == {"apply_rope_fusion": False, "moe_permute_fusion": False, "moe_grouped_gemm": False}


def test_every_kernel_present_keeps_every_fusion_and_cpu_turns_all_off():
    assert kernels.settings(is_cpu=False, probe=probe_with(set(APEX) | te_needs())) == {}
    calls = []
    off = kernels.settings(is_cpu=True, probe=lambda n: calls.append(n) or "ok")
    assert set(off) == set(kernels.FUSION_KERNELS) | set(kernels.CPU_OFF) and not any(off.values())
    assert calls == []  # no kernel is imported on CPU


def test_importable_says_why_in_one_line():
    assert kernels.importable("json") == "ok"
    assert kernels.importable("json:dumps") == "ok"
    assert kernels.importable("json:no_such_thing") == "json.no_such_thing is None (the installed version lacks it)"
    assert kernels.importable("no_such_kernel_xyz").startswith("ModuleNotFoundError: No module named 'no_such_kernel_xyz'")


PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
cpu_shim.apply("cpu")
from megatron.core.tensor_parallel import layers
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe import moe_utils
from workers.trainer import kernels
print(json.dumps({
    "megatron_grad_accum": layers._grad_accum_fusion_available,
    "ours_grad_accum": kernels.importable("fused_weight_gradient_mlp_cuda") == "ok",
    "megatron_rope": rope_utils.fused_apply_rotary_pos_emb is not None,
    "ours_rope": kernels.importable(kernels.FUSION_KERNELS["apply_rope_fusion"][0]) == "ok",
    "megatron_permute": getattr(moe_utils, "fused_permute", None) is not None,
    "ours_permute": kernels.importable(kernels.FUSION_KERNELS["moe_permute_fusion"][0]) == "ok",
}))
"""


def test_our_probes_agree_with_megatrons_own_availability_flags():
    """What megatron-core itself concludes about this machine (it decides at import time)."""
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for what in ("grad_accum", "rope", "permute"):
        assert got[f"ours_{what}"] == got[f"megatron_{what}"], (what, got)
