"""Placement of vLLM engines on cuda, on a real Ray cluster with declared (fake) GPUs.

A TP>1 engine's actor is placed with `plan.generator_options`; then, from inside that actor, the
placement group vLLM's Ray executor asks for is created exactly as vllm/v1/executor/ray_utils.py
`initialize_ray_cluster` does without a current placement group: first it requires a GPU still free
on the actor's node (require_gpu_on_driver), then TP bundles {"GPU": 1}, the first pinned with
`node:<ip>`, strategy PACK. It must be placed: the actor may not hold the GPUs its executor needs.
Trainer actors (one GPU each) take the train node's GPUs beside it. Ray runs in a subprocess of its
own (`ray.init(address="local", num_gpus=...)`: GPUs declared, none needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import ray
from ray.util.placement_group import placement_group
from launcher import plan as P
from launcher.config.schema import GENERATION_SLOT, TRAIN_SLOT, GenerationRole, Topology, TrainRole

gen = json.loads(sys.argv[1])
t = Topology(name="t", executor="slurm", device="cuda", nodes=2, gpus_per_node=4, colocate_roles=False,
             train=TrainRole(nodes=1, ranks_per_node=4, tensor_parallel=2), generation=GenerationRole(nodes=1, **gen))
assert not P.check(t), P.check(t)
plan = P.build(t)
gen_node = plan.nodes[1]
# one Ray node standing for the generation node (its GPUs, its role slots) plus the train node's
# resources: the GPUs are one pool here, so the trainers take theirs first, as on the train node
ray.init(address="local", num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False,
         resources={**plan.nodes[0].ray_resources(), **gen_node.ray_resources()})

@ray.remote
class Holder:
    def ok(self):
        return ray.get_gpu_ids()

trainers = [Holder.options(**P.trainer_options(plan, r)).remote() for r in range(plan.train_world)]
ray.get([a.ok.remote() for a in trainers], timeout=60)

@ray.remote
class Engine:
    def __init__(self, tp):
        self.tp = tp

    def vllm_executor_placement(self):
        # vllm/v1/executor/ray_utils.py initialize_ray_cluster, no current placement group
        from ray._private.state import available_resources_per_node
        node_id = ray.get_runtime_context().get_node_id()
        free_here = available_resources_per_node()[node_id].get("GPU", 0)
        if free_here < 1:
            return {"placed": False, "why": f"Current node has no GPU available ({free_here})"}
        ip = ray.util.get_node_ip_address()
        specs = [{"GPU": 1.0} for _ in range(self.tp)]
        specs[0][f"node:{ip}"] = 0.001
        pg = placement_group(specs, strategy="PACK")
        ready = pg.wait(timeout_seconds=20)
        return {"placed": bool(ready), "why": "" if ready else "placement group not ready after 20 s",
                "gpus_held_by_actor": len(ray.get_gpu_ids())}

opts = [P.generator_options(plan, e) for e in range(plan.engines)]
engines = [Engine.options(**o).remote(plan.generation_tp) for o in opts]
# one engine after another, as vLLM engines start (each keeps its group)
out = [ray.get(e.vllm_executor_placement.remote(), timeout=90) for e in engines]
print("RESULT " + json.dumps({"options": opts, "engines": out}))
ray.shutdown()
"""


def run_case(gen: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(gen)], cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("gen", [dict(ranks_per_node=4, engines=1, tensor_parallel=4),
                                 dict(ranks_per_node=4, engines=2, tensor_parallel=2)],
                         ids=["1xTP4", "2xTP2"])
def test_tp_engine_leaves_its_gpus_to_the_vllm_executor(gen):
    r = run_case(gen)
    assert all("num_gpus" not in o for o in r["options"]), r["options"]
    assert r["engines"] == [{"placed": True, "why": "", "gpus_held_by_actor": 0}] * gen["engines"], r


def test_tp1_engine_takes_its_one_gpu():
    r = run_case(dict(ranks_per_node=4, engines=4, tensor_parallel=1))
    assert [o.get("num_gpus") for o in r["options"]] == [1, 1, 1, 1]
