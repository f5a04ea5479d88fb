"""`python -m launcher.export` refusals: one exact line on stderr, exit code 2, no traceback.

Checkpoints here are small run checkpoints written with the launcher's CheckpointManager and a
plain torch.distributed.checkpoint (the format megatron's torch_dist writes; the GPT stack's keys,
a leading layer axis), so no Megatron model is needed. Real trainer checkpoints are exported in
tests/integration/test_export.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
R, HIDDEN, QKV = 8, 128, 256  # tiny_llama: 4 heads + 2 * 2 groups of 32
QKV_IN = "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
QKV_OUT = "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight"


def attention_lora(rank: int = R, layers: int = 2) -> dict:
    return {QKV_IN: torch.randn(layers, rank, HIDDEN), QKV_OUT: torch.randn(layers, QKV, rank),
            "decoder.layers.self_attention.linear_proj.adapter.linear_in.weight": torch.randn(layers, rank, 128),
            "decoder.layers.self_attention.linear_proj.adapter.linear_out.weight": torch.randn(layers, HIDDEN, rank)}


def with_optimizer(tensors: dict) -> dict:
    return {**tensors, **{f"optimizer.state.exp_avg.{k}": torch.zeros_like(v) for k, v in tensors.items()}}


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("tiny_llama")


@pytest.fixture
def make_checkpoint(base, tmp_path):
    """make_checkpoint(tensors, *config overrides) -> a complete RUN/checkpoints/step_1."""
    from launcher.config import compose as config_mod
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.config.schema import Checkpointing

    def make(tensors: dict, *overrides: str) -> Path:
        from tests.helpers.checkpoints import trainer_state

        raw = config_mod.compose([f"model.path={base}", "peft=lora_attention", f"peft.dim={R}", "peft.alpha=16",
                                  "run.name=err", *overrides])
        manager = CheckpointManager(tmp_path / "run" / "checkpoints", Checkpointing())
        tmp = manager.begin(1)
        trainer_state(tmp / "trainer", 1, dict(tensors))
        return manager.commit(tmp, 1, {"consumed_prompts": 0, "metrics": {}}, config_mod.to_yaml(raw)).path

    return make


def out_of(checkpoint) -> Path:
    """Where a test exports RUN/checkpoints/step_N: RUN/adapter (never inside a run's checkpoints)."""
    return Path(checkpoint).parents[1] / "adapter"


def run_export(capsys, checkpoint, *extra) -> tuple[int, str, str]:
    from launcher.export import main

    rc = main(["--checkpoint", str(checkpoint), "--out", str(out_of(checkpoint)), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_refused(result, line: str):
    rc, out, err = result
    assert (rc, out, err) == (2, "", f"error: {line}\n")


def test_missing_checkpoint(capsys, tmp_path):
    path = tmp_path / "run" / "checkpoints" / "step_9"
    assert_refused(run_export(capsys, path),
                   f"{path}: no such checkpoint directory (expected RUN/checkpoints/step_N)")


def test_incomplete_checkpoint(capsys, make_checkpoint):
    ckpt = make_checkpoint(attention_lora())
    (ckpt / "manifest.json").unlink()
    assert_refused(run_export(capsys, ckpt), f"{ckpt}: incomplete checkpoint (no manifest.json)")


def test_truncated_trainer_file(capsys, make_checkpoint):
    ckpt = make_checkpoint(attention_lora())
    data = next((ckpt / "trainer").glob("*.distcp"))
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:100])
    assert_refused(run_export(capsys, ckpt), f"{data}: 100 bytes, the manifest says {size} (truncated?)")


def test_checkpoint_without_adapters(capsys, make_checkpoint):
    full = {"decoder.layers.self_attention.linear_qkv.weight": torch.randn(2, QKV, HIDDEN)}
    ckpt = make_checkpoint(with_optimizer(full), "peft=none")
    assert_refused(run_export(capsys, ckpt),
                   f"{ckpt}/trainer: no LoRA adapter tensors (*.adapter.linear_in/linear_out) in the checkpoint "
                   "(the run had peft.enabled=false); nothing to export")


def test_rank_mismatch(capsys, make_checkpoint):
    ckpt = make_checkpoint(with_optimizer(attention_lora()), "peft.dim=16")
    assert_refused(run_export(capsys, ckpt),
                   f"rank mismatch: decoder.layers.0.self_attention.linear_proj has LoRA rank 8 but "
                   f"{ckpt}/config.yaml says peft.dim=16")


def test_factors_of_different_rank(capsys, make_checkpoint):
    tensors = attention_lora()
    tensors[QKV_OUT] = torch.randn(2, QKV, 4)
    ckpt = make_checkpoint(tensors)
    assert_refused(run_export(capsys, ckpt), "decoder.layers.0.self_attention.linear_qkv: rank of A (8, 128) != "
                                             "rank of B (256, 4)")


def test_unknown_module(capsys, make_checkpoint):
    tensors = {**attention_lora(), "decoder.layers.mixer.in_proj.adapter.linear_in.weight": torch.randn(2, R, HIDDEN),
               "decoder.layers.mixer.in_proj.adapter.linear_out.weight": torch.randn(2, 512, R)}
    ckpt = make_checkpoint(tensors)
    assert_refused(run_export(capsys, ckpt), "unknown module decoder.layers.0.mixer.in_proj: Megatron-Bridge's llama "
                                             "mapping has no HF module for it")


def test_not_plain_lora(capsys, make_checkpoint):
    magnitude = "decoder.layers.self_attention.linear_qkv.adapter.weight_magnitude"
    ckpt = make_checkpoint({**attention_lora(), magnitude: torch.ones(2, QKV)})
    assert_refused(run_export(capsys, ckpt), f"{magnitude}: not a plain LoRA factor (adapter.linear_in/linear_out); "
                                             "only LoRA adapters can be exported")


def test_module_missing_from_base_model(capsys, make_checkpoint, base):
    ckpt = make_checkpoint(attention_lora(layers=3))  # the base model has 2 layers
    assert_refused(run_export(capsys, ckpt),
                   f"decoder.layers.2.self_attention.linear_proj -> model.layers.2.self_attn.o_proj: the base "
                   f"checkpoint {base.resolve()} has no weight model.layers.2.self_attn.o_proj.weight")


def test_base_model_of_another_family(capsys, make_checkpoint, tiny_model):
    ckpt = make_checkpoint(attention_lora())
    qwen = tiny_model("tiny_qwen2")
    assert_refused(run_export(capsys, ckpt, "--base-model", str(qwen)),
                   f"{qwen.resolve()}/config.json is a qwen2 model but {ckpt}/config.yaml says model.family=llama "
                   "(wrong --base-model?)")


def test_base_model_of_another_shape(capsys, make_checkpoint, tiny_model):
    """The run's facts (config.yaml) give the layout; a base of the same family but another shape is refused."""
    ckpt = make_checkpoint(attention_lora())
    g4 = tiny_model("tiny_llama_g4")
    assert_refused(run_export(capsys, ckpt, "--base-model", str(g4)),
                   f"{g4.resolve()}/config.json is not shaped like the model {ckpt}/config.yaml trained: hidden_size "
                   f"128 -> 160; num_attention_heads 4 -> 8; num_query_groups 2 -> 4 (wrong --base-model?)")


def test_missing_base_model(capsys, make_checkpoint, tmp_path):
    ckpt = make_checkpoint(attention_lora())
    assert_refused(run_export(capsys, ckpt, "--base-model", str(tmp_path / "nowhere")),
                   f"{tmp_path / 'nowhere'}: no config.json, not an HF model directory (from --base-model); "
                   "pass --base-model PATH")


def test_cli_process_refuses_with_one_line_and_code_2(make_checkpoint):
    ckpt = make_checkpoint(with_optimizer(attention_lora()), "peft.dim=16")
    proc = subprocess.run([sys.executable, "-m", "launcher.export", "--checkpoint", str(ckpt), "--out",
                           str(out_of(ckpt))], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: rank mismatch: decoder.layers.0.self_attention.linear_proj has LoRA "
                                        f"rank 8 but {ckpt}/config.yaml says peft.dim=16"]
    assert not out_of(ckpt).exists()


def test_exporter_module_imports_no_torch():
    code = "import sys, launcher.export, launcher.__main__; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


# --------------------------------------------------------------------------- Nemotron-H (a hybrid stack: a key per layer)


def nemotron_h_checkpoint(make_checkpoint, tiny_model, tensors: dict) -> Path:
    """A checkpoint of a run on tiny_nemotron_h (its facts, resolved from its config.json, in config.yaml)."""
    return make_checkpoint(tensors, f"model.path={tiny_model('tiny_nemotron_h')}")


def test_lora_on_the_routed_experts_of_a_hybrid_stack(capsys, make_checkpoint, tiny_model):
    key = "decoder.layers.2.mlp.experts.experts.linear_fc1.adapter.linear_in.weight"  # a layer's experts, stacked
    ckpt = nemotron_h_checkpoint(make_checkpoint, tiny_model, {key: torch.randn(4, R, HIDDEN),
                                                   key.replace("linear_in", "linear_out"): torch.randn(4, 64, R)})
    assert_refused(run_export(capsys, ckpt, "--base-model", str(tiny_model("tiny_nemotron_h"))),
                   f"{key}: the checkpoint has LoRA on MoE experts, which the PEFT exporter does not write yet "
                   "(docs/moe.md); adapters on attention export (peft.target_modules=[linear_qkv, linear_proj])")


def test_lora_on_a_mamba_out_proj(capsys, make_checkpoint, tiny_model):
    prefix = "decoder.layers.3.mixer.out_proj.adapter"
    ckpt = nemotron_h_checkpoint(make_checkpoint, tiny_model, {f"{prefix}.linear_in.weight": torch.randn(R, 128),
                                                   f"{prefix}.linear_out.weight": torch.randn(HIDDEN, R)})
    assert_refused(run_export(capsys, ckpt, "--base-model", str(tiny_model("tiny_nemotron_h"))),
                   "the checkpoint has LoRA on mixer.out_proj (decoder.layers.3.mixer.out_proj), which an HF PEFT "
                   "adapter cannot hold: PEFT refuses LoRA on a Mamba layer's out_proj for nemotron_h "
                   "(peft.tuners.tuners_utils._check_lora_target_modules_mamba); the run "
                   f"({ckpt}/config.yaml) can only serve it through its merged refit modes")


def test_a_mamba_in_proj_b_stored_in_parts_is_joined_in_hf_row_order(capsys, make_checkpoint, tiny_model):
    """Megatron-Bridge checkpoints an in_proj LoRA-B as its z, x, B, C, dt parts (each TP-sharded on its
    own): the adapter's in_proj B is the parts in that order, HF's in_proj rows."""
    from safetensors.torch import load_file

    prefix = "decoder.layers.0.mixer.in_proj.adapter"
    sizes = {"z": 128, "x": 128, "B": 32, "C": 32, "dt": 8}  # tiny_nemotron_h: 8 heads x 16, 2 groups x 16
    parts = {name: torch.randn(rows, R) for name, rows in sizes.items()}
    a = torch.randn(R, HIDDEN)
    ckpt = nemotron_h_checkpoint(make_checkpoint, tiny_model, {f"{prefix}.linear_in.weight": a, **{
        f"{prefix}.linear_out.weight.{name}": t for name, t in reversed(list(parts.items()))}})
    rc, out, err = run_export(capsys, ckpt, "--base-model", str(tiny_model("tiny_nemotron_h")))
    assert (rc, err) == (0, ""), err
    tensors = load_file(str(out_of(ckpt) / "adapter_model.safetensors"))
    assert sorted(tensors) == ["base_model.model.backbone.layers.0.mixer.in_proj.lora_A.weight",
                               "base_model.model.backbone.layers.0.mixer.in_proj.lora_B.weight"]
    assert torch.equal(tensors["base_model.model.backbone.layers.0.mixer.in_proj.lora_B.weight"],
                       torch.cat(list(parts.values())))
    assert torch.equal(tensors["base_model.model.backbone.layers.0.mixer.in_proj.lora_A.weight"], a)


def test_a_hybrid_base_of_another_layer_pattern_or_mamba_shape_is_refused(capsys, make_checkpoint, tiny_model,
                                                                          tmp_path):
    """Nemotron-H's own shape facts (model_facts.shape_keys: the layer pattern, Mamba sizes) count as
    the common ones do: the same heads and widths with other layers or Mamba groups is another model."""
    from launcher.config.schema import BUILTIN_MODELS
    from workers import tiny_models

    other = tiny_models.build(tmp_path / "other", "tiny_nemotron_h", spec={
        **BUILTIN_MODELS["tiny_nemotron_h"], "hybrid_override_pattern": "M*EM-*", "n_groups": 4})
    ckpt = _nemotron_h_qkv_checkpoint(make_checkpoint, tiny_model)
    assert_refused(run_export(capsys, ckpt, "--base-model", str(other)),
                   f"{other.resolve()}/config.json is not shaped like the model {ckpt}/config.yaml trained: "
                   f"family_facts.hybrid_override_pattern 'M*EM*-' -> 'M*EM-*'; family_facts.n_groups 2 -> 4 "
                   f"(wrong --base-model?)")


def _nemotron_h_qkv_checkpoint(make_checkpoint, tiny_model):
    """A tiny_nemotron_h checkpoint whose adapter is LoRA on one attention layer's linear_qkv."""
    return nemotron_h_checkpoint(make_checkpoint, tiny_model, {
        "decoder.layers.1.self_attention.linear_qkv.adapter.linear_in.weight": torch.randn(R, HIDDEN),
        "decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight": torch.randn(4 * 48 + 2 * 2 * 48, R)})


def test_a_base_of_another_latent_width_is_refused_and_mtp_layers_do_not_matter(capsys, make_checkpoint, tiny_model,
                                                                               tmp_path):
    """LatentMoE's width decides the routed experts' shapes (a shape fact); the MTP layers are no shape an
    adapter holds: the same model without them is a fine base."""
    from launcher.config.schema import BUILTIN_MODELS
    from workers import tiny_models

    latent = tiny_models.build(tmp_path / "latent", "tiny_nemotron_h", spec={
        **BUILTIN_MODELS["tiny_nemotron_h"], "moe_latent_size": 32})
    mtp = tiny_models.build(tmp_path / "mtp", "tiny_nemotron_h", spec={
        **BUILTIN_MODELS["tiny_nemotron_h"], "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"})
    ckpt = _nemotron_h_qkv_checkpoint(make_checkpoint, tiny_model)
    assert_refused(run_export(capsys, ckpt, "--base-model", str(latent)),
                   f"{latent.resolve()}/config.json is not shaped like the model {ckpt}/config.yaml trained: "
                   f"family_facts.moe_latent_size 0 -> 32 (wrong --base-model?)")
    rc, out, err = run_export(capsys, ckpt, "--base-model", str(mtp))
    assert rc == 0, err


# ------------------------------------------------------------------------------ round three (docs/security.md)
def _forged(ckpt: Path, edit) -> Path:
    """`edit` on a checkpoint, its manifest rewritten to match (what anyone who can write it can do)."""
    from tests.helpers.checkpoints import rewrite_manifest

    edit(ckpt)
    rewrite_manifest(ckpt)
    return ckpt


def test_a_cut_trainer_file_with_a_matching_manifest(capsys, make_checkpoint):
    """A `.distcp` cut short and a manifest rewritten to match: named from the DCP metadata's byte
    ranges before any reader meets the end of the file (it was a CheckpointException traceback)."""
    ckpt = make_checkpoint(attention_lora())
    data = next((ckpt / "trainer").glob("*.distcp"))
    _forged(ckpt, lambda c: data.write_bytes(data.read_bytes()[:100]))
    rc, out, err = run_export(capsys, ckpt)
    assert (rc, out) == (2, "") and err.startswith(f"error: {data}: 100 bytes, but .metadata says its data runs to "
                                                   f"byte ") and err.count("\n") == 1, err


def test_a_config_of_nested_aliases_is_refused_at_once(capsys, make_checkpoint):
    """YAML aliases expand exponentially (9 levels of 9: 387 million nodes) and hung the exporter:
    the config is read without aliases (launcher.config.bounded)."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
    ckpt = make_checkpoint(attention_lora())
    _forged(ckpt, lambda c: (c / "config.yaml").write_text((c / "config.yaml").read_text() + "bomb:\n" + "".join(
        "  " + line + "\n" for line in bomb.splitlines())))
    rc, out, err = run_export(capsys, ckpt)
    assert (rc, out) == (2, "") and err.startswith(f"error: {ckpt}/config.yaml: an alias (*a) at line "), err


def test_a_forged_run_name_never_reaches_the_serve_line(capsys, make_checkpoint):
    """The adapter's default name comes from the checkpoint's run.name: it passes the run-name rule where
    the config is read, so `vllm serve ... --lora-modules NAME=DIR` pasted runs nothing else."""
    ckpt = make_checkpoint(attention_lora())
    _forged(ckpt, lambda c: (c / "config.yaml").write_text((c / "config.yaml").read_text().replace(
        "name: err", "name: 'x;touch /tmp/i34-pwned;#'", 1)))
    assert_refused(run_export(capsys, ckpt), f"{ckpt}/config.yaml: run.name: must be one path component of letters, "
                                             f"digits and . _ + - (starting with a letter or digit, at most 128 "
                                             f"characters); got 'x;touch /tmp/i34-pwned;#'")


@pytest.mark.parametrize("where", ["in-it", "deeper", "beside-it", "another-runs"])
def test_out_inside_a_checkpoint_is_refused(capsys, make_checkpoint, tmp_path, where):
    """`--out` inside the checkpoint it reads wrote files no manifest lists: the checkpoint could no
    longer be exported or resumed. Refused before anything is read, inside any run's checkpoints too."""
    ckpt = make_checkpoint(attention_lora())
    before = sorted(p.name for p in ckpt.iterdir())
    other = tmp_path / "other-run"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("run: {}\n")
    out, inside = {"in-it": (ckpt / "adapter", ckpt), "deeper": (ckpt / "trainer" / "a", ckpt),
                   "beside-it": (ckpt.parent / "adapter", ckpt.parent),
                   "another-runs": (other / "checkpoints" / "adapter", other / "checkpoints")}[where]
    from launcher.export import main

    rc = main(["--checkpoint", str(ckpt), "--out", str(out)])
    assert (rc, capsys.readouterr().err) == (2, f"error: --out {out}: inside {inside}, a run's checkpoints (they "
                                                f"hold only what the run writes: an export there makes them "
                                                f"unusable); give a directory outside it\n")
    assert sorted(p.name for p in ckpt.iterdir()) == before and not out.exists()
