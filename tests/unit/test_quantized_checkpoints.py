"""A quantized checkpoint is refused at submission in one line: the file, the kind, the BF16 alternative.

LoRA training here needs unquantized weights: the trainers build BF16 Megatron layers and read every
tensor of the folder as a weight, and the dry run counted the packed tensors as weights. Nothing read
`quantization_config` before, so an FP8 / NVFP4 / MXFP4 / compressed-tensors release was submitted and
failed after start-up. Now `launcher.config.model_facts.check_unquantized` reads it where transformers and
vLLM do (config.json's `quantization_config`, NVIDIA ModelOpt's `hf_quant_config.json`, `compression_config`,
`text_config.quantization_config`) before the facts, and refuses it naming the kind as the model card does.

The quantized files are published ones (tests/fixtures/quantized, SOURCES.md there), copied byte for
byte into a model folder built by the project's tiny model helpers, and submitted the way a user does,
`python -m launcher model.path=<folder> submit=false` (in-process: launcher.__main__.main): exit code 2,
one stderr line, nothing written under run.root. The BF16 release of three of them, built from the same
published config (scaled: depth and widths only, as tests/helpers/published_models.py does), is accepted;
the same folder with the published quantization added is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launcher import __main__ as cli
from launcher.config import model_facts
from launcher.config.schema import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
ALTERNATIVE = ("LoRA training here needs unquantized weights: use the BF16 release of this model, or dequantize "
               "it first")

# fixture folder (tests/fixtures/quantized) -> (the file the line names, what it says of it)
REFUSED = {
    "deepseek-ai__DeepSeek-V3": (
        "config.json", 'quantization_config.quant_method "fp8": quantized weights, FP8 (fine-grained, 128x128 blocks)'),
    "Qwen__Qwen3-30B-A3B-FP8": (
        "config.json", 'quantization_config.quant_method "fp8": quantized weights, FP8 (fine-grained, 128x128 blocks)'),
    "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4": (
        "hf_quant_config.json", 'quantization.quant_algo "NVFP4": quantized weights, NVFP4 (ModelOpt)'),
    "nvidia__NVIDIA-Nemotron-3-Ultra-550B-A55B-NVFP4": (
        "hf_quant_config.json", 'quantization.quant_algo "NVFP4": quantized weights, NVFP4 (ModelOpt)'),
    "nvidia__MiniMax-M2.5-NVFP4": (
        "config.json", 'quantization_config.quant_method "modelopt", quant_algo "NVFP4": quantized weights, '
                       'NVFP4 (ModelOpt)'),
    "nvidia__Llama-3.1-70B-Instruct-FP8": (
        "hf_quant_config.json", 'quantization.quant_algo "FP8": quantized weights, FP8 (ModelOpt)'),
    "openai__gpt-oss-20b": ("config.json", 'quantization_config.quant_method "mxfp4": quantized weights, MXFP4'),
    "RedHatAI__Llama-4-Scout-17B-16E-Instruct-FP8-dynamic": (
        "config.json", 'quantization_config.quant_method "compressed-tensors": quantized weights, '
                       'compressed-tensors (float-quantized)'),
}


def _line(folder: Path, file: str, says: str) -> str:
    return f"error: model.path: {folder / file}: {says}; {ALTERNATIVE}"


def _submit(sandbox: Path, folder: Path, root: str, *extra: str) -> int:
    return cli.main([f"model.path={folder}", f"run.root={sandbox / root}", "run.name=q", "submit=false", *extra])


def _quantized_folder(sandbox: Path, source: str, tiny: Path) -> Path:
    """sandbox/models/<published name>: a tiny built model's weights and tokenizer, then the published
    files of `source` (config.json, hf_quant_config.json) copied over them byte for byte."""
    folder = sandbox / "models" / source.split("__", 1)[1]
    shutil.copytree(tiny, folder)
    for f in sorted((FIXTURES / source).iterdir()):
        shutil.copyfile(f, folder / f.name)
    return folder


def test_every_fixture_has_its_line():
    assert sorted(REFUSED) == sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


@pytest.mark.parametrize("source", sorted(REFUSED))
@pytest.mark.parametrize("mode", ["submit=false", "dry_run=true"])
def test_a_published_quantized_checkpoint_is_refused(source, mode, sandbox, tiny_model, capsys):
    """The published files as downloaded: exit 2, the one line, nothing under run.root (a dry run too:
    its plan would count the packed tensors as the model's weights)."""
    folder = _quantized_folder(sandbox, source, tiny_model("tiny_llama"))
    file, says = REFUSED[source]
    rc = cli.main([f"model.path={folder}", f"run.root={sandbox / 'runs'}", "run.name=q", mode])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert err.splitlines() == [_line(folder, file, says)]
    assert out == ""
    assert not (sandbox / "runs").exists()


def _scaled_llama_3_1_70b(config: dict) -> dict:
    """nvidia/Llama-3.1-70B-Instruct-FP8's config.json scaled as tests/helpers/published_models.py scales
    Llama-3.2-1B: width / 16 (8 heads over 2 groups, head_dim 64 kept: 8192 / 64 = 512 / 8), 2 layers;
    every other key as published."""
    sizes = dict(hidden_size=512, intermediate_size=1792, num_attention_heads=8, num_key_value_heads=2,
                 num_hidden_layers=2)
    assert set(sizes) <= set(config)
    return {**config, **sizes}


def _bf16_release(name: str, cache: Path) -> tuple[Path, dict | None, str | None]:
    """The BF16 checkpoint built from a published config.json, and what makes it the quantized release
    of REFUSED[name]: the `quantization_config` to add to its config.json, or the hf_quant_config.json to
    put beside it."""
    from tests.helpers import published_models
    from workers import tiny_models

    quantized = json.loads((FIXTURES / name / "config.json").read_text())
    if name == "Qwen__Qwen3-30B-A3B-FP8":
        qc = quantized.pop("quantization_config")
        assert quantized == published_models.published("Qwen__Qwen3-30B-A3B")   # the FP8 release = BF16 + it
        return published_models.build("Qwen3-30B-A3B", cache / "published"), qc, None
    if name == "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4":
        bf16 = published_models.published("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
        assert {k: v for k, v in quantized.items() if k != "transformers_version"} == \
               {k: v for k, v in bf16.items() if k != "transformers_version"}
        return published_models.build("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", cache / "published"), None, \
            "hf_quant_config.json"
    assert name == "nvidia__Llama-3.1-70B-Instruct-FP8" and "quantization_config" not in quantized
    built = tiny_models.build_from_config(cache / "quantized" / "Llama-3.1-70B-Instruct",
                                          _scaled_llama_3_1_70b(quantized))
    return built, None, "hf_quant_config.json"


@pytest.mark.parametrize("name", ["Qwen__Qwen3-30B-A3B-FP8", "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4",
                                  "nvidia__Llama-3.1-70B-Instruct-FP8"])
def test_the_bf16_release_is_accepted_and_the_same_folder_quantized_is_refused(name, sandbox, model_cache,
                                                                               capsys):
    built, quantization_config, beside = _bf16_release(name, model_cache)
    bf16 = sandbox / "models" / built.name
    shutil.copytree(built, bf16)
    assert _submit(sandbox, bf16, "runs-bf16") == 0, capsys.readouterr().err
    assert (sandbox / "runs-bf16" / "q" / "config.yaml").is_file()
    capsys.readouterr()

    folder = sandbox / "models" / (built.name + "-quantized")
    shutil.copytree(built, folder)
    if quantization_config is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config},
                                                       indent=2))
    if beside is not None:
        shutil.copyfile(FIXTURES / name / beside, folder / beside)
    assert _submit(sandbox, folder, "runs-quantized") == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [_line(folder, *REFUSED[name])]
    assert out == ""
    assert not (sandbox / "runs-quantized").exists()


