"""Model facts from a checkpoint's config.json: what is read, what is refused (one line, exit code 2).

The config.json files are written the way transformers writes them (the keys real checkpoints
have: Qwen3-MoE's num_experts, Mixtral's num_local_experts, Nemotron-H's n_routed_experts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.__main__ import main
from launcher.config import model_facts
from launcher.config.schema import ConfigError
from tests.helpers import published_models

REPO = Path(__file__).resolve().parents[2]

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "vocab_size": 151936,
             "torch_dtype": "bfloat16"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 2688,
              "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
              "n_routed_experts": 128, "num_experts_per_tok": 6, "mamba_num_heads": 64, "mamba_head_dim": 64,
              "n_groups": 8, "ssm_state_size": 128,
              "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"}


def checkpoint(tmp_path: Path, config, name: str = "ckpt") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def test_qwen3_moe_facts(tmp_path):
    facts, archs = model_facts.read(checkpoint(tmp_path, QWEN3_MOE))
    assert archs == ["Qwen3MoeForCausalLM"]
    # absent keys take what transformers' Qwen3MoeConfig / Qwen3MoeAttention assume
    assert facts == model_facts.ModelFacts(
        family="qwen3_moe", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, head_dim=128,
        num_experts=128, moe_router_topk=8, ffn_hidden_size=0, moe_ffn_hidden_size=768, tie_word_embeddings=False,
        qkv_bias=False, qk_norm=True, rope_theta=10000.0, rope_scaling={}, max_position_embeddings=None,
        family_facts={"use_sliding_window": False, "rms_norm_eps": 1e-6, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "norm_topk_prob": False})


def test_dense_defaults_head_dim_and_groups(tmp_path):
    cfg = dict(LLAMA)
    del cfg["num_key_value_heads"]
    facts, _ = model_facts.read(checkpoint(tmp_path, cfg))
    assert (facts.head_dim, facts.num_query_groups, facts.num_experts, facts.moe_router_topk) == (128, 32, 0, 0)


def test_other_expert_key_names(tmp_path):
    facts, _ = model_facts.read(checkpoint(tmp_path, NEMOTRON_H))
    assert (facts.family, facts.num_experts, facts.moe_router_topk, facts.head_dim) == ("nemotron_h", 128, 6, 128)
    mixtral = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    facts, _ = model_facts.read(checkpoint(tmp_path, mixtral, "mixtral"))
    assert (facts.num_experts, facts.moe_router_topk) == (8, 2)


@pytest.mark.parametrize("config,message", [
    ("[1, 2]", "{f} must hold a JSON object, got list"),
    ('{"model_type": "llama",', "{f}: not valid JSON (Expecting property name enclosed in double quotes: "
                                "line 1 column 24 (char 23))"),
    ({**LLAMA, "num_hidden_layers": "32"}, "{f}: num_hidden_layers must be a positive integer, got '32'"),
    ({**LLAMA, "hidden_size": 0}, "{f}: hidden_size must be a positive integer, got 0"),
    ({**LLAMA, "num_attention_heads": True}, "{f}: num_attention_heads must be a positive integer, got True"),
    ({k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}, "{f}: num_hidden_layers is missing"),
    ({k: v for k, v in LLAMA.items() if k != "model_type"},
     "{f}: model_type is missing (a transformers config.json names its model_type)"),
    ({**LLAMA, "num_key_value_heads": 5}, "{f}: num_key_value_heads 5 must divide num_attention_heads 32"),
    ({**LLAMA, "hidden_size": 4100}, "{f}: has no head_dim and hidden_size 4100 is not a multiple of "
                                     "num_attention_heads 32"),
    ({**QWEN3_MOE, "num_experts_per_tok": 0}, "{f}: an MoE model needs num_experts_per_tok in [1, 128], got 0"),
    ({**QWEN3_MOE, "num_experts": "many"}, "{f}: num_experts must be an integer >= 0, got 'many'"),
    ({**LLAMA, "architectures": "LlamaForCausalLM"},
     "{f}: architectures must be a list of strings, got 'LlamaForCausalLM'"),
])
def test_bad_config_json_is_one_line(tmp_path, config, message):
    d = checkpoint(tmp_path, config)
    with pytest.raises(ConfigError) as e:
        model_facts.read(d)
    assert e.value.key == "model.path"
    assert e.value.message == message.format(f=d / "config.json")


def test_registry_read_from_the_bridge_sources():
    archs = model_facts.bridge_architectures()
    assert archs is not None, "Megatron-Bridge is installed in this venv"
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
            "NemotronHForCausalLM", "MistralForCausalLM", "DeepseekV3ForCausalLM"} <= archs
    assert "GPT2LMHeadModel" not in archs
    assert set(model_facts.supported_families()) >= {"llama", "qwen2", "qwen3", "qwen3_moe", "nemotron_h"}


def test_the_registry_agrees_with_megatron_bridges_own_dispatch_table():
    """The static reading sees every architecture the real registry holds (run in a fresh process)."""
    probe = ("import sys, json; sys.path.insert(0, sys.argv[1]); from workers import cpu_shim; cpu_shim.apply('cpu');"
             "from megatron.bridge import AutoBridge; print(json.dumps(AutoBridge.list_supported_models()))")
    p = subprocess.run([sys.executable, "-c", probe, str(REPO)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    real = set(json.loads(p.stdout.strip().splitlines()[-1]))
    assert real - model_facts.bridge_architectures() == set()


def test_reading_stays_torch_free(tmp_path):
    d = checkpoint(tmp_path, QWEN3_MOE)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from launcher.config import model_facts as m;"
             "m.check_supported(*m.read(sys.argv[2]), 'x'); print(m.supported_families());"
             "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'megatron', 'transformers')))")
    p = subprocess.run([sys.executable, "-c", probe, str(REPO), str(d)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_unsupported_architectures_name_the_supported_families(tmp_path):
    supported = ", ".join(model_facts.supported_families())
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "hidden_size": 768,
            "num_hidden_layers": 12, "num_attention_heads": 12}
    d = checkpoint(tmp_path, gpt2, "gpt2")
    with pytest.raises(ConfigError) as e:
        model_facts.check_supported(*model_facts.read(d), where="W")
    assert str(e.value) == (f"model.path: W is gpt2 (GPT2LMHeadModel): Megatron-Bridge has no bridge for it; "
                            f"supported families: {supported}")
    # the bridge maps DeepSeek-V3 (MLA attention), our LoRA layout does not
    ds = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
          "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
          "n_routed_experts": 256, "num_experts_per_tok": 8}
    d = checkpoint(tmp_path, ds, "ds")
    with pytest.raises(ConfigError) as e:
        model_facts.check_supported(*model_facts.read(d), where="W")
    assert str(e.value) == f"model.path: W is model_type 'deepseek_v3': no LoRA layout for it; supported families: " \
                           f"{supported}"


def test_cli_reads_the_checkpoint_numbers(tmp_path, capsys):
    """model.path alone: no architecture number restated; the dry run plans EP over its experts."""
    d = checkpoint(tmp_path, {**QWEN3_MOE, "num_hidden_layers": 4})
    rc = main([f"model.path={d}", "refit=merged_delta", f"run.root={tmp_path}/runs", "dry_run=true"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "note: model:" not in err  # the default model group states no number to contradict
    for line in ("  family: qwen3_moe\n", "  num_layers: 4\n", "  num_experts: 128\n", "  moe_router_topk: 8\n",
                 "  head_dim: 128\n", "  builtin: null\n", f"  facts_from: {d}/config.json\n",
                 "  name: local-ckpt\n"):  # the run is named after the checkpoint's directory
        assert line in out
    assert not (tmp_path / "runs").exists()


def test_a_conf_number_the_checkpoint_contradicts_is_a_note(tmp_path, capsys):
    d = checkpoint(tmp_path, {**QWEN3_MOE, "num_hidden_layers": 4})
    rc = main([f"model.path={d}", "model.family=llama", "model.num_layers=2", "model.hidden_size=2048",
               f"run.root={tmp_path}/runs", "dry_run=true"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err.splitlines()[0] == (f"note: model: {d}/config.json says family=qwen3_moe (conf: llama), num_layers=4 "
                                   f"(conf: 2); using the checkpoint's numbers")
    assert "  num_layers: 4\n" in out and "  family: qwen3_moe\n" in out


def test_cli_bad_config_json_is_one_line_and_writes_nothing(tmp_path, capsys):
    d = checkpoint(tmp_path, {**LLAMA, "num_attention_heads": "32"})
    rc = main([f"model.path={d}", f"run.root={tmp_path}/runs"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err == f"error: model.path: {d}/config.json: num_attention_heads must be a positive integer, got '32'\n"
    assert not (tmp_path / "runs").exists()


def test_cli_unknown_family_without_checkpoint(tmp_path, capsys):
    rc = main([f"model.path={tmp_path}/elsewhere", "model.family=gpt2", f"run.root={tmp_path}/runs", "dry_run=true"])
    assert rc == 2
    assert capsys.readouterr().err == (f"error: model.family: must be one of "
                                       f"{', '.join(model_facts.supported_families())}, got 'gpt2'\n")


# --------------------------------------------------------------------------- MoE rules


def moe_errors(*overrides: str) -> list[str]:
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.config.validate import validate

    return [str(e) for e in validate(typed(compose(["model=tiny_qwen3_moe", *overrides])))]


def test_tiny_moe_configs_are_valid():
    assert moe_errors("refit=merged_delta") == []
    assert moe_errors("refit=merged_delta", "topology.train.expert_parallel=2") == []


def test_every_refit_mode_is_valid_for_moe_on_cpu():
    """vLLM CPU's two MoE defects are patched in workers.cpu_shim (apply_vllm), so nothing is refused."""
    for mode in ("merged", "merged_delta", "adapter"):
        assert moe_errors(f"refit={mode}", "topology.train.expert_parallel=2") == []


