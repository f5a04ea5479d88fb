"""Where a TP>1 engine's vLLM workers go: the placement group its actor starts in (launcher.plan
engine_bundles says which bundles, pinned to which nodes). Ray only; the placement smoke uses it too."""

from __future__ import annotations

from typing import Any


def in_placement_group(bundles: list[dict]) -> tuple[Any, dict]:
    """(placement group of `bundles`, .options() that put an actor in its bundle 0 with its child
    tasks and actors, vLLM's workers among them, in the same group)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.placement_group(bundles, strategy="PACK")
    return pg, {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}
