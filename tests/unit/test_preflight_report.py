"""run.job=preflight, node 0's side: from the probes' reports to one line per problem and the table.
The probes themselves run for real in tests/slurm/test_preflight_on_slurm.py; here their reports
are the records a real probe prints (one local probe is run to get one), varied per node."""

from __future__ import annotations

import copy
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config import compose
from launcher.config.schema import typed
from launcher.cluster import kernel_probes, preflight

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
    assert [ln.split()[-4] for ln in table.splitlines()[2:5]] == ["-", "-", "FAIL"]   # imports


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


# ------------------------------------------------------------------ NVLink cliques and kernel probes (cuda)
# `nvidia-smi -q` as a GB200 node prints it: the header and GPU blocks in the driver's layout, the Fabric
# sections verbatim from two public reports: a registered GPU (kubernetes-sigs/dra-driver-nvidia-gpu issue
# #626, `nvidia-smi -q | grep -E -C3 "ClusterUUID|CliqueId"`) and one whose registration has not completed
# (NVIDIA/gpu-operator issue #2511, driver 580.159.04)
GPU = """GPU 0000000{n}:01:00.0
    Product Name                          : NVIDIA GB200
    Product Brand                         : NVIDIA
    GPU UUID                              : GPU-1182579c-5a69-8e8e-cb7a-e6e0b65d47c{n}
    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : {clique}
        ClusterUUID                       : dc6e40c4-d722-4357-9ba6-5291dd461278
        Health
            Summary                       : Unhealthy
            Bandwidth                     : Full
    Processes                             : None
"""
IN_PROGRESS = """GPU 00000009:01:00.0
    Product Name                                       : NVIDIA GB200
    Fabric
        State                                          : In Progress
        Status                                         : N/A
        CliqueId                                       : N/A
        ClusterUUID                                    : N/A
        Health
            Summary                                    : N/A
            Bandwidth                                  : N/A
            Route Recovery in progress                 : N/A
            Route Unhealthy                            : N/A
            Access Timeout Recovery                    : N/A
            Incorrect Configuration                    : N/A
            Partition Assigned                         : N/A
"""
HEAD = """
==============NVSMI LOG==============

Timestamp                                 : Tue Jun  2 09:49:44 2026
Driver Version                            : 580.159.04
CUDA Version                              : 13.0

Attached GPUs                             : {n}
"""
UUID = "dc6e40c4-d722-4357-9ba6-5291dd461278"


def test_the_fabric_clique_is_read_from_nvidia_smi_q():
    four = HEAD.format(n=4) + "".join(GPU.format(n=n, clique=2) for n in (8, 9, 10, 11))
    assert preflight.fabric_clique(four) == {"clique": f"{UUID}/2", "why": ""}
    one_elsewhere = HEAD.format(n=2) + GPU.format(n=8, clique=2) + GPU.format(n=9, clique=3)
    assert preflight.fabric_clique(one_elsewhere) == {
        "clique": None, "why": f"its GPUs are in 2 cliques: {UUID}/2, {UUID}/3"}
    assert preflight.fabric_clique(HEAD.format(n=2) + GPU.format(n=8, clique=2) + IN_PROGRESS) == {
        "clique": None, "why": "GPU 00000009:01:00.0: fabric state In Progress"}
    h100 = HEAD.format(n=1) + GPU.format(n=8, clique=0).replace(UUID, "00000000-0000-0000-0000-000000000000")
    assert preflight.fabric_clique(h100)["why"] == ("GPU 00000008:01:00.0: ClusterUUID "
                                                    "00000000-0000-0000-0000-000000000000")
    no_section = "\n".join(ln for ln in GPU.format(n=8, clique=2).splitlines() if ln.startswith(("GPU", "    P")))
    assert preflight.fabric_clique(HEAD.format(n=1) + no_section)["why"] == (
        "GPU 00000008:01:00.0: no Fabric section (no NVLink fabric, or an older driver)")
    assert preflight.fabric_clique("")["why"] == "nvidia-smi -q lists no GPU"


@pytest.fixture(scope="module")
def cuda_domain():
    """slurm_3n on cuda with its 3 nodes in one NVLink domain (2 train, 1 generates: tiny_llama, dense)."""
    cfg = typed(compose.compose(["topology=slurm_3n", "topology.device=cuda", "topology.nvlink_domain_nodes=3"]))
    return cfg, plan_mod.build(cfg.topology)


