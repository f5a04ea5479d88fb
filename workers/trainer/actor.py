"""Megatron LoRA trainer: one rank of the policy, usable as a plain object or inside a Ray actor.

`MegatronTrainer(config, rank, world_size, master_addr, master_port)` joins a torch.distributed
group (gloo on CPU, nccl on cuda), initialises megatron `parallel_state` from the topology's
train section, builds the model from a local HF directory through Megatron-Bridge, wraps the
targeted linears with Megatron-Bridge LoRA (only adapters train; `peft.enabled=false` trains
everything), and sets up the megatron-core optimizer + OptimizerParamScheduler.

Methods (all ranks of the group call each one together: they are collective):
  logprobs(batch, adapters=True)  per-token logprobs; adapters=False is the reference policy
                                  (the pretrained weights, without a second model copy)
  train(batch)                    one optimizer step of the GRPO loss on this rank's DP shard
  export_merged()                 (hf_name, tensor) with LoRA merged, behind the refit guard
  adapter_state(), lora_config()  full (TP-gathered) LoRA factors under Megatron names
  save_state(dir), load_state(dir) adapter + optimizer + scheduler + RNG, megatron dist_checkpointing
                                  (torch_dist), resharding-safe (saved at TP=2, loads at TP=1)
Batches follow docs/architecture.md. CPU specifics all live in workers.cpu_shim; the cuda path
(nccl, Transformer Engine layer spec when importable, distributed optimizer) is the same code
behind `is_cpu(device)`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Iterator, Optional

from workers import cpu_shim
from launcher.config.schema import Optim, Peft, TrainRole, from_dict
from workers.trainer.loss import LossConfig, grpo_loss, loss_config

# --------------------------------------------------------------------------- configuration


# The config sections are launcher.config.schema's dataclasses (one definition of every key):
# topology.train, peft, optim and grpo.loss.
ParallelConfig, PeftConfig, OptimConfig = TrainRole, Peft, Optim


@dataclass
class TrainerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 1234
    max_num_steps: int = 10  # scheduler decay steps when optim.lr_decay_iters is null
    micro_batch_size: int = 0  # sequences per micro-batch; 0: the rank's whole shard at once
    activation_checkpointing: bool = False
    init_timeout_s: float = 600.0
    megatron_log_level: str = "WARNING"  # megatron's INFO logs list every bucket and config field
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    @classmethod
    def from_sections(cls, model_path: str, *, parallel: dict | None = None, peft: dict | None = None,
                      optim: dict | None = None, loss: dict | None = None, **top) -> "TrainerConfig":
        """Build from plain config sections (topology.train, peft, optim, grpo.loss) + top-level keys."""
        cfg = from_dict(cls, {"model_path": str(model_path), **top}, "trainer")
        cfg.parallel = from_dict(TrainRole, parallel, "topology.train")
        cfg.peft = from_dict(Peft, peft, "peft")
        cfg.optim = from_dict(Optim, optim, "optim")
        cfg.loss = loss_config(loss)
        cfg.check()
        return cfg

    @classmethod
    def from_run_config(cls, cfg: dict, model_path: str, **top) -> "TrainerConfig":
        """From the composed run config as plain data (OmegaConf.to_container(cfg, resolve=True))."""
        return cls.from_sections(
            model_path, parallel=cfg["topology"]["train"], peft=cfg["peft"], optim=cfg["optim"],
            loss=cfg["grpo"]["loss"], **{"device": cfg["topology"]["device"], "dtype": cfg["model"]["dtype"],
                                         "seed": cfg["run"]["seed"], "max_num_steps": cfg["grpo"]["max_num_steps"],
                                         **top})

    def check(self) -> None:
        if self.peft.enabled and not self.peft.target_modules:
            raise ValueError("peft.enabled needs a non-empty peft.target_modules")
        if self.peft.enabled and self.peft.dim <= 0:
            raise ValueError("peft.enabled needs peft.dim > 0")
        if self.optim.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer must be adam or sgd, got {self.optim.optimizer!r}")
        if self.parallel.sequence_parallel and cpu_shim.is_cpu(self.device) and self.parallel.tensor_parallel > 1:
            raise ValueError("sequence_parallel needs Transformer Engine (or Apex) norms; megatron's torch "
                             "norms assert without them, so it is not available on CPU")
        if self.parallel.context_parallel != 1:
            raise ValueError("context_parallel > 1 is not supported by the trainer's data path yet")

    @property
    def use_distributed_optimizer(self) -> bool:
        flag = self.optim.use_distributed_optimizer
        if flag == "auto":
            return not cpu_shim.is_cpu(self.device)  # megatron's distributed optimizer refuses CPU
        return bool(flag)


# --------------------------------------------------------------------------- small helpers

def guard_refit_names(named_tensors):
    """Yield (name, tensor) pairs, raising on an unmerged PEFT name (vLLM cannot load those)."""
    from workers.refit.wire import guard_names

    return guard_names(named_tensors)


def node_address() -> tuple[str, int]:
    """This node's IP and a currently free TCP port on it (for the process-group rendezvous)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # not inside Ray
        ip = socket.gethostbyname(socket.gethostname())
    from launcher.cluster.ray_node import free_port

    return ip, free_port()