def test_lora_on_experts_is_refused_where_it_is_not_exact():
    head = ("peft.target_modules: 'linear_fc1', 'linear_fc2' wrap the 4 experts of tiny_qwen3_moe: LoRA on experts "
            "is exact only with refit.mode=merged at topology.train.expert_parallel=1 (")
    tail = "); LoRA on attention (linear_qkv, linear_proj) works at every expert_parallel"
    assert moe_errors("peft=lora_all_linear", "topology.train.expert_parallel=2") == [
        head + "Megatron-Bridge 0.6.2's merged export merges one rank's expert adapter into every expert at "
               "expert_parallel > 1 (docs/moe.md)" + tail]
    assert moe_errors("peft=lora_all_linear", "refit=merged_delta") == [
        head + "refit.mode=merged_delta does not carry expert adapters yet" + tail]
    pattern = "peft.target_modules=[decoder.layers.*.mlp.experts.local_experts.*.linear_fc2]"
    errs = moe_errors(pattern, "topology.train.expert_parallel=2")
    assert len(errs) == 1 and "'decoder.layers.*.mlp.experts.local_experts.*.linear_fc2' wrap the 4 experts" in errs[0]


def test_expert_parallel_must_divide_the_experts():
    assert moe_errors("refit=merged_delta", "topology.train.expert_parallel=3", "topology.train.tensor_parallel=1",
                      "topology.train.ranks_per_node=3", "grpo.num_prompts_per_step=6") == [
        "topology.train.expert_parallel: must divide model.num_experts = 4, got 3"]