def cuda_nodes(setup, cliques):
    nodes = nodes_like(setup[3], setup[4])
    for h, clique in zip(HOSTS, cliques):
        nodes[h].update(fabric={"clique": clique, "why": "" if clique else "GPU 00000009:01:00.0: fabric state In "
                                                                           "Progress"},
                        gpu_arch="sm_100", kernel_probes={"te_attention:fused": "ok"} if h != "gpu-c" else {})
    return nodes


def judge_with(setup, cfg, plan, nodes):
    _, _, ctx, _, folder = setup
    report = {"job": "7", "device": plan.device, "hosts": HOSTS, "nodes": [], "net": NETS}
    report["problems"] = preflight._judge(cfg, plan, ctx, nodes, NETS, report, folder, "abc")
    return report


def test_a_node_outside_its_nvlink_domains_clique_is_named(setup, cuda_domain):
    cfg, plan = cuda_domain
    assert judge_with(setup, cfg, plan, cuda_nodes(setup, [f"{UUID}/2"] * 3))["problems"] == []
    report = judge_with(setup, cfg, plan, cuda_nodes(setup, [f"{UUID}/2", f"{UUID}/2", f"{UUID}/7"]))
    where = "nodes 0-2 share one NVLink domain: topology.nvlink_domain_nodes=3, NCCL_MNNVL_ENABLE=1 makes NCCL fail " \
            "across cliques"
    assert report["problems"] == [f"node 2 (gpu-c): its GPUs are in NVLink clique {UUID}/7, 2 of its domain's 3 "
                                  f"nodes in {UUID}/2 ({where})"]
    table = preflight.format_table({**report, "seconds": 1.0})
    assert [ln.split()[-2] for ln in table.splitlines()[2:5]] == ["dc6e40c4/2", "dc6e40c4/2", "dc6e40c4/7"]
    p = judge_with(setup, cfg, plan, cuda_nodes(setup, [f"{UUID}/2", None, f"{UUID}/2"]))["problems"]
    assert p == [f"node 1 (gpu-b): no NVLink fabric clique (GPU 00000009:01:00.0: fabric state In Progress); {where}"]


def test_a_cpu_run_never_fails_on_cliques_or_kernels(setup):
    """The cpu probe reads no fabric (a CPU node has no nvidia-smi) and has no kernel to probe, even with a
    domain set; the same cliques that fail the cuda run above are no problem here."""
    cfg = typed(compose.compose(["topology=slurm_3n", "topology.nvlink_domain_nodes=3"]))
    assert setup[3]["fabric"] == {"clique": None, "why": "not read: a cpu run"}
    assert judge_with(setup, cfg, plan_mod.build(cfg.topology), nodes_like(setup[3], setup[4]))["problems"] == []


def test_the_kernel_probes_of_a_nemotron_h_moe_recipe_and_of_a_dense_llama():
    def chosen(*overrides):
        cfg = typed(compose.compose(list(overrides)))
        return kernel_probes.chosen(cfg, plan_mod.build(cfg.topology))

    assert chosen("topology=ultra_6n4g") == {
        "train": ["te_attention:fused", "mamba_chunk_scan", "causal_conv1d", "te_grouped_linear"],
        "generation": ["vllm_fused_moe:relu2_no_mul"]}
    assert chosen("topology=ultra_6n4g", "model=tiny_llama") == {"train": ["te_attention:fused"], "generation": []}
    assert chosen("topology=ultra_6n4g", "model=tiny_qwen3_moe", "topology.train.attention_backend=flash") == {
        "train": ["te_attention:flash", "te_grouped_linear"], "generation": ["vllm_fused_moe:silu"]}
    assert chosen("topology=ultra_6n4g", "model=tiny_llama", "topology.train.attention_backend=local") == {
        "train": [], "generation": []}
    assert chosen("topology=slurm_3n", "model=tiny_nemotron3") == {"train": [], "generation": []}   # cpu