def _torch_dtype(name: Optional[str]):
    import torch

    return None if name in (None, "null", "") else getattr(torch, str(name).replace("torch.", ""))


# --------------------------------------------------------------------------- the trainer


class MegatronTrainer:
    def __init__(self, config: TrainerConfig | dict, rank: int, world_size: int,
                 master_addr: Optional[str] = None, master_port: Optional[int] = None):
        if isinstance(config, dict):
            config = TrainerConfig.from_sections(**config)
        self.cfg = config
        self.rank = rank
        self.world_size = world_size
        self.device = config.device
        self.is_cpu = cpu_shim.is_cpu(config.device)
        self.step = 0
        self.model = None
        if master_addr is not None and master_port is not None:
            self.setup(master_addr, master_port)

    # ----------------------------------------------------------------- setup
    def node_address(self) -> tuple[str, int]:
        return node_address()

    def where(self) -> dict:
        """Where this rank runs (answers before setup)."""
        return {"rank": self.rank, "node_ip": node_address()[0], "hostname": socket.gethostname(),
                "pid": os.getpid()}

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the process group at master_addr:master_port, build model + optimizer; returns info()."""
        logging.getLogger("megatron").setLevel(self.cfg.megatron_log_level)  # before megatron imports
        cpu_shim.apply(self.device)
        import torch
        from datetime import timedelta

        t0 = time.time()
        if not torch.distributed.is_initialized():
            if not self.is_cpu:
                torch.cuda.set_device(0)  # Ray / Slurm expose exactly one GPU to each trainer rank
            torch.distributed.init_process_group(
                "gloo" if self.is_cpu else "nccl", init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=self.cfg.init_timeout_s))
        _portable_tensor_pickles()
        self._init_parallel_state()
        self._seed_everything()
        self._build_model()
        self._build_optimizer()
        self.setup_seconds = time.time() - t0
        return self.info()

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps

        p = self.cfg.parallel
        model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
        if self.world_size % model_parallel:
            raise ValueError(f"world size {self.world_size} is not a multiple of TP*PP*CP = {model_parallel}")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=p.pipeline_parallel,
                context_parallel_size=p.context_parallel, expert_model_parallel_size=p.expert_parallel,
                expert_tensor_parallel_size=p.expert_tensor_parallel,
                create_gloo_process_groups=True)
        self.ps = ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()

    def _seed_everything(self) -> None:
        import numpy as np
        import torch
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        seed = self.cfg.seed
        random.seed(seed)
        np.random.seed(seed)
        # The same CPU seed on every rank: with CPU initialisation megatron draws each full LoRA-A
        # on every rank and keeps its TP slice, so TP=1 and TP=2 start from the same adapters.
        torch.manual_seed(seed)
        # On CPU megatron's CUDA RNG tracker must be the inert "inference" one (it asserts CUDA).
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=self.is_cpu)

    def _build_model(self) -> None:
        import torch
        from megatron.bridge import AutoBridge
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.utils import get_model_config

        cfg, p = self.cfg, self.cfg.parallel
        dtype = _torch_dtype(cfg.dtype) or torch.float32
        self.bridge = AutoBridge.from_hf_pretrained(cfg.model_path)  # no dtype=: it leaks into the tokenizer
        self.vocab_size = int(self.bridge.hf_pretrained.config.vocab_size)
        provider = self.bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = p.tensor_parallel
        provider.pipeline_model_parallel_size = p.pipeline_parallel
        provider.context_parallel_size = p.context_parallel
        provider.expert_model_parallel_size = p.expert_parallel
        provider.expert_tensor_parallel_size = p.expert_tensor_parallel
        provider.sequence_parallel = p.sequence_parallel and p.tensor_parallel > 1
        provider.params_dtype = dtype
        if provider.vocab_size % p.tensor_parallel:
            provider.should_pad_vocab = True  # megatron splits the vocab evenly over TP ranks
        if cfg.activation_checkpointing:
            provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = \
                "full", "uniform", 1
        if self.is_cpu or not _have_transformer_engine():
            from megatron.bridge.models.gpt_provider import local_layer_spec

            if hasattr(provider, "transformer_layer_spec"):
                provider.transformer_layer_spec = local_layer_spec
        if self.is_cpu:  # fused kernels are CUDA-only
            for flag in ("apply_rope_fusion", "persist_layer_norm", "bias_activation_fusion",
                         "masked_softmax_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion",
                         "gradient_accumulation_fusion"):
                if hasattr(provider, flag):
                    setattr(provider, flag, False)
        provider.finalize()
        provider.register_pre_wrap_hook(self._apply_peft)  # after the bridge's weight-loading hook

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        low_precision = dtype in (torch.bfloat16, torch.float16)
        # The bridge's DDP wrapping runs under a torch.cuda.Stream; on CPU wrap with megatron's
        # DDP ourselves (the same class, without the stream).
        model = provider.provide_distributed_model(
            ddp_config=ddp_config, wrap_with_ddp=not self.is_cpu, use_cpu_initialization=self.is_cpu,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            **({} if low_precision else {"mixed_precision_wrapper": None}))
        if self.is_cpu:
            model = [DistributedDataParallel(config=get_model_config(chunk), ddp_config=ddp_config, module=chunk)
                     for chunk in model]
            for chunk in model:
                chunk.broadcast_params()
        self.model = model
        self.model_config = get_model_config(self.model[0])
        self.model_config.finalize_model_grads_func = finalize_model_grads
        self.model_config.no_sync_func = self.model[0].no_sync
        self.provider = provider

    def _apply_peft(self, model: list) -> list:
        """Pre-wrap hook: LoRA (or full fine-tuning), router freezing, PEFT statistics."""
        import torch

        pc = self.cfg.peft
        self.lora = None
        if pc.enabled:
            from megatron.bridge.peft.lora import LoRA

            torch.manual_seed(self.cfg.seed)  # adapters start identical whatever ran before
            self.lora = LoRA(target_modules=list(pc.target_modules), dim=pc.dim, alpha=pc.alpha,
                             dropout=pc.dropout, dropout_position=pc.dropout_position,
                             lora_A_init_method=pc.lora_A_init_method,
                             lora_B_init_method=pc.lora_B_init_method, lora_dtype=_torch_dtype(pc.lora_dtype))
            model = self.lora(model, training=True)
        if pc.freeze_moe_router:
            from megatron.core.transformer.moe.router import TopKRouter

            for chunk in model:
                for module in chunk.modules():
                    if isinstance(module, TopKRouter):
                        for param in module.parameters():
                            param.requires_grad = False
        total = sum(p.numel() for chunk in model for p in chunk.parameters())
        trainable = sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)
        self.num_parameters = {"total": total, "trainable": trainable}
        self.peft_statistics = ("PEFT Statistics:\n"
                                f"  Total parameters: {total:,}\n"
                                f"  Trainable parameters: {trainable:,}\n"
                                f"  Trainable percentage: {100 * trainable / total:.2f}%")
        if self.rank == 0:
            print(self.peft_statistics, flush=True)
        return model

    def _build_optimizer(self) -> None:
        import torch
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        oc, cfg = self.cfg.optim, self.cfg
        dtype = _torch_dtype(cfg.dtype) or torch.float32
        self.optimizer_config = OptimizerConfig(
            optimizer=oc.optimizer, lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
            adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps, clip_grad=oc.clip_grad,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        with cpu_shim.cuda_factories_on_cpu(self.device):
            self.optimizer = get_megatron_optimizer(self.optimizer_config, self.model)
        self.model_config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = self._make_scheduler()

    def _make_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        oc = self.cfg.optim
        decay_steps = oc.lr_decay_iters or self.cfg.max_num_steps
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=oc.lr, min_lr=oc.min_lr, lr_warmup_steps=oc.lr_warmup_iters,
            lr_decay_steps=decay_steps, lr_decay_style=oc.lr_decay_style, start_wd=oc.weight_decay,
            end_wd=oc.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=oc.override_opt_param_scheduler)

    def info(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "node_ip": node_address()[0],
                "hostname": socket.gethostname(), "pid": os.getpid(), "device": self.device,
                "dp_rank": self.dp_rank, "dp_size": self.dp_size, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "pp_rank": self.pp_rank, "pp_size": self.pp_size,
                "is_output_rank": self._is_output_rank(), "peft_statistics": self.peft_statistics,
                "num_parameters": self.num_parameters, "step": self.step}

    def _is_output_rank(self) -> bool:
        """One rank per DP shard returns results (TP rank 0 of the last pipeline stage)."""
        return self.tp_rank == 0 and self.ps.is_pipeline_last_stage()

    # ----------------------------------------------------------------- forward plumbing
    @property
    def _module(self):
        """The bare GPTModel (under megatron DDP and, for bf16/fp16, Float16Module)."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model[0])

    @property
    def _comm_device(self):
        """Where small tensors for collectives live (NCCL only reduces CUDA tensors)."""
        import torch

        return torch.device("cpu") if self.is_cpu else torch.device("cuda", torch.cuda.current_device())

    def _seq_multiple(self) -> int:
        return self.cfg.parallel.tensor_parallel if self.provider.sequence_parallel else 1

    def _microbatches(self, batch: dict) -> list[dict]:
        import torch

        device = "cpu" if self.is_cpu else torch.cuda.current_device()
        ids = batch["input_ids"]
        b, t = ids.shape
        t_pad = math.ceil(t / self._seq_multiple()) * self._seq_multiple()
        mbs = self.cfg.micro_batch_size or b
        out = []
        for start in range(0, b, mbs):
            mb = {}
            for key, value in batch.items():
                if isinstance(value, torch.Tensor) and value.dim() == 2:
                    value = torch.nn.functional.pad(value[start:start + mbs], (0, t_pad - t))
                elif isinstance(value, torch.Tensor):
                    value = value[start:start + mbs]
                else:
                    continue
                mb[key] = value.to(device)
            out.append(mb)
        return out

    def _token_logprobs(self, logits, input_ids):
        """log p(input_ids[t] | :t) from vocab-parallel logits [B, T, V/TP]; position 0 gets 0."""
        import torch
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float()
        local_vocab = logits.shape[-1]
        first = self.tp_rank * local_vocab
        if first + local_vocab > self.vocab_size:  # megatron pads the vocab to a multiple of TP
            padded = torch.arange(first, first + local_vocab, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        targets = torch.roll(input_ids, shifts=-1, dims=1)
        nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
        nll = nll.transpose(0, 1)
        return torch.cat([torch.zeros_like(nll[:, :1]), -nll[:, :-1]], dim=1)

    def _forward_step(self, loss_fn, data_iterator, model):
        import torch

        mb = next(data_iterator)
        ids = mb["input_ids"]
        b, t = ids.shape
        position_ids = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
        logits = model(ids, position_ids, causal)
        return logits, partial(loss_fn, mb)

    def _run(self, microbatches: list[dict], loss_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t_pad = microbatches[0]["input_ids"].shape[1]
        with cpu_shim.cuda_factories_on_cpu(self.device):
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(microbatches),
                model=self.model, num_microbatches=len(microbatches), seq_length=t_pad,
                micro_batch_size=microbatches[0]["input_ids"].shape[0], forward_only=forward_only,
                collect_non_loss_data=forward_only)

    def _from_last_stage(self, value):
        """Pipeline parallelism: results exist on the last stage only; share them with the group."""
        import torch

        if self.pp_size == 1:
            return value
        holder = [value]
        src = torch.distributed.get_global_rank(self.ps.get_pipeline_model_parallel_group(), self.pp_size - 1)
        torch.distributed.broadcast_object_list(holder, src=src, group=self.ps.get_pipeline_model_parallel_group())
        return holder[0]

    # ----------------------------------------------------------------- public API
    def logprobs(self, batch: dict, adapters: bool = True):
        """float32 [B, T] logprobs of this rank's shard; None on ranks that are not output ranks."""
        import torch

        if not adapters and self.lora is None:
            raise ValueError("adapters=False (the reference policy) needs peft.enabled; full fine-tuning "
                             "changes the base weights themselves")
        t = batch["input_ids"].shape[1]
        microbatches = self._microbatches({"input_ids": batch["input_ids"]})

        def collect(mb, output, non_loss_data=False):
            return self._token_logprobs(output, mb["input_ids"]).detach()

        for chunk in self.model:
            chunk.eval()
        adapters_off = self.lora.disable_adapter(self.model) if not adapters else nullcontext()
        with torch.no_grad(), adapters_off:
            out = self._run(microbatches, collect, forward_only=True)
        result = self._from_last_stage(torch.cat(out).float().cpu()[:, :t] if out else None)
        return result if self.tp_rank == 0 else None

    def train(self, batch: dict) -> dict:
        """One optimizer step of the GRPO loss on this rank's DP shard of the global batch."""
        import torch

        t0 = time.time()
        mask = batch["loss_mask"].float()
        local = torch.tensor([mask.sum().item(), float((mask.sum(dim=1) > 0).sum().item())], dtype=torch.float64,
                             device=self._comm_device)
        torch.distributed.all_reduce(local, group=self.ps.get_data_parallel_group(with_context_parallel=True))
        normalizer = float(local[0].item() if self.cfg.loss.token_level_loss else local[1].item())
        keys = ["input_ids", "loss_mask", "advantages", "prev_logprobs", "generation_logprobs",
                "reference_logprobs"]
        microbatches = self._microbatches({k: batch[k] for k in keys if batch.get(k) is not None})
        # The schedule divides each micro-batch loss by their number and DDP averages over DP;
        # undo both so that the summed gradient is that of the global-batch loss.
        scale = len(microbatches) * self.dp_size

        def loss_fn(mb, output):
            lp = self._token_logprobs(output, mb["input_ids"])
            loss, metrics = grpo_loss(lp, mb["prev_logprobs"], mb["advantages"], mb["loss_mask"], self.cfg.loss,
                                      generation_logprobs=mb.get("generation_logprobs"),
                                      reference_logprobs=mb.get("reference_logprobs"), normalizer=normalizer)
            metrics["loss"] = float(loss.detach())
            return loss * scale, metrics

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_microbatch = self._run(microbatches, loss_fn, forward_only=False)
        with cpu_shim.cuda_factories_on_cpu(self.device):
            updated, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        self.step += 1
        metrics = self._reduce_metrics(per_microbatch)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=float(lr),
                       update_successful=bool(updated), step=self.step, train_seconds=time.time() - t0)
        return metrics

    def _reduce_metrics(self, per_microbatch: list[dict]) -> dict:
        """Token-weighted means over micro-batches and DP ranks; the loss is summed (it is global)."""
        import torch

        names = ["clip_fraction_low", "clip_fraction_high", "dual_clip_fraction", "kl", "is_weight_mean",
                 "ratio_mean"]
        values = torch.zeros(len(names) + 2, dtype=torch.float64)
        for m in self._from_last_stage(per_microbatch) or []:
            values[:len(names)] += torch.tensor([m[n] * m["num_tokens"] for n in names], dtype=torch.float64)
            values[len(names)] += m["num_tokens"]
            values[len(names) + 1] += m["loss"]
        values = values.to(self._comm_device)
        torch.distributed.all_reduce(values, group=self.ps.get_data_parallel_group(with_context_parallel=True))
        values = values.cpu()
        tokens = max(values[len(names)].item(), 1.0)
        out = {n: values[i].item() / tokens for i, n in enumerate(names)}
        out.update(loss=values[len(names) + 1].item(), num_tokens=values[len(names)].item())
        return out

    # ----------------------------------------------------------------- weights out
    def export_merged(self, merge_adapters: Optional[bool] = None) -> Iterator[tuple[str, Any]]:
        """HF-named weights, LoRA merged in (plain weights for full fine-tuning), refit-guarded.

        Collective over the model-parallel group: every rank must drain it; every rank gets full
        tensors. merge_adapters overrides the default (merge iff LoRA) - only to exercise the guard.
        """
        merge = self.lora is not None if merge_adapters is None else merge_adapters
        weights = self.bridge.export_hf_weights(self.model, cpu=True, show_progress=False,
                                                merge_adapter_weights=merge)
        return guard_refit_names(self._unpad_vocab(weights))

    def _unpad_vocab(self, weights):
        """Drop the rows megatron added to make the vocab divisible by TP (the bridge exports them)."""
        if not getattr(self.provider, "should_pad_vocab", False):
            yield from weights
            return
        hf_rows = _hf_first_dims(self.cfg.model_path)
        for name, tensor in weights:
            rows = hf_rows.get(name)
            yield name, (tensor[:rows] if rows is not None and tensor.dim() and tensor.shape[0] > rows else tensor)

    def export_merged_state(self, keep: bool | str = True, merge_adapters: Optional[bool] = None):
        """export_merged() drained into a list (returned by rank 0 only when keep='rank0')."""
        pairs = list(self.export_merged(merge_adapters))
        return pairs if keep is True or (keep == "rank0" and self.rank == 0) else None

    def refit_payload(self, mode: str, bucket_mb: int):
        from workers.refit import wire as refit

        return refit.trainer_payload(self, mode, bucket_mb)

    def open_refit_group(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        """Rank 0 only: host workers.refit's broadcast group (blocks until the generators join)."""
        from workers.refit import wire as refit

        refit.open_sender_group(host, port, world_size, backend)

    def close_refit_group(self) -> None:
        from workers.refit import wire as refit

        refit.close_sender_group()

    def lora_config(self) -> dict:
        pc, mc = self.cfg.peft, self.model_config
        return {"enabled": pc.enabled, "dim": pc.dim, "alpha": pc.alpha, "target_modules": list(pc.target_modules),
                "dropout": pc.dropout, "dropout_position": pc.dropout_position,
                "num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
                "num_attention_heads": mc.num_attention_heads, "num_query_groups": mc.num_query_groups,
                "head_dim": mc.kv_channels, "ffn_hidden_size": mc.ffn_hidden_size,
                "gated_linear_unit": bool(mc.gated_linear_unit)}

    def adapter_state(self) -> dict:
        """{megatron name: full LoRA factor} (A = linear_in [r, in], B = linear_out [out, r]), TP-gathered."""
        if self.lora is None:
            return {}
        return self._full_named({n: p for n, p in self._module.named_parameters() if ".adapter." in n},
                                lambda name, param: param.detach())

    def optimizer_state(self) -> dict:
        """{name: {"exp_avg": full tensor, "exp_avg_sq": ..., "step": ...}} of the trainable parameters."""
        if self.cfg.use_distributed_optimizer:
            raise NotImplementedError("optimizer_state() reads the plain optimizer (not the distributed one)")
        inner = self.optimizer.optimizer
        trainable = {n: p for n, p in self._module.named_parameters() if p.requires_grad}
        keys = sorted({k for p in trainable.values() for k in inner.state.get(p, {})})
        out: dict = {}
        for key in keys:
            full = self._full_named(trainable, lambda name, param: _as_tensor(inner.state[param][key], param))
            for name, tensor in full.items():
                out.setdefault(name, {})[key] = tensor
        return out

    def parameters_snapshot(self) -> dict:
        """{name: this rank's local tensor} of every parameter (for tests and debugging)."""
        return {n: p.detach().float().cpu().clone() for n, p in self._module.named_parameters()}

    def _full_named(self, params: dict, value_of) -> dict:
        """Gather value_of(name, param) over TP (then PP) into full tensors under global layer names."""
        import torch

        state = {}
        offset = self._layer_offset()
        for name, param in params.items():
            tensor = value_of(name, param)
            if tensor.dim() == 0 or not getattr(param, "tensor_model_parallel", False) or self.tp_size == 1:
                full = tensor.float().cpu().clone()
            else:
                if getattr(param, "allreduce", True) is False or ".experts." in name:
                    raise NotImplementedError(f"expert parameter {name} is not gathered over EP")
                full = self._gather_tp(tensor, param.partition_dim, name)
            state[self._global_layer_name(name, offset)] = full
        if self.pp_size > 1:
            parts = [None] * self.pp_size
            torch.distributed.all_gather_object(parts, state, group=self.ps.get_pipeline_model_parallel_group())
            state = {k: v for part in parts for k, v in part.items()}
        return state

    def _gather_tp(self, tensor, dim: int, name: str):
        import torch

        shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        torch.distributed.all_gather(shards, tensor.contiguous(), group=self.ps.get_tensor_model_parallel_group())
        gated_rows = "linear_fc1." in name and ".linear_in." not in name and dim == 0
        if gated_rows and self.model_config.gated_linear_unit:
            # each TP rank holds [gate_r; up_r]: the full tensor is [gate_0..gate_n; up_0..up_n]
            halves = [s.chunk(2, dim=dim) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim).float().cpu()
        return torch.cat(shards, dim=dim).float().cpu()

    def _layer_offset(self) -> int:
        if self.pp_size == 1:
            return 0
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return get_transformer_layer_offset(self.model_config)

    @staticmethod
    def _global_layer_name(name: str, offset: int) -> str:
        if not offset or "layers." not in name:
            return name
        head, _, tail = name.partition("layers.")
        index, _, rest = tail.partition(".")
        return f"{head}layers.{int(index) + offset}.{rest}"

    # ----------------------------------------------------------------- checkpoints
    def _trainable_sharded_state_dict(self) -> dict:
        trainable = {n for n, p in self._module.named_parameters() if p.requires_grad}
        sharded = self._module.sharded_state_dict()
        return {k: v for k, v in sharded.items() if k in trainable}

    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {"world_size": self.world_size, "tensor_parallel": p.tensor_parallel,
                "pipeline_parallel": p.pipeline_parallel, "expert_parallel": p.expert_parallel,
                "expert_tensor_parallel": p.expert_tensor_parallel}

    def _optimizer_metadata(self) -> dict:
        # The distributed optimizer (cuda) must save in a format that reshards across TP/DP changes.
        return {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}

    def save_state(self, directory: str) -> None:
        """Adapter (trainable) weights + optimizer + scheduler + RNG, torch_dist format, collective."""
        from megatron.core import dist_checkpointing

        import torch

        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
        torch.distributed.barrier()
        model_sd = self._trainable_sharded_state_dict()
        # Before the first step the optimizer has no state (Adam creates it lazily): save none.
        has_optimizer_state = any(len(s) for s in self.optimizer.optimizer.state.values())
        state = {"model": model_sd,
                 "scheduler": self.scheduler.state_dict(),
                 "trainer": {"step": self.step, "layout": self._layout(), "peft": asdict(self.cfg.peft),
                             "has_optimizer_state": has_optimizer_state},
                 }
        if has_optimizer_state:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, metadata=self._optimizer_metadata())
        with cpu_shim.cuda_factories_on_cpu(self.device):
            dist_checkpointing.save(state, directory)
        _save_rng(os.path.join(directory, "rng", f"rank{self.rank}.safetensors"), self.is_cpu)
        torch.distributed.barrier()

    def load_state(self, directory: str) -> dict:
        """Load what save_state wrote, possibly at another TP/PP/DP layout (RNG then restarts from the seed)."""
        import torch
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(directory)
        same_layout = common["trainer"]["layout"] == self._layout()
        model_sd = self._trainable_sharded_state_dict()
        state = {"model": model_sd}
        if common["trainer"]["has_optimizer_state"]:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                   metadata=self._optimizer_metadata())
        with cpu_shim.cuda_factories_on_cpu(self.device):
            loaded = dist_checkpointing.load(state, directory)
        params = dict(self._module.named_parameters())
        with torch.no_grad():
            for name, tensor in loaded["model"].items():
                params[name].copy_(tensor)
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:  # saved before the first step: a fresh optimizer
            self.optimizer.optimizer.state.clear()
        self.scheduler = self._make_scheduler()  # fresh: load_state_dict adds the saved step count
        self.scheduler.load_state_dict(common["scheduler"])
        self.step = int(common["trainer"]["step"])
        if same_layout:
            _load_rng(os.path.join(directory, "rng", f"rank{self.rank}.safetensors"), self.is_cpu)
        torch.distributed.barrier()
        return {"step": self.step, "rng_restored": same_layout, "saved_layout": common["trainer"]["layout"]}

    def shutdown(self) -> None:
        import torch

        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _portable_tensor_pickles() -> None:
    """Keep tensors returned by this process loadable where megatron is not imported.

    `import megatron.core` replaces torch.storage._load_from_bytes with its weights_only=True
    version, so every tensor pickled afterwards (each Ray return value) names
    megatron.core.safe_globals.safe_load_from_bytes and cannot be unpickled by the driver or a
    vLLM worker without importing megatron (and, on CPU, without our import stubs). Registering
    megatron's function under torch's name keeps its safe behaviour here and the standard name in
    the pickles.
    """
    import torch
    import megatron.core  # noqa: F401  (applies the replacement first)

    loader = torch.storage._load_from_bytes
    loader.__module__, loader.__qualname__, loader.__name__ = "torch.storage", "_load_from_bytes", "_load_from_bytes"


