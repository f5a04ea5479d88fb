"""`run.job=placement_smoke`: one probe actor per trainer rank and vLLM engine, each checked to
have landed on the node the plan names (the launcher's own health check).

A TP>1 engine on cuda (ultra_6n4g: TP 8 over two nodes) has vLLM workers besides its actor: the
actor starts in bundle 0 of the placement group of plan.engine_bundles (one-GPU bundles pinned to
the workers' planned nodes), which vLLM's RayExecutorV2 takes as its own, one worker per bundle;
the engine pins its ranking to the bundle order (VLLM_RAY_BUNDLE_INDICES=0..TP-1, see
workers.generator.actor), so worker rank r is the one in bundle r (ray_executor_v2.py
get_bundles_for_indices; unpinned it would rank the actor's node first and the others by Ray node
id). The smoke makes the same group and puts one probe in each bundle, before the trainer probes
claim their GPUs (the real run starts both at once: the pinning, not the order, must keep the
workers off the training nodes), and checks every (engine, tp_rank) against the plan. It also
records the GPUs each Ray node offers and checks them against the plan on cuda."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from launcher import files
from launcher import plan as plan_mod


def run(plan: plan_mod.Plan, hostnames: list[str], out: Path) -> dict:
    """One tiny actor per trainer rank, per vLLM engine and (TP>1 on cuda) per vLLM worker, each
    reporting where it runs.

    Raises if an actor is not on its planned node. Writes the report to `out` (JSON)."""
    import ray

    from workers.generator.placement import in_placement_group

    @ray.remote
    class Probe:
        def where(self) -> dict:
            return {"hostname": socket.gethostname(), "slurm_node": os.environ.get("SLURMD_NODENAME"),
                    "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                    "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    t0 = time.time()
    specs = [("train", r, plan.trainer_node(r), plan_mod.trainer_options(plan, r)) for r in range(plan.train_world)]
    specs += [("generation", e, plan.engine_nodes(e)[0], plan_mod.generator_options(plan, e)) for e in range(plan.engines)]
    # the engines (and their vLLM workers' bundles) first, then the trainers: see the docstring
    groups, engines, worker_specs, worker_actors = [], [], [], []
    for e in range(plan.engines):
        opts, bundles = plan_mod.generator_options(plan, e), plan_mod.engine_bundles(plan, e)
        if bundles:
            pg, placed = in_placement_group(bundles)
            groups.append(pg)
            opts = {**opts, **placed}
        engines.append(Probe.options(**opts).remote())
        if bundles:
            w_specs, w_actors = _vllm_workers(Probe, plan, e, pg)
            worker_specs, worker_actors = worker_specs + w_specs, worker_actors + w_actors
    # on cuda each probe takes the GPUs its real actor takes
    trainers = [Probe.options(**opts).remote() for _, _, _, opts in specs[:plan.train_world]]
    actors = trainers + engines
    try:
        infos = ray.get([a.where.remote() for a in actors], timeout=120)
        worker_infos = ray.get([a.where.remote() for a in worker_actors], timeout=120)
    except ray.exceptions.GetTimeoutError:
        for pg in groups:
            ray.util.remove_placement_group(pg)
        raise RuntimeError(f"not every trainer, engine and vLLM worker was placed within 120s; the cluster has "
                           f"{ray.available_resources()} free") from None
    specs, actors, infos = specs + worker_specs, actors + worker_actors, infos + worker_infos
    report = {"seconds": round(time.time() - t0, 2), "actors": [], "nodes": _ray_nodes(ray, plan, hostnames)}
    wrong = []
    for (role, idx, node, _), info in zip(specs, infos):
        expected = hostnames[node]
        report["actors"].append({"role": role, "index": idx, "planned_node": node, "planned_host": expected, **info})
        if info["slurm_node"] not in (None, expected) or (info["slurm_node"] is None and len(hostnames) > 1):
            wrong.append(f"{role} {idx} on {info['slurm_node'] or info['hostname']}, planned {expected}")
    if plan.device == "cuda":
        wrong += [f"Ray node {n['host']} offers {n['gpus']} GPU(s), planned {plan.nodes[n['index']].gpus}"
                  for n in report["nodes"] if n["gpus"] != plan.nodes[n["index"]].gpus]
    for a in actors:
        ray.kill(a)
    for pg in groups:
        ray.util.remove_placement_group(pg)
    files.write_json(out, report)
    if wrong:
        raise RuntimeError("placement differs from the plan: " + "; ".join(wrong))
    return report


def _vllm_workers(probe, plan: plan_mod.Plan, engine: int, pg):
    """A probe per vLLM worker of a TP>1 engine, one per bundle of its group, as RayExecutorV2 places
    them with the engine's VLLM_RAY_BUNDLE_INDICES (worker rank r in bundle r, one GPU each)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actors = [probe.options(num_cpus=0, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=b)).remote() for b in range(plan.generation_tp)]
    planned = {rank: n.index for n in plan.nodes for e, rank in n.generation_workers if e == engine}
    return [("vllm_worker", f"{engine}:{rank}", planned[rank], {}) for rank in range(plan.generation_tp)], actors


def _ray_nodes(ray, plan: plan_mod.Plan, hostnames: list[str]) -> list[dict]:
    """Each alive Ray node of the job: its plan index (from its `node_<i>` resource) and GPUs."""
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        idx = next((p.index for p in plan.nodes if plan_mod.node_resource(p.index) in res), None)
        if idx is not None:
            nodes.append({"index": idx, "host": hostnames[idx], "ip": n.get("NodeManagerAddress"),
                          "gpus": int(res.get("GPU", 0))})
    return sorted(nodes, key=lambda n: n["index"])
