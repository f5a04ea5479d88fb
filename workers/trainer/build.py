"""Building one trainer rank: process group, megatron parallel state, seeds, the model through
Megatron-Bridge (LoRA or full fine-tuning), the megatron-core optimizer and its scheduler.

Megatron is imported inside the functions, on purpose: this module comes with the trainer actor
class, which the driver imports too, and megatron must not be imported there (on CPU
`workers.cpu_shim.apply` has to patch first, and an imported megatron.core changes how every
tensor pickles: see workers.trainer.state.portable_tensor_pickles).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch

from workers import cpu_shim
from workers.trainer import bridge_fixes, provider_facts, provider_settings
from workers.trainer.config import ParallelConfig, PeftConfig, TrainerConfig

INIT_TIMEOUT_S = 600.0   # every rank of the group has joined within this (Ray starts them together)


def torch_dtype(name: Optional[str]):
    return None if name in (None, "null", "") else getattr(torch, str(name).replace("torch.", ""))


def join_process_group(cfg: TrainerConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """gloo on CPU, nccl on cuda (one GPU per rank), rendezvous at master_addr:master_port."""
    if torch.distributed.is_initialized():
        return
    is_cpu = cpu_shim.is_cpu(cfg.device)
    if not is_cpu:
        torch.cuda.set_device(0)  # Ray / Slurm expose exactly one GPU to each trainer rank
    torch.distributed.init_process_group(
        "gloo" if is_cpu else "nccl", init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank, world_size=world_size, timeout=timedelta(seconds=INIT_TIMEOUT_S))


def init_parallel_state(p: ParallelConfig, world_size: int):
    """megatron parallel_state for TP/PP/CP/EP (once per process); returns the module."""
    from megatron.core import parallel_state as ps

    model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of TP*PP*CP = {model_parallel}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=p.pipeline_parallel,
            context_parallel_size=p.context_parallel, expert_model_parallel_size=p.expert_parallel,
            expert_tensor_parallel_size=p.expert_tensor_parallel,
            create_gloo_process_groups=True)
    return ps


def seed_everything(seed: int, is_cpu: bool) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    # The same CPU seed on every rank: with CPU initialisation megatron draws each full LoRA-A
    # on every rank and keeps its TP slice, so TP=1 and TP=2 start from the same adapters.
    torch.manual_seed(seed)
    # On CPU megatron's CUDA RNG tracker must be the inert "inference" one (it asserts CUDA).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=is_cpu)


@dataclass
class BuiltModel:
    bridge: Any                # megatron.bridge AutoBridge of the HF checkpoint
    provider: Any              # its model provider (finalized; sequence_parallel, should_pad_vocab, ...)
    model: list                # megatron DDP-wrapped model chunks
    model_config: Any          # megatron TransformerConfig of model[0]
    vocab_size: int            # the HF vocabulary (megatron may pad it for TP)
    lora: Any                  # megatron.bridge LoRA, or None for full fine-tuning
    num_parameters: dict
    peft_statistics: str


def build_model(cfg: TrainerConfig, rank: int) -> BuiltModel:
    """The model from the local HF directory, LoRA applied before DDP wrapping."""
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.utils import get_model_config

    is_cpu = cpu_shim.is_cpu(cfg.device)
    bridge_fixes.apply()  # Megatron-Bridge defects (Mamba in_proj LoRA in the merged export)
    dtype = torch_dtype(cfg.dtype) or torch.float32
    facts = cfg.facts  # the run's facts (config.yaml): what Megatron must build, and vLLM loads
    facts_from = (cfg.model or {}).get("facts_from") or f"{cfg.model_path}/config.json"
    bridge = AutoBridge.from_hf_pretrained(cfg.model_path)  # no dtype=: it leaks into the tokenizer
    provider_facts.without_mtp(bridge)  # GRPO trains the model, not its MTP layers (docs/nemotron_h.md)
    provider = bridge.to_megatron_provider(load_weights=True)
    # the layout, MoE, recompute, attention and fusion settings (workers.trainer.provider_settings)
    for note in provider_settings.apply(provider, cfg, is_cpu, have_te=_have_transformer_engine(),
                                        hf_config=bridge.hf_pretrained.config):
        if rank == 0:
            print(f"note: {note}", flush=True)  # the trainer rank's log
    provider.params_dtype = dtype
    provider_facts.apply(provider, facts)
    provider.finalize()
    differ = provider_facts.check(provider, facts)
    if differ:
        raise ValueError(f"the model Megatron-Bridge built from {cfg.model_path} is not the run's ({facts_from}): "
                         f"{'; '.join(differ)}")
    peft: dict = {}
    # after the bridge's weight-loading hook
    provider.register_pre_wrap_hook(lambda model: apply_peft(model, cfg.peft, cfg.seed, rank, peft))

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    # The bridge's DDP wrapping runs under a torch.cuda.Stream; on CPU wrap with megatron's
    # DDP ourselves (the same class, without the stream).
    model = provider.provide_distributed_model(
        ddp_config=ddp_config, wrap_with_ddp=not is_cpu, use_cpu_initialization=is_cpu,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        **({} if low_precision else {"mixed_precision_wrapper": None}))
    if is_cpu:
        model = [DistributedDataParallel(config=get_model_config(chunk), ddp_config=ddp_config, module=chunk)
                 for chunk in model]
        for chunk in model:
            chunk.broadcast_params()
    model_config = get_model_config(model[0])
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = model[0].no_sync
    return BuiltModel(bridge=bridge, provider=provider, model=model, model_config=model_config,
                      vocab_size=int(bridge.hf_pretrained.config.vocab_size), **peft)


def apply_peft(model: list, pc: PeftConfig, seed: int, rank: int, out: dict) -> list:
    """Pre-wrap hook: LoRA (or full fine-tuning), router freezing (with LoRA, or freeze_moe_router: its
    weights and its expert bias), PEFT statistics (into `out`)."""
    lora = None
    if pc.enabled:
        from megatron.bridge.peft.lora import LoRA

        torch.manual_seed(seed)  # adapters start identical whatever ran before
        lora = LoRA(target_modules=list(pc.target_modules), dim=pc.dim, alpha=pc.alpha,
                    dropout=pc.dropout, dropout_position=pc.dropout_position,
                    lora_A_init_method=pc.lora_A_init_method,
                    lora_B_init_method=pc.lora_B_init_method, lora_dtype=torch_dtype(pc.lora_dtype))
        model = lora(model, training=True)
        _inherit_partition_sizes(model)
    if pc.enabled or pc.freeze_moe_router:
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    for param in module.parameters():
                        param.requires_grad = False  # LoRA has frozen them already
                    # the expert bias is a buffer: finalize_model_grads updates it unless this is set
                    # (trainer and generator would drift apart, and checkpoints do not hold it)
                    module.frozen_expert_bias = True
    total = sum(p.numel() for chunk in model for p in chunk.parameters())
    trainable = sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)
    statistics = ("PEFT Statistics:\n"
                  f"  Total parameters: {total:,}\n"
                  f"  Trainable parameters: {trainable:,}\n"
                  f"  Trainable percentage: {100 * trainable / total:.2f}%")
    if rank == 0:
        print(statistics, flush=True)
    out.update(lora=lora, num_parameters={"total": total, "trainable": trainable}, peft_statistics=statistics)
    return model


def _inherit_partition_sizes(model: list) -> None:
    """A LoRA-B (adapter.linear_out) has the rows of the linear it wraps: where that weight is
    block-interleaved over TP ranks (megatron's `partition_sizes`: a Mamba in_proj holds [z, x, B, C, dt]
    per rank), so is the B, and workers.trainer.gather gathers both by those blocks."""
    for chunk in model:
        for module in chunk.modules():
            sizes = getattr(getattr(getattr(module, "to_wrap", None), "weight", None), "partition_sizes", None)
            out = getattr(getattr(module, "adapter", None), "linear_out", None)
            if sizes is not None and out is not None:
                out.weight.partition_sizes = list(sizes)


def build_optimizer(cfg: TrainerConfig, model: list, model_config):
    """megatron-core's optimizer over the trainable parameters; hooks its loss scaling into the model."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = cfg.optim
    dtype = torch_dtype(cfg.dtype) or torch.float32
    optimizer_config = OptimizerConfig(
        optimizer=oc.optimizer, lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
        adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps, clip_grad=oc.clip_grad,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    with cpu_shim.cuda_factories_on_cpu(cfg.device):
        optimizer = get_megatron_optimizer(optimizer_config, model)
    model_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def make_scheduler(optimizer, cfg: TrainerConfig):
    """megatron's scheduler with the arguments launcher.config.job_limits.scheduler_args gives (the
    launcher checks those at submission and the job again before it starts: what this refuses)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from launcher.config.job_limits import scheduler_args

    return OptimizerParamScheduler(optimizer, **scheduler_args(cfg.optim, cfg.max_num_steps))


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401  (a probe: absent on CPU machines)
    except Exception:
        return False
    return True
