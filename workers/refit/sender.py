"""Refit, trainer side: what trainer rank 0 runs to ship its weights (or LoRA factors) to the generators.

The trainer actor holds one `Sender`. It sends through the Ray object store until the driver opens
the broadcast group (`open_group`, on rank 0; `control.BroadcastRefit.connect`), then through that group until
`close_group`. Changing the transport forgets what was sent, so the next refit resends the layout.
Every rank runs `payload` (the export is a collective over the model-parallel group); ranks other
than 0 drop each exported tensor as it comes, rank 0 streams them into buckets: no rank holds the
model's weights at once (on cuda the export stays on the GPU, workers.trainer.actor). The merged
export writes into a buffer pool the sender gives back bucket by bucket and keeps between refits in
host memory (workers.trainer.merged_export), so a refit reuses memory it has touched before.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from workers.lora import layout as lora_layout
from workers.refit.buffers import BufferPool
from workers.refit.transports import DEFAULT_TIMEOUT_S, BroadcastTransport, RayTransport
from workers.refit.wire import RefitPayload, kind_of, lora_stream


def _model_layout(trainer) -> lora_layout.ModelLayout:
    """The layout of the run's model facts (the trainer's config holds them: TrainerConfig.facts)."""
    return lora_layout.ModelLayout.from_facts(trainer.cfg.facts)


class Sender:
    """Trainer rank 0's end of refit (every rank calls `payload`: the exports are collectives)."""

    def __init__(self):
        self.transport: RayTransport | BroadcastTransport = RayTransport()
        self.buffers = BufferPool()   # the merged export's tensors (workers.refit.buffers)

    def open_group(self, host: str, port: int, world_size: int, backend: str = "nccl",
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """On trainer rank 0: host the refit group (blocks until every vLLM worker has joined and
        one warm-up broadcast went through); its collectives wait at most timeout_s."""
        self.transport = BroadcastTransport.host(host, port, world_size, backend, timeout_s)

    def close_group(self) -> None:
        self.transport = RayTransport()

    def payload(self, trainer, mode: str, bucket_mb: float) -> RefitPayload | None:
        """Runs on every trainer rank; rank 0 ships and returns the payload (None elsewhere).

        trainer: has export_merged(buffers, keep) (merged) or adapter_state() + lora_config() (LoRA
        modes), and `rank` (0 if absent).
        """
        t0 = time.perf_counter()
        kind = kind_of(mode)
        rank = getattr(trainer, "rank", 0)
        release = None
        if kind == "weights":
            # guarded there; merged into the pool's buffers, which come back bucket by bucket
            named: Iterable[tuple[str, torch.Tensor]] = trainer.export_merged(buffers=self.buffers, keep=rank == 0)
            groups, dim, alpha = (), 0, 0.0
            if rank != 0:
                for _ in named:  # drain: the export is collective over the model-parallel group
                    pass
                return None
            release = self.buffers.give_back
        else:
            state = trainer.adapter_state()
            if rank != 0:
                return None
            if not state:
                raise ValueError(f"refit mode {mode!r} needs LoRA, but the trainer has no adapter weights")
            dim, alpha = lora_layout.lora_numbers(trainer.lora_config())
            named, groups = lora_stream(lora_layout.hf_lora_groups(_model_layout(trainer), state))
        bucket_bytes = max(1, int(bucket_mb * 2**20))
        try:
            payload = self.transport.send(mode, kind, named, tuple(groups), dim, alpha, bucket_bytes, release)
        except BaseException:
            self.buffers.clear()   # tensors still on loan are not coming back
            raise
        if not self._keep_buffers(trainer):
            self.buffers.clear()
        payload.sender_s = time.perf_counter() - t0
        return payload

    @staticmethod
    def _keep_buffers(trainer) -> bool:
        """Keep the pool between refits in host memory only: there a fresh allocation faults in every
        page, while on a GPU PyTorch's caching allocator already reuses the blocks (and the memory
        plan counts refit's buffers only during a refit)."""
        return str(getattr(trainer, "device", "cpu")).startswith("cpu")
