"""LoRA layout: Megatron fused LoRA factors <-> HF modules, checked against independent layouts.

The expected QKV layout is written out here by hand ([groups, heads_per_group + 2, head_dim, r]),
so a wrong use of the Bridge helpers (or a contiguous q|k|v split, the upstream bug) fails.
"""

from __future__ import annotations

import pytest
import torch

from workers.lora import layout as lora_layout, peft as lora_peft
from workers.lora.layout import ModelLayout
from tests.helpers.lora import fuse_lora_b
from tests.helpers.recipes import RECIPES


@pytest.fixture(scope="module", autouse=True)
def megatron_importable():
    """Tests below import Megatron-Bridge helpers directly; on CPU that needs the shim first."""
    from workers import cpu_shim

    cpu_shim.apply("cpu")


# query groups 1, 2, 4; two of them with heads * head_dim != hidden_size
LAYOUTS = {
    "mqa_g1": ModelLayout("llama", num_attention_heads=4, num_query_groups=1, head_dim=32, hidden_size=96),
    "gqa_g2": ModelLayout("llama", num_attention_heads=4, num_query_groups=2, head_dim=32, hidden_size=128),
    "gqa_g4": ModelLayout("llama", num_attention_heads=8, num_query_groups=4, head_dim=32, hidden_size=160),
    "nemotron_h": ModelLayout("nemotron_h", num_attention_heads=4, num_query_groups=2, head_dim=48, hidden_size=128),
}


def reference_qkv_split(layout: ModelLayout, fused: torch.Tensor):
    """Per query group g: [heads_per_group q heads | k_g | v_g], head_dim rows each."""
    g, hpg, hd = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    x = fused.reshape(g, hpg + 2, hd, fused.shape[-1])
    q = x[:, :hpg].reshape(g * hpg * hd, -1)
    k = x[:, hpg].reshape(g * hd, -1)
    v = x[:, hpg + 1].reshape(g * hd, -1)
    return q, k, v


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_qkv_lora_b_split_matches_query_group_layout_and_round_trips(name):
    layout = LAYOUTS[name]
    r = 8
    qkv_rows = (layout.num_attention_heads + 2 * layout.num_query_groups) * layout.head_dim
    b = torch.randn(qkv_rows, r, generator=torch.Generator().manual_seed(0))
    mm = lora_layout.ModuleMap("decoder.layers.0.self_attention.linear_qkv", "qkv", ("q", "k", "v"))

    q, k, v = lora_layout.split_lora_b(layout, mm, b)
    for got, want in zip((q, k, v), reference_qkv_split(layout, b)):
        assert torch.equal(got, want)
    assert q.shape == (layout.num_attention_heads * layout.head_dim, r)
    assert k.shape == v.shape == (layout.num_query_groups * layout.head_dim, r)
    assert torch.equal(fuse_lora_b(layout, mm, (q, k, v)), b)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_split_b_times_shared_a_equals_bridge_split_of_the_fused_delta(name):
    """Splitting B then multiplying by the shared A gives the rows Bridge's base-weight split gives."""
    from megatron.bridge.models.conversion.param_mapping import split_qkv_weights

    layout = LAYOUTS[name]
    gen = torch.Generator().manual_seed(1)
    qkv_rows = (layout.num_attention_heads + 2 * layout.num_query_groups) * layout.head_dim
    b = torch.randn(qkv_rows, 4, generator=gen, dtype=torch.float64)
    a = torch.randn(4, layout.hidden_size, generator=gen, dtype=torch.float64)
    mm = lora_layout.ModuleMap("decoder.layers.0.self_attention.linear_qkv", "qkv", ("q", "k", "v"))
    expected = split_qkv_weights(layout.bridge_config(), b @ a)  # the Bridge's split of a fused weight
    for part, want in zip(lora_layout.split_lora_b(layout, mm, b), expected):
        torch.testing.assert_close(part @ a, want, rtol=0, atol=1e-12)


def test_gated_fc1_split_including_tp_interleaved_gathers():
    layout = LAYOUTS["gqa_g2"]
    mm = lora_layout.ModuleMap("decoder.layers.0.mlp.linear_fc1", "gated", ("gate", "up"))
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(256, 8, generator=gen), torch.randn(256, 8, generator=gen)
    fused = torch.cat([gate, up])
    got_gate, got_up = lora_layout.split_lora_b(layout, mm, fused)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    assert torch.equal(fuse_lora_b(layout, mm, (gate, up)), fused)
    # gathered from TP=2 shards: [gate_0; up_0; gate_1; up_1]
    interleaved = torch.cat([gate[:128], up[:128], gate[128:], up[128:]])
    got_gate, got_up = lora_layout.split_lora_b(layout, mm, interleaved, fc1_tp_shards=2)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)