def test_nemotron_h_as_transformers_5_saves_it_counts_its_blocks(tmp_path):
    """transformers 5 writes Nemotron-H's layers as `layers_block_type` (no num_hidden_layers)."""
    saved = {k: v for k, v in NEMOTRON_H.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
    saved["layers_block_type"] = ["mamba", "moe", "attention", "mamba", "moe"]
    facts, _ = model_facts.read(checkpoint(tmp_path, saved))
    assert facts.num_layers == 5 and facts.family == "nemotron_h" and facts.num_experts == 128


# --------------------------------------------------------------------------- published shapes, one resolution


@pytest.mark.parametrize("name,expected", [
    ("Llama-3.2-1B", dict(family="llama", num_attention_heads=8, num_query_groups=2, head_dim=64, hidden_size=512,
                          tie_word_embeddings=True, qkv_bias=False, qk_norm=False, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                        "low_freq_factor": 1.0, "original_max_position_embeddings": 8192})),
    ("Qwen2.5-0.5B-Instruct", dict(family="qwen2", num_attention_heads=14, num_query_groups=2, head_dim=32,
                                   hidden_size=448, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
                                   rope_theta=1000000.0,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "original_max_position_embeddings": 32768,
                                                 "truncate": True})),
    ("Qwen3-0.6B", dict(family="qwen3", num_attention_heads=4, num_query_groups=2, head_dim=128, hidden_size=256,
                        tie_word_embeddings=True, qkv_bias=False, qk_norm=True)),
    ("Qwen3-30B-A3B", dict(family="qwen3_moe", num_attention_heads=16, num_query_groups=2, head_dim=32,
                           hidden_size=256, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                           ffn_hidden_size=768, tie_word_embeddings=False, qk_norm=True)),
    # no head_dim key: transformers 5's NemotronHConfig defaults it to 128 (the legacy attention_head_dim is
    # not read), whatever hidden / heads is
    ("Nemotron-H-56B-Base-8K", dict(family="nemotron_h", num_layers=9, num_attention_heads=16, num_query_groups=2,
                                    head_dim=128, hidden_size=128, num_experts=0, rope_theta=None,
                                    ffn_hidden_size=512)),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", dict(family="nemotron_h", num_layers=7, num_experts=8, moe_router_topk=3,
                                                 head_dim=32, moe_ffn_hidden_size=32)),
    ("NVIDIA-Nemotron-3-Super-120B-A12B-BF16", dict(family="nemotron_h", num_layers=9, num_experts=8,
                                                    moe_router_topk=3, head_dim=32)),
])
def test_published_configs_read_as_their_classes_do(name, expected):
    """config.json as the Hub's files spell it (rope_scaling + rope_theta, Qwen2.5's old `type` key): the
    facts fill what the family's HF class assumes (Qwen2's q/k/v bias, Qwen3's q/k norm) and YaRN's
    defaults (beta_fast 32, beta_slow 1, truncate)."""
    from tests.helpers import published_models

    facts, _ = model_facts.read_hf(published_models.PUBLISHED[name](), name)
    assert {k: getattr(facts, k) for k in expected} == expected


