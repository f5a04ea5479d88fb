"""The layout's import rules, read from the source with `ast` (imports inside functions included).

Data flows config -> plan -> job -> cluster -> driver -> workers (STAGES), and imports follow it in
both directions:
- no cycle among the project's modules (`from pkg import mod` runs pkg/__init__.py: it counts);
- backward: a stage imports from an earlier stage only the data every stage shares: the config
  (launcher/config/), the plan (plan.py, memory.py, activations.py, refit_cost.py) and SHARED (paths, files,
  records, logs, progress, the printed commands in shell.py, the JobContext in cluster/context.py, the metric
  names in metric_names.py);
- forward: a stage imports a later stage only inside a function, at the hand-off (the submission
  names the bootstrap, the bootstrap the driver's job kinds): importing a stage never loads a
  later one. One exception, the SEAM: the driver imports workers/contracts.py (the Protocols and
  typed records the loop and the workers' groups exchange) at module level, and that module
  imports only the standard library when it runs (torch and the refit report only for type
  checkers), so importing the driver still loads no worker code;
- the SHARED modules import only the config, the plan and each other;
- the COMMANDS (the entry points a user runs) may import any stage; no stage imports a command;
- workers/ import from launcher/ only its config schema (the sections and their allowed values),
  the one reader of a checkpoint's facts (launcher/config/model_facts.py), the one bounded reader
  of files from outside the run (launcher/config/bounded.py) and what the job's components refuse
  (launcher/config/job_limits.py: the scheduler's arguments);
- in launcher/, only driver/, export.py and the preflight (which checks what workers import on a
  node) import workers/;
- launcher/ modules other than driver/ and export.py import no torch, ray, vllm or megatron at
  module level (the dry run and the CLI stay torch-free and fast).
Every launcher module is a stage's, shared or a command (a new module must say which). The
checker is shown to find each kind of break in small synthetic packages.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers", "transformer_engine")
# the config's sections and rules, the one reader of a checkpoint's facts, the one bounded file reader and the
# job's limits (all torch-free)
WORKERS_MAY_IMPORT = ("launcher.config.schema", "launcher.config.model_facts", "launcher.config.bounded",
                      "launcher.config.job_limits")
STAGES = ("config", "plan", "job", "cluster", "driver", "workers")
PLAN = ("launcher.plan", "launcher.memory", "launcher.activations",
        "launcher.refit_cost")   # the plan stage: top-level modules
SHARED = ("launcher.paths", "launcher.files", "launcher.records", "launcher.logs", "launcher.progress",
          "launcher.shell", "launcher.cluster.context", "launcher.metric_names")
COMMANDS = ("launcher.__main__", "launcher.cli", "launcher.status", "launcher.stop", "launcher.export",
            "launcher.sweep")
WORKER_IMPORTERS = ("launcher.export", "launcher.cluster.preflight")   # besides driver/
SEAM = ("workers.contracts",)   # the driver's types of the workers: imported at module level


@dataclass(frozen=True)
class Import:
    source: str      # importing module, dotted
    target: str      # imported module (or module.attr when the attr is not a module), dotted
    top_level: bool  # executed when the importing module is imported (not inside a function)


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _walk(node: ast.AST, in_function: bool):
    for child in ast.iter_child_nodes(node):
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, in_function
        yield from _walk(child, inner)


def imports(root: Path, packages: tuple[str, ...]) -> list[Import]:
    mods = modules(root, packages)
    out = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, in_function in _walk(ast.parse(path.read_text(), str(path)), False):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod;
                # either runs pkg (or mod) first
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
                if base in mods and base not in targets:
                    targets.append(base)
            else:
                continue
            out += [Import(name, t, not in_function) for t in targets]
    return out


def project_edges(found: list[Import], mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for imp in found:
        target = imp.target
        while target and target not in mods:  # a.b.attr -> a.b
            target = target.rpartition(".")[0]
        if target and target != imp.source:
            edges[imp.source].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def stage(module: str) -> str | None:
    """The stage a module belongs to; None for the shared modules, the commands and the root packages."""
    parts = module.split(".")
    if module in SHARED or module in COMMANDS:
        return None
    if parts[0] == "workers":
        return "workers"
    if module in PLAN:
        return "plan"
    if len(parts) > 1 and parts[1] in STAGES:
        return parts[1]
    return None


def _empty(path: Path) -> bool:
    """A module with nothing but its docstring (an empty package __init__.py): importing it runs nothing."""
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def _shared(module: str) -> bool:
    """Data every stage shares: the config, the plan and SHARED."""
    return module in SHARED or stage(module) in ("config", "plan")


def _unplaced(mods: dict[str, Path]) -> list[str]:
    return [f"{m}: neither a stage's module nor shared nor a command (say which in {Path(__file__).name})"
            for m in mods if m.startswith("launcher.") and stage(m) is None and m not in SHARED and m not in COMMANDS]


def _runs_at_import(path: Path) -> list[str]:
    """The modules a module imports when it is imported: its module-level imports, but for those
    under `if TYPE_CHECKING:` (annotations only)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        for n, in_function in [(node, False), *_walk(node, isinstance(node, ast.FunctionDef))]:
            if in_function:
                continue
            if isinstance(n, ast.Import):
                out += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and not n.level:
                out.append(n.module or "")
    return out


