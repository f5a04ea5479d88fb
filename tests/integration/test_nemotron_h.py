"""Nemotron-H (the reference model's family) through every part of the trainer and the generator on CPU,
float32: the architecture as released (Nemotron 3 Super/Ultra), the tiny_nemotron3 recipe (MEM*E: Mamba-2,
LatentMoE with a shared expert and the router's expert bias, attention; MTP layers in the checkpoint).

LoRA on everything an HF PEFT adapter can hold (attention qkv/proj, Mamba in_proj, the shared expert),
B non-zero from the start. Checked against what we did not write: Megatron vs HF transformers (its own
torch Mamba path and latent MoE) on the trainer's merged export at TP1, TP2 (sequence parallel) and
EP2 within 1e-5; the checkpoint's MTP layers change neither the GRPO loss nor the adapter gradients
(the trainer builds none) and are never refitted; the same GRPO step at TP1 and TP2; a LoRA step moves
only adapter tensors and the router's expert bias stays (frozen, float32); a checkpoint at TP2 resumes
at TP1 with the same adapters, bitwise, and back, and at its own layout bitwise; every refit mode to
vLLM gives gen_kl_error < 1e-5, with a prompt longer than vLLM's Mamba block, and merged and
merged_delta give vLLM the same weights; the exported PEFT adapter attaches fully to transformers' model
whether the base names its stack backbone.layers (the Hub's files) or model.layers (transformers 5's),
reproduces the trainer and is served by `workers.generator.serve` with the exporter's hint; LoRA on a
Mamba out_proj (which PEFT refuses) trains and refits exactly at EP2 while its export is refused in one
line. Last, the other recipes at TP1 (tiny_nemotron_h: MLP layers and MoE without a latent width; the
dense one) with LoRA on the MLP, and in bfloat16 the expert bias stays float32 and as loaded; full
fine-tuning trains the latent projections alike at TP1 and TP2 (sequence parallel), and moves the
expert bias and checkpoints it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from launcher.config import model_facts

from tests.helpers import hf_reference as hf
from tests.helpers.batches import padded_batch, with_prev
from tests.helpers.hf_reference import assert_close, token_logprobs

pytestmark = pytest.mark.integration

ATOL = 1e-5
PEFT_TARGETS = ["linear_qkv", "linear_proj", "in_proj", "decoder.layers.*.mlp.shared_experts.linear_fc1",
                "decoder.layers.*.mlp.shared_experts.linear_fc2"]
MLP_TARGETS = ["decoder.layers.*.mlp.linear_fc1", "decoder.layers.*.mlp.linear_fc2"]   # the - layers
LORA = {"enabled": True, "target_modules": PEFT_TARGETS, "dim": 8, "alpha": 20, "dropout": 0.0,
        "dropout_position": "post", "lora_A_init_method": "xavier", "lora_B_init_method": "xavier",
        "lora_dtype": None, "freeze_moe_router": False}
WITH_OUT_PROJ = {**LORA, "target_modules": PEFT_TARGETS + ["out_proj"]}
OPTIM = {"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-2, "clip_grad": 1.0, "lr_decay_style": "constant"}
SLOT = {"resources": {"generation_slot": 1}, "num_cpus": 0.5}
LONG_PROMPT = 150  # vLLM's Mamba block is 128 tokens with prefix caching (cpu_shim turns it off for hybrids)
MOE_LAYERS = (1, 4)  # MEM*E


def make_group(model_dir, tp=1, ep=1, peft=LORA, dtype="float32"):
    from tests.helpers.trainer import probed_group

    return probed_group(model_dir, peft, OPTIM, tp=tp, ep=ep, dtype=dtype)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("tiny_nemotron3")


@pytest.fixture(scope="module")
def batch():
    """4 right-padded sequences of 40 tokens (more than 2 Mamba chunks of 16; even: TP2 splits them)."""
    return padded_batch(40, [(4, 40), (9, 30), (20, 37), (5, 12)])


@pytest.fixture(scope="module")
def groups(local_ray, model_dir, tmp_path_factory):
    tp1 = make_group(model_dir)
    tp2 = make_group(model_dir, tp=2)
    start = tmp_path_factory.mktemp("nemotron-h") / "start"
    tp1.save_state(start)
    tp2.load_state(start)  # the same adapters (LoRA's initialisation draws differ with the layout)
    out = {"tp1": tp1, "tp2": tp2, "start": start}
    yield out
    for g in out.values():
        if hasattr(g, "shutdown"):
            g.shutdown()


def test_megatron_matches_hf_at_tp1_and_tp2(groups, batch, model_dir, tmp_path):
    ids = batch["input_ids"]
    assert_close(groups["tp1"].logprobs(batch, adapters=False), token_logprobs(hf.load(model_dir), ids),
                 "TP1 base vs HF")
    for name in ("tp1", "tp2"):
        merged = dict(groups[name].export_merged())
        assert {"backbone.layers.0.mixer.in_proj.weight", "backbone.layers.1.mixer.gate.e_score_correction_bias",
                "backbone.layers.4.mixer.fc1_latent_proj.weight"} <= set(merged)
        assert not [n for n in merged if n.startswith("mtp.")]   # the trainer builds no MTP layers
        with_lora = groups[name].logprobs(batch)
        assert_close(with_lora, token_logprobs(hf.load(model_dir, merged, files_in=tmp_path / name), ids),
                     f"{name} vs HF on its merged export")
    # the adapters matter (B starts non-zero), so the comparison above could fail
    assert (groups["tp1"].logprobs(batch) - groups["tp1"].logprobs(batch, adapters=False)).abs().max() > 1e-2


def without_mtp(model_dir: Path, out: Path) -> Path:
    """model_dir without its MTP layers: the same weights, no mtp.* tensors, depth 0 in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(num_nextn_predict_layers=0)
    config.pop("mtp_hybrid_override_pattern")
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mtp_layers_change_neither_the_grpo_loss_nor_the_adapter_gradients(groups, batch, model_dir, tmp_path):
    """The checkpoint's MTP layers (num_nextn_predict_layers 1, mtp.* tensors): the trainer builds none, so
    a GRPO step on it is the step on the same model without them (megatron would add 0.3 x the MTP
    cross-entropy over every position, prompt and padding included, and its gradient would reach the
    adapters): the same loss, the same gradient of every adapter, bitwise."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert len([k for k in f.keys() if k.startswith("mtp.")]) == 48
    plain = make_group(without_mtp(model_dir, tmp_path / "no-mtp"))
    try:
        tp1 = groups["tp1"]
        assert not [n for n in tp1.call("parameters_snapshot")[0] if "mtp" in n]
        start = tp1.call("adapter_state")[0]
        assert all(torch.equal(start[n], t) for n, t in plain.call("adapter_state")[0].items())   # same adapters
        b = with_prev(tp1, batch)
        assert torch.equal(b["prev_logprobs"], plain.logprobs(batch))
        (with_mtp,), (without,) = tp1.call("gradients", b), plain.call("gradients", b)
        assert sorted(with_mtp) == sorted(without) and all(".adapter." in n for n in with_mtp)
        assert all(torch.equal(with_mtp[n], without[n]) for n in with_mtp)
        assert max(g.abs().max().item() for g in with_mtp.values()) > 1e-3   # the loss has a gradient
        m1, m2 = tp1.train(b), plain.train(b)
        assert (m1["loss"], m1["grad_norm"]) == (m2["loss"], m2["grad_norm"]) and m1["grad_norm"] > 0
        assert all(torch.equal(tp1.call("adapter_state")[0][n], t) for n, t in plain.call("adapter_state")[0].items())
    finally:
        plain.shutdown()
    groups["tp1"].load_state(groups["start"])   # as the tests below expect it


def test_a_lora_step_moves_only_adapters_and_not_the_expert_bias(groups, batch):
    """The same GRPO step at TP1 and TP2 (every adapter's gradient, gathered over TP); only LoRA tensors
    change; the router's expert bias, which megatron updates every step unless frozen (Nemotron-H's bridge
    enables it), stays as loaded, float32."""
    tp1, tp2 = groups["tp1"], groups["tp2"]
    params = tp1.call("parameters_snapshot")[0]
    biases = tp1.call("expert_biases")[0]
    assert list(biases) == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in MOE_LAYERS]
    assert all(b.abs().max() > 0 for b in biases.values())  # the recipe's bias is not zero
    g1, g2 = tp1.call("gradients", with_prev(tp1, batch))[0], tp2.call("gradients", with_prev(tp2, batch))[0]
    top = max(g.abs().max().item() for g in g1.values())
    assert sorted(g1) == sorted(g2) and max((g1[n] - g2[n]).abs().max().item() for n in g1) < 1e-5 * top
    for _ in range(2):
        m1, m2 = tp1.train(with_prev(tp1, batch)), tp2.train(with_prev(tp2, batch))
        assert m1["loss"] == pytest.approx(m2["loss"], abs=ATOL) and \
            m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    # Adam divides each gradient element by its own running magnitude: the few elements whose gradient
    # is ~1e-7 take steps that differ by lr x their relative float noise (measured: logprobs 1.1e-5 apart
    # after one step, 1.7e-5 after two; the gradients above agree to 1e-6 of the largest)
    assert_close(tp1.logprobs(batch), tp2.logprobs(batch), "TP1 vs TP2 after two Adam steps", atol=1e-4)
    now = tp1.call("parameters_snapshot")[0]
    moved = sorted(n for n in now if not torch.equal(now[n], params[n]))
    assert moved and all(".adapter." in n for n in moved), moved
    assert any("mixer.in_proj.adapter" in n for n in moved) and any("shared_experts" in n for n in moved)
    for rank_biases in tp1.call("expert_biases") + tp2.call("expert_biases"):
        for name, bias in rank_biases.items():
            assert bias.dtype == torch.float32 and torch.equal(bias, biases[name]), name


def test_checkpoint_at_tp2_resumes_at_tp1_and_back(groups, batch, tmp_path):
    tp1, tp2 = groups["tp1"], groups["tp2"]
    tp2.train(with_prev(tp2, batch))
    tp2.save_state(tmp_path / "tp2")
    saved = tp2.call("adapter_state")[0]   # whole (TP-gathered) adapters
    info = tp1.load_state(tmp_path / "tp2")
    assert info["saved_layout"]["tensor_parallel"] == 2 and not info["rng_restored"]
    resumed = tp1.call("adapter_state")[0]
    assert sorted(resumed) == sorted(saved) and all(torch.equal(resumed[n], saved[n]) for n in saved)   # bitwise
    assert_close(tp1.logprobs(batch), tp2.logprobs(batch), "TP1 resumed from TP2")
    tp1.train(with_prev(tp1, batch))
    tp1.save_state(tmp_path / "tp1")
    saved = tp1.call("adapter_state")[0]
    assert tp2.load_state(tmp_path / "tp1")["saved_layout"]["tensor_parallel"] == 1
    resumed = tp2.call("adapter_state")[0]
    assert sorted(resumed) == sorted(saved) and all(torch.equal(resumed[n], saved[n]) for n in saved)   # bitwise
    assert_close(tp2.logprobs(batch), tp1.logprobs(batch), "TP2 resumed from TP1")


def test_resume_at_the_same_layout_is_bitwise(groups, batch, tmp_path):
    tp2 = groups["tp2"]
    tp2.save_state(tmp_path / "here")
    b = with_prev(tp2, batch)
    first = tp2.train(b)
    params = tp2.call("parameters_snapshot")
    assert tp2.load_state(tmp_path / "here")["rng_restored"]
    again = tp2.train(b)
    assert (first["loss"], first["grad_norm"]) == (again["loss"], again["grad_norm"])
    for before, now in zip(params, tp2.call("parameters_snapshot")):
        assert all(torch.equal(before[n], now[n]) for n in before)


# ---------------------------------------------------------------------------- refit to vLLM


@pytest.fixture(scope="module")
def engines(local_ray, model_dir):
    from workers.generator.actor import GeneratorConfig
    from workers.generator.group import GeneratorGroup

    plain = GeneratorGroup(GeneratorConfig(model=str(model_dir), kv_cache_memory_bytes=32 * 2**20), [SLOT],
                           ready_timeout_s=300)
    lora = GeneratorGroup(GeneratorConfig(model=str(model_dir), kv_cache_memory_bytes=32 * 2**20, enable_lora=True,
                                          max_lora_rank=8), [SLOT], ready_timeout_s=300)
    yield {"merged": plain, "merged_delta": plain, "adapter": lora}
    plain.shutdown()
    lora.shutdown()


def prompts(seed):
    """4 prompts, one longer than vLLM's Mamba block."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (n,), generator=g).tolist() for n in (3, 9, LONG_PROMPT, 17)]