@pytest.mark.parametrize("source", sorted(p.name for p in published_models.FIXTURES.iterdir() if p.is_dir()))
def test_every_published_file_reads_as_published(source):
    """The published config.json itself, unscaled, every key in its original spelling."""
    facts, architectures = model_facts.read(published_models.FIXTURES / source)
    hub = json.loads((published_models.FIXTURES / source / "config.json").read_text())
    assert facts.family == hub["model_type"] and architectures == hub["architectures"]
    assert facts.hidden_size == hub["hidden_size"] and facts.num_layers == hub["num_hidden_layers"]


@pytest.mark.parametrize("name", list(published_models.PUBLISHED))
def test_a_published_fixture_resolves_by_model_path_alone(name, model_cache, tmp_path, capsys):
    """`python -m launcher model.path=DIR dry_run=true` with the default model group and topology."""
    d = published_models.build(name, model_cache / "published")
    assert main([f"model.path={d}", f"run.root={tmp_path}/runs", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert f"name: {name}" in out and f"family: {published_models.FAMILY[name]}" in out, out[-3000:]


def test_both_spellings_of_rope_give_the_same_facts():
    """transformers 5 writes rope_parameters (theta inside); the Hub's files rope_scaling + rope_theta."""
    from tests.helpers import published_models

    published = published_models.qwen3_30b_a3b()
    t5 = {k: v for k, v in published.items() if k not in ("rope_scaling", "rope_theta")}
    t5["rope_parameters"] = {**published["rope_scaling"], "rope_theta": 1000000.0}
    assert model_facts.read_hf(t5, "t5")[0] == model_facts.read_hf(published, "hub")[0]
    plain = {**published, "rope_scaling": None}
    assert model_facts.read_hf(plain, "x")[0].rope_scaling == {}


def test_the_built_in_recipes_facts_are_the_built_checkpoints(tiny_model):
    """A recipe's facts (resolved at submission, without building) equal what the built model's config.json says."""
    from launcher.config.schema import BUILTIN_MODELS

    for recipe in BUILTIN_MODELS:
        if recipe == "llama_100m":
            continue  # the benchmark model: 100M parameters to build
        assert model_facts.builtin_facts(recipe) == model_facts.read(tiny_model(recipe))[0], recipe


def test_a_path_under_home_is_resolved_too(tmp_path, monkeypatch):
    """model.path='~/...' (expanded only when made absolute): its facts were never read, validation, the
    expert-LoRA guard and the exporter used the default group's numbers (llama, no experts)."""
    from launcher.config.compose import compose

    monkeypatch.setenv("HOME", str(tmp_path))
    checkpoint(tmp_path, QWEN3_MOE, "my-moe")
    cfg = compose(["model.path='~/my-moe'"])
    assert (cfg.model.path, cfg.model.family, cfg.model.num_experts) == (str(tmp_path / "my-moe"), "qwen3_moe", 128)
    assert (cfg.model.name, cfg.run.name, cfg.model.builtin) == ("my-moe", "local-my-moe", None)


def test_run_name_follows_the_checkpoint_unless_given(tmp_path):
    from launcher.config.compose import compose

    d = checkpoint(tmp_path, LLAMA, "Llama 3 (8B)")
    assert compose([f"model.path='{d}'"]).run.name == "local-Llama-3--8B"
    assert compose([f"model.path='{d}'", "run.name=mine"]).run.name == "mine"
    assert compose([f"model.path='{d}'", "model.name=m"]).run.name == "local-m"
    snapshot = Path("/hub/models--Qwen--Qwen3-8B/snapshots/0123abcd")
    assert model_facts.checkpoint_name(snapshot) == "Qwen3-8B"


def test_the_job_refuses_a_checkpoint_changed_since_submission(tmp_path):
    """The facts are resolved at submission; at the job's start the checkpoint must still say the same
    (both the trainer and vLLM load it)."""
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.driver import models

    d = checkpoint(tmp_path, QWEN3_MOE)
    cfg = typed(compose([f"model.path={d}"]))
    assert models.ensure(cfg) == d
    (d / "config.json").write_text(json.dumps({**QWEN3_MOE, "hidden_size": 1024}))
    with pytest.raises(ConfigError) as e:
        models.ensure(cfg)
    assert str(e.value) == (f"model.path: {d}/config.json no longer says what the run's config.yaml ({d}/config.json) "
                            f"says: hidden_size 2048 -> 1024 (the checkpoint changed since submission: submit again)")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "nemotron_h"])
