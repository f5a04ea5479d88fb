"""Placement of vLLM engines on cuda, on a real Ray cluster with declared (fake) GPUs.

A TP>1 engine's actor starts as GeneratorGroup starts it: `plan.generator_options` inside bundle 0
of the placement group of `plan.engine_bundles` (workers.generator.placement), with the environment
the engine sets (GeneratorConfig.engine_env). From inside the actor, the steps of vLLM 0.32's
default Ray executor, RayExecutorV2 (vllm/v1/executor/ray_executor_v2.py _init_executor), are
taken: `initialize_ray_cluster(require_gpu_on_driver=False)`'s checks of the current group (found,
one-GPU bundles, TP of them; the actor itself needs no GPU), the worker ranking by vLLM's own
`get_bundles_for_indices` with the engine's VLLM_RAY_BUNDLE_INDICES (rank r in bundle r), and one
worker per bundle (num_gpus=1, that bundle). The engines start before the trainers (the real run
starts both at once); the trainers (one GPU each) must still find theirs. Ray runs in a subprocess
of its own (`ray.init(address="local", num_gpus=...)`: GPUs declared, none needed), one for all the
cases: each case's actors and placement groups are removed, and all 8 GPUs free again, before the
next starts. The pinning of bundles to the planned nodes is checked on the multi-node Slurm
cluster (tests/slurm/test_ultra_placement.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, shutil, sys, tempfile, time
import ray
from launcher import plan as P

WAIT_S = float(sys.argv[2])  # hang detection, not a claim (see WAIT_S below)
from launcher.config.schema import GENERATION_SLOT, TRAIN_SLOT, GenerationRole, Topology, TrainRole

def plan_of(gen):
    t = Topology(name="t", executor="slurm", device="cuda", nodes=2, gpus_per_node=4, colocate_roles=False,
                 train=TrainRole(nodes=1, ranks_per_node=4, tensor_parallel=2),
                 generation=GenerationRole(nodes=1, **gen))
    assert not P.check(t), P.check(t)
    return P.build(t)

plans = [plan_of(gen) for gen in json.loads(sys.argv[1])]
# one Ray node standing for the generation node (its GPUs, its role slots) plus the train node's
# resources, as many as the largest case needs: the GPUs are one pool here (which node a bundle is
# pinned to is not told apart)
resources = {}
for plan in plans:
    for key, n in {**plan.nodes[0].ray_resources(), **plan.nodes[1].ray_resources()}.items():
        resources[key] = max(resources.get(key, 0), n)
temp = tempfile.mkdtemp(prefix="ray-placement-")
ray.init(address="local", num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False,
         resources=resources, _temp_dir=temp)

@ray.remote
class Holder:
    def ok(self):
        return ray.get_gpu_ids()

@ray.remote
class Engine:
    def __init__(self, tp, env):
        import os
        self.tp = tp
        os.environ.update(env)  # what VllmGenerator does before it builds the engine

    def vllm_executor_placement(self):
        # vllm/v1/executor/ray_utils.py initialize_ray_cluster(require_gpu_on_driver=False), current group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        import vllm.envs as envs
        from vllm.v1.executor import ray_utils
        pg = ray.util.get_current_placement_group()
        if pg is None:
            return {"placed": False, "why": "no current placement group: vLLM would make its own"}
        gpu_bundles = [b for b in pg.bundle_specs if b.get("GPU", 0)]
        if len(gpu_bundles) < self.tp or any(b["GPU"] > 1 for b in gpu_bundles):
            return {"placed": False, "why": f"bundles {pg.bundle_specs}"}
        # ray_executor_v2.py step 2: the ranking (pinned by the engine's VLLM_RAY_BUNDLE_INDICES)
        if not envs.VLLM_RAY_BUNDLE_INDICES:
            return {"placed": False, "why": "VLLM_RAY_BUNDLE_INDICES unset: vLLM ranks by Ray node id"}
        ranked = ray_utils.get_bundles_for_indices(pg, list(map(int, envs.VLLM_RAY_BUNDLE_INDICES.split(","))),
                                                   self.tp)
        # step 4: one worker per bundle, num_gpus=VLLM_RAY_PER_WORKER_GPUS (1), in that bundle
        workers = [Holder.options(num_cpus=0, num_gpus=envs.VLLM_RAY_PER_WORKER_GPUS,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=pg, placement_group_bundle_index=b)).remote()
                   for b, _, _ in ranked]
        gpus = ray.get([w.ok.remote() for w in workers], timeout=WAIT_S)
        return {"placed": True, "why": "", "gpus_held_by_actor": len(ray.get_gpu_ids()),
                "rank_bundles": [b for b, _, _ in ranked], "v2": envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND,
                "worker_gpus": sorted(g for w in gpus for g in w)}

from workers.generator.actor import GeneratorConfig
from workers.generator.placement import in_placement_group

def case(plan):
    opts = [P.generator_options(plan, e) for e in range(plan.engines)]
    bundles = [P.engine_bundles(plan, e) for e in range(plan.engines)]
    env = GeneratorConfig(model="m", device="cuda", tensor_parallel=plan.generation_tp).engine_env()
    engines, groups = [], []
    for o, b in zip(opts, bundles):
        if b:
            pg, placed = in_placement_group(b)
            groups.append(pg)
            o = {**o, **placed}
        engines.append(Engine.options(**o).remote(plan.generation_tp, env))
    trainers = [Holder.options(**P.trainer_options(plan, r)).remote() for r in range(plan.train_world)]
    out = [ray.get(e.vllm_executor_placement.remote(), timeout=WAIT_S) for e in engines]
    trainer_gpus = ray.get([a.ok.remote() for a in trainers], timeout=WAIT_S)
    for a in engines + trainers:  # the next case starts on an empty cluster
        ray.kill(a)
    for pg in groups:
        ray.util.remove_placement_group(pg)
    deadline = time.time() + WAIT_S
    while ray.available_resources().get("GPU", 0) < 8:
        assert time.time() < deadline, ray.available_resources()
        time.sleep(0.2)
    return {"options": opts, "bundles": bundles, "engines": out,
            "trainer_gpus": sorted(g for t in trainer_gpus for g in t)}

print("RESULT " + json.dumps([case(plan) for plan in plans]))
ray.shutdown()
shutil.rmtree(temp, ignore_errors=True)
"""