def sequences_batch(gens, prompt_ids) -> dict:
    rows = [list(p) + g.token_ids for p, g in zip(prompt_ids, gens)]
    width = max(map(len, rows))
    width += width % 2  # TP2 + sequence parallel splits the sequence
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.int64), "loss_mask": torch.zeros(len(rows), width),
             "generation_logprobs": torch.zeros(len(rows), width), "advantages": torch.linspace(-1, 1, len(rows))}
    for i, (p, g) in enumerate(zip(prompt_ids, gens)):
        batch["input_ids"][i, :len(rows[i])] = torch.tensor(rows[i])
        batch["loss_mask"][i, len(p):len(rows[i])] = 1
        batch["generation_logprobs"][i, len(p):len(rows[i])] = torch.tensor(g.logprobs)
    return batch


def refit_and_check(group, engine, mode, seed):
    """Refit `engine` from `group` in `mode`, sample, and check vLLM's logprobs against the trainer's."""
    from launcher.driver.agreement import agreement_metrics

    engine.apply_refit(group.refit_payload(mode, 0.05))
    ps = prompts(seed)
    gens = engine.generate(ps, temperature=1.0, max_tokens=8, seeds=[1, 2, 3, 4])
    sampled = sequences_batch(gens, ps)
    trained = group.logprobs(sampled)
    metrics = agreement_metrics(sampled["generation_logprobs"], trained, sampled["loss_mask"])
    assert metrics["gen_kl_error"] < 1e-5, (mode, metrics)
    on = sampled["loss_mask"].bool()
    moved = (trained - group.logprobs(sampled, adapters=False))[on].abs().max().item()
    off = (sampled["generation_logprobs"] - trained)[on].abs().max().item()
    assert moved > 1e-3 and off < moved / 100, (mode, moved, off)  # the refit is what made them agree
    return gens