def test_transformers_config_classes_read_from_source_are_the_classes(family):
    """launcher.config.hf_classes reads each family's config class without importing it (torch): its
    fields, defaults and other names equal the imported class's own."""
    import dataclasses
    import math

    import transformers

    from launcher.config import hf_classes

    real = transformers.CONFIG_MAPPING[family]
    read = hf_classes.hf_class(family)
    assert read.name == real.__name__
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    fields = {f.name: f for f in dataclasses.fields(real) if f.name not in base}
    assert set(read.defaults) == set(fields)
    for name, f in fields.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        got = read.defaults[name]
        if got is hf_classes.COMPUTED:
            continue
        if isinstance(default, tuple):
            default = list(default)
        assert got == default or (isinstance(got, list) and all(
            a == b or (math.isinf(a) and a == b) for a, b in zip(got, default))), name
    assert {k: v for k, v in read.aliases.items() if k in real.attribute_map} == dict(real.attribute_map)
    assert base <= hf_classes.generic_fields()


def test_an_unread_key_is_compared_with_its_class_default_in_every_family():
    """The mechanism is the family's class, not a list per model: hidden_act is read by no fact of llama's."""
    from tests.helpers import published_models as pm

    for name, make in pm.PUBLISHED.items():
        cfg = make()
        model_facts.read_hf(cfg, name)   # as published: accepted
        # Nemotron-H's class has no hidden_act (its unread keys: tests/unit/test_nemotron_h_config.py)
        key, default = ("mamba_proj_bias", "false") if cfg["model_type"] == "nemotron_h" else ("hidden_act", '"silu"')
        with pytest.raises(ConfigError, match=rf"{key} \"gelu\" \(\w+Config's default {default}\)"):
            model_facts.read_hf({**cfg, key: "gelu"}, name)
    qwen2 = pm.qwen2_5_0_5b_instruct()
    with pytest.raises(ConfigError, match="layer_types must be full_attention on every layer without "
                                          "use_sliding_window"):
        model_facts.read_hf({**qwen2, "layer_types": ["full_attention", "sliding_attention"]}, "x")
