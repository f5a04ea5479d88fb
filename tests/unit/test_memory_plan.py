"""The memory plan (launcher.memory): per GPU, what a trainer rank and a vLLM worker hold, from the
model's size and the topology; a plan that cannot fit is refused in one line naming the key to
change. The reference recipe's defaults fit; the model numbers of a checkpoint on this machine
come from its safetensors headers and are checked against the HF model itself."""

from __future__ import annotations

import pytest

from launcher import memory, plan as plan_mod
from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.config.validate import validate


def plan_of(*overrides):
    cfg = typed(compose(list(overrides)))
    return cfg, memory.plan_memory(cfg, plan_mod.build(cfg.topology))


def line(lines, start):
    return next(x.gib for x in lines if x.what.startswith(start))


def test_the_reference_recipe_fits_with_its_defaults():
    cfg, m = plan_of("topology=ultra_6n4g")
    assert m.errors == [] and validate(cfg) == []
    # 561e9 parameters, 524e9 of them experts, bf16: (37e9 / TP 2 + 524e9 / EP 16) x 2 bytes per trainer rank
    assert line(m.trainer, "weights") == pytest.approx((37e9 / 2 + 524e9 / 16) * 2 / 2**30)
    assert line(m.engine, "weights") == pytest.approx(561e9 * 2 / 8 / 2**30)       # TP 8: every parameter
    assert line(m.engine_outside, "merged refit") == pytest.approx(524e9 / 40 * 2 / 2**30)  # one MoE layer
    assert m.budget_gib == pytest.approx(0.8 * 184)
    text = m.describe()
    assert text.startswith("memory per GPU (184 GiB, topology.gpu_memory_gib; model: model.size)")
    assert "left for activations" in text and "DOES NOT FIT" not in text


def test_vllm_at_the_old_default_share_is_refused_naming_the_key():
    cfg, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.6")
    assert [e.key for e in m.errors] == ["vllm.gpu_memory_utilization"]
    msg = str(m.errors[0])
    assert msg.startswith("vllm.gpu_memory_utilization: 0.6 x 184 GiB = 110.4 GiB cannot hold weights (TP 8) 130.6")
    assert msg.endswith("set it to at least 0.74 (at most 0.86: refit needs 25.4 GiB outside it)")
    assert [str(e) for e in validate(cfg)] == [msg]


def test_too_large_a_share_leaves_no_room_for_a_merged_refit():
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95")
    assert [str(e) for e in m.errors] == [
        "vllm.gpu_memory_utilization: 0.95 leaves 9.2 GiB outside vLLM's budget, refit needs 25.4 (refit buckets "
        "0.5 + merged refit: one module's weights held by vLLM's layerwise reload 24.4 + refit group 0.5): set it "
        "to at most 0.86"]
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95", "refit=adapter")
    assert m.errors == []  # an adapter refit loads no weights into vLLM


def test_a_gpu_too_small_for_the_engine_and_a_full_fine_tune_too_large_for_the_trainers():
    _, m = plan_of("topology=ultra_6n4g", "topology.gpu_memory_gib=80")  # an H100
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel", "topology.generation.tensor_parallel"]
    assert str(m.errors[1]).endswith("on a 80 GiB GPU (topology.gpu_memory_gib) at TP 8: raise "
                                     "topology.generation.tensor_parallel")
    _, m = plan_of("topology=ultra_6n4g", "peft=none", "refit=merged")  # every weight trains: grads + Adam
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel"]
    assert line(m.trainer, "grads") == pytest.approx((37e9 / 2 + 524e9 / 16) * 4 / 2**30)


def test_cpu_has_no_gpu_plan_and_an_unknown_size_is_said():
    cfg, m = plan_of()
    assert m.describe() == "memory: no GPU plan on cpu" and m.errors == []
    _, m = plan_of("topology=ultra_6n4g", "model.size.parameters=null")
    assert m.errors == [] and m.describe().startswith("memory: no plan: model.path /models/nvidia/nemotron-3-ultra "
                                                      "is not on this machine")


def test_the_cli_refuses_before_anything_is_written(tmp_path, capsys):
    rc = main(["topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.6", f"run.root={tmp_path}", "dry_run=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "vllm.gpu_memory_utilization: 0.6 x 184 GiB" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    assert main(["topology=ultra_6n4g", f"run.root={tmp_path}", "dry_run=true"]) == 0
    assert "vLLM worker: budget 147.2 GiB (vllm.gpu_memory_utilization)" in capsys.readouterr().out


def test_a_checkpoint_here_is_read_from_its_headers(tiny_model):
    """Parameter counts against the HF model itself (what this module did not compute)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("tiny_qwen3_moe")
    cfg = typed(compose([f"model.path={path}", "model=tiny_qwen3_moe"]))
    size = memory.model_size(cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    params = dict(hf.named_parameters())
    assert size.parameters == sum(p.numel() for p in params.values())
    experts = {n: p.numel() for n, p in params.items() if ".experts." in n}
    assert size.expert_parameters == sum(experts.values()) > 0
    per_layer = {}
    for n, k in experts.items():
        layer = n.split(".layers.")[1].split(".")[0]
        per_layer[layer] = per_layer.get(layer, 0) + k
    assert size.largest_module_parameters == max(max(per_layer.values()), hf.get_input_embeddings().weight.numel())
    assert (size.attention_layers, size.kv_heads, size.head_dim) == (2, 2, 32)
    assert size.source.endswith("(safetensors headers)")
