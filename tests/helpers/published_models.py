"""Checkpoints of published models: each family's config.json as its publisher wrote it, with only
depth and width scaled down (random weights, this repository's word-level tokenizer).

The files are in tests/fixtures/published/<org>__<model>/config.json, copied from public copies of
the Hub's files (SOURCES.md there names each source). They are read with Python's json, as
transformers 4 did, so every key and spelling is kept: Nemotron-H-56B-Base-8K's
`"time_step_limit": [0.0, Infinity]` and `attention_head_dim`, Qwen2.5's missing head_dim, Nemotron 3
Super's `mtp_hybrid_override_pattern`, `auto_map`, `transformers_version`, ...

`scaled` is the one place that edits them: the given sizes replace the published ones (each must be
a key the file has), depth is the first N layers (num_hidden_layers, or the first N symbols of a
hybrid layer pattern); every other key stays as published. What the scaled fixtures keep: heads per
KV group, head_dim where it is a size vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 160,
192, 224, 256, 512: vllm/v1/attention/backends/cpu_attn.py) and halved otherwise, KV groups even
(the default topology's tensor_parallel=2 divides them), expert width relative to hidden.

Two fixtures add what the model card tells users to add for long inputs (CARD_EDITS, said in
their docstrings): Qwen2.5's YaRN in the old `type` spelling and Qwen3-30B-A3B's YaRN.

`build(name, cache)` writes the checkpoint (tiny_models.build_from_config writes config.json with
Python's json: `Infinity` appears literally, as in the published file), under the published name.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "published"
PATTERN_KEYS = ("hybrid_override_pattern",)


def published(source: str) -> dict:
    """tests/fixtures/published/<source>/config.json, read as transformers 4 read it (Python's json)."""
    return json.loads((FIXTURES / source / "config.json").read_text())


def scaled(source: str, layers: int, **sizes) -> dict:
    """The published config of `source` with depth `layers` (the first layers of its pattern) and
    `sizes` in place of the published numbers; every other key as published."""
    config = published(source)
    unknown = sorted(set(sizes) - set(config))
    if unknown:
        raise KeyError(f"{source}: {unknown} not in the published file (scaled edits sizes, it adds no key)")
    config.update(sizes)
    for key in PATTERN_KEYS:
        if key in config:
            config[key] = config[key][:layers]
    if "num_hidden_layers" in config:
        config["num_hidden_layers"] = layers
    return config


def llama_3_2_1b() -> dict:
    """meta-llama/Llama-3.2-1B: llama3 rope scaling (factor 32), tied embeddings, 32 heads over 8
    groups of head_dim 64. Scaled: width / 4 (8 heads over 2 groups, head_dim 64 kept), 2 layers."""
    return scaled("meta-llama__Llama-3.2-1B", 2, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=2)


def qwen2_5_0_5b_instruct() -> dict:
    """Qwen/Qwen2.5-0.5B-Instruct: no head_dim key (hidden / heads = 64), q/k/v bias (Qwen2's class),
    14 heads over 2 groups, tied embeddings, sliding_window set but not used. Scaled: width / 2 (head_dim
    32, hidden 448), 2 layers. Card edit: rope_scaling {factor 4.0, original_max_position_embeddings
    32768, type yarn}, the old `type` key, as Qwen2.5's documentation writes it."""
    return {**scaled("Qwen__Qwen2.5-0.5B-Instruct", 2, hidden_size=448, intermediate_size=2432),
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}


def qwen3_0_6b() -> dict:
    """Qwen/Qwen3-0.6B: q/k RMSNorm, head_dim 128 with 16 heads = 2 x hidden, 8 groups, tied embeddings,
    rope_scaling null. Scaled: width / 4 (4 heads over 2 groups, head_dim 128 kept), 2 layers."""
    return scaled("Qwen__Qwen3-0.6B", 2, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2)


def qwen3_30b_a3b() -> dict:
    """Qwen/Qwen3-30B-A3B: 128 experts top-8 of width 0.375 x hidden, no shared expert, every layer
    sparse, untied. Scaled: width / 8 (hidden 256, 16 heads over 2 groups with head_dim 128 -> 32), 8
    experts top-2 (expert_parallel=2 puts 4 on each rank), 2 layers. Card edit: rope_scaling {rope_type
    yarn, factor 4.0, original_max_position_embeddings 32768}, as the Qwen3 model card advises."""
    return {**scaled("Qwen__Qwen3-30B-A3B", 2, hidden_size=256, intermediate_size=768, moe_intermediate_size=96,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=32, num_experts=8,
                     num_experts_per_tok=2),
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def nemotron_h_56b_base() -> dict:
    """nvidia/Nemotron-H-56B-Base-8K: a dense hybrid (Mamba-2, MLP, attention: the kind of Nemotron-Nano-9B-v2,
    whose file could not be found), saved by transformers 4 with `"time_step_limit": [0.0, Infinity]`, the
    legacy `attention_head_dim` 128 (transformers 5 ignores it; its head_dim default is 128 too) and
    `rms_norm_eps`. Scaled: the first 9 layers "M-M-M-M*-"; hidden 8192 -> 128, 64 heads over 8 groups ->
    16 over 2 (head_dim 128), Mamba 256 heads x 64 -> 16 x 16 (2 x hidden, as published) in 2 groups,
    state 256 -> 32, MLP 32768 -> 512."""
    return scaled("nvidia__Nemotron-H-56B-Base-8K", 9, hidden_size=128, num_attention_heads=16,
                  num_key_value_heads=2, mamba_num_heads=16, mamba_head_dim=16, n_groups=2, ssm_state_size=32,
                  intermediate_size=512)


def nemotron_3_nano() -> dict:
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: Mamba-2, attention and MoE (128 experts top-6, one
    shared, relu2, routing scale 2.5). Scaled: the first 7 layers "MEMEM*E"; hidden 2688 -> 64; 32
    heads over 2 groups of 128 -> 8 over 2 of 32; Mamba 64 x 64 -> 16 x 16 in 2 groups, state 32; 8
    experts top-3 of width 32, shared expert 64."""
    return scaled("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", 7, hidden_size=64, num_attention_heads=8,
                  head_dim=32, mamba_num_heads=16, mamba_head_dim=16, n_groups=2, ssm_state_size=32,
                  n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64, intermediate_size=32)


def nemotron_3_super() -> dict:
    """nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16, the released architecture: LatentMoE (512 experts
    top-22 computing in 1024 of hidden 4096), one MTP step of attention + MoE
    (`mtp_hybrid_override_pattern` "*E"). Scaled: the first 9 layers "MEMEMEM*E"; hidden 64, latent 16
    (a quarter, as published); 32 heads over 2 groups -> 8 over 2 of head_dim 32; Mamba 128 x 64 ->
    8 x 16 (2 x hidden, as published) in 2 groups, state 32; 8 experts top-3 of width 32, shared 64."""
    return scaled("nvidia__NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 9, hidden_size=64, moe_latent_size=16,
                  num_attention_heads=8, head_dim=32, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                  ssm_state_size=32, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64, intermediate_size=32)


# directory name (the published model's) -> its scaled config.json
PUBLISHED = {"Llama-3.2-1B": llama_3_2_1b, "Qwen2.5-0.5B-Instruct": qwen2_5_0_5b_instruct,
             "Qwen3-0.6B": qwen3_0_6b, "Qwen3-30B-A3B": qwen3_30b_a3b,
             "Nemotron-H-56B-Base-8K": nemotron_h_56b_base, "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": nemotron_3_nano,
             "NVIDIA-Nemotron-3-Super-120B-A12B-BF16": nemotron_3_super}
FAMILY = {name: make()["model_type"] for name, make in PUBLISHED.items()}
# what tests/e2e/test_published_models.py runs through the pipeline (the rest: tests/e2e/test_nemotron_h_local.py
# runs Super; each is resolved by a dry run in tests/unit/test_model_facts.py)
RUN_THROUGH = ("Llama-3.2-1B", "Qwen2.5-0.5B-Instruct", "Qwen3-30B-A3B", "Nemotron-H-56B-Base-8K")


def build(name: str, cache: Path) -> Path:
    """The fixture `name` (a key of PUBLISHED) as a checkpoint directory `cache/name`. Weights are drawn
    with std 0.08 * sqrt(128 / hidden_size): the logits' scale of the 128-wide built-in models (a wider
    model at their 0.08 has twice as sharp logits, and float32 differences between two correct
    implementations grow with them)."""
    from workers import tiny_models

    config = PUBLISHED[name]()
    return tiny_models.build_from_config(Path(cache) / name, config,
                                         init_std=0.08 * (128 / config["hidden_size"]) ** 0.5)
