"""Driver side of generation: N VllmGenerator actors, requests split across them, order kept.

`GeneratorGroup(config, actor_options)` starts one actor per `.options()` dict (the placement
plan gives one per engine, e.g. {"resources": {"generation_slot": 1, "node_1": 1}, "num_cpus": 1}).
`generate` cuts the prompts (and their seeds) into contiguous, nearly equal slices, one per
engine, runs them concurrently and concatenates the results, so result i belongs to prompt i.
`bundles` (plan.engine_bundles, one per engine: None or the placement group of a TP>1 engine on
cuda) starts that engine's actor in bundle 0 of a group made from them, which vLLM's Ray executor
then places its workers in (`in_placement_group`). `apply_refit` hands the same payload to every
engine; `open_refit_group` makes every vLLM worker join trainer rank 0's broadcast group (ranks 1..
in engine order).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from workers.contracts import Generation, GeneratorInfo
from workers.generator.actor import GeneratorConfig, VllmGenerator
from workers.generator.placement import in_placement_group
from workers.process_env import with_actor_env
from workers.refit.transports import BroadcastTransport, RayTransport


def split_evenly(n: int, parts: int) -> list[slice]:
    """Contiguous slices of range(n), sizes differing by at most one, earlier slices larger."""
    base, extra = divmod(n, parts)
    slices, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


class GeneratorGroup:
    ACTOR: type = VllmGenerator   # what each engine runs (tests/helpers/generator.py: a recording one)
    infos: list[GeneratorInfo]   # one per engine, in engine order (workers.contracts.Generators)

    def __init__(self, config: GeneratorConfig | Mapping[str, Any], actor_options: Sequence[Mapping[str, Any]],
                 ready_timeout_s: float | None = None, bundles: Sequence[list[dict] | None] | None = None):
        """Starts the engines and waits until all are up (at most ready_timeout_s, e.g. when the
        cluster lacks the resources the options ask for; None waits forever)."""
        import ray

        if not actor_options:
            raise ValueError("GeneratorGroup needs one .options() dict per engine")
        self.config = config if isinstance(config, GeneratorConfig) else GeneratorConfig(**config)
        remote_cls = ray.remote(self.ACTOR)
        self.groups, self.actors = [], []
        for opts, engine_bundles in zip(actor_options, bundles or [None] * len(actor_options)):
            opts = dict(opts)
            if engine_bundles:
                pg, placed = in_placement_group(engine_bundles)
                self.groups.append(pg)
                opts.update(placed)
            self.actors.append(remote_cls.options(**with_actor_env(opts)).remote(self.config))
        try:
            self.infos = ray.get([a.info.remote() for a in self.actors], timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise TimeoutError(f"vLLM engines not up after {ready_timeout_s}s; options asked for: "
                               f"{list(actor_options)}; cluster has {ray.available_resources()}") from None
        self.transport = RayTransport.name

    @property
    def engines(self) -> int:
        return len(self.actors)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int | Sequence[int] = 16, seeds: Sequence[int] | None = None,
                 ignore_eos: bool = False) -> list[Generation]:
        import ray

        if seeds is not None and len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
        refs = []
        for actor, part in zip(self.actors, split_evenly(len(prompt_token_ids), self.engines)):
            if part.start == part.stop:
                continue
            limit = max_tokens if isinstance(max_tokens, int) else list(max_tokens[part])
            refs.append(actor.generate.remote(list(prompt_token_ids[part]), temperature, top_p, limit,
                                              None if seeds is None else list(seeds[part]), ignore_eos))
        return [g for chunk in ray.get(refs) for g in chunk]

    def apply_refit(self, payload) -> dict:
        """Every engine applies `payload`; seconds is the slowest engine's. The first engine that
        fails raises (workers.refit.control.wait_all)."""
        from workers.refit.control import wait_all

        return self.refit_summary(wait_all(self.start_refit(payload)))

    def start_refit(self, payload) -> list:
        """Every engine starts applying `payload`: one ObjectRef per engine (see refit_summary)."""
        return [a.apply_refit.remote(payload) for a in self.actors]

    @staticmethod
    def refit_summary(results: list[dict]) -> dict:
        return {"seconds": max(r["seconds"] for r in results), "bytes": results[0]["bytes"],
                "buckets": results[0]["buckets"], "layouts_fetched": sum(r["layouts_fetched"] for r in results),
                "engines": results}

    def num_workers(self) -> int:
        import ray

        return sum(ray.get([a.num_workers.remote() for a in self.actors]))

    def open_refit_group(self, host: str, port: int, backend: str, rank_offset: int = 1,
                         timeout_s: float = 600.0) -> tuple[int, list]:
        """Start joining the broadcast group: returns (world_size, ObjectRefs). Wait on the refs
        together with trainer rank 0's open_refit_group(host, port, world_size, backend): the rendezvous
        blocks every member (and each engine actor) until all ranks have arrived."""
        import ray

        counts = ray.get([a.num_workers.remote() for a in self.actors])
        world_size = rank_offset + sum(counts)
        refs, offset = [], rank_offset
        for actor, count in zip(self.actors, counts):
            refs.append(actor.open_refit_group.remote(host, port, world_size, offset, backend, timeout_s))
            offset += count
        self.transport = BroadcastTransport.name
        return world_size, refs

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        for pg in getattr(self, "groups", []):
            ray.util.remove_placement_group(pg)
        self.groups = []