def violations(root: Path) -> list[str]:
    pkgs = ("launcher", "workers")
    mods = modules(root, pkgs)
    found = imports(root, pkgs)
    bad = _unplaced(mods)
    for seam in (m for m in SEAM if m in mods):
        bad += [f"{seam} imports {t} when imported: the seam imports only the standard library (type-only "
                f"imports under `if TYPE_CHECKING:`)" for t in _runs_at_import(mods[seam])
                if t.split(".")[0] in pkgs + HEAVY]
    cycle = find_cycle(project_edges(found, mods))
    if cycle:
        bad.append("import cycle: " + " -> ".join(cycle))
    for imp in found:
        src, tgt = imp.source, imp.target
        while tgt not in mods and "." in tgt and tgt.split(".")[0] in pkgs:  # a.b.attr -> a.b
            tgt = tgt.rpartition(".")[0]
        if tgt == src or tgt in mods and mods[tgt].name == "__init__.py" and _empty(mods[tgt]):
            continue  # itself, or a package whose __init__.py runs nothing
        in_driver = src == "launcher.driver" or src.startswith("launcher.driver.")
        if src.startswith("workers") and tgt.startswith("launcher") and not tgt.startswith(WORKERS_MAY_IMPORT):
            bad.append(f"{src} imports {tgt}: workers/ may import only {' and '.join(WORKERS_MAY_IMPORT)}")
        if src.startswith("launcher") and tgt.split(".")[0] == "workers" and not (in_driver or src in WORKER_IMPORTERS):
            bad.append(f"{src} imports {tgt}: in launcher/ only driver/, export.py and the preflight import workers/")
        if (src.startswith("launcher") and not in_driver and src != "launcher.export" and imp.top_level
                and tgt.split(".")[0] in HEAVY):
            bad.append(f"{src} imports {tgt} at module level: keep the control plane torch-free")
        if tgt not in mods:
            continue
        a, b = stage(src), stage(tgt)
        if tgt in COMMANDS and src not in COMMANDS:
            bad.append(f"{src} imports {tgt}: only a command imports a command")
        elif src in SHARED and not _shared(tgt):
            bad.append(f"{src} imports {tgt}: a shared module imports only the config, the plan and the shared modules")
        elif a and b and STAGES.index(b) < STAGES.index(a) and not _shared(tgt) and not src.startswith("workers"):
            bad.append(f"{src} imports {tgt}: {a}/ imports from an earlier stage only the shared data")
        elif (a and b and STAGES.index(b) > STAGES.index(a) and imp.top_level and not _shared(tgt)
              and not (a == "driver" and tgt in SEAM)):
            bad.append(f"{src} imports {tgt} at module level: {a}/ hands off to {b}/ inside a function")
    return bad