# Each wait of the script is for a hang, not a time: at a load of 40 (CI, the streams side by side)
# an engine actor that imports vllm (10 s of CPU) took more than 90 s to answer.
WAIT_S = 300

CASES = {"1xTP4": dict(ranks_per_node=4, engines=1, tensor_parallel=4),
         "2xTP2": dict(ranks_per_node=4, engines=2, tensor_parallel=2),
         "4xTP1": dict(ranks_per_node=4, engines=4, tensor_parallel=1)}


@pytest.fixture(scope="module")
def placed() -> dict:
    """Every case of CASES, in one Ray cluster (one subprocess): case name -> what it placed."""
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(list(CASES.values())), str(WAIT_S)], cwd=REPO,
                       capture_output=True, text=True, timeout=2.5 * WAIT_S)  # under pytest's 900 s
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-4000:]
    return dict(zip(CASES, json.loads(line[len("RESULT "):])))


@pytest.mark.parametrize("name", ["1xTP4", "2xTP2"])
def test_tp_engine_starts_in_the_placement_group_its_vllm_workers_take(placed, name):
    r, gen = placed[name], CASES[name]
    assert all("num_gpus" not in o for o in r["options"]), r["options"]
    assert [len(b) for b in r["bundles"]] == [gen["tensor_parallel"]] * gen["engines"]
    assert all(set(b) == {"GPU", "node_1"} | ({"generation_slot"} if i == 0 else set())
               for bs in r["bundles"] for i, b in enumerate(bs))  # pinned to the generation node
    engines = r["engines"]
    assert [(e["placed"], e["why"], e["gpus_held_by_actor"]) for e in engines] == [(True, "", 0)] * gen["engines"], r
    assert all(e["v2"] and e["rank_bundles"] == list(range(gen["tensor_parallel"])) for e in engines), engines
    workers = [g for e in engines for g in e["worker_gpus"]]
    assert len(workers) == 4 and len(r["trainer_gpus"]) == 4  # 8 GPUs, each taken once
    assert sorted(map(int, workers + r["trainer_gpus"])) == list(range(8))


def test_tp1_engine_takes_its_one_gpu(placed):
    r = placed["4xTP1"]
    assert [o.get("num_gpus") for o in r["options"]] == [1, 1, 1, 1]
