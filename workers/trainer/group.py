"""TrainerGroup: the driver's handle on N MegatronTrainer Ray actors (one per trainer rank).

The group creates one actor per rank with its own `.options()` dict (docs/architecture.md:
`resources={TRAIN_SLOT: 1, "node_<i>": 1}`, plus `num_gpus=1` on cuda), asks rank 0 for its
node IP and a free port, and has every rank join the process group there. Each method fans out
to all ranks (megatron calls are collective) and gathers the answer:
  logprobs / train   split the batch's sequences into contiguous data-parallel shards (every
                     rank of a DP shard gets the same shard) and concatenate the results in order
  adapter_state, lora_config, save_state, load_state, refit_payload: rank 0's answer
If an actor dies or raises, the call fails at once with an error naming the rank and its node
(the other ranks may be stuck in a collective; `shutdown()` ends them).
"""

from __future__ import annotations

from typing import Any, Optional

import ray
import torch

from launcher.config.schema import TRAIN_SLOT
from workers.contracts import TrainerBatch, TrainerInfo
from workers.process_env import with_actor_env
from workers.trainer.actor import MegatronTrainer
from workers.trainer.config import TrainerConfig


class TrainerGroupError(RuntimeError):
    pass


def task_error_line(err) -> str:
    """The exception a remote call raised, in one line (`Type: message`): str(RayTaskError) begins
    with a `ray::Class.method() (pid=...)` header and the traceback, and ends with it."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".strip()
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Contiguous, as-even-as-possible shards of a batch's sequences (dim 0 of every tensor)."""
    size = batch["input_ids"].shape[0]
    if size < parts:
        raise ValueError(f"batch of {size} sequences cannot be split over {parts} data-parallel ranks")
    bounds = [round(i * size / parts) for i in range(parts + 1)]
    return [{k: (v[bounds[i]:bounds[i + 1]] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(parts)]


class TrainerGroup:
    ACTOR: type[MegatronTrainer] = MegatronTrainer   # what each rank runs (tests/helpers/trainer.py: a probed one)
    infos: list[TrainerInfo]     # one per rank, in rank order (workers.contracts.Trainers)
    peft_statistics: str

    def __init__(self, config: TrainerConfig, actor_options: Optional[list[dict]] = None,
                 num_ranks: Optional[int] = None, poll_s: float = 1.0):
        if actor_options is None:
            if not num_ranks:
                raise ValueError("give actor_options (one dict per rank) or num_ranks")
            cuda = config.device.startswith("cuda")
            actor_options = [{"num_cpus": 1, "resources": {TRAIN_SLOT: 1}, **({"num_gpus": 1} if cuda else {})}
                             for _ in range(num_ranks)]
        self.config = config
        self.world_size = len(actor_options)
        self.poll_s = poll_s
        remote_cls = ray.remote(self.ACTOR)
        self.actors = [remote_cls.options(**with_actor_env(opts)).remote(config, rank, self.world_size)
                       for rank, opts in enumerate(actor_options)]
        self.where = self._call("where")
        master_addr, master_port = self._get([self.actors[0].node_address.remote()], ranks=[0])[0]
        self.master = (master_addr, master_port)
        self.infos = self._call("setup", master_addr, master_port)
        self.dp_size = self.infos[0]["dp_size"]
        self.peft_statistics = self.infos[0]["peft_statistics"]

    # ----------------------------------------------------------------- fan-out plumbing
    def _describe(self, rank: int) -> str:
        where = getattr(self, "where", None)
        if where:
            return f"trainer rank {rank} (node {where[rank]['node_ip']}, host {where[rank]['hostname']}, " \
                   f"pid {where[rank]['pid']})"
        return f"trainer rank {rank}"

    def _get(self, refs: list, ranks: list[int]) -> list:
        """ray.get that fails fast: the first rank that raises or dies ends the call, named."""
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.poll_s)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    raise TrainerGroupError(f"{self._describe(ranks[i])} died: {err}") from err
                except ray.exceptions.RayTaskError as err:
                    raise TrainerGroupError(f"{self._describe(ranks[i])} failed: {task_error_line(err)}") from err
        return results

    def _call(self, method: str, *args, per_rank_args: Optional[list[tuple]] = None, **kwargs) -> list:
        refs = []
        for rank, actor in enumerate(self.actors):
            call_args = per_rank_args[rank] if per_rank_args is not None else args
            refs.append(getattr(actor, method).remote(*call_args, **kwargs))
        return self._get(refs, list(range(len(refs))))

    def _shards(self, batch: dict) -> list[tuple]:
        shards = split_batch(batch, self.dp_size)
        return [(shards[info["dp_rank"]],) for info in self.infos]

    # ----------------------------------------------------------------- the trainer API
    def logprobs(self, batch: TrainerBatch, adapters: bool = True) -> torch.Tensor:
        answers = self._call("logprobs", per_rank_args=[(s[0], adapters) for s in self._shards(batch)])
        by_dp: dict[int, Any] = {}
        for info, answer in zip(self.infos, answers):
            if info["is_output_rank"]:
                by_dp[info["dp_rank"]] = answer
        return torch.cat([by_dp[d] for d in range(self.dp_size)])

    def train(self, batch: TrainerBatch) -> dict:
        return self._call("train", per_rank_args=self._shards(batch))[0]

    def adapter_state(self) -> dict:
        return self._call("adapter_state")[0]

    def lora_config(self) -> dict:
        return self._call("lora_config")[0]

    def save_state(self, directory: str) -> None:
        self._call("save_state", str(directory))

    def load_state(self, directory: str) -> dict:
        return self._call("load_state", str(directory))[0]

    def refit_payload(self, mode: str, bucket_mb: int):
        """workers.refit.sender.Sender.payload on every rank (the export is collective); rank 0's payload."""
        return self._call("refit_payload", mode, bucket_mb)[0]

    def open_refit_group(self, host: str, port: int, world_size: int, backend: str = "gloo",
                         timeout_s: float = 600.0):
        """Rank 0 hosts refit's broadcast group. Returns its ObjectRef: ray.get it together with the
        generators' joins (the rendezvous blocks until everyone arrives)."""
        return self.actors[0].open_refit_group.remote(host, port, world_size, backend, timeout_s)

    def close_refit_group(self) -> None:
        self._get([self.actors[0].close_refit_group.remote()], ranks=[0])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
