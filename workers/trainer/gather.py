"""Full tensors out of a model-parallel trainer: TP shards gathered, PP stages joined, layer
numbers made global (PP stage k numbers its layers from 0).

Collective: every rank of the trainer group calls these together, and every rank gets the full
tensors. `ps` is megatron's parallel_state module (as workers.trainer.build.init_parallel_state
returns it), `model_config` the model's TransformerConfig.
"""

from __future__ import annotations

from typing import Callable

import torch


def full_named(params: dict, value_of: Callable, ps, model_config) -> dict:
    """Gather value_of(name, param) over TP (then PP) into full tensors under global layer names."""
    tp_size, pp_size = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size()
    state = {}
    offset = layer_offset(pp_size, model_config)
    for name, param in params.items():
        if ep_size > 1 and ".experts." in name:  # local expert numbers: not the global ones (docs/moe.md)
            raise NotImplementedError(f"expert parameter {name} is not gathered over EP ({ep_size} ranks)")
        tensor = value_of(name, param)
        if tensor.dim() == 0 or not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
            full = tensor.float().cpu().clone()
        else:
            if getattr(param, "allreduce", True) is False or ".experts." in name:
                raise NotImplementedError(f"expert parameter {name} is not gathered over EP")
            full = gather_tp(tensor, param.partition_dim, name, ps, bool(model_config.gated_linear_unit),
                             getattr(param, "partition_sizes", None))
        state[global_layer_name(name, offset)] = full
    if pp_size > 1:
        parts = [None] * pp_size
        torch.distributed.all_gather_object(parts, state, group=ps.get_pipeline_model_parallel_group())
        state = {k: v for part in parts for k, v in part.items()}
    return state


def gather_tp(tensor, dim: int, name: str, ps, gated_linear_unit: bool, partition_sizes=None):
    """The full tensor of a TP-sharded parameter (a gated fc1 weight interleaves [gate; up] per rank).

    partition_sizes (megatron's attribute of a block-interleaved parameter, e.g. a Mamba in_proj:
    each rank holds [z_r, x_r, B_r, C_r, dt_r]; build.apply_peft gives its LoRA-B the same): the
    full tensor is each block gathered over the ranks, block after block ([z_0 z_1 .. | x_0 x_1 ..])."""
    shards = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    if partition_sizes:
        blocks = [s.split(list(partition_sizes), dim=dim) for s in shards]
        return torch.cat([b[i] for i in range(len(partition_sizes)) for b in blocks], dim=dim).float().cpu()
    gated_rows = "linear_fc1." in name and ".linear_in." not in name and dim == 0
    if gated_rows and gated_linear_unit:
        # each TP rank holds [gate_r; up_r]: the full tensor is [gate_0..gate_n; up_0..up_n]
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim).float().cpu()
    return torch.cat(shards, dim=dim).float().cpu()


def layer_offset(pp_size: int, model_config) -> int:
    """Global number of this pipeline stage's first layer."""
    if pp_size == 1:
        return 0
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # after the shim

    return get_transformer_layer_offset(model_config)


def global_layer_name(name: str, offset: int) -> str:
    if not offset or "layers." not in name:
        return name
    head, _, tail = name.partition("layers.")
    index, _, rest = tail.partition(".")
    return f"{head}layers.{int(index) + offset}.{rest}"


def adapter_state(module, ps, model_config) -> dict:
    """{megatron name: full LoRA factor} (A = linear_in [r, in], B = linear_out [out, r])."""
    return full_named({n: p for n, p in module.named_parameters() if ".adapter." in n},
                      lambda name, param: param.detach(), ps, model_config)


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron optimizer: one, or one per parameter kind of a
    ChainedOptimizer (an MoE model with trainable expert weights: dense and expert groups)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
