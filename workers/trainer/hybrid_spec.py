"""The hybrid (Nemotron-H: Mamba-2, attention, MLP, MoE layers) stack spec without Transformer Engine.

Why: Megatron-Bridge's HybridModelProvider builds from megatron-core's `hybrid_stack_spec`, which is
Transformer Engine throughout (norms fused into the input linears); megatron-core ships no local
hybrid spec (modelopt's needs TE's norm). Where TE is absent (this CPU machine) the trainer uses
this one, the hybrid counterpart of the GPT `local_layer_spec` it uses for dense models: megatron's
torch norms as separate modules, plain Column/RowParallelLinear, local DotProductAttention, and
SequentialMLP experts (`get_moe_module_spec(use_te=False)`). Parameter names differ from the TE
spec only where the norm is a module of its own (`decoder.layers.N.norm.weight` for Mamba,
`input_layernorm` for attention, `pre_mlp_layernorm` for MLP and MoE layers); Megatron-Bridge's
Nemotron-H mapping names both spellings.

The hybrid stack's final norm is not in the spec (hybrid_block.py builds TENorm itself):
workers.cpu_shim's `hybrid_final_norm` makes it a torch norm.

Megatron is imported inside the function (see workers.trainer.build for why).
"""

from __future__ import annotations

from functools import partial


def local_hybrid_stack_spec(provider):
    """The HybridStack ModuleSpec (Megatron-Bridge calls it with the provider: its expert count)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    experts = getattr(provider, "num_moe_experts", None)
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=get_moe_module_spec(use_te=False, num_experts=experts or 1, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe))