def test_each_kernel_probe_is_ok_its_error_or_skipped(monkeypatch):
    """probe_kernels on a (pretended) CUDA training node: a kernel that raised gives its error in one
    line, one whose library does not import is skipped (the import is the problem line), and a
    generation probe is not run on a node that does not generate."""
    import torch

    def run(name):
        if name == "causal_conv1d":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_probes, "arch", lambda: "sm_100")
    monkeypatch.setattr(kernel_probes, "run", run)
    args = {"device": "cuda", "train_hosts": [socket.gethostname()], "generation_hosts": [],
            "kernel_probes": {"train": ["te_attention:fused", "mamba_chunk_scan", "causal_conv1d"],
                              "generation": ["vllm_fused_moe:silu"]}}
    got = preflight.probe_kernels(args, {"transformer_engine.pytorch": "ok", "mamba_ssm": "ModuleNotFoundError: x"})
    assert got == {"host": socket.gethostname(), "gpu_arch": "sm_100", "probes": {
        "te_attention:fused": "ok", "mamba_chunk_scan": "skipped: mamba_ssm does not import",
        "causal_conv1d": "RuntimeError: CUDA error: no kernel image is available for execution on the device"}}


def test_a_kernel_probe_that_raised_is_one_problem_line_naming_the_kernel_and_architecture(setup, cuda_domain):
    cfg, plan = cuda_domain
    real = preflight._try(lambda: kernel_probes.run("causal_conv1d"))  # a real error: this torch has no CUDA
    assert re.fullmatch(r"[A-Za-z]+Error: [^\n]+", real), real
    nodes = cuda_nodes(setup, [f"{UUID}/2"] * 3)
    nodes["gpu-a"]["kernel_probes"] = {"te_attention:fused": "ok", "causal_conv1d": real}
    del nodes["gpu-b"]["kernel_probes"]   # its kernels' record never came: the probe hung in a kernel
    report = judge_with(setup, cfg, plan, nodes)
    assert report["problems"] == [
        f"node 0 (gpu-a): kernel causal_conv1d failed on sm_100: {real}",
        "node 1 (gpu-b): no report from its kernel probes (te_attention:fused): one of them hung or crashed the probe"]
    table = preflight.format_table({**report, "seconds": 1.0})
    assert [ln.split()[-3] for ln in table.splitlines()[2:5]] == ["sm_100:FAIL", "-", "-"]


def test_a_probe_process_reports_its_kernels_after_the_all_reduce_and_skips_them_without_cuda(tmp_path):
    """The probe command as node 0 starts it (world 1, gloo): its three records, the kernels' last; on a
    cpu run every kernel asked for is skipped, which the judge and the table take as no failure."""
    from launcher.cluster.ray_node import free_port

    (tmp_path / "node0.txt").write_text("abc")
    args = {"device": "cpu", "run_dir": str(tmp_path), "token_file": str(tmp_path / "node0.txt"), "nonce": "abc",
            "model_dir": str(tmp_path / "model"), "model_must_exist": False, "checkpoint_dir": str(tmp_path),
            "train_hosts": [socket.gethostname()], "world": 1, "timeout_s": 30, "master": f"127.0.0.1:{free_port()}",
            "kernel_probes": {"train": ["te_attention:fused", "mamba_chunk_scan"], "generation": []}}
    out = subprocess.run([sys.executable, "-m", "launcher.cluster.preflight", "probe", json.dumps(args)],
                         capture_output=True, text=True, check=True, cwd=str(Path(__file__).resolve().parents[2]))
    records = preflight._records(out.stdout)
    assert [r["kind"] for r in records] == ["node", "net", "kernels"]
    assert records[2]["probes"] == {n: "skipped: a cpu run" for n in ("te_attention:fused", "mamba_chunk_scan")}
    node = {**records[0], "kernel_probes": records[2]["probes"], "gpu_arch": records[2]["gpu_arch"], "index": 0}
    assert preflight._kernels_cell(node) == "skip"


def test_the_agreement_check_fails_on_nan_and_on_a_wrong_result():
    import torch

    kernel_probes._agrees(torch.tensor([1.0, 2.0]), torch.tensor([1.01, 2.0]), "x")
    with pytest.raises(RuntimeError, match="the attention differs from torch's by nan"):
        kernel_probes._agrees(torch.tensor([float("nan")]), torch.tensor([0.0]), "the attention")
    with pytest.raises(RuntimeError, match=r"x differs from torch's by 0\.5 \(tolerance 0\.1\)"):
        kernel_probes._agrees(torch.tensor([1.5]), torch.tensor([2.0]), "x")
