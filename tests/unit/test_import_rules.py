"""The layout's import rules, read from the source with `ast` (imports inside functions included).

Data flows config -> plan -> job -> cluster -> driver -> workers; the rules that keep it one way:
- no cycle among the project's modules;
- workers/ import from launcher/ only its config schema and the model facts' reader;
- launcher/driver/ never imports launcher/job/ or the bootstrap;
- in launcher/, only driver/ and export.py import workers/;
- launcher/ modules other than driver/ and export.py import no torch, ray, vllm or megatron at
  module level (the dry run and the CLI stay torch-free and fast).
The checker is shown to find a planted cycle in a small synthetic package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers", "transformer_engine")
# the config's sections and rules, and the one reader of a checkpoint's facts (both torch-free)
WORKERS_MAY_IMPORT = ("launcher.config.schema", "launcher.config.model_facts")


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
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
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


def violations(root: Path) -> list[str]:
    pkgs = ("launcher", "workers")
    mods = modules(root, pkgs)
    found = imports(root, pkgs)
    bad = []
    cycle = find_cycle(project_edges(found, mods))
    if cycle:
        bad.append("import cycle: " + " -> ".join(cycle))
    for imp in found:
        src, tgt = imp.source, imp.target
        in_driver = src == "launcher.driver" or src.startswith("launcher.driver.")
        if src.startswith("workers") and tgt.startswith("launcher") and not tgt.startswith(WORKERS_MAY_IMPORT):
            bad.append(f"{src} imports {tgt}: workers/ may import only {' and '.join(WORKERS_MAY_IMPORT)}")
        if in_driver and (tgt.startswith("launcher.job") or tgt.startswith("launcher.cluster.bootstrap")):
            bad.append(f"{src} imports {tgt}: the driver never imports job/ or the bootstrap")
        if src.startswith("launcher") and tgt.split(".")[0] == "workers" and not (in_driver or src == "launcher.export"):
            bad.append(f"{src} imports {tgt}: in launcher/ only driver/ and export.py import workers/")
        if (src.startswith("launcher") and not in_driver and src != "launcher.export" and imp.top_level
                and tgt.split(".")[0] in HEAVY):
            bad.append(f"{src} imports {tgt} at module level: keep the control plane torch-free")
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
        "launcher/a.py": "def f():\n    from launcher import b\n    return b\n",
        "launcher/b.py": "def g():\n    from launcher.c import h\n    return h\n",
        "launcher/c.py": "def h():\n    import launcher.a\n",
        "workers/__init__.py": "",
    })
    cycle = find_cycle(project_edges(imports(tmp_path, ("launcher", "workers")), modules(tmp_path, ("launcher", "workers"))))
    assert cycle == ["launcher.a", "launcher.b", "launcher.c", "launcher.a"]
    assert violations(tmp_path) == ["import cycle: launcher.a -> launcher.b -> launcher.c -> launcher.a"]


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
        "launcher.driver imports launcher.job.submit: the driver never imports job/ or the bootstrap",
        "launcher.plan imports workers.w: in launcher/ only driver/ and export.py import workers/",
        "launcher.job.submit imports torch at module level: keep the control plane torch-free",
        "workers.w imports launcher.plan: workers/ may import only launcher.config.schema and "
        "launcher.config.model_facts",
    ])
