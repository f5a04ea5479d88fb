"""run.job=preflight, node 0's side: from the probes' reports to one line per problem and the table.
The probes themselves run for real in tests/slurm/test_preflight_on_slurm.py; here their reports
are the records a real probe prints (one local probe is run to get one), varied per node."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config import compose
from launcher.config.schema import typed
from launcher.cluster import preflight

HOSTS = ["gpu-a", "gpu-b", "gpu-c"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = typed(compose.compose(["topology=slurm_3n", "run.job=preflight", f"run.root={root}", "run.name=pf"]))
    plan = plan_mod.build(cfg.topology)
    run_dir = root / "pf"
    folder = run_dir / "preflight" / "7.0"
    folder.mkdir(parents=True)
    (folder / "node0.txt").write_text("abc")
    args = {"device": "cpu", "run_dir": str(run_dir), "token_file": str(folder / "node0.txt"), "nonce": "abc",
            "model_dir": str(root / "models" / "tiny_llama"), "model_must_exist": False,
            "checkpoint_dir": str(run_dir / "checkpoints"), "train_hosts": [], "world": 1, "timeout_s": 30,
            "master": "127.0.0.1:1"}
    probe = json.loads(subprocess.run([sys.executable, "-c", "import json, sys; from launcher.cluster import "
                                       "preflight; print(json.dumps(preflight.probe(json.loads(sys.argv[1]))))",
                                       json.dumps(args)], capture_output=True, text=True, check=True,
                                      env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin:/bin"}).stdout)
    ctx = JobContext(run_dir=run_dir, job_id="7", attempt=0, node_index=0, hostnames=HOSTS)
    return cfg, plan, ctx, probe, folder


def nodes_like(probe: dict, folder: Path) -> dict:
    out = {}
    for h in HOSTS:
        r = copy.deepcopy(probe)
        r.update(host=h, own_file=str(folder / f"node-{h}.txt"))
        (folder / f"node-{h}.txt").write_text(f"abc {h}")
        out[h] = r
    return out


NETS = {h: {"ok": True, "backend": "gloo", "mib": 16, "seconds": 0.5, "busbw_gbs": 0.09} for h in HOSTS}


def judge(setup, nodes, nets=NETS):
    cfg, plan, ctx, _, folder = setup
    report = {"job": "7", "device": "cpu", "hosts": HOSTS, "nodes": [], "net": nets}
    report["problems"] = preflight._judge(cfg, plan, ctx, nodes, nets, report, folder, "abc")
    return report


def test_a_real_probe_sees_the_run_directory_and_four_gpus(setup):
    probe = setup[3]
    assert probe["gpus"] == 4 and probe["run_dir_read"] == "ok" and probe["run_dir_write"] == "ok"
    assert probe["torch"].startswith("2.") and len(probe["packages_hash"]) == 12
    assert any(p.startswith("torch==") for p in probe["packages"])


def test_the_package_list_does_not_depend_on_what_the_probe_imported(monkeypatch):
    """On a generation node the probe imports vLLM's executor class, which through setuptools puts
    setuptools/_vendor on sys.path; importlib.metadata then also finds the vendored copies there
    (autocommand, backports.tarfile, importlib-metadata, inflect) and that node's packages differed
    from node 0's (tests/slurm/test_preflight_on_slurm.py). Here the same directory, the installed
    setuptools' own, is put on sys.path the way setuptools does it (appended)."""
    import importlib.metadata as md
    import importlib.util

    vendor = Path(importlib.util.find_spec("setuptools").submodule_search_locations[0]) / "_vendor"
    vendored = {d.metadata["Name"].lower() for d in md.distributions(path=[str(vendor)])}
    assert {"autocommand", "inflect"} <= vendored   # the directory the defect put on sys.path
    before = preflight._packages()
    assert not any(p.split("==")[0] in ("autocommand", "inflect") for p in before)
    assert any(p.startswith("torch==") for p in before)
    monkeypatch.setattr(sys, "path", sys.path + [str(vendor)])
    assert {"autocommand", "inflect"} <= {d.metadata["Name"].lower() for d in md.distributions()}  # what it read
    assert preflight._packages() == before