@pytest.mark.parametrize("value", [None, {}])
def test_a_null_or_empty_quantization_config_is_no_quantization(value, sandbox, model_cache, capsys):
    """transformers writes `"quantization_config": null` into no file, but a hand-edited one may say null or
    {}: the weights are the BF16 ones, and the folder is accepted."""
    from tests.helpers import published_models

    folder = sandbox / "models" / "Qwen3-30B-A3B"
    shutil.copytree(published_models.build("Qwen3-30B-A3B", model_cache / "published"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": value}, indent=2))
    assert _submit(sandbox, folder, "runs") == 0, capsys.readouterr().err


# The kinds no published file here shows (tests/fixtures/quantized/SOURCES.md: none was found whole), and
# the spellings transformers and vLLM also read: each is the keys its loader dispatches on
# (transformers/quantizers/auto.py, vllm/transformers_utils/model_arch_config_convertor.py), written here,
# not copied from a release.
KINDS = [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     'quantization_config.quant_method "awq": quantized weights, AWQ 4-bit'),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     'quantization_config.quant_method "gptq": quantized weights, GPTQ 4-bit'),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     'quantization_config.quant_method "bitsandbytes": quantized weights, bitsandbytes 4-bit'),
    ({"quantization_config": {"quant_method": "bitsandbytes", "_load_in_8bit": True}},
     'quantization_config.quant_method "bitsandbytes": quantized weights, bitsandbytes 8-bit'),
    ({"quantization_config": {"load_in_8bit": True}},   # transformers: bitsandbytes without a quant_method
     "quantization_config.load_in_8bit true: quantized weights, bitsandbytes 8-bit"),
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}},
     'quantization_config.quant_method "fbgemm_fp8": quantized weights, FP8 (fbgemm)'),
    ({"quantization_config": {"quant_method": "fp8"}},
     'quantization_config.quant_method "fp8": quantized weights, FP8'),
    ({"quantization_config": {"quant_method": "nvfp4"}},
     'quantization_config.quant_method "nvfp4": quantized weights, NVFP4'),
    ({"quantization_config": {"quant_method": "compressed_tensors", "format": "pack-quantized"}},   # vLLM's alias
     'quantization_config.quant_method "compressed_tensors": quantized weights, compressed-tensors (pack-quantized)'),
    ({"quantization_config": {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}},
     'quantization_config.quantization.quant_algo "FP8": quantized weights, FP8 (ModelOpt)'),   # ModelOpt's layout
    ({"compression_config": {"quant_method": "compressed-tensors"}},   # older compressed-tensors (vLLM reads it)
     'compression_config.quant_method "compressed-tensors": quantized weights, compressed-tensors'),
    ({"text_config": {"quantization_config": {"quant_method": "fp8"}}},   # a multimodal model's
     'text_config.quantization_config.quant_method "fp8": quantized weights, FP8'),
    ({"quantization_config": {"quant_method": "int3_magic"}},   # unknown: named as written, refused
     'quantization_config.quant_method "int3_magic": quantized weights of a kind this launcher does not know'),
    ({"quantization_config": {"bits": 4}},
     "quantization_config has no quant_method (transformers refuses such a config)"),
]


