"""Plan arithmetic for every topology in conf/, the rendered sbatch (golden file) and the dry run."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.config import compose as config_mod
from launcher.config import ranges
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
                        "slurm.container_mounts=/lustre:/lustre")
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


def _body(script: str, reached: Path) -> str:
    """A job script without its #SBATCH lines, its srun line (the job itself) replaced by `touch reached`."""
    lines = [line for line in script.splitlines() if not line.startswith("#SBATCH")]
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    return "\n".join(lines[:srun] + [f"touch {reached}"]) + "\n"


@pytest.mark.parametrize("setup, stops", [
    ("echo $I45_NOT_SET", True),               # an unset variable
    ("false", True),                           # a command that fails
    ("false | cat", True),                     # ... inside a pipe
    ("export I45_SET=1 && echo $I45_SET", False),
])
def test_both_scripts_run_slurm_setup_under_the_same_shell_options(tmp_path, setup, stops):
    """The plain-sbatch script and submitit's run the one prologue (sbatch.prologue, behind SHELL_OPTIONS): the
    same slurm.setup line stops both before the job's srun, or neither. Each body is run by bash as Slurm runs it
    (the #SBATCH lines are comments), with the srun line replaced by a marker."""
    cfg, plan = plan_of("topology=slurm_3n", f"slurm.setup=['{setup}','touch {tmp_path}/after']")
    spec = sbatch.job_spec(cfg, plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith("I45_")} | {"SLURM_JOB_ID": "7"}
    results = {}
    for name, script in (("sbatch", sbatch.render(spec, plan, tmp_path)), ("submitit",
                                                                           sbatch.submitit_script(spec, tmp_path))):
        for f in ("after", "reached"):
            (tmp_path / f).unlink(missing_ok=True)
        p = subprocess.run(["bash", "-c", _body(script, tmp_path / "reached")], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
        results[name] = (p.returncode != 0, (tmp_path / "after").exists(), (tmp_path / "reached").exists())
    expected = (True, False, False) if stops else (False, True, True)
    assert results == {"sbatch": expected, "submitit": expected}


@functools.lru_cache(maxsize=None)
def _composed(topology: str):
    return typed(compose([f"topology={topology}"]))


def with_(topology: str, **settings):
    """A copy of the composed topology's config with `settings` ({"section__key": value}) set, and its plan."""
    cfg = copy.deepcopy(_composed(topology))
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg, plan_mod.build(cfg.topology)


def _sbatch_lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if line.startswith("#SBATCH --")
            and not line.startswith(("#SBATCH --output", "#SBATCH --error", "#SBATCH --wckey"))}


NVLINK = {"#SBATCH --segment=6", "#SBATCH --exclusive", "#SBATCH --mem=0"}


def test_the_nvlink_domain_reaches_both_scripts_and_only_a_cuda_job_takes_whole_nodes():
    cfg, plan = with_("ultra_6n4g")
    spec = sbatch.job_spec(cfg, plan)
    via_submitit, plain = sbatch.submitit_script(spec, Path("/r")), sbatch.render(spec, plan, Path("/r"))
    assert _sbatch_lines(via_submitit) == _sbatch_lines(plain) and NVLINK <= _sbatch_lines(plain)
    for text in (via_submitit, plain):  # before slurm.setup, which may override it
        assert "\nexport NCCL_MNNVL_ENABLE=1\n" in text
        assert "# note: --segment=6 needs Slurm >= 24.05 with TopologyPlugin=topology/block" in text
    # one node per domain: --segment=1 (Slurm's blocks still apply), no multi-node NVLink for NCCL
    spec = sbatch.job_spec(*with_("ultra_6n4g", topology__nvlink_domain_nodes=1))
    assert spec.flags["segment"] == 1 and spec.env == {}
    # null: no segment, still whole nodes on cuda
    spec = sbatch.job_spec(*with_("ultra_6n4g", topology__nvlink_domain_nodes=None))
    assert "segment" not in spec.flags and spec.flags["exclusive"] is True and spec.flags["mem"] == "0"
    assert spec.env == {} and spec.notes == []
    # the CPU test cluster: none of it
    cfg, plan = with_("slurm_2n")
    spec = sbatch.job_spec(cfg, plan)
    text = sbatch.submitit_script(spec, Path("/r")) + sbatch.render(spec, plan, Path("/r"))
    assert not {line.split("=")[0] for line in NVLINK} & {line.split("=")[0] for line in _sbatch_lines(text)}
    assert "NCCL_MNNVL_ENABLE" not in text and "--segment" not in text


