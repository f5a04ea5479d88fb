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
import importlib.util
out = {"te_installed": importlib.util.find_spec("transformer_engine") is not None}
out["cuda_applied"] = cpu_shim.apply("cuda")
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
import megatron.core.transformer.moe.token_dispatcher as td
out["splits_as_numpy"] = type(td.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__
out["splits_kept"] = type(td.maybe_move_tensor_to_cpu(torch.tensor([1, 2]))).__name__
stream = td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
stream.record_event().synchronize()
with torch.cuda.stream(stream):
    pass
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm
norms = {}
for sp in (False, True):
    c = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                          tensor_model_parallel_size=2 if sp else 1, sequence_parallel=sp)
    norm = WrappedTorchNorm(c, 8)
    norms[str(sp)] = [type(norm).__name__, getattr(norm.weight, "sequence_parallel", None), c.sequence_parallel]
out["norms"] = norms
import megatron.core.models.hybrid.hybrid_block as hybrid_block
out["hybrid_final_norm"] = hybrid_block.TENorm.__name__
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
out["linear_tp_size"] = isinstance(ColumnParallelLinear.tp_size, property)
import megatron.core.tensor_parallel.random as mrandom
out["cuda_rng_state"] = list(mrandom._get_all_rng_states()[1].shape)  # asserts "no CUDA" unpatched
out["checkpoint_fp8"] = [mrandom.CheckpointWithoutOutput().fp8, mrandom.CheckpointWithoutOutput(fp8=True).fp8]
print(json.dumps(out))
"""


def test_cpu_shim_patches_only_what_it_says():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # on cuda: the Python 3.11 alias, and without Transformer Engine its import stub for the bridge's LoRA
    assert set(out["cuda_applied"]) <= {"typing_override", "te_stub", "bridge_no_te", "no_fp8_checkpoint"} | (
        set() if out["triton_installed"] else {"import_stubs"})  # a triton stub only where triton is missing
    if not out["te_installed"]:
        assert {"te_stub", "bridge_no_te", "no_fp8_checkpoint"} <= set(out["cuda_applied"])
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
    assert {"moe_dispatcher", "torch_norm_sp"} <= set(out["cpu_applied"])
    assert (out["splits_as_numpy"], out["splits_kept"]) == ("ndarray", "Tensor")  # gloo's all_to_all wants lists
    # sequence parallel: the torch norm builds, tags its weights for the TP grad all-reduce, keeps the config
    assert out["norms"] == {"False": ["RMSNorm", None, False], "True": ["RMSNorm", True, True]}
    # the hybrid stack's final norm, and TE's tp_size on megatron's linears
    assert {"mamba_ssm", "hybrid_final_norm", "linear_tp_size", "no_jit_fuser"} <= set(out["cpu_applied"])
    assert out["hybrid_final_norm"] == "WrappedTorchNorm" and out["linear_tp_size"]
    # activation recompute: no CUDA RNG state to keep; the output-discarding checkpoint is not fp8 without TE
    assert "recompute_rng" in out["cpu_applied"] and out["cuda_rng_state"] == [0]
    assert out["checkpoint_fp8"] == [False, True]


MAMBA_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from workers import cpu_shim
cpu_shim.apply("cpu")  # as the trainer does: before anything imports megatron's Mamba mixer
import megatron.core.ssm.mamba_mixer as mixer
out = {"mixer": [mixer.HAVE_MAMBA_SSM, mixer.RMSNormGated.__module__, mixer.mamba_chunk_scan_combined.__module__,
                 mixer.mamba_split_conv1d_scan_combined.__module__]}
try:
    import mamba_ssm  # noqa: F401  (not a megatron module: must still fail)
    out["outside_megatron"] = "importable"
except ImportError:
    out["outside_megatron"] = "ImportError"
from transformers.models.nemotron_h import modeling_nemotron_h as hf
out["transformers_scan"] = hf.mamba2_chunk_scan.__module__
from megatron.core.activations import squared_relu  # Nemotron-H's activation: a plain function, not compiled
out["squared_relu_compiled"] = hasattr(squared_relu, "_torchdynamo_orig_callable")
print(json.dumps(out))
"""


def test_megatrons_mamba_mixer_gets_the_stand_in_and_nobody_else_does():
    proc = subprocess.run([sys.executable, "-c", MAMBA_PROBE, str(REPO)], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mixer"] == [True] + ["workers.cpu_shim.mamba"] * 3
    assert out["outside_megatron"] == "ImportError"
    assert out["transformers_scan"].startswith("transformers.")  # its own torch path, not our stand-in
    assert out["squared_relu_compiled"] is False  # megatron's jit_fuser (torch.compile) is off on CPU