def test_healthy_nodes_give_no_problem_and_a_table(setup):
    report = judge(setup, nodes_like(setup[3], setup[4]))
    assert report["problems"] == []
    table = preflight.format_table({**report, "seconds": 1.0})
    assert [ln.split()[1] for ln in table.splitlines()[2:5]] == HOSTS
    assert "all-reduce: gloo, 16 MiB, 3/3 node(s), 0.5s per call, 0.09 GB/s bus bandwidth" in table
    assert table.endswith("0 problem(s)")


def test_each_problem_is_one_line_naming_its_node(setup):
    nodes = nodes_like(setup[3], setup[4])
    nodes["gpu-b"]["gpus"] = 2
    nodes["gpu-c"]["packages"] = [p if not p.startswith("torch==") else "torch==9.9" for p in nodes["gpu-c"]["packages"]]
    nodes["gpu-c"]["packages_hash"] = "other"
    nodes["gpu-c"]["run_dir_read"] = "FileNotFoundError: [Errno 2] No such file or directory: '/x'"
    del nodes["gpu-a"]
    nets = {h: v for h, v in NETS.items() if h != "gpu-a"}
    report = judge(setup, nodes, nets)
    p = report["problems"]
    assert p[0] == "node 0 (gpu-a): no report from its probe (could not start python there?)"
    assert p[1] == "node 1 (gpu-b): sees 2 GPU(s), the plan needs 4 (topology.gpus_per_node)"
    assert p[2].startswith(f"node 2 (gpu-c): cannot see the run directory {setup[2].run_dir} (the file node 0 "
                           "wrote: FileNotFoundError")
    assert p[3].startswith("node 2 (gpu-c): installed packages differ from node 1 (gpu-b): torch==9.9")
    assert p[4] == "all-reduce across 3 node(s) failed (2/3 probes reported)"
    assert len(p) == 5
    table = preflight.format_table({**report, "seconds": 1.0})
    assert "0     gpu-a            (no report)" in table
    assert [ln for ln in table.splitlines() if ln.startswith("PROBLEM: ")] == [f"PROBLEM: {x}" for x in p]


def test_a_node_that_writes_elsewhere_is_named(setup):
    nodes = nodes_like(setup[3], setup[4])
    (setup[4] / "node-gpu-b.txt").unlink()        # what gpu-b wrote never reached node 0's filesystem
    p = judge(setup, nodes)["problems"]
    assert p == [f"node 1 (gpu-b): node 0 cannot read the file it wrote ({setup[4] / 'node-gpu-b.txt'}): "
                 "not the same filesystem"]


def test_probe_lines_stay_short_and_survive_interleaving(capsys):
    """slurmstepd forwards task output in ~1 KiB chunks: each line stays under it, and node 0
    reassembles records whose lines arrive interleaved with another node's."""
    a = {"kind": "node", "host": "gpu-a", "packages": [f"pkg{i}==1.0" for i in range(400)], "err": '"' * 900}
    b = {"kind": "node", "host": "gpu-b", "packages": ["x==2"], "err": ""}
    preflight._emit(a)
    lines_a = capsys.readouterr().out.splitlines()
    preflight._emit(b)
    lines_b = capsys.readouterr().out.splitlines()
    assert len(lines_a) > 10 and max(len(ln.encode()) for ln in lines_a + lines_b) < 1000
    mixed = [ln for pair in zip(lines_a, lines_b + [""] * len(lines_a)) for ln in pair if ln]
    got = {r["host"]: r for r in preflight._records("srun: warning\n" + "\n".join(mixed[::-1]))}
    assert got == {"gpu-a": a, "gpu-b": b}
    assert preflight._records("\n".join(lines_a[:-1])) == []        # a lost piece: no record


def test_the_build_needs_of_the_reference_recipe_and_of_a_cpu_run():
    cfg = typed(compose.compose(["topology=ultra_6n4g"]))
    needs = preflight.build_needs(cfg, plan_mod.build(cfg.topology))
    assert [n for n, _ in needs["train"]] == ["transformer_engine.pytorch", "mamba_ssm", "causal_conv1d"]
    assert needs["generation"] == [["vllm.v1.executor.ray_executor_v2:RayExecutorV2",
                                    "the vLLM executor the engine runs"]]
    cfg = typed(compose.compose(["topology=slurm_3n"]))
    needs = preflight.build_needs(cfg, plan_mod.build(cfg.topology))
    assert needs == {"train": [], "generation": [["vllm.v1.executor.uniproc_executor:UniProcExecutor",
                                                  "the vLLM executor the engine runs"]]}


