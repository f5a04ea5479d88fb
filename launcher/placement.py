"""Pin actors to the nodes the plan names, and the placement smoke check.

Each Ray node carries `node_<i>` plus role slots (see launcher.topology); an actor asks for one
role slot and one unit of its node's resource, so it can only land where the plan put it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from launcher import topology


def trainer_options(plan: topology.Plan, rank: int) -> dict:
    opts = {"num_cpus": 0, "resources": {topology.TRAIN_SLOT: 1, topology.node_resource(plan.trainer_node(rank)): 1}}
    if plan.device == "cuda":
        opts["num_gpus"] = 1
    return opts


def generator_options(plan: topology.Plan, engine: int) -> dict:
    """The engine actor sits on the engine's first node. On cuda an engine within one node takes
    its TP GPUs; an engine spanning nodes (ultra_6n4g: TP8 over 2 nodes) takes none itself - vLLM's
    Ray executor places one worker per GPU on the engine's nodes."""
    nodes = plan.engine_nodes(engine)
    workers_here = sum(1 for n in plan.nodes if n.index == nodes[0] for e, _ in n.generation_workers if e == engine)
    opts: dict = {"num_cpus": 0,
                  "resources": {topology.GENERATION_SLOT: workers_here, topology.node_resource(nodes[0]): 1}}
    if plan.device == "cuda" and len(nodes) == 1:
        opts["num_gpus"] = plan.generation_tp
    return opts


def smoke(plan: topology.Plan, hostnames: list[str], out: Path) -> dict:
    """One tiny actor per trainer rank and per vLLM engine, each reporting where it runs.

    Raises if an actor is not on its planned node. Writes the report to `out` (JSON)."""
    import ray

    @ray.remote
    class Probe:
        def where(self) -> dict:
            return {"hostname": socket.gethostname(), "slurm_node": os.environ.get("SLURMD_NODENAME"),
                    "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    t0 = time.time()
    specs = [("train", r, plan.trainer_node(r), trainer_options(plan, r)) for r in range(plan.train_world)]
    specs += [("generation", e, plan.engine_nodes(e)[0], generator_options(plan, e)) for e in range(plan.engines)]
    actors = [Probe.options(**{k: v for k, v in opts.items() if k != "num_gpus"}).remote()
              for _, _, _, opts in specs]
    infos = ray.get([a.where.remote() for a in actors], timeout=120)
    report = {"seconds": round(time.time() - t0, 2), "actors": []}
    wrong = []
    for (role, idx, node, _), info in zip(specs, infos):
        expected = hostnames[node]
        report["actors"].append({"role": role, "index": idx, "planned_node": node, "planned_host": expected, **info})
        if info["slurm_node"] not in (None, expected) or (info["slurm_node"] is None and len(hostnames) > 1):
            wrong.append(f"{role} {idx} on {info['slurm_node'] or info['hostname']}, planned {expected}")
    for a in actors:
        ray.kill(a)
    out.write_text(json.dumps(report, indent=1))
    if wrong:
        raise RuntimeError("placement differs from the plan: " + "; ".join(wrong))
    return report