@pytest.mark.parametrize("config, says", KINDS, ids=[s.split(":")[0] + "-" + str(i) for i, (_, s) in
                                                     enumerate(KINDS)])
def test_each_kind_is_named_as_a_model_card_names_it(config, says, tmp_path):
    with pytest.raises(ConfigError) as e:
        model_facts.check_unquantized(tmp_path, config)
    assert e.value.key == "model.path"
    assert e.value.message == f"{tmp_path / 'config.json'}: {says}; {ALTERNATIVE}"


@pytest.mark.parametrize("config, says", [
    ({"quantization_config": "fp8"}, "quantization_config must be an object or null, got 'fp8'"),
    ({"quantization_config": {"quant_method": 8}}, "quantization_config.quant_method must be a string, got 8"),
])
def test_a_malformed_quantization_config_is_one_line(config, says, tmp_path):
    with pytest.raises(ConfigError) as e:
        model_facts.check_unquantized(tmp_path, config)
    assert e.value.message == f"{tmp_path / 'config.json'}: {says}"


@pytest.mark.parametrize("config, beside", [
    ({}, None), ({"quantization_config": None}, None), ({"quantization_config": {}}, None),
    ({"compression_config": None, "text_config": {"quantization_config": None}}, None),
    # ModelOpt's export of a KV-cache-only quantization: the weights are not quantized
    ({}, {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}),
])
def test_what_is_no_quantization_passes(config, beside, tmp_path):
    if beside is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(beside))
    assert model_facts.check_unquantized(tmp_path, config) is None