def _hf_first_dims(model_path: str) -> dict[str, int]:
    """{hf name: size of dim 0} read from the safetensors headers of the HF checkpoint."""
    from pathlib import Path

    from safetensors import safe_open

    rows = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if shape:
                    rows[name] = shape[0]
    return rows


def _as_tensor(value, like):
    import torch

    return value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _save_rng(path: str, is_cpu: bool) -> None:
    """This rank's RNG states as plain tensors in a safetensors file: a checkpoint never holds
    pickled Python objects, so loading one cannot run code (a ShardedObject would be unpickled)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python_mt": torch.tensor(mt, dtype=torch.int64),
               "python_meta": torch.tensor([version, gauss is not None], dtype=torch.int64),
               "python_gauss": torch.tensor([gauss or 0.0], dtype=torch.float64),
               "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
               "numpy_meta": torch.tensor([pos, has_gauss], dtype=torch.int64),
               "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
               "torch": torch.get_rng_state()}
    if not is_cpu:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tensors["cuda"] = torch.cuda.get_rng_state()
        for key, state in get_cuda_rng_tracker().get_states().items():
            tensors[f"tracker.{key}"] = state
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def _load_rng(path: str, is_cpu: bool) -> None:
    import numpy as np
    from safetensors.torch import load_file

    t = load_file(path)
    version, has_gauss = t["python_meta"].tolist()
    random.setstate((int(version), tuple(t["python_mt"].tolist()),
                     float(t["python_gauss"][0]) if has_gauss else None))
    pos, np_has_gauss = t["numpy_meta"].tolist()
    np.random.set_state(("MT19937", t["numpy_keys"].numpy().astype(np.uint32), int(pos), int(np_has_gauss),
                         float(t["numpy_gauss"][0])))
    import torch

    torch.set_rng_state(t["torch"])
    if not is_cpu and "cuda" in t:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(t["cuda"])
        get_cuda_rng_tracker().set_states({k.split(".", 1)[1]: v for k, v in t.items() if k.startswith("tracker.")})