@pytest.mark.parametrize("model, backend, train", [
    ("nemotron3_ultra", "flash", ["transformer_engine.pytorch", "mamba_ssm", "causal_conv1d", "flash_attn"]),
    ("tiny_llama", "fused", ["transformer_engine.pytorch"]),
    ("tiny_llama", "flash", ["transformer_engine.pytorch", "flash_attn"]),
    ("tiny_llama", "local", [])])
def test_a_cuda_training_node_is_probed_for_its_attention_backends_kernels(model, backend, train):
    cfg = typed(compose.compose(["topology=ultra_6n4g", f"model={model}",
                                 f"topology.train.attention_backend={backend}"]))
    needs = preflight.build_needs(cfg, plan_mod.build(cfg.topology))["train"]
    assert [n for n, _ in needs] == train
    why = dict((n, w) for n, w in needs)
    if "flash_attn" in why:
        assert why["flash_attn"] == ("attention_backend flash: the flash-attn package Transformer Engine's flash "
                                     "attention runs; or set topology.train.attention_backend=local")


def test_a_real_probe_imports_what_its_roles_need_and_each_failure_is_a_problem_line(setup):
    """A generation node (gpu-c) that lacks a package and one whose executor class is missing."""
    cfg, plan, ctx, _, folder = setup
    args = {"device": "cpu", "run_dir": str(ctx.run_dir), "token_file": str(folder / "node0.txt"), "nonce": "abc",
            "model_dir": str(folder), "model_must_exist": False, "checkpoint_dir": str(folder), "train_hosts": [],
            "generation_hosts": [socket.gethostname()], "world": 1, "timeout_s": 30, "master": "127.0.0.1:1",
            "needs": {"train": [["mamba_ssm", "not asked: this node does not train"]],
                      "generation": [["json:JSONDecoder", "present"], ["no_such_executor_pkg:Executor", "missing"]]}}
    real = json.loads(subprocess.run([sys.executable, "-c", "import json, sys; from launcher.cluster import "
                                      "preflight; print(json.dumps(preflight.probe(json.loads(sys.argv[1]))))",
                                      json.dumps(args)], capture_output=True, text=True, check=True,
                                     cwd=str(Path(__file__).resolve().parents[2])).stdout)
    assert real["imports"]["json:JSONDecoder"] == "ok" and "mamba_ssm" not in real["imports"]
    assert real["imports"]["no_such_executor_pkg:Executor"].startswith("ModuleNotFoundError: No module named")
    nodes = nodes_like(setup[3], setup[4])
    nodes["gpu-c"]["imports"] = {"vllm.v1.executor.uniproc_executor:UniProcExecutor":
                                 real["imports"]["no_such_executor_pkg:Executor"]}
    p = judge(setup, nodes)["problems"]
    assert p == ["node 2 (gpu-c): cannot import vllm.v1.executor.uniproc_executor.UniProcExecutor (the vLLM executor "
                 "the engine runs): ModuleNotFoundError: No module named 'no_such_executor_pkg'"]
    table = preflight.format_table({**judge(setup, nodes), "seconds": 1.0})
    assert [ln.split()[-2] for ln in table.splitlines()[2:5]] == ["-", "-", "FAIL"]


def test_training_nodes_with_other_fusion_kernels_or_smaller_gpus_are_named(setup):
    nodes = nodes_like(setup[3], setup[4])
    for h in HOSTS:
        nodes[h]["kernels"] = {"fused_weight_gradient_mlp_cuda": "ok", "transformer_engine.pytorch": "ok"}
        nodes[h]["gpu_memory_gib"] = 185.0
    nodes["gpu-b"]["kernels"]["fused_weight_gradient_mlp_cuda"] = "ModuleNotFoundError: No module named 'x'"
    nodes["gpu-c"]["gpu_memory_gib"] = 79.1
    p = judge(setup, nodes)["problems"]
    assert p == ["node 1 (gpu-b): fused_weight_gradient_mlp_cuda does not import here, unlike on node 0 (gpu-a): its "
                 "trainer ranks would build other fusions (workers/trainer/kernels.py)",
                 "node 2 (gpu-c): its GPUs have 79.1 GiB, the memory plan assumes 184 (topology.gpu_memory_gib)"]
