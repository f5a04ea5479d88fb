"""Plan arithmetic for every topology in conf/, the rendered sbatch (golden file) and the dry run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.config import compose as config_mod
from launcher import plan as plan_mod
from launcher.job import sbatch
from launcher.config.compose import compose
from launcher.config.schema import typed

GOLDEN = Path(__file__).parent / "golden"


def plan_of(*overrides):
    cfg = typed(compose(list(overrides)))
    return cfg, plan_mod.build(cfg.topology)


# topology -> (train ranks per node, vLLM workers per node, tp, dp, engines, generation tp)
EXPECTED = {
    "local": ([(0, 1)], [[(0, 0)]], 2, 1, 1, 1),
    "slurm_2n": ([(0,), ()], [[], [(0, 0)]], 1, 1, 1, 1),
    "slurm_3n": ([(0,), (1,), ()], [[], [], [(0, 0)]], 2, 1, 1, 1),
    "slurm_4n": ([(0,), (1,), (), ()], [[], [], [(0, 0)], [(1, 0)]], 2, 1, 2, 1),
    "ultra_6n4g": ([(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15), (), ()],
                   [[], [], [], [], [(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 4), (0, 5), (0, 6), (0, 7)]], 2, 8, 1, 8),
}


def test_every_topology_has_an_expected_plan():
    assert sorted(EXPECTED) == config_mod.group_options("topology")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_plan_arithmetic(name):
    cfg, plan = plan_of(f"topology={name}")
    ranks, workers, tp, dp, engines, gtp = EXPECTED[name]
    assert [n.train_ranks for n in plan.nodes] == list(ranks)
    assert [list(n.generation_workers) for n in plan.nodes] == workers
    assert (plan.tp, plan.dp, plan.engines, plan.generation_tp) == (tp, dp, engines, gtp)
    assert plan.tp * plan.pp * plan.cp * plan.dp == plan.train_world
    for n in plan.nodes:
        res = n.ray_resources()
        assert res[plan_mod.node_resource(n.index)] == plan_mod.NODE_RESOURCE_UNITS
        assert res.get(plan_mod.TRAIN_SLOT, 0) == len(n.train_ranks)
        assert res.get(plan_mod.GENERATION_SLOT, 0) == len(n.generation_workers)
    for r in range(plan.train_world):
        assert r in plan.nodes[plan.trainer_node(r)].train_ranks


def test_ultra_plan_table():
    _, plan = plan_of("topology=ultra_6n4g")
    text = plan.describe([f"gb{i:02d}" for i in range(6)])
    assert "training: 16 ranks = TP 2 x PP 1 x CP 1 x DP 8 (EP 16, ETP 1) on cuda" in text
    assert "generation: 1 vLLM engine(s) x TP 8" in text
    assert "gb00           train (head)         0-3" in text
    assert "gb05           generation           -                  0:4 0:5 0:6 0:7                  4" in text


def test_a_tp8_engine_over_two_nodes_gets_one_gpu_bundle_per_worker_pinned_to_its_node():
    _, plan = plan_of("topology=ultra_6n4g")
    assert plan_mod.engine_bundles(plan, 0) == (
        [{"GPU": 1, "node_4": 2, "generation_slot": 4}]   # + the engine's actor (generator_options)
        + [{"GPU": 1, "node_4": 1}] * 3 + [{"GPU": 1, "node_5": 1}] * 4)
    assert plan_mod.generator_options(plan, 0) == {"num_cpus": 0, "resources": {"generation_slot": 4, "node_4": 1}}
    for topology in ("local", "slurm_4n"):  # cpu, and TP1 engines: vLLM makes no group
        _, plan = plan_of(f"topology={topology}")
        assert all(plan_mod.engine_bundles(plan, e) is None for e in range(plan.engines))
    _, plan = plan_of("topology=slurm_4n", "topology.device=cuda", "topology.gpus_per_node=2",
                      "topology.generation.ranks_per_node=2", "topology.generation.tensor_parallel=2",
                      "topology.generation.engines=2")
    assert plan_mod.engine_bundles(plan, 1) == [{"GPU": 1, "node_3": 2, "generation_slot": 2}, {"GPU": 1, "node_3": 1}]


def test_rendered_sbatch_matches_golden_file():
    cfg, plan = plan_of("topology=ultra_6n4g", "slurm.partition=batch", "slurm.account=llm",
                        "slurm.python=/opt/venv/bin/python", "slurm.setup=[module load cuda/12.8]",
                        "slurm.container_image=nvcr.io/nvidia/nemo-rl:latest",
                        "slurm.container_mounts=/lustre:/lustre", "+slurm.extra_sbatch.exclusive=true")
    text = sbatch.render(sbatch.job_spec(cfg, plan), plan, Path("/lustre/runs/ultra lora"))
    golden = GOLDEN / "ultra_6n4g.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # the script parses


def test_submitit_script_is_the_same_job():
    cfg, plan = plan_of("topology=slurm_3n", "slurm.partition=gpu")
    spec = sbatch.job_spec(cfg, plan)
    text = sbatch.submitit_script(spec, Path("/runs/x"))
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=2", "#SBATCH --partition=gpu", "#SBATCH --signal=USR2@120",
                 "#SBATCH --time=240"):
        assert line in text
    assert "--kill-on-bad-exit=1" in text and "-m submitit.core._submit /runs/x/submitit/%j" in text
    # Slurm >= 22.05: the step does not inherit the job's --cpus-per-task, so srun states it too
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=2" in srun.split()
    assert "--cpus-per-task" not in sbatch.submitit_script(sbatch.job_spec(*plan_of("topology=ultra_6n4g",
                                                                                    "topology.cpus_per_node=null")),
                                                           Path("/runs/x"))


def test_dry_run_is_fast_imports_no_torch_and_writes_nothing(tmp_path):
    code = ("import sys, time; t=time.time(); from launcher.__main__ import main; "
            f"rc = main(['topology=ultra_6n4g', 'dry_run=true', 'run.root={tmp_path}']); "
            "assert rc == 0, rc; bad = [m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules]; "
            "print('IMPORTED', bad); print('SECONDS', time.time() - t)")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.time() - t0
    assert p.returncode == 0, p.stderr
    assert "IMPORTED []" in p.stdout
    assert "node 4         generation" in p.stdout
    assert "#SBATCH --nodes=6" in p.stdout and "#SBATCH --gpus-per-node=4" in p.stdout
    assert "  name: ultra_6n4g" in p.stdout  # the resolved config
    assert list(tmp_path.iterdir()) == []
    print(f"dry run wall {wall:.2f}s")
