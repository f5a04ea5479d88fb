"""Refit, driver side: one object per transport that the GRPO loop calls without knowing which.

`make_refit(trainers, generators, section, device)` resolves `refit.transport` and returns the
object (workers.contracts.WeightSync): `connect()` once after start-up, `push(version)` to send
the trainers' weights to every engine, `is_stale(version)` whether the engines hold another
version, `close()`. A version is the number of optimizer steps the weights have taken; the object
remembers which one the engines hold (`generators_version`; None until the first push: the
engines hold what they loaded at start).

  ObjectStoreRefit  (transport "ray") trainer rank 0 puts each bucket into the Ray object store,
                    the engines read them. The copy in the store outlives the trainers' next step,
                    so the two halves can run apart: `take(version)` runs the trainer side now and
                    returns a snapshot, `deliver(snapshot)` hands it to the engines later (the
                    pipelined loop takes the weights before training on and delivers them when the
                    engines finish their rollout). `push` is take + deliver.
  BroadcastRefit    ("gloo" | "nccl") trainer rank 0 and every vLLM worker in one broadcast group:
                    sender and receivers run together, so only `push`, with both sides free.

Reports: the sender returns bytes and seconds in its payload, the engines their own seconds;
`transfer_and_update_weights` is the driver's wall time of both halves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from launcher.config.schema import REFIT_TRANSPORTS
from workers.refit.transports import DEFAULT_TIMEOUT_S, BroadcastTransport, RayTransport
from workers.refit.wire import RefitPayload, RefitReport


def resolve_transport(transport: str, device: str) -> str:
    """Config `refit.transport` -> "ray" | "gloo" | "nccl" (auto: nccl on cuda, ray on cpu)."""
    if transport not in REFIT_TRANSPORTS:
        raise ValueError(f"unknown refit transport {transport!r} ({' | '.join(REFIT_TRANSPORTS)})")
    if transport == "auto":
        return "nccl" if str(device).startswith("cuda") else "ray"
    return transport


@dataclass
class Snapshot:
    """The trainers' weights of one version, taken (in the object store) and not yet delivered."""

    version: int
    payload: RefitPayload
    taken_s: float       # driver wall time of the trainer side


class _Refit:
    transport = "?"
    deferrable = False
    generators_version: int | None    # the version the engines hold (None: what they loaded at start)

    def __init__(self, trainers, generators, mode: str, bucket_mb: float, timeout_s: float = DEFAULT_TIMEOUT_S):
        """trainers: a TrainerGroup (its `actors`, rank 0 first); generators: a GeneratorGroup."""
        self.trainers, self.generators = trainers, generators
        self.mode, self.bucket_mb, self.timeout_s = mode, bucket_mb, timeout_s
        self.generators_version: int | None = None

    def connect(self) -> None:
        pass

    def close(self) -> None:
        pass

    def is_stale(self, version: int) -> bool:
        return self.generators_version != version

    def take(self, version: int) -> Snapshot:
        raise NotImplementedError(f"the {self.transport} transport sends and receives at once: push()")

    def deliver(self, snapshot: Snapshot) -> RefitReport:
        raise NotImplementedError(f"the {self.transport} transport sends and receives at once: push()")

    def _senders(self) -> list:
        """Sender.payload on every trainer rank (the export is collective): ObjectRefs, rank 0 first."""
        return [a.refit_payload.remote(self.mode, self.bucket_mb) for a in self.trainers.actors]

    def _report(self, payload: RefitPayload, received: dict, seconds: float) -> RefitReport:
        return RefitReport(mode=self.mode, transport=payload.transport, bytes=payload.bytes, tensors=payload.tensors,
                           buckets=received["buckets"], sender_s=payload.sender_s, receiver_s=received["seconds"],
                           transfer_and_update_weights_s=seconds)


class ObjectStoreRefit(_Refit):
    transport = RayTransport.name
    deferrable = True

    def take(self, version: int) -> Snapshot:
        t0 = time.perf_counter()
        payload = wait_all(self._senders())[0]
        return Snapshot(version, payload, time.perf_counter() - t0)

    def deliver(self, snapshot: Snapshot) -> RefitReport:
        """The engines apply the snapshot; the first engine that fails raises."""
        t0 = time.perf_counter()
        received = self.generators.refit_summary(wait_all(self.generators.start_refit(snapshot.payload)))
        self.generators_version = snapshot.version
        return self._report(snapshot.payload, received, snapshot.taken_s + time.perf_counter() - t0)

    def push(self, version: int) -> RefitReport:
        return self.deliver(self.take(version))


class BroadcastRefit(_Refit):
    deferrable = False

    def __init__(self, trainers, generators, mode: str, bucket_mb: float, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "nccl"):
        super().__init__(trainers, generators, mode, bucket_mb, timeout_s)
        self.transport = backend

    def connect(self) -> None:
        """Trainer rank 0 hosts the broadcast group on its node (IP and free port from its
        `node_address()`) and every vLLM worker joins; the rendezvous blocks until all have arrived,
        then one warm-up broadcast creates NCCL's communicator (not the first refit). Both sides wait
        at most timeout_s (`refit.timeout_s`) in any of the group's collectives."""
        import ray

        host, port = ray.get(self.trainers.actors[0].node_address.remote())
        world_size, joins = self.generators.open_refit_group(host, port, backend=self.transport,
                                                             timeout_s=self.timeout_s)
        wait_all([self.trainers.actors[0].open_refit_group.remote(host, port, world_size, self.transport,
                                                                  self.timeout_s)] + joins)

    def push(self, version: int) -> RefitReport:
        """Rank 0 sends while every engine receives. The first trainer rank or engine that fails
        ends the call with its error (wait_all): a failing vLLM worker reads the rest of the refit
        first, so the others finish anyway, but a dead process would leave them waiting."""
        t0 = time.perf_counter()
        refs = self._senders()
        engine_refs = self.generators.start_refit(BroadcastTransport.expect(self.mode))
        results = wait_all(refs + engine_refs)
        received = self.generators.refit_summary(results[len(refs):])
        self.generators_version = version
        return self._report(results[0], received, time.perf_counter() - t0)

    def close(self) -> None:
        """Back to the object store (the next refit resends the layout)."""
        self.trainers.close_refit_group()
        self.generators.transport = RayTransport.name
        self.generators_version = None


def make_refit(trainers, generators, transport: str, device: str, mode: str, bucket_mb: float,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> ObjectStoreRefit | BroadcastRefit:
    """The refit object of config `refit.transport` (not connected yet: call connect())."""
    resolved = resolve_transport(transport, device)
    if resolved == RayTransport.name:
        return ObjectStoreRefit(trainers, generators, mode, bucket_mb, timeout_s)
    return BroadcastRefit(trainers, generators, mode, bucket_mb, timeout_s, backend=resolved)


def wait_all(refs: list, poll_s: float = 0.5) -> list[Any]:
    """ray.get of every ref, in order; the first that failed (raised, or whose actor died) raises at
    once, whatever the others are doing (ray.get of a list would wait for them in order)."""
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
        for ref in ready:
            results[index[ref]] = ray.get(ref)
    return results