@pytest.mark.parametrize("mode", ["merged", "merged_delta", "adapter"])
def test_every_refit_mode_is_exact(mode, groups, engines, batch):
    tp2 = groups["tp2"]
    tp2.train(with_prev(tp2, batch))  # the adapters move between refits
    refit_and_check(tp2, engines[mode], mode, seed=len(mode))


def test_merged_and_merged_delta_give_vllm_the_same_model(groups, engines):
    """merged sends every weight (the expert bias too), merged_delta only LoRA factors: the same
    samples, bitwise, only if the trainer's base - expert bias included - never moved."""
    tp1, engine = groups["tp1"], engines["merged"]
    outs = [refit_and_check(tp1, engine, mode, seed=5) for mode in ("merged", "merged_delta")]
    assert [(g.token_ids, g.logprobs) for g in outs[0]] == [(g.token_ids, g.logprobs) for g in outs[1]]


# ---------------------------------------------------------------------------- the adapter after training


@pytest.fixture(scope="module")
def exported(groups, model_dir, tmp_path_factory):
    from workers.lora.export import export_adapter

    d = tmp_path_factory.mktemp("nemotron-h-export")
    groups["tp2"].save_state(d / "ckpt")
    return export_adapter(d / "ckpt", d / "adapter", model_dir, facts=model_facts.read(model_dir)[0], dim=8,
                          alpha=20, peft_enabled=True, config_file=d / "config.yaml")


