"""The typed contracts between the driver (launcher/driver) and the workers' groups, in one place.

The driver sees the workers through three objects: the trainer group, the generator group and the
refit object (weights trainer -> generators). Each is described here as a Protocol of what the
GRPO loop calls, so the loop takes any object that has those members: the real groups
(workers.trainer.group.TrainerGroup, workers.generator.group.GeneratorGroup, workers.refit.control)
or the fakes of tests/unit/test_grpo_loop.py, which check the schedule without Ray
(tests/unit/test_contracts.py checks that the real classes satisfy the Protocols, without starting them).
NeMo RL's weight_sync/interfaces.py (one synchronizer the loop calls without knowing the transport)
and its TypedDict batch specs, torchtitan's weight sync component and prime-rl's weight broadcast
base class have the same shape.

What crosses the seam is typed too: the batch given to trainers (docs/architecture.md, "The batch
given to trainers"), what each actor reports about itself (`infos`), one generation's result.
torch is only named in annotations: importing this module imports neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, TypedDict, runtime_checkable

if TYPE_CHECKING:
    import torch

    from workers.refit.wire import RefitReport


class _SampledBatch(TypedDict):
    input_ids: torch.Tensor                # int64 [B, T]
    loss_mask: torch.Tensor                # float32 [B, T]: 1 on generated (trained) tokens
    advantages: torch.Tensor               # float32 [B]
    generation_logprobs: torch.Tensor      # float32 [B, T]: what the generator reported


class TrainerBatch(_SampledBatch, total=False):
    """B sequences of length T (prompt + response, right padded). Every [B, T] value at t is
    log p(input_ids[t] | input_ids[:t]); position 0 is 0. The driver builds the sampled part
    (launcher.driver.rollout.build_batch), then adds the trainers' own logprobs."""

    prev_logprobs: torch.Tensor            # float32 [B, T]: the trainer's, before the update
    reference_logprobs: torch.Tensor       # float32 [B, T]: adapters off (KL penalty on)


class NumParameters(TypedDict):
    total: int
    trainable: int


class TrainerInfo(TypedDict):
    """What one trainer rank reports after setup (MegatronTrainer.info)."""

    rank: int
    world_size: int
    node_ip: str
    hostname: str
    pid: int
    device: str
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_output_rank: bool         # returns results for its data-parallel shard
    peft_statistics: str         # the Bridge's "PEFT Statistics" text
    num_parameters: NumParameters
    step: int                    # optimizer steps taken (the weights version)
    startup: list                # [(phase, time.time() at its end)], driver.startup


class GeneratorInfo(TypedDict):
    """What one vLLM engine reports once up (VllmGenerator.info)."""

    pid: int
    hostname: str
    start_seconds: float
    startup: list
    model: str
    device: str
    enable_lora: bool
    adapter_id: int


@dataclass
class Generation:
    """One request's result: the sampled tokens with the engine's logprob of each."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None


@runtime_checkable
class Trainers(Protocol):
    """The trainer ranks as the GRPO loop uses them (workers.trainer.group.TrainerGroup). Every call
    blocks until all ranks answered; the weights version is the number of train() calls."""

    infos: list[TrainerInfo]
    peft_statistics: str

    def logprobs(self, batch: TrainerBatch, adapters: bool = True) -> torch.Tensor: ...
    def train(self, batch: TrainerBatch) -> dict[str, Any]: ...
    def save_state(self, directory: str) -> None: ...
    def load_state(self, directory: str) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class Generators(Protocol):
    """The vLLM engines as the GRPO loop uses them (workers.generator.group.GeneratorGroup):
    result i belongs to prompt i; each request is seeded on its own."""

    infos: list[GeneratorInfo]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int | Sequence[int] = 16, seeds: Sequence[int] | None = None,
                 ignore_eos: bool = False) -> list[Generation]: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class WeightSync(Protocol):
    """The refit object: the trainers' weights to every engine, whatever the transport
    (workers.refit.control.make_refit). A version is the number of optimizer steps the weights
    have taken; the engines hold one version at a time and every engine the same.

    `deferrable`: the transport can take the trainers' weights now and hand them to the engines
    later (`take` then `deliver`: the Ray object store holds the copy), so the trainers train on
    while the engines finish what they generate. Otherwise (a broadcast group: both sides in one
    collective) only `push`, when both are free."""

    transport: str
    deferrable: bool
    generators_version: int | None     # what the engines hold; None: what they loaded at start

    def connect(self) -> None: ...
    def push(self, version: int) -> RefitReport: ...
    def is_stale(self, version: int) -> bool: ...
    def take(self, version: int) -> Any: ...
    def deliver(self, snapshot: Any) -> RefitReport: ...
    def close(self) -> None: ...
