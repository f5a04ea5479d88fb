"""Nemotron 3 Ultra's config.json, as published (nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16), for
the tests that need the real shape without its weights: the memory plan of `topology=ultra_6n4g`
(tests/unit/test_memory_plan.py) and the recipe's provider settings (tests/unit/test_provider_settings.py).

The file itself is not on this machine (no network to the Hub); its values are the ones public code
quotes from it, and the counts check against each other:
  - a Nemotron 3 Ultra model script of the miles RL framework (a fork on GitHub; its "HF config:"
    comment and MODEL_ARGS): 108 layers, hidden 8192, 64 attention heads over 2 KV heads, head_dim 128,
    intermediate and moe_intermediate 5120, 512 routed experts, top-22, 1 shared expert of 10240,
    routed_scaling_factor 5.0, moe_latent_size 2048, n_group 1, topk_group 1, sigmoid routing with
    the expert bias, num_nextn_predict_layers 1, Mamba n_groups 8, vocab 131072, untied embeddings;
  - an Aurora vLLM deployment note ("Model facts (from HF config.json)"): 108 = 48 mamba + 48 moe + 12
    attention layers, mamba_num_heads 256, ssm_state_size 128, conv_kernel 4,
    max_position_embeddings 262144;
  - a published-config check (Ultra's `layers_block_type`, transformers 5's spelling, with attention
    at layers 7, 14, 23, 32, 39, 48, 57, 64, 73, 82, 89, 98 and Mamba / MoE alternating in between;
    `mtp_layers_block_type` [attention, moe]);
  - Sebastian Raschka's note on the release: latent MoE 8192 -> 2048 -> 8192.
Not stated in those, taken from Nemotron 3 Super's published config.json (88 layers, hidden 4096,
mamba_num_heads 128 x mamba_head_dim 64 = 2 x hidden): mamba_head_dim 64 (256 x 64 = 2 x 8192),
chunk_size 128, layer_norm_epsilon 1e-5. Parameter count from these numbers: 549.3e9 without the MTP
layer (the name's 550B), 560.5e9 with it (Hugging Face lists 561e9 for the BF16 checkpoint: the
memory plan's model.size); 50.1e9 per rank at TP 2 / EP 16 (the upstream run logged 51.0e9).
"""

from __future__ import annotations

import json
from pathlib import Path

ATTENTION_LAYERS = (7, 14, 23, 32, 39, 48, 57, 64, 73, 82, 89, 98)


def layers_block_type() -> list[str]:
    """108 blocks: attention at ATTENTION_LAYERS, Mamba and MoE alternating through the rest."""
    out, moe = [], False
    for index in range(108):
        if index in ATTENTION_LAYERS:
            out.append("attention")
        else:
            out.append("moe" if moe else "mamba")
            moe = not moe
    return out


def config() -> dict:
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "torch_dtype": "bfloat16",
        "vocab_size": 131072, "hidden_size": 8192, "layers_block_type": layers_block_type(),
        "num_attention_heads": 64, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
        "intermediate_size": 5120, "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
        "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 5120,
        "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 10240, "moe_latent_size": 2048,
        "routed_scaling_factor": 5.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "mamba_num_heads": 256, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "mamba_hidden_act": "silu", "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"],
    }


def write(directory: Path) -> Path:
    """A directory holding only Ultra's config.json (what a dry run for the cluster reads)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(), indent=2))
    return directory
