"""Refit, driver side: pick and connect the transport once, then run one refit per step.

Reports: the sender returns bytes and seconds in its payload, the generators their own seconds;
`run_refit` adds the driver's wall time as `transfer_and_update_weights`.
"""

from __future__ import annotations

import time
from typing import Callable

from launcher.config.schema import REFIT_TRANSPORTS
from workers.refit.transports import DEFAULT_TIMEOUT_S, BroadcastTransport
from workers.refit.wire import RefitReport


def resolve_transport(transport: str, device: str) -> str:
    """Config `refit.transport` -> "ray" | "gloo" | "nccl" (auto: nccl on cuda, ray on cpu)."""
    if transport not in REFIT_TRANSPORTS:
        raise ValueError(f"unknown refit transport {transport!r} ({' | '.join(REFIT_TRANSPORTS)})")
    if transport == "auto":
        return "nccl" if str(device).startswith("cuda") else "ray"
    return transport


def connect(trainers, generators, transport: str, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Driver, once after start-up: set up the transport; returns the resolved name.

    For gloo/nccl, trainer rank 0 hosts the broadcast group on its node (IP and free port from its
    `node_address()`) and every vLLM worker joins; the rendezvous blocks until all have arrived,
    then one warm-up broadcast creates NCCL's communicator (not the first refit). Both sides wait
    at most timeout_s (`refit.timeout_s`) in any of the group's collectives.
    trainers: a TrainerGroup (its `actors`, rank 0 first); generators: a GeneratorGroup.
    """
    import ray

    resolved = resolve_transport(transport, device)
    if resolved == "ray":
        return resolved
    host, port = ray.get(trainers.actors[0].node_address.remote())
    world_size, joins = generators.open_refit_group(host, port, backend=resolved, timeout_s=timeout_s)
    wait_all([trainers.actors[0].open_refit_group.remote(host, port, world_size, resolved, timeout_s)] + joins)
    return resolved


def run_refit(start_sender: Callable[[], list], generators, mode: str) -> RefitReport:
    """Driver: one refit. start_sender() launches Sender.payload on every trainer rank and returns
    their ObjectRefs, rank 0 first (e.g. `lambda: [a.refit_payload.remote(mode, mb) for a in actors]`).

    The first trainer rank or engine that fails ends the call with its error (wait_all), while the
    others may still be running: over the broadcast group a failing vLLM worker reads the rest of
    the refit first, so they all finish anyway, but a dead process would leave them waiting.
    """
    t0 = time.perf_counter()
    refs = start_sender()
    if getattr(generators, "transport", "ray") == BroadcastTransport.name:
        engine_refs = generators.start_refit(BroadcastTransport.expect(mode))  # receive while rank 0 sends
        results = wait_all(refs + engine_refs)
        payload, received = results[0], generators.refit_summary(results[len(refs):])
    else:
        payload = wait_all(refs)[0]
        received = generators.refit_summary(wait_all(generators.start_refit(payload)))
    total = time.perf_counter() - t0
    return RefitReport(mode=mode, transport=payload.transport, bytes=payload.bytes, tensors=payload.tensors,
                       buckets=received["buckets"], sender_s=payload.sender_s,
                       receiver_s=received["seconds"], transfer_and_update_weights_s=total)


def wait_all(refs: list, poll_s: float = 0.5) -> list:
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