@pytest.mark.parametrize("family, module, kind, hf", [
    ("llama", "decoder.layers.3.self_attention.linear_qkv", "qkv",
     ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj")),
    ("llama", "decoder.layers.3.self_attention.linear_proj", "single", ("model.layers.3.self_attn.o_proj",)),
    ("llama", "decoder.layers.0.mlp.linear_fc1", "gated", ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")),
    ("llama", "decoder.layers.0.mlp.linear_fc2", "single", ("model.layers.0.mlp.down_proj",)),
    ("qwen2", "decoder.layers.1.self_attention.linear_qkv", "qkv",
     ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj")),
    # Qwen3: q/k norm (not a LoRA target: the projections map as in Llama)
    ("qwen3", "decoder.layers.1.self_attention.linear_qkv", "qkv",
     ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj")),
    ("qwen3", "decoder.layers.1.mlp.linear_fc1", "gated", ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")),
    # Qwen3-MoE: attention as Qwen3; each local expert's fc1/fc2 (SequentialMLP, the CPU spec)
    ("qwen3_moe", "decoder.layers.0.self_attention.linear_proj", "single", ("model.layers.0.self_attn.o_proj",)),
    ("qwen3_moe", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1", "gated",
     ("model.layers.1.mlp.experts.3.gate_proj", "model.layers.1.mlp.experts.3.up_proj")),
    ("qwen3_moe", "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2", "single",
     ("model.layers.1.mlp.experts.2.down_proj",)),
    # Nemotron-H: transformers v5 / vLLM names (model.layers.N.mixer), not the remote-code `backbone.`
    ("nemotron_h", "decoder.layers.1.self_attention.linear_qkv", "qkv",
     ("model.layers.1.mixer.q_proj", "model.layers.1.mixer.k_proj", "model.layers.1.mixer.v_proj")),
    ("nemotron_h", "decoder.layers.1.self_attention.linear_proj", "single", ("model.layers.1.mixer.o_proj",)),
    ("nemotron_h", "decoder.layers.5.mlp.linear_fc1", "single", ("model.layers.5.mixer.up_proj",)),  # relu2: no gate
    ("nemotron_h", "decoder.layers.5.mlp.linear_fc2", "single", ("model.layers.5.mixer.down_proj",)),
    # Mamba: in_proj is one HF linear (rows z, x, B, C, dt); out_proj; an MoE layer's shared expert
    ("nemotron_h", "decoder.layers.0.mixer.in_proj", "single", ("model.layers.0.mixer.in_proj",)),
    ("nemotron_h", "decoder.layers.3.mixer.out_proj", "single", ("model.layers.3.mixer.out_proj",)),
    ("nemotron_h", "decoder.layers.2.mlp.shared_experts.linear_fc1", "single",
     ("model.layers.2.mixer.shared_experts.up_proj",)),
])
def test_module_map_from_bridge_registry(family, module, kind, hf):
    mm = lora_layout.module_map(family, module)
    assert (mm.kind, mm.hf_modules) == (kind, hf)


def test_nemotron_h_module_names_exist_in_transformers_model(tiny_model):
    """The HF names we produce for Nemotron-H are real module paths of transformers' model."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(tiny_model("tiny_nemotron_h"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    names = {n for n, _ in model.named_modules()}
    for module in ("decoder.layers.1.self_attention.linear_qkv", "decoder.layers.5.mlp.linear_fc1",
                   "decoder.layers.1.self_attention.linear_proj", "decoder.layers.5.mlp.linear_fc2",
                   "decoder.layers.0.mixer.in_proj", "decoder.layers.3.mixer.out_proj",
                   "decoder.layers.2.mlp.shared_experts.linear_fc1", "decoder.layers.2.mlp.shared_experts.linear_fc2"):
        for hf in lora_layout.module_map("nemotron_h", module).hf_modules:
            assert hf in names, hf


@pytest.mark.parametrize("recipe", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_qwen3_names_are_the_checkpoints_names(tiny_model, recipe):
    """Every HF module the layout names for Qwen3 / Qwen3-MoE is a weight of the saved checkpoint."""
    from safetensors import safe_open

    path = tiny_model(recipe)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = {k[: -len(".weight")] for k in f.keys()}
    layout = ModelLayout.from_hf_config(path)
    assert layout.family == RECIPES[recipe]["family"] and layout.head_dim == 32
    modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    modules += ([f"mlp.experts.local_experts.{e}.linear_fc{i}" for e in range(4) for i in (1, 2)]
                if recipe == "tiny_qwen3_moe" else ["mlp.linear_fc1", "mlp.linear_fc2"])
    for layer in range(2):
        for module in modules:
            for hf in lora_layout.module_map(layout.family, f"decoder.layers.{layer}.{module}").hf_modules:
                assert hf in saved, hf
    assert {"model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"} <= saved  # the q/k norm


def test_layout_from_hf_config_and_model_section(tiny_model):
    got = ModelLayout.from_hf_config(tiny_model("tiny_llama_g4"))
    spec = RECIPES["tiny_llama_g4"]
    assert got == ModelLayout("llama", spec["num_attention_heads"], spec["num_key_value_heads"],
                              spec["head_dim"], spec["hidden_size"])
    section = {"family": "llama", "num_attention_heads": 8, "num_query_groups": 4, "head_dim": 32,
               "hidden_size": 160, "num_layers": 2, "name": "x"}
    assert ModelLayout.from_model_section(section) == got


def test_hf_lora_groups_and_peft_names_from_adapter_state():
    layout = LAYOUTS["gqa_g2"]
    gen = torch.Generator().manual_seed(3)
    r, hidden, ffn = 4, 128, 256
    qkv_rows = (4 + 2 * 2) * 32
    state = {}
    for layer in (1, 0):  # out of order on purpose: the result is in canonical layer order
        p = f"decoder.layers.{layer}"
        state[f"{p}.self_attention.linear_qkv.adapter.linear_in.weight"] = torch.randn(r, hidden, generator=gen)
        state[f"{p}.self_attention.linear_qkv.adapter.linear_out.weight"] = torch.randn(qkv_rows, r, generator=gen)
        state[f"module.{p}.mlp.linear_fc1.adapter.linear_in.weight"] = torch.randn(r, hidden, generator=gen)
        state[f"module.{p}.mlp.linear_fc1.adapter.linear_out.weight"] = torch.randn(2 * ffn, r, generator=gen)
    groups = lora_layout.hf_lora_groups(layout, state)
    assert [g.megatron_module for g in groups] == [
        "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.self_attention.linear_qkv"]
    qkv0 = groups[1]
    assert qkv0.lora_a is state["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
    assert [b.shape[0] for b in qkv0.lora_b] == [128, 64, 64]
    peft = lora_peft.peft_state_dict(groups)
    assert len(peft) == 2 * (3 + 2) * 2
    assert peft["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (64, r)
    assert torch.equal(peft["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"],
                       state["module.decoder.layers.1.mlp.linear_fc1.adapter.linear_in.weight"])
    cfg = lora_peft.peft_adapter_config(groups, dim=r, alpha=8)
    assert cfg["target_modules"] == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (r, 8, "LORA")


def test_adapter_state_errors_are_named():
    with pytest.raises(ValueError, match="linear_out"):
        lora_layout.megatron_lora_modules({"decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": torch.zeros(2, 3)})
    with pytest.raises(NotImplementedError, match="not plain LoRA"):
        lora_layout.megatron_lora_modules({"decoder.layers.0.mlp.linear_fc2.adapter.weight_magnitude": torch.zeros(3)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha, dim", [(32, 12), (32, 16), (16, 16), (64, 16), (8, 16)])
def test_merge_is_bitwise_the_bridge_merge(dtype, alpha, dim):
    """alpha/dim = 32/12 is not a power of two, so any other order of operations changes bits; 2, 1
    and 4 take the one-pass path of the in-place merge, 0.5 does not (a power of two below 1 can
    round subnormal products). With out= (and a float32 scratch for bf16) nothing changes either,
    also when the buffers held other values before."""
    from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge

    gen = torch.Generator().manual_seed(4)
    base = torch.randn(96, 160, generator=gen).to(dtype)
    b = (0.3 * torch.randn(96, dim, generator=gen)).to(dtype)
    a = torch.randn(dim, 160, generator=gen).to(dtype)
    want = MegatronPeftBridge._merge_single_adapter_weight(None, base, alpha, dim, a, b)
    got = lora_layout.merge_lora_weight(base, b, a, alpha=alpha, dim=dim)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got, base)
    out, scratch = torch.full_like(base, 7.0), torch.full(base.shape, -3.0)
    into = lora_layout.merge_lora_weight(base, b, a, alpha=alpha, dim=dim, out=out,
                                         scratch=scratch if dtype != torch.float32 else None)
    assert into is out and torch.equal(out, want)