def test_the_project_follows_the_import_rules():
    assert violations(ROOT) == []


def test_every_project_module_is_seen():
    mods = modules(ROOT, ("launcher", "workers"))
    for m in ("launcher.__main__", "launcher.config.schema", "launcher.cluster.bootstrap", "launcher.driver.grpo",
              "workers.trainer.actor", "workers.refit.vllm_extension"):
        assert m in mods
    edges = project_edges(imports(ROOT, ("launcher", "workers")), mods)
    assert "launcher.config.schema" in edges["launcher.config.validate"]


def _package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_planted_cycle_inside_functions_is_found(tmp_path):
    _package(tmp_path, {
        "launcher/__init__.py": "",
        "launcher/driver/__init__.py": "",
        "launcher/driver/a.py": "def f():\n    from launcher.driver import b\n    return b\n",
        "launcher/driver/b.py": "def g():\n    from launcher.driver.c import h\n    return h\n",
        "launcher/driver/c.py": "def h():\n    import launcher.driver.a\n",
        "workers/__init__.py": "",
    })
    cycle = find_cycle(project_edges(imports(tmp_path, ("launcher", "workers")), modules(tmp_path, ("launcher", "workers"))))
    assert cycle == ["launcher.driver.a", "launcher.driver.b", "launcher.driver.c", "launcher.driver.a"]
    assert violations(tmp_path) == ["import cycle: launcher.driver.a -> launcher.driver.b -> launcher.driver.c -> "
                                    "launcher.driver.a"]


def test_planted_rule_breaks_are_named(tmp_path):
    _package(tmp_path, {
        "launcher/__init__.py": "",
        "launcher/config/__init__.py": "",
        "launcher/config/schema.py": "",
        "launcher/job/__init__.py": "",
        "launcher/job/submit.py": "import torch\n",
        "launcher/driver/__init__.py": "def run():\n    from launcher.job import submit\n",
        "launcher/plan.py": "def f():\n    from workers import w\n",
        "workers/__init__.py": "",
        "workers/w.py": "from launcher.config import schema\nfrom launcher import plan\n",
    })
    assert sorted(violations(tmp_path)) == sorted([
        "import cycle: launcher.plan -> workers.w -> launcher.plan",
        "launcher.driver imports launcher.job.submit: driver/ imports from an earlier stage only the shared data",
        "launcher.plan imports workers.w: in launcher/ only driver/, export.py and the preflight import workers/",
        "launcher.job.submit imports torch at module level: keep the control plane torch-free",
        "workers.w imports launcher.plan: workers/ may import only launcher.config.schema and "
        "launcher.config.model_facts and launcher.config.bounded and launcher.config.job_limits",
    ])


def _stages(tmp_path, extra: dict[str, str]) -> list[str]:
    """A synthetic launcher with one module per stage, the shared ones and a command, plus `extra`."""
    files = {f"launcher/{d}/__init__.py": "" for d in ("config", "job", "cluster", "driver")}
    files.update({"launcher/__init__.py": "", "workers/__init__.py": "", "launcher/config/schema.py": "",
                  "launcher/plan.py": "from launcher.config import schema\n",
                  "launcher/paths.py": "from launcher.config.schema import X\n",
                  "launcher/cluster/context.py": "from launcher import paths, plan\n",
                  "launcher/job/submit.py": "def task():\n    from launcher.cluster import bootstrap\n",
                  "launcher/cluster/bootstrap.py": "from launcher.cluster.context import log\n"
                                                   "def head():\n    from launcher.driver import jobs\n",
                  "launcher/cluster/ray_node.py": "", "launcher/cluster/signals.py": "",
                  "launcher/driver/jobs.py": "from launcher import paths\nfrom launcher.cluster.context import log\n"
                                             "def run():\n    from workers import actor\n",
                  "launcher/status.py": "from launcher.job import submit\nfrom launcher.driver import jobs\n",
                  "workers/actor.py": "from launcher.config.schema import X\n"})
    _package(tmp_path, {**files, **extra})
    return violations(tmp_path)


