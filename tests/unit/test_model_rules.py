"""Facts of a checkpoint the training stack does not honour are refused before submission, in one
line naming the config.json key (launcher.config.model_rules); the published shapes pass.

Each case is a published config.json (tests/helpers/published_models.py) with one key changed to a
value real checkpoints use and megatron-core would compute differently from vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launcher.__main__ import main
from tests.helpers import published_models as pm


def write(tmp_path: Path, config: dict, name: str = "ckpt") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def refusal(tmp_path, capsys, config: dict, *overrides: str) -> tuple[int, str]:
    d = write(tmp_path, config)
    rc = main([f"model.path={d}", f"run.root={tmp_path}/runs", "dry_run=true", *overrides])
    err = capsys.readouterr().err
    return rc, err.replace(f"{d}/config.json", "F")


@pytest.mark.parametrize("name", list(pm.PUBLISHED))
def test_the_published_shapes_are_valid(tmp_path, capsys, name):
    rc, err = refusal(tmp_path, capsys, pm.PUBLISHED[name]())
    assert (rc, err) == (0, "")


def _llama3(**rope) -> dict:
    cfg = pm.llama_3_2_1b()
    cfg["rope_scaling"] = {**cfg["rope_scaling"], **rope}
    return cfg


def _yarn(**rope) -> dict:
    cfg = pm.qwen3_30b_a3b()   # the YaRN its model card advises
    cfg["rope_scaling"] = {**cfg["rope_scaling"], **rope}
    return cfg


HONOURED = "(supported: plain RoPE, llama3, yarn: the types megatron-core is checked to compute as vLLM does)"
CASES = [
    (_yarn(rope_type="dynamic"), f"rope_scaling.rope_type 'dynamic' is not supported {HONOURED}"),
    ({**pm.llama_3_2_1b(), "rope_scaling": {"type": "linear", "factor": 2.0}},
     f"rope_scaling.rope_type 'linear' is not supported {HONOURED}"),
    (_llama3(original_max_position_embeddings=16384),
     "rope_scaling.original_max_position_embeddings 16384: megatron-core's llama3 rope scaling computes with "
     "original_max_position_embeddings 8192 only (low_freq_factor 1, high_freq_factor 4, "
     "original_max_position_embeddings 8192); training would use other frequencies than vLLM"),
    (_llama3(high_freq_factor=2.0),
     "rope_scaling.high_freq_factor 2: megatron-core's llama3 rope scaling computes with high_freq_factor 4 only "
     "(low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192); training would use other "
     "frequencies than vLLM"),
    (_yarn(attention_factor=1.2), "rope_scaling.attention_factor 1.2: megatron-core's YaRN derives it from factor, "
                                  "mscale and mscale_all_dim; remove it or set those"),
    ({**pm.qwen2_5_0_5b_instruct(), "use_sliding_window": True},
     "use_sliding_window true: Megatron-Bridge builds full attention for this family"),
    ({**pm.qwen3_30b_a3b(), "mlp_only_layers": [0]},
     "decoder_sparse_step 1, mlp_only_layers [0]: Megatron-Bridge's Qwen3-MoE makes every layer sparse "
     "(decoder_sparse_step 1, mlp_only_layers [] are supported)"),
    ({**pm.llama_3_2_1b(), "attention_bias": True},
     "attention_bias true: llama's attention then biases o_proj too, which Megatron-Bridge does not map (q/k/v "
     "biases are supported for qwen2)"),
    ({**pm.qwen3_0_6b(), "head_dim": 40},
     "head_dim 40: vLLM's CPU attention supports head sizes 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 "
     "only"),
]


@pytest.mark.parametrize("config,message", CASES, ids=[m.split(":")[0] for _, m in CASES])
def test_what_the_stack_cannot_honour_is_one_line(tmp_path, capsys, config, message):
    assert refusal(tmp_path, capsys, config) == (2, f"error: model.path: F: {message}\n")


HEAD_SIZE_PROBE = """
import json, sys, torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
out = {}
for hd in map(int, sys.argv[1:]):
    for block in (16, 128):
        isa = _get_attn_isa(torch.float32, block, hd)
        torch.manual_seed(hd)
        q, k, v = torch.randn(5, 4, hd), torch.randn(5, 2, hd), torch.randn(5, 2, hd)
        kc, vc = torch.zeros(2, 2, block, hd), torch.zeros(2, 2, block, hd)
        starts, lens = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
        try:
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(5), isa)
            meta = ops.cpu_attn_get_scheduler_metadata(1, 4, 2, hd, lens, torch.float32, starts, True, -1, isa, False)
            got = torch.empty_like(q)
            ops.cpu_attention_with_kv_cache(q, kc, vc, got, starts, lens, hd ** -0.5, True, None, -1,
                                            torch.zeros(1, 2, dtype=torch.int32), 0.0, meta, None)
        except RuntimeError as e:
            out[f"{hd}/{block}"] = str(e).splitlines()[0]
            continue
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True).transpose(0, 1)
        out[f"{hd}/{block}"] = float((got - want).abs().max())
