"""Checkpoints shaped like published ones: each family's config.json as its publisher wrote it,
with only depth and width scaled down (random weights, this repository's word-level tokenizer).

Each function returns the config.json of one fixture and says in its docstring which published
model it copies and which keys it takes (values from the model's config.json on the Hugging Face
Hub; rope scaling from the model card where the published file has none). Kept as published:
model_type and architectures, heads per KV group, head_dim relative to hidden (heads x head_dim =
hidden, or 2 x hidden), tied embeddings, q/k/v bias (a property of the Qwen2 class), q/k norm
(Qwen3's classes), rope theta, rope scaling of the type the family's cards use, expert width
relative to hidden. Scaled: num_hidden_layers to 2, and widths by a common factor. vLLM's CPU
attention kernel supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only
(vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes), so a head_dim is kept where it
is one of those and halved otherwise (the docstrings say where). KV groups stay even so the
default topology's tensor_parallel=2 divides them.

`build(name, cache)` writes the checkpoint (tiny_models.build_from_config; the file keeps the
published spelling, e.g. `rope_scaling` + `rope_theta` rather than transformers 5's
`rope_parameters`), under the directory name of the published model.
"""

from __future__ import annotations

from pathlib import Path


def llama_3_2_1b() -> dict:
    """meta-llama/Llama-3.2-1B (config.json): model_type llama, LlamaForCausalLM, hidden_size 2048,
    intermediate_size 8192 (4 x hidden), num_attention_heads 32, num_key_value_heads 8 (4 heads
    per group), head_dim 64 (heads x head_dim = hidden), tie_word_embeddings true, attention_bias
    false, mlp_bias false, rms_norm_eps 1e-05, rope_theta 500000.0, max_position_embeddings
    131072, rope_scaling {rope_type llama3, factor 32.0, low_freq_factor 1.0, high_freq_factor
    4.0, original_max_position_embeddings 8192}.
    Scaled: width / 4 (8 heads over 2 groups, head_dim 64 kept, hidden 512), 2 layers."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 512,
            "initializer_range": 0.02, "intermediate_size": 2048, "max_position_embeddings": 131072,
            "mlp_bias": False, "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": True, "use_cache": True}


def qwen2_5_0_5b_instruct() -> dict:
    """Qwen/Qwen2.5-0.5B-Instruct (config.json): model_type qwen2, Qwen2ForCausalLM, hidden_size
    896, intermediate_size 4864, num_attention_heads 14, num_key_value_heads 2 (7 heads per
    group), no head_dim key (hidden / heads = 64), q/k/v bias (Qwen2's attention always has it),
    tie_word_embeddings true, rms_norm_eps 1e-06, rope_theta 1000000.0, max_position_embeddings
    32768, sliding_window 32768 with use_sliding_window false. Rope scaling as Qwen2.5's
    documentation tells users to add for long inputs: rope_scaling {factor 4.0,
    original_max_position_embeddings 32768, type yarn} (the old `type` key, as written there).
    Scaled: width / 2 (14 heads over 2 groups kept; head_dim 64 -> 32, hidden 448), 2 layers."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
            "hidden_act": "silu", "hidden_size": 448, "initializer_range": 0.02, "intermediate_size": 2432,
            "max_position_embeddings": 32768, "max_window_layers": 2, "num_attention_heads": 14,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_cache": True,
            "use_sliding_window": False}


def qwen3_0_6b() -> dict:
    """Qwen/Qwen3-0.6B (config.json): model_type qwen3, Qwen3ForCausalLM, hidden_size 1024,
    intermediate_size 3072 (3 x hidden), num_attention_heads 16, num_key_value_heads 8 (2 heads per
    group), head_dim 128 (heads x head_dim = 2048 = 2 x hidden), q/k RMSNorm (Qwen3's attention),
    attention_bias false, tie_word_embeddings true, rms_norm_eps 1e-06, rope_theta 1000000,
    max_position_embeddings 40960, use_sliding_window false. Rope scaling as the Qwen3 model card
    advises for long inputs: rope_scaling {rope_type yarn, factor 4.0,
    original_max_position_embeddings 32768}.
    Scaled: width / 4 (4 heads over 2 groups, head_dim 128 kept, hidden 256), 2 layers."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 256,
            "initializer_range": 0.02, "intermediate_size": 768, "max_position_embeddings": 40960,
            "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "use_cache": True,
            "use_sliding_window": False}


def qwen3_30b_a3b() -> dict:
    """Qwen/Qwen3-30B-A3B (config.json): model_type qwen3_moe, Qwen3MoeForCausalLM, hidden_size
    2048, num_attention_heads 32, num_key_value_heads 4 (8 heads per group), head_dim 128 (heads x
    head_dim = 4096 = 2 x hidden), q/k RMSNorm, attention_bias false, num_experts 128,
    num_experts_per_tok 8, moe_intermediate_size 768 (0.375 x hidden), intermediate_size 6144,
    norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [] (every layer sparse), no shared
    expert, router_aux_loss_coef 0.001, tie_word_embeddings false, rms_norm_eps 1e-06, rope_theta
    1000000.0, max_position_embeddings 40960. Rope scaling as the Qwen3 model card advises:
    rope_scaling {rope_type yarn, factor 4.0, original_max_position_embeddings 32768}.
    Scaled: width / 8 (hidden 256, moe_intermediate_size 96, intermediate_size 768; 16 heads over
    2 groups with head_dim 128 -> 32, so that heads x head_dim stays 2 x hidden), 8 experts of
    which 2 per token (expert_parallel=2 puts 4 on each rank), 2 layers."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 32, "hidden_act": "silu",
            "hidden_size": 256, "initializer_range": 0.02, "intermediate_size": 768,
            "max_position_embeddings": 40960, "max_window_layers": 2, "mlp_only_layers": [],
            "moe_intermediate_size": 96, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "output_router_logits": False, "rms_norm_eps": 1e-06,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False}


# directory name (the published model's) -> its config.json
PUBLISHED = {"Llama-3.2-1B": llama_3_2_1b, "Qwen2.5-0.5B-Instruct": qwen2_5_0_5b_instruct,
             "Qwen3-0.6B": qwen3_0_6b, "Qwen3-30B-A3B": qwen3_30b_a3b}
FAMILY = {name: make()["model_type"] for name, make in PUBLISHED.items()}


def build(name: str, cache: Path) -> Path:
    """The fixture `name` (a key of PUBLISHED) as a checkpoint directory `cache/name`. Weights are drawn
    with std 0.08 * sqrt(128 / hidden_size): the logits' scale of the 128-wide built-in models (a wider
    model at their 0.08 has twice as sharp logits, and float32 differences between two correct
    implementations grow with them)."""
    from workers import tiny_models

    config = PUBLISHED[name]()
    return tiny_models.build_from_config(Path(cache) / name, config, init_std=0.08 * (128 / config["hidden_size"]) ** 0.5)