def test_the_flow_of_a_synthetic_launcher_passes(tmp_path):
    assert _stages(tmp_path, {}) == []


def test_an_import_of_an_earlier_stage_is_refused_unless_shared(tmp_path):
    """Backward: the in-job signal handling in job/ (imported by cluster/), a cluster helper
    imported by the driver: each named; the JobContext, paths and the plan stay allowed."""
    assert _stages(tmp_path, {
        "launcher/job/stop.py": "",
        "launcher/cluster/signals.py": "def f():\n    from launcher.job import stop\n",
        "launcher/driver/preflight.py": "from launcher.cluster.ray_node import free_port\n"
                                        "from launcher.cluster.context import JobContext\nfrom launcher import plan\n",
    }) == [
        "launcher.cluster.signals imports launcher.job.stop: cluster/ imports from an earlier stage only the shared data",
        "launcher.driver.preflight imports launcher.cluster.ray_node: driver/ imports from an earlier stage only the "
        "shared data",
    ]


def test_a_later_stage_is_imported_only_inside_a_function(tmp_path):
    """Forward: job/ naming a driver module at module level would load the driver with the job."""
    assert _stages(tmp_path, {"launcher/job/run_dir.py": "from launcher.driver import jobs\n"}) == [
        "launcher.job.run_dir imports launcher.driver.jobs at module level: job/ hands off to driver/ inside a function",
    ]


def test_shared_modules_and_commands_keep_their_place(tmp_path):
    assert sorted(_stages(tmp_path, {
        "launcher/paths.py": "def f():\n    from launcher.cluster import ray_node\n",
        "launcher/cluster/signals.py": "from launcher import status\n",
        "launcher/helpers.py": "",
    })) == sorted([
        "launcher.helpers: neither a stage's module nor shared nor a command (say which in test_import_rules.py)",
        "launcher.paths imports launcher.cluster.ray_node: a shared module imports only the config, the plan and "
        "the shared modules",
        "launcher.cluster.signals imports launcher.status: only a command imports a command",
    ])


def test_a_package_init_that_imports_its_modules_is_a_cycle(tmp_path):
    """`from launcher.driver import data` runs launcher/driver/__init__.py: if that imports grpo,
    which imports data that way, the two are a cycle (the driver's, before its job kinds moved out)."""
    assert _stages(tmp_path, {
        "launcher/driver/__init__.py": "def run():\n    from launcher.driver import grpo\n",
        "launcher/driver/data.py": "",
        "launcher/driver/grpo.py": "from launcher.driver import data\n",
    }) == ["import cycle: launcher.driver -> launcher.driver.grpo -> launcher.driver"]


def test_the_seam_is_the_one_worker_module_the_driver_imports_at_module_level(tmp_path):
    """workers/contracts.py may be imported by the driver at module level while it imports only
    the standard library when it runs (type-only imports under TYPE_CHECKING); another workers
    module still may not, nor may the seam import torch or worker code at run time."""
    seam = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING, Protocol\n"
            "if TYPE_CHECKING:\n    import torch\n    from workers.actor import X\n"
            "class Trainers(Protocol):\n    def f(self):\n        import torch\n")
    assert _stages(tmp_path, {"workers/contracts.py": seam,
                              "launcher/driver/grpo.py": "from workers.contracts import Trainers\n"}) == []
    assert sorted(_stages(tmp_path, {
        "workers/contracts.py": seam + "import torch\nfrom workers.actor import X\n",
        "launcher/driver/grpo.py": "from workers.contracts import Trainers\nfrom workers import actor\n",
    })) == sorted([
        "workers.contracts imports torch when imported: the seam imports only the standard library (type-only "
        "imports under `if TYPE_CHECKING:`)",
        "workers.contracts imports workers.actor when imported: the seam imports only the standard library "
        "(type-only imports under `if TYPE_CHECKING:`)",
        "launcher.driver.grpo imports workers.actor at module level: driver/ hands off to workers/ inside a function",
    ])
