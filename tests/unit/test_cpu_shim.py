"""workers.cpu_shim in a fresh interpreter: what it patches on cpu, and that cuda is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
out = {"cuda_applied": cpu_shim.apply("cuda")}
out["cuda_ctx_is_null"] = type(cpu_shim.cuda_factories_on_cpu("cuda")).__name__ == "nullcontext"
out["cpu_applied"] = cpu_shim.apply("cpu")
import torch
out["current_device"] = torch.cuda.current_device()
with cpu_shim.cuda_factories_on_cpu("cpu"):
    t = torch.zeros(2, device="cuda")
    out["factory_device"], out["type_inside"] = str(t.device), t.type()
out["type_outside"] = t.type()
import importlib.util
out["triton_installed"] = importlib.util.find_spec("triton") is not None
try:
    import triton  # noqa: F401  (not a megatron module: must still fail)
    out["triton_outside_megatron"] = "importable"
except ImportError:
    out["triton_outside_megatron"] = "ImportError"
import megatron.core.transformer.moe.ops.paged_stash as stash  # imports triton: gets the stub
out["stub_triton_in_megatron"] = stash.triton.__name__
import megatron.bridge.peft.lora_layers as lora_layers  # imports transformer_engine: gets the stub
import megatron.bridge.peft.utils as peft_utils
out["bridge_have_te"] = peft_utils.HAVE_TE
import megatron.core.transformer.utils as tu
out["causal_mask_device"] = str(tu.get_default_causal_mask(3).device)
print(json.dumps(out))
"""


def test_cpu_shim_patches_only_what_it_says():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["cuda_applied"]) <= {"typing_override"}  # on cuda: only the Python 3.11 alias
    assert out["cuda_ctx_is_null"]
    assert set(out["cpu_applied"]) >= {"current_device", "cuda_sync", "import_stubs", "causal_mask", "bridge_no_te"}
    assert out["current_device"] == "cpu"
    assert out["factory_device"] == "cpu" and out["type_inside"] == "torch.cuda.FloatTensor"
    assert out["type_outside"] == "torch.FloatTensor"
    if not out["triton_installed"]:  # the stub is for megatron's importers only
        assert out["triton_outside_megatron"] == "ImportError"
        assert out["stub_triton_in_megatron"] == "triton"
    assert out["bridge_have_te"] is False
    assert out["causal_mask_device"] == "cpu"
