"""`run.job=placement_smoke`: one probe actor per trainer rank and vLLM engine, each checked to
have landed on the node the plan names (the launcher's own health check)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from launcher import plan as plan_mod


def run(plan: plan_mod.Plan, hostnames: list[str], out: Path) -> dict:
    """One tiny actor per trainer rank and per vLLM engine, each reporting where it runs.

    Raises if an actor is not on its planned node. Writes the report to `out` (JSON)."""
    import ray

    @ray.remote
    class Probe:
        def where(self) -> dict:
            return {"hostname": socket.gethostname(), "slurm_node": os.environ.get("SLURMD_NODENAME"),
                    "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    t0 = time.time()
    specs = [("train", r, plan.trainer_node(r), plan_mod.trainer_options(plan, r)) for r in range(plan.train_world)]
    specs += [("generation", e, plan.engine_nodes(e)[0], plan_mod.generator_options(plan, e)) for e in range(plan.engines)]
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
