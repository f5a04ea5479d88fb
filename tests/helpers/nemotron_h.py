"""A Nemotron-H that is not our recipe: a published config.json scaled down in depth and width.

Source: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, config.json (as published; the keys that decide
the layout): hidden_size 2688, hybrid_override_pattern
"MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME" (52 layers), num_attention_heads 32,
num_key_value_heads 2, head_dim 128, mamba_num_heads 64, mamba_head_dim 64, n_groups 8,
ssm_state_size 128, chunk_size 128, conv_kernel 4, n_routed_experts 128, num_experts_per_tok 6,
n_shared_experts 1, moe_intermediate_size 1856, moe_shared_expert_intermediate_size 3712,
routed_scaling_factor 2.5, n_group 1, topk_group 1, norm_topk_prob true, mlp_hidden_act relu2,
layer_norm_epsilon 1e-5.

Scaled: depth to the pattern's first 7 layers ("MEMEM*E": Mamba and MoE alternating, one attention);
widths divided (hidden 2688/42 = 64; heads, head dims, Mamba heads and groups, state by 4; experts by
16 and top-k by 2; expert widths by 58); what is not a size (routed_scaling_factor, chunk_size,
norm_topk_prob, n_group, the kv heads 2) as published. So against the project's tiny_nemotron_h it
differs in layer pattern, attention heads and head dim, Mamba heads / state / chunk, expert count,
top-k and routing scale: a user's checkpoint will not look like our recipe.
"""

from __future__ import annotations

from pathlib import Path

NANO_30B_A3B_SCALED = dict(
    family="nemotron_h", hidden_size=64, hybrid_override_pattern="MEMEM*E",
    num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    mamba_num_heads=16, mamba_head_dim=16, n_groups=2, ssm_state_size=32, chunk_size=128, conv_kernel=4,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64, intermediate_size=32, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    norm_topk_prob=True, mlp_hidden_act="relu2")


# The same with the released architecture's additions, other than tiny_nemotron3's: LatentMoE in a width
# of 16 (a quarter of hidden, as Super's 1024 of 4096) and two MTP steps of one MoE layer each (Megatron-
# Bridge's Ultra recipes train 2 MTP layers; the recipe has one step of attention + MoE).
NANO_SCALED_LATENT_MTP = dict(NANO_30B_A3B_SCALED, moe_latent_size=16, num_nextn_predict_layers=2,
                              mtp_hybrid_override_pattern="E")


def build_nano_latent_mtp(out_dir: Path) -> Path:
    """NANO_SCALED_LATENT_MTP's checkpoint (MTP tensors as workers.tiny_models writes them) in out_dir."""
    from workers import tiny_models

    return tiny_models.build(out_dir, "nemotron_3_nano_scaled_latent_mtp", spec=NANO_SCALED_LATENT_MTP)


def build_nano_scaled(out_dir: Path) -> Path:
    """The scaled Nemotron-3-Nano checkpoint (random weights, the tiny models' tokenizer) in out_dir."""
    from workers import tiny_models

    return tiny_models.build(out_dir, "nemotron_3_nano_30b_a3b_scaled", spec=NANO_30B_A3B_SCALED)


# The reference topology's placement smoke (tests/slurm/test_ultra_placement.py) builds no model, but
# validation checks the model's facts against ultra_6n4g: EP16 must divide the experts, the TP8 engine
# the attention heads, train TP2 the KV groups, Mamba heads and groups. The stand-in for Nemotron 3 Ultra
# is the built-in recipe of the released architecture, tiny_nemotron3 (LatentMoE with 16 experts, 8
# attention heads in 2 KV groups, Mamba 8 heads in 2 groups, MTP layers), whose facts divide them all.
ULTRA_STAND_IN = ["model=tiny_nemotron3"]