def test_a_bad_nvlink_domain_is_refused_in_one_line(tmp_path, capsys):
    from launcher.__main__ import main

    rc = main(["topology=ultra_6n4g", "topology.nvlink_domain_nodes=4", "dry_run=true", f"run.root={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("error: topology.nvlink_domain_nodes: must divide the job's 6 nodes (topology.nodes; "
                               "sbatch --segment=N allocates them in groups of N, each inside one topology block), "
                               "got 4"), err
    with pytest.raises(config_mod.ConfigError, match="^topology.nvlink_domain_nodes: must divide the job's 6 nodes"):
        sbatch.job_spec(*with_("ultra_6n4g", topology__nvlink_domain_nodes=12))  # more than the job's nodes
    cfg, _ = with_("ultra_6n4g", topology__nvlink_domain_nodes=0)
    assert [str(e) for e in ranges.check(cfg)] == ["topology.nvlink_domain_nodes: must be in [1, 4096] or null, got 0"]


@pytest.mark.parametrize("topology,key,value,refused", [
    # the launcher's own options: one error naming the key that sets them
    ("ultra_6n4g", "segment", 2, "is set by the launcher (set topology.nvlink_domain_nodes)"),
    ("slurm_2n", "segment", 2, "is set by the launcher (set topology.nvlink_domain_nodes)"),
    ("ultra_6n4g", "exclusive", True, "is set by the launcher (a Slurm job on cuda takes whole nodes: "
                                      "--exclusive --mem=0)"),
    ("ultra_6n4g", "exclusive", "topo", "is set by the launcher"),
    ("ultra_6n4g", "mem", "64G", "is set by the launcher (a Slurm job on cuda takes whole nodes"),
    ("ultra_6n4g", "me", "64G", "abbreviates --mem, which is set by the launcher"),
    ("ultra_6n4g", "mem_per_gpu", "8G", "is set by the launcher (a Slurm job on cuda takes whole nodes with "
                                        "--mem=0, which sbatch does not combine with this)"),
    ("ultra_6n4g", "mem-per-cpu", "2G", "is set by the launcher (a Slurm job on cuda takes whole nodes with --mem=0"),
    # a CPU job does not take whole nodes: these stay the user's
    ("slurm_2n", "exclusive", True, None), ("slurm_2n", "mem", "64G", None), ("slurm_2n", "mem_per_cpu", "2G", None),
    # options next to --segment that Slurm's topology/block reads
    ("ultra_6n4g", "spread_segments", True, None), ("ultra_6n4g", "consolidate_segments", True, None),
    # what sbatch prints is read for the job id; an option that only starts like one stays the user's
    ("slurm_2n", "parsable", True, "is set by the launcher (the launcher reads the job id from what sbatch prints)"),
    ("slurm_2n", "wait", True, "is set by the launcher (the launcher submits and returns"),
    ("slurm_2n", "wait_all_nodes", "1", None),
])
def test_extra_sbatch_cannot_change_the_nvlink_or_whole_node_options(topology, key, value, refused):
    cfg, plan = with_(topology, slurm__extra_sbatch={key: value})
    if refused is None:
        spec = sbatch.job_spec(cfg, plan)
        flag = key.replace("_", "-")
        assert spec.flags[flag] == value
        line = f"#SBATCH --{flag}" + ("" if value is True else f"={value}")
        assert line in sbatch.submitit_script(spec, Path("/r")) and line in sbatch.render(spec, plan, Path("/r"))
        return
    with pytest.raises(config_mod.ConfigError) as e:
        sbatch.job_spec(cfg, plan)
    assert str(e.value).startswith(f"slurm.extra_sbatch.{key}: {refused}"), str(e.value)


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
    assert all(line in p.stdout for line in NVLINK) and "export NCCL_MNNVL_ENABLE=1" in p.stdout
    assert "needs Slurm >= 24.05 with TopologyPlugin=topology/block" in p.stdout  # what --segment needs
    assert "  name: ultra_6n4g" in p.stdout  # the resolved config
    assert list(tmp_path.iterdir()) == []
    print(f"dry run wall {wall:.2f}s")
