"""`run.job=placement_smoke`: one probe actor per trainer rank and vLLM engine, each checked to
have landed on the node the plan names (the launcher's own health check).

A TP>1 engine on cuda (ultra_6n4g: TP 8 over two nodes) has vLLM workers besides its actor:
vLLM's Ray executor places them itself, in a placement group of one-GPU bundles whose first
bundle is pinned to the actor's node, packed onto the GPUs still free
(vllm/v1/executor/ray_utils.py initialize_ray_cluster), and ranks them actor's node first, then
nodes with fewer workers, then by IP (ray_executor.py _init_workers_ray). The smoke builds the
same group while the trainer probes hold their GPUs, as the trainers do in the real run, puts
one probe in each bundle and checks every (engine, tp_rank) against the plan. It also records
the GPUs each Ray node offers and checks them against the plan on cuda."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from launcher import plan as plan_mod


def run(plan: plan_mod.Plan, hostnames: list[str], out: Path) -> dict:
    """One tiny actor per trainer rank, per vLLM engine and (TP>1 on cuda) per vLLM worker, each
    reporting where it runs.

    Raises if an actor is not on its planned node. Writes the report to `out` (JSON)."""
    import ray

    @ray.remote
    class Probe:
        def where(self) -> dict:
            return {"hostname": socket.gethostname(), "slurm_node": os.environ.get("SLURMD_NODENAME"),
                    "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                    "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    t0 = time.time()
    specs = [("train", r, plan.trainer_node(r), plan_mod.trainer_options(plan, r)) for r in range(plan.train_world)]
    specs += [("generation", e, plan.engine_nodes(e)[0], plan_mod.generator_options(plan, e)) for e in range(plan.engines)]
    # on cuda each probe takes the GPUs its real actor takes: vLLM's workers get what is left
    actors = [Probe.options(**opts).remote() for _, _, _, opts in specs]
    infos = ray.get([a.where.remote() for a in actors], timeout=120)
    groups = []
    if plan.device == "cuda" and plan.generation_tp > 1:
        for e in range(plan.engines):
            engine_info = infos[plan.train_world + e]
            w_specs, w_actors, w_infos, pg = _vllm_workers(ray, Probe, plan, e, engine_info["ip"])
            specs, actors, infos, groups = specs + w_specs, actors + w_actors, infos + w_infos, groups + [pg]
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
    out.write_text(json.dumps(report, indent=1))
    if wrong:
        raise RuntimeError("placement differs from the plan: " + "; ".join(wrong))
    return report


def _vllm_workers(ray, probe, plan: plan_mod.Plan, engine: int, engine_ip: str):
    """A probe per vLLM worker of a TP>1 engine, placed as vLLM's Ray executor places its workers."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = [{"GPU": 1.0} for _ in range(plan.generation_tp)]
    bundles[0][f"node:{engine_ip}"] = 0.001
    pg = ray.util.placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=60)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"the {len(bundles)} vLLM workers of engine {engine} found no {len(bundles)} free GPUs "
                           f"packed from the engine's node ({engine_ip}) within 60s") from None
    actors = [probe.options(num_cpus=0, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=b)).remote() for b in range(len(bundles))]
    infos = ray.get([a.where.remote() for a in actors], timeout=120)
    per_ip = {}
    for info in infos:
        per_ip[info["ip"]] = per_ip.get(info["ip"], 0) + 1
    order = sorted(range(len(infos)), key=lambda b: (infos[b]["ip"] != engine_ip, per_ip[infos[b]["ip"]],
                                                     infos[b]["ip"]))  # vLLM compares the IPs as strings
    planned = {rank: n.index for n in plan.nodes for e, rank in n.generation_workers if e == engine}
    specs = [("vllm_worker", f"{engine}:{rank}", planned[rank], {}) for rank in range(len(order))]
    return specs, [actors[b] for b in order], [infos[b] for b in order], pg


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
