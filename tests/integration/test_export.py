"""`python -m launcher.export` on real trainer checkpoints, proven by HF PEFT (CPU, float32).

GQA shapes with 1, 2 and 4 query groups (tiny_llama_mqa and tiny_llama_g4 have heads * head_dim !=
hidden), LoRA on every linear (fused QKV, gated fc1, proj, fc2); tiny_llama is trained and saved at
TP=2. The exported adapter loaded with `PeftModel.from_pretrained` must give the trainer's logprobs
(1e-5) and not the base model's. The upstream converter's contiguous QKV split is rebuilt from the
same checkpoint and must fail that comparison for GQA (it is only right for one query group).

Nemotron-H: `nemotron_h_checkpoint.py` writes a LoRA checkpoint with factors made by hand directly
with megatron-core dist_checkpointing, in the layout the trainer's `save_state` writes for a hybrid
stack (keys and shapes derived from Megatron-Bridge's NemotronH mapping registry and the base
checkpoint), so the expected adapter is known independently of the trainer (a trained Nemotron-H
adapter is exported and served in test_nemotron_h.py).
PEFT must attach every exported tensor to transformers' NemotronHForCausalLM, with the base
checkpoint's `backbone.` names and with `model.` names alike.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_runs import trained_run
from tests.helpers import hf_reference as hf
from tests.helpers.hf_reference import token_logprobs

pytestmark = pytest.mark.integration
ATOL = 1e-5
HERE = Path(__file__).resolve().parent

# (recipe, TP): query groups 1, 2, 4; tiny_llama saved by two TP ranks
SHAPES = [("tiny_llama_mqa", 1), ("tiny_llama", 2), ("tiny_llama_g4", 1)]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "lora-runs"  # shared with test_vllm_serve


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{r}-tp{tp}" for r, tp in SHAPES])
def exported(request, local_ray, tiny_model, runs_root, tmp_path_factory):
    """A trained run of the shape, and its checkpoint exported with the CLI's entry (in-process)."""
    from launcher import export

    recipe, tp = request.param
    run = trained_run(runs_root, tiny_model(recipe), recipe, tp)
    out = tmp_path_factory.mktemp(f"adapter-{recipe}-tp{tp}")
    report = export.export(run.checkpoint, out)
    return run, report