print(json.dumps(out))
"""


def test_head_sizes_are_the_ones_vllm_cpus_kernel_runs():
    """Every head size the rule lets through runs in vLLM's CPU attention kernel (as SDPA computes it,
    at both of its ISAs' block sizes) and the ones next to them do not: the kernel, not the backend's
    get_supported_head_sizes, which omits 48 (the Nemotron-H recipes' head_dim, served by vLLM here)."""
    import ast
    import importlib.util
    import subprocess
    import sys

    from launcher.config.model_rules import VLLM_CPU_HEAD_SIZES

    src = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "v1/attention/backends/cpu_attn.py"
    fn = next(n for n in ast.walk(ast.parse(src.read_text()))
              if isinstance(n, ast.FunctionDef) and n.name == "get_supported_head_sizes")
    assert set(VLLM_CPU_HEAD_SIZES) - set(ast.literal_eval(fn.body[-1].value)) == {48}
    refused = (16, 24, 40, 56)
    p = subprocess.run([sys.executable, "-c", HEAD_SIZE_PROBE, *map(str, VLLM_CPU_HEAD_SIZES + refused)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    ran = json.loads(p.stdout.strip().splitlines()[-1])
    for hd in VLLM_CPU_HEAD_SIZES:
        for block in (16, 128):
            assert isinstance(ran[f"{hd}/{block}"], float) and ran[f"{hd}/{block}"] < 1e-5, (hd, block, ran)
    for hd in refused:
        assert ran[f"{hd}/16"].startswith(f"Unsupported CPU attention configuration: head_dim={hd}"), ran


def test_head_size_refusal_names_the_sizes():
    """On cpu, a head size vLLM's CPU kernel does not run is one line; on cuda any head_dim passes."""
    from launcher.config import model_facts, model_rules
    from launcher.config.schema import Model

    facts, _ = model_facts.read_hf({**pm.qwen3_0_6b(), "head_dim": 40}, "F")
    model = Model(**facts.as_section(), facts_from="F")
    assert [str(e) for e in model_rules.errors(model, "cpu")] == [
        "model.path: F: head_dim 40: vLLM's CPU attention supports head sizes 32, 48, 64, 80, 96, 112, 128, 160, "
        "192, 224, 256, 512 only"]
    assert model_rules.errors(model, "cuda") == []


def test_facts_not_from_a_file_are_named_by_their_key():
    """Facts a dry run takes from the model group (no config.json here): the error names model.<key>."""
    from launcher.config import model_rules
    from launcher.config.schema import Model

    model = Model(family="qwen3", head_dim=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert [str(e) for e in model_rules.errors(model, "cpu")] == [
        f"model.rope_scaling: rope_scaling.rope_type 'dynamic' is not supported {HONOURED}"]
