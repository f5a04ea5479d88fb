"""Megatron LoRA trainer: one rank of the policy, usable as a plain object or inside a Ray actor.

`MegatronTrainer(config, rank, world_size, master_addr, master_port)` joins a torch.distributed
group (gloo on CPU, nccl on cuda), initialises megatron `parallel_state` from the topology's
train section, builds the model from a local HF directory through Megatron-Bridge, wraps the
targeted linears with Megatron-Bridge LoRA (only adapters train; `peft.enabled=false` trains
everything), and sets up the megatron-core optimizer + OptimizerParamScheduler (workers.trainer.build).

Methods (all ranks of the group call each one together: they are collective):
  logprobs(batch, adapters=True)  per-token logprobs; adapters=False is the reference policy
                                  (the pretrained weights, without a second model copy)
  train(batch)                    one optimizer step of the GRPO loss on this rank's DP shard
  export_merged()                 (hf_name, tensor) with LoRA merged (workers.trainer.merged_export),
                                  behind the refit guard
  adapter_state(), lora_config()  full (TP-gathered) LoRA factors under Megatron names (workers.trainer.gather)
  save_state(dir), load_state(dir) adapter + optimizer + scheduler + RNG, megatron dist_checkpointing
                                  (torch_dist), resharding-safe (saved at TP=2, loads at TP=1) (workers.trainer.state)
  refit_payload / open_refit_group / close_refit_group   refit's sender on rank 0 (workers.refit.sender)
Batches follow docs/architecture.md. CPU specifics all live in workers.cpu_shim; the cuda path
(nccl, Transformer Engine layer spec when importable, distributed optimizer) is the same code
behind `is_cpu(device)`. Megatron is imported inside the methods: the driver imports this class
to start the actors and must not import megatron (see workers.trainer.build).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import partial
from typing import Any, Iterator, Optional

import torch

from workers import cpu_shim, hf_checkpoint
from workers.refit.buffers import BufferPool
from workers.refit.sender import Sender
from workers.refit.transports import DEFAULT_TIMEOUT_S
from workers.refit.wire import guard_names
from workers.contracts import TrainerBatch, TrainerInfo
from workers.lora.layout import ModelLayout, hf_lora_groups, lora_numbers
from workers.trainer import build, gather, merged_export, state
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import grpo_loss

MEGATRON_LOG_LEVEL = "WARNING"   # megatron's INFO lines list every bucket and config field


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> tuple[str, int]:
    """This node's IP and a currently free TCP port on it (for the process-group rendezvous)."""
    try:  # ray imported here: the trainer also runs without Ray (tests/gpu on a machine that has none)
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # not inside Ray, or no Ray installed
        ip = socket.gethostbyname(socket.gethostname())
    return ip, free_port()


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()


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
        self.refit_sender = Sender()
        # (phase, time.time() at its end) for the driver's start-up breakdown; the first phase begins
        # when the driver asked Ray for this actor (a prestarted Ray worker makes it 0)
        self.startup = [("Ray worker process start", _process_start()),
                        ("imports (torch, ray, trainer module)", time.time())]
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
        self.startup.append(("waiting for the group (where, rank 0's address)", time.time()))
        logging.getLogger("megatron").setLevel(MEGATRON_LOG_LEVEL)  # before megatron imports
        cpu_shim.apply(self.device)
        build.join_process_group(self.cfg, self.rank, self.world_size, master_addr, master_port)
        state.portable_tensor_pickles()
        self.ps = build.init_parallel_state(self.cfg.parallel, self.world_size)
        self.dp_rank, self.dp_size = self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = (self.ps.get_tensor_model_parallel_rank(),
                                      self.ps.get_tensor_model_parallel_world_size())
        self.pp_rank, self.pp_size = (self.ps.get_pipeline_model_parallel_rank(),
                                      self.ps.get_pipeline_model_parallel_world_size())
        build.seed_everything(self.cfg.seed, self.is_cpu)
        self.startup.append(("process group + parallel state (first megatron import)", time.time()))
        built = build.build_model(self.cfg, self.rank)
        self.startup.append(("Megatron build (Bridge, weights, LoRA)", time.time()))
        self.bridge, self.provider, self.model, self.model_config = (built.bridge, built.provider, built.model,
                                                                     built.model_config)
        self.vocab_size, self.lora = built.vocab_size, built.lora
        self.num_parameters, self.peft_statistics = built.num_parameters, built.peft_statistics
        self.optimizer = build.build_optimizer(self.cfg, self.model, self.model_config)
        self.scheduler = self._make_scheduler()
        self.startup.append(("optimizer + scheduler", time.time()))
        return self.info()

    def _make_scheduler(self):
        return build.make_scheduler(self.optimizer, self.cfg)

    def info(self) -> TrainerInfo:
        return TrainerInfo(rank=self.rank, world_size=self.world_size, node_ip=node_address()[0],
                           hostname=socket.gethostname(), pid=os.getpid(), device=self.device,
                           dp_rank=self.dp_rank, dp_size=self.dp_size, tp_rank=self.tp_rank,
                           tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
                           is_output_rank=self._is_output_rank(), peft_statistics=self.peft_statistics,
                           num_parameters=self.num_parameters, step=self.step, startup=self.startup)

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
        return torch.device("cpu") if self.is_cpu else torch.device("cuda", torch.cuda.current_device())

    def _seq_multiple(self) -> int:
        return self.cfg.parallel.tensor_parallel if self.provider.sequence_parallel else 1

    def _microbatches(self, batch: dict) -> list[dict]:
        device = "cpu" if self.is_cpu else torch.cuda.current_device()
        ids = batch["input_ids"]
        b, t = ids.shape
        t_pad = math.ceil(t / self._seq_multiple()) * self._seq_multiple()
        mbs = self.cfg.parallel.micro_batch_size or b
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
        """log p(input_ids[t] | :t) from vocab-parallel logits [B, T, V/TP]; position 0 gets 0.

        p is the distribution generation samples from: softmax(logits / grpo.temperature)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
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
        if self.pp_size == 1:
            return value
        holder = [value]
        src = torch.distributed.get_global_rank(self.ps.get_pipeline_model_parallel_group(), self.pp_size - 1)
        torch.distributed.broadcast_object_list(holder, src=src, group=self.ps.get_pipeline_model_parallel_group())
        return holder[0]

    # ----------------------------------------------------------------- public API
    def logprobs(self, batch: TrainerBatch, adapters: bool = True):
        """float32 [B, T] logprobs of this rank's shard; None on ranks that are not output ranks."""
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

    def train(self, batch: TrainerBatch) -> dict:
        """One optimizer step of the GRPO loss on this rank's DP shard of the global batch."""
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
    def export_merged(self, buffers: BufferPool | None = None, keep: bool = True) -> Iterator[tuple[str, Any]]:
        """HF-named weights, LoRA merged in (plain weights for full fine-tuning), refit-guarded.

        Collective over the model-parallel group: every rank must drain it; every rank gets full
        tensors, merged on the ranks that keep them (keep=False: a rank that drains the export merges
        nothing). The merge is workers.trainer.merged_export's, into tensors taken from `buffers`
        (the refit sender's pool, given back bucket by bucket; None: fresh tensors); LoRA on routed
        experts keeps Megatron-Bridge's merged export.
        """
        if self.lora is None:
            return self._export_hf(merge_adapters=False)
        wrapped = [n for n, _ in self._module.named_parameters() if ".adapter." in n]
        if not merged_export.merges_here(wrapped):
            return self._export_hf(merge_adapters=True)
        dim, alpha = lora_numbers(self.lora_config())
        layout = ModelLayout.from_facts(self.cfg.facts)
        groups = hf_lora_groups(layout, self.adapter_state())  # TP-gathered on every rank (collective)
        base = self._unpad_vocab(self._bridge_export(merge_adapters=False))
        return guard_names(merged_export.merged(base, groups, alpha, dim, layout.family, buffers, keep))

    def _export_hf(self, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        """Megatron-Bridge's export, refit-guarded, with LoRA merged by the Bridge or not at all."""
        return guard_names(self._unpad_vocab(self._bridge_export(merge_adapters)))

    def _bridge_export(self, merge_adapters: bool) -> Iterator[tuple[str, Any]]:
        """On cuda the tensors stay on the GPU (cpu=False): rank 0 packs its refit buckets there and
        the other ranks drop each one at once; cpu=True would copy the whole model to host memory on
        every rank at every refit. (On CPU cpu=True copies nothing: the tensors alias the weights.)"""
        return self.bridge.export_hf_weights(self.model, cpu=self.is_cpu, show_progress=False,
                                             merge_adapter_weights=merge_adapters,
                                             conversion_tasks=self._conversion_tasks())

    def _conversion_tasks(self) -> list:
        """The Bridge's export tasks (each Megatron parameter, its mapping and module), built once:
        export_hf_weights otherwise rebuilds them on every export by walking every module, about
        half of an unmerged export of llama_100m here (docs/benchmarks.md). They hold the modules
        and parameters themselves, which training updates in place, so they stay valid."""
        if getattr(self, "_export_tasks", None) is None:
            from megatron.bridge.models.conversion.model_bridge import unwrap_model

            models = self.model if isinstance(self.model, list) else [self.model]
            self._export_tasks = self.bridge._model_bridge.build_conversion_tasks(self.bridge.hf_pretrained,
                                                                                  unwrap_model(models))
        return self._export_tasks

    def _unpad_vocab(self, weights):
        """Drop the rows megatron added to make the vocab divisible by TP (the bridge exports them)."""
        if not getattr(self.provider, "should_pad_vocab", False):
            yield from weights
            return
        hf_rows = {name: shape[0] for name, shape in hf_checkpoint.weight_shapes(self.cfg.model_path).items()
                   if shape}
        for name, tensor in weights:
            rows = hf_rows.get(name)
            yield name, (tensor[:rows] if rows is not None and tensor.dim() and tensor.shape[0] > rows else tensor)

    def refit_payload(self, mode: str, bucket_mb: int):
        return self.refit_sender.payload(self, mode, bucket_mb)

    def open_refit_group(self, host: str, port: int, world_size: int, backend: str = "gloo",
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Rank 0 only: host refit's broadcast group (blocks until the generators join)."""
        self.refit_sender.open_group(host, port, world_size, backend, timeout_s)

    def close_refit_group(self) -> None:
        self.refit_sender.close_group()

    def lora_config(self) -> dict:
        """The LoRA settings (the model's numbers are the run's facts: self.cfg.facts)."""
        pc = self.cfg.peft
        return {"enabled": pc.enabled, "dim": pc.dim, "alpha": pc.alpha, "target_modules": list(pc.target_modules),
                "dropout": pc.dropout, "dropout_position": pc.dropout_position}

    def adapter_state(self) -> dict:
        """{megatron name: full LoRA factor} (A = linear_in [r, in], B = linear_out [out, r]), TP-gathered."""
        if self.lora is None:
            return {}
        return gather.adapter_state(self._module, self.ps, self.model_config)

    # ----------------------------------------------------------------- checkpoints
    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {"world_size": self.world_size, "tensor_parallel": p.tensor_parallel,
                "pipeline_parallel": p.pipeline_parallel, "expert_parallel": p.expert_parallel,
                "expert_tensor_parallel": p.expert_tensor_parallel}

    def save_state(self, directory: str) -> None:
        """Adapter (trainable) weights + optimizer + scheduler + RNG, torch_dist format, collective."""
        state.save_state(directory, rank=self.rank, module=self._module, optimizer=self.optimizer,
                         scheduler=self.scheduler, device=self.device,
                         trainer_info={"step": self.step, "layout": self._layout(), "peft": asdict(self.cfg.peft)})

    def load_state(self, directory: str) -> dict:
        """Load what save_state wrote, possibly at another TP/PP/DP layout (RNG then restarts from the seed)."""
        loaded = state.load_state(directory, rank=self.rank, module=self._module, optimizer=self.optimizer,
                                  layout=self._layout(), device=self.device)
        self.scheduler = self._make_scheduler()  # fresh: load_state_dict adds the saved step count
        try:
            self.scheduler.load_state_dict(loaded["scheduler"])
        except AssertionError as e:  # megatron: "class input value 4 and checkpointvalue 3 for total number ..."
            raise ValueError(f"the checkpoint's learning-rate schedule differs from this run's ({e}): resume with "
                             f"the checkpoint's grpo.max_num_steps and optim settings, or set "
                             f"optim.override_opt_param_scheduler=true (this run's schedule, the saved step "
                             f"count)") from None
        self.step = int(loaded["trainer"]["step"])
        torch.distributed.barrier()
        return {"step": self.step, "rng_restored": loaded["rng_restored"], "saved_layout": loaded["trainer"]["layout"]}

    def shutdown(self) -> None:
        if getattr(self, "ps", None) is not None:  # megatron's parallel_state, from setup()
            self.ps.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