def peft_logprobs(model_dir, adapter_dir, ids):
    """Logprobs of ids under the base with the PEFT adapter attached, and under the base alone."""
    return token_logprobs(hf.load(model_dir, adapter_dir=adapter_dir), ids), token_logprobs(hf.load(model_dir), ids)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_adapter_files_and_report(exported):
    from safetensors import safe_open

    run, report = exported
    config = json.loads((report.out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 8, 16)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(run.model_dir.resolve())
    with safe_open(str(report.out / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    assert len(keys) == report.tensors == 2 * 7 * 2  # 2 layers x 7 HF modules x (A, B)
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in keys
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in keys
    # only LoRA bytes were read (8 factors x 2 layers, float32, plus DCP's torch.save framing of each
    # stored chunk, ~1.8 KB); reading the optimizer state (twice as large) would at least triple it
    spec = {"tiny_llama_mqa": (96, 192, 4, 1), "tiny_llama": (128, 256, 4, 2), "tiny_llama_g4": (160, 256, 8, 4)}
    hidden, ffn, heads, groups = spec[run.recipe]
    qkv, attn = (heads + 2 * groups) * 32, heads * 32
    per_layer = 8 * ((hidden + qkv) + (attn + hidden) + (hidden + 2 * ffn) + (ffn + hidden))
    lora_bytes = 2 * per_layer * 4
    assert lora_bytes < report.bytes_read < 2 * lora_bytes and report.bytes_read < report.checkpoint_bytes / 2
    assert len(report.skipped["optimizer state"]) == 16 and "not a LoRA tensor" not in report.skipped


def test_peft_logits_equal_trainer_and_differ_from_base(exported):
    run, report = exported
    lp, base_lp = peft_logprobs(run.model_dir, report.out, run.probe_ids)
    assert max_diff(lp, run.trainer_logprobs) <= ATOL, f"PEFT vs trainer {max_diff(lp, run.trainer_logprobs):.2e}"
    assert max_diff(base_lp, run.trainer_logprobs) > 1e-2  # the adapters changed the model


def test_contiguous_qkv_split_fails_for_gqa(exported, tmp_path):
    """The upstream bug, rebuilt from the same checkpoint: q | k | v as contiguous rows of fused B."""
    from safetensors.torch import load_file, save_file

    from workers.lora import checkpoint as lora_checkpoint
    from workers.lora.layout import ModelLayout

    run, report = exported
    layout = ModelLayout.from_hf_config(run.model_dir)
    state, _ = lora_checkpoint.load_lora(lora_checkpoint.scan(run.checkpoint / "trainer"))
    tensors = load_file(str(report.out / "adapter_model.safetensors"))
    q_rows = layout.num_attention_heads * layout.head_dim
    kv_rows = layout.num_query_groups * layout.head_dim
    for layer in range(2):
        fused = state[f"decoder.layers.{layer}.self_attention.linear_qkv.adapter.linear_out.weight"]
        for proj, rows in (("q", slice(0, q_rows)), ("k", slice(q_rows, q_rows + kv_rows)),
                           ("v", slice(q_rows + kv_rows, None))):
            tensors[f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj.lora_B.weight"] = fused[rows].clone()
    shutil.copy(report.out / "adapter_config.json", tmp_path / "adapter_config.json")
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    lp, _ = peft_logprobs(run.model_dir, tmp_path, run.probe_ids)
    if layout.num_query_groups == 1:  # MQA: the interleaved layout is the contiguous one
        assert max_diff(lp, run.trainer_logprobs) <= ATOL
    else:
        assert max_diff(lp, run.trainer_logprobs) > 1e-3, "a contiguous QKV split passed the logits check"


def test_cli_prints_counts_skips_and_serve_command(local_ray, tiny_model, runs_root, tmp_path):
    """The command itself, in its own process, on the TP=2 run: output lines and the same tensors."""
    from launcher import export

    run = trained_run(runs_root, tiny_model("tiny_llama"), "tiny_llama", 2)  # on disk already: not retrained
    report = export.export(run.checkpoint, tmp_path / "in-process")
    out = tmp_path / "adapter"
    proc = subprocess.run([sys.executable, "-m", "launcher.export", "--checkpoint", str(run.checkpoint),
                           "--out", str(out), "--name", "mine"], cwd=HERE.parents[1], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("wrote 28 tensors (14 HF modules from 8 Megatron LoRA modules; rank 8, alpha 16, ")
    assert lines[2] == "skipped 17 entries:"  # RNG states live in rng/*.safetensors, outside the DCP
    assert {line.split(":")[0].strip() for line in lines[3:5]} == {
        "16 optimizer state", "1 common state (scheduler, step, trainer info)"}
    assert lines[-1] == (f"  vllm serve {run.model_dir.resolve()} --enable-lora --lora-modules mine={out.resolve()} "
                         "--max-lora-rank 8")
    from safetensors.torch import load_file

    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(report.out / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- Nemotron-H


@pytest.fixture(scope="module")
def nemotron_h(tiny_model, tmp_path_factory):
    """A synthetic Nemotron-H LoRA run checkpoint and the per-HF-module factors it was made from."""
    from launcher.config import compose as config_mod
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.config.schema import Checkpointing

    from lora_runs import overrides

    model_dir = tiny_model("tiny_nemotron_h")
    root = tmp_path_factory.mktemp("nemotron-h")
    manager = CheckpointManager(root / "run" / "checkpoints", Checkpointing())
    tmp = manager.begin(3)
    proc = subprocess.run([sys.executable, str(HERE / "nemotron_h_checkpoint.py"), str(model_dir), str(tmp / "trainer"),
                           str(root / "factors.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = config_mod.compose(overrides(model_dir, "tiny_nemotron_h", 1, "nemotron-h"))
    checkpoint = manager.commit(tmp, 3, {"consumed_prompts": 24, "metrics": {}}, config_mod.to_yaml(raw))
    # the same base checkpoint with transformers-v5 / vLLM names (model.layers.N.mixer.*)
    renamed = root / "base-model-names"
    shutil.copytree(model_dir, renamed)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    save_file({("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in weights.items()},
              str(renamed / "model.safetensors"), metadata={"format": "pt"})
    return {"checkpoint": checkpoint.path, "model_dir": model_dir, "renamed": renamed,
            "factors": torch.load(root / "factors.pt")}


def peft_attach(model_dir, adapter_dir):
    """(PeftModel, PEFT's own load result of the adapter's tensors, base model's logits)."""
    import peft
    import transformers
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 40, 9, 120, 33, 7, 64]])
    with torch.no_grad():
        base_logits = base(ids).logits
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    result = set_peft_model_state_dict(model, load_peft_weights(str(adapter_dir)))  # the load PEFT just did
    return model, result, base_logits, ids


@pytest.mark.parametrize("base", ["backbone", "model"])
def test_nemotron_h_adapter_attaches_to_every_module(nemotron_h, base, tmp_path):
    import transformers
    from safetensors import safe_open

    from launcher import export

    base_dir = nemotron_h["model_dir"] if base == "backbone" else nemotron_h["renamed"]
    report = export.export(nemotron_h["checkpoint"], tmp_path / "adapter", base_model=base_dir)
    with safe_open(str(report.out / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    assert keys and all(k.startswith(f"base_model.model.{base}.layers.") for k in keys), keys[:3]
    assert not [k for k in keys if "self_attn" in k or "gate_proj" in k]  # mixer.*, relu2 MLP has no gate
    assert report.target_modules == ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    model, result, base_logits, ids = peft_attach(base_dir, report.out)
    assert result.unexpected_keys == []  # every exported tensor found its module
    assert [k for k in result.missing_keys if "lora_" in k] == []  # every LoRA module PEFT made got its tensors
    params = dict(model.named_parameters())
    factors = nemotron_h["factors"]  # {"model.layers.N.mixer.x_proj": (A, B)} as generated
    assert len(factors) == report.hf_modules == len(keys) // 2
    for module, (a, b) in factors.items():
        assert torch.equal(params[f"base_model.model.{module}.lora_A.default.weight"], a), module
        assert torch.equal(params[f"base_model.model.{module}.lora_B.default.weight"], b), module

    # logits: PEFT == the base with W + (alpha / r) B A merged by hand (independent of PEFT's forward)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        weights = dict(merged.named_parameters())
        for module, (a, b) in factors.items():
            weights[f"{module}.weight"].add_((16 / 8) * (b @ a))
        want = merged(ids).logits
        got = model(ids).logits
    assert max_diff(got, want) <= ATOL
    assert max_diff(got, base_logits) > 1e-2


@pytest.mark.filterwarnings("ignore:Found missing adapter keys")
def test_upstream_nemotron_h_names_attach_nothing(nemotron_h, tmp_path):
    """The check above can fail: upstream's `model.layers.N.self_attn.*` names find no module."""
    from safetensors.torch import load_file, save_file

    from launcher import export

    report = export.export(nemotron_h["checkpoint"], tmp_path / "adapter", base_model=nemotron_h["renamed"])
    tensors = load_file(str(report.out / "adapter_model.safetensors"))
    wrong = tmp_path / "upstream"
    wrong.mkdir()
    save_file({k.replace(".mixer.", ".self_attn."): v for k, v in tensors.items()}, str(wrong / "adapter_model.safetensors"))
    shutil.copy(report.out / "adapter_config.json", wrong / "adapter_config.json")
    _, result, _, _ = peft_attach(nemotron_h["renamed"], wrong)
    assert len(result.unexpected_keys) == len(tensors)