def test_exported_adapter_attaches_fully_to_either_stack_name_and_is_the_trainer(groups, exported, batch, model_dir,
                                                                                  tmp_path):
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    assert exported.target_modules == ["down_proj", "in_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    trainer = groups["tp2"].logprobs(batch)
    for base in (model_dir, stack_named_model_layers(model_dir, tmp_path / "model-layers")):
        model = hf.load(base, adapter_dir=exported.out)
        result = set_peft_model_state_dict(model, load_peft_weights(str(exported.out)))
        assert result.unexpected_keys == [] and [k for k in result.missing_keys if "lora_" in k] == []
        wrapped = sorted(n.split("base_model.model.")[1] for n, _ in model.named_modules() if n.endswith(".lora_A"))
        assert len(wrapped) == exported.hf_modules == 2 + 4 + 2 * 2  # in_proj x2, q/k/v/o, shared up/down x2
        assert_close(token_logprobs(model, batch["input_ids"]), trainer, f"PEFT adapter on {base.name} vs trainer")


def stack_named_model_layers(model_dir: Path, out: Path) -> Path:
    """model_dir's checkpoint with the names transformers 5 gives the stack in memory (model.layers.N,
    model.embeddings, model.norm_f) instead of the Hub files' backbone.*."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    renamed = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in weights.items()}
    assert any(k.startswith("model.layers.") for k in renamed) and not any(k.startswith("backbone.") for k in renamed)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_h"
    return out


def test_vllm_serve_with_the_exporters_hint_serves_the_adapter(exported, model_dir, tmp_path):
    from launcher.export import Report
    from tests.helpers.vllm_server import post, serve_args, vllm_server

    report = Report(**vars(exported), base=Path(model_dir).resolve(), name="nh-lora", rank=8, alpha=20)
    args = serve_args(report.serve_command())
    assert "--lora-target-modules" in args  # an MoE base: its experts stay unwrapped
    ids = torch.tensor(prompts(6)[2][:40])[None]
    base = token_logprobs(hf.load(model_dir), ids)[0, 1:]
    with_peft = token_logprobs(hf.load(model_dir, adapter_dir=exported.out), ids)[0, 1:]
    with vllm_server(args, tmp_path / "server.log") as (url, _, _):
        def served(model: str) -> torch.Tensor:
            r = post(f"{url}/v1/completions", {"model": model, "prompt": ids[0].tolist(), "max_tokens": 1,
                                               "temperature": 0.0, "prompt_logprobs": 0})
            rows = r["choices"][0]["prompt_logprobs"][1:]
            return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, ids[0, 1:].tolist())])

        with_adapter, without = served("nh-lora"), served(str(report.base))
    assert_close(with_adapter, with_peft, "vllm serve with the adapter vs PeftModel", atol=1e-4)
    assert_close(without, base, "vllm serve without it vs the base", atol=1e-4)
    assert (with_adapter - without).abs().max().item() > 1e-2


# ---------------------------------------------------------------------------- EP2, and LoRA on out_proj


def test_ep2_with_lora_on_out_proj_matches_hf_refits_exactly_and_refuses_to_export(groups, engines, batch,
                                                                                  model_dir, tmp_path):
    """out_proj: exact through the merged modes at EP2 (the experts split over two ranks); an HF
    PEFT adapter cannot hold it, so the exporter refuses the checkpoint in one line."""
    from workers.lora.export import ExportError, export_adapter

    groups.pop("tp2").shutdown()  # the trainer slots: TP1 (1) + EP2 (2)
    ep2 = make_group(model_dir, ep=2, peft=WITH_OUT_PROJ)
    try:
        assert [i["dp_size"] for i in ep2.infos] == [2, 2]
        ep2.train(with_prev(ep2, batch))
        merged = dict(ep2.export_merged())
        assert "backbone.layers.4.mixer.experts.15.down_proj.weight" in merged  # every expert, gathered over EP
        assert_close(ep2.logprobs(batch), token_logprobs(hf.load(model_dir, merged, files_in=tmp_path / "hf"),
                                                         batch["input_ids"]), "EP2 vs HF on its merged export")
        refit_and_check(ep2, engines["merged_delta"], "merged_delta", seed=9)
        ep2.save_state(tmp_path / "ckpt")
    finally:
        ep2.shutdown()
    with pytest.raises(ExportError) as e:
        export_adapter(tmp_path / "ckpt", tmp_path / "adapter", model_dir, facts=model_facts.read(model_dir)[0],
                       dim=8, alpha=20, peft_enabled=True, config_file=tmp_path / "config.yaml")
    assert str(e.value).startswith("the checkpoint has LoRA on mixer.out_proj (decoder.layers.0.mixer.out_proj and "
                                   "more), which an HF PEFT adapter cannot hold: PEFT refuses LoRA on a Mamba layer's "
                                   "out_proj") and "\n" not in str(e.value)
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("recipe", ["tiny_nemotron_h", "tiny_nemotron_h_dense"])
def test_the_other_recipes_match_hf(local_ray, tiny_model, batch, tmp_path, recipe):
    """M*EM*- (MLP layers, MoE without a latent width) and M*-M*- (no MoE), LoRA on the MLP layers too."""
    model_dir = tiny_model(recipe)
    group = make_group(model_dir, peft={**LORA, "target_modules": ["linear_qkv", "in_proj", *MLP_TARGETS]})
    try:
        merged = dict(group.export_merged())
        assert any("experts" in n for n in merged) == (recipe == "tiny_nemotron_h")
        assert not any("latent" in n for n in merged)
        assert_close(group.logprobs(batch), token_logprobs(hf.load(model_dir, merged, files_in=tmp_path),
                                                           batch["input_ids"]), f"{recipe} vs HF")
        assert (group.logprobs(batch) - group.logprobs(batch, adapters=False)).abs().max() > 1e-2
    finally:
        group.shutdown()


def test_in_bfloat16_the_expert_bias_stays_float32_and_as_loaded(local_ray, model_dir, batch):
    """bf16 wraps the model in Float16Module, which would round the router's float32 expert bias
    (vLLM keeps it float32): it stays float32, equal to the checkpoint's, through a LoRA step."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        saved = f.get_tensor("backbone.layers.1.mixer.gate.e_score_correction_bias")
    assert saved.dtype == torch.float32 and not torch.equal(saved, saved.bfloat16().float())  # bf16 would change it
    group = make_group(model_dir, dtype="bfloat16")
    try:
        group.train(with_prev(group, batch))
        bias = group.call("expert_biases")[0]["decoder.layers.1.mlp.router.expert_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, saved)
    finally:
        group.shutdown()


def test_full_fine_tuning_trains_the_latent_projections_alike_at_tp2_and_moves_the_expert_bias(local_ray, model_dir,
                                                                                                 batch, tmp_path):
    """Without LoRA the LatentMoE projections train: each TP rank holds the whole weight (the CPU stand-in,
    as Transformer Engine's duplicated linear) but under sequence parallelism sees only its tokens, so their
    gradient is summed over TP: the same at TP2 as at TP1. And without LoRA (and without
    peft.freeze_moe_router) megatron updates the expert bias every step, as in pretraining: then a
    checkpoint holds it, and a resume restores it."""
    full = {**LORA, "enabled": False, "target_modules": [], "dim": 0}
    group = make_group(model_dir, peft=full)
    try:
        tp2 = make_group(model_dir, tp=2, peft=full)
        try:
            g1 = group.call("gradients", with_prev(group, batch), only="latent_proj")[0]
            g2 = tp2.call("gradients", with_prev(tp2, batch), only="latent_proj")[0]
        finally:
            tp2.shutdown()
        assert sorted(g1) == sorted(g2) == [f"decoder.layers.{i}.mlp.fc{k}_latent_proj.weight"
                                            for i in MOE_LAYERS for k in (1, 2)]
        top = max(g.abs().max().item() for g in g1.values())
        assert top > 0 and max((g1[n] - g2[n]).abs().max().item() for n in g1) < 1e-5 * top   # not half of it
        before = group.call("expert_biases")[0]
        group.train(with_prev(group, batch))
        saved = group.call("expert_biases")[0]
        assert all(not torch.equal(saved[n], before[n]) for n in before)  # moved (megatron's rate: 1e-3 per step)
        group.save_state(tmp_path / "ckpt")
        group.train(with_prev(group, batch))
        group.load_state(tmp_path / "ckpt")
        restored = group.call("expert_biases")[0]
        assert all(torch.equal(restored[n], saved[n]) for n in saved)
    finally:
        group.shutdown()
