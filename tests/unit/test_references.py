"""Every reference to the project's own code and files resolves, so none can go stale unnoticed.

Two kinds, read from the sources and the docs:
- dotted names `launcher.x.y` / `workers.x.y` (in .py files: in strings and comments, where code
  does not check them): the longest prefix that is a module of the tree, then each further part
  an attribute it defines (a top-level def, class, assignment or import; then a method or class
  attribute of that class);
- paths `launcher/...`, `workers/...`, `tests/...`, `docs/...`, `conf/...`, `benchmarks/...`,
  `scripts/...`, `sbatch/...`, `notes/...`: a file or folder of the repository (also `x/y.py` given
  as `x/y`, and `x/y.attr` for an attribute of x/y.py). A pattern (`*`, `<...>`, `{...}`) is not
  a reference.
ALLOWED lists the few deliberate non-references, each with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("launcher", "workers", "tests", "benchmarks", "docs", "scripts", "sbatch", "conf")
SUFFIXES = (".py", ".md", ".yaml", ".j2", ".sh", ".toml")
DOTTED = re.compile(r"(?<![\w./-])((?:launcher|workers)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w./-])((?:launcher|workers|tests|docs|conf|benchmarks|scripts|sbatch|notes)"
                  r"/[\w./-]*\w)([*<{]?)")

# (file, reference): why it is not a reference to this repository
ALLOWED = {
    ("tests/unit/test_import_rules.py", "*"): "synthetic packages planted to show the import rules fail",
    ("tests/unit/test_references.py", "*"): "this test's own examples",
    ("tests/unit/test_tiers.py", "*"): "the test ids of a synthetic test tree",
    ("tests/unit/test_peer_vectors.py", "docs/algo/dapo.md"): "verl's repository",
    ("tests/unit/test_peer_vectors.py", "tests/trainer/ppo/test_core_algos_on_cpu.py"): "verl's repository",
    ("tests/unit/test_peer_vectors.py", "workers/reward_manager/dapo.py"): "verl's repository",
    ("tests/unit/test_peer_vectors.py", "tests/unit/algorithms/test_grpo.py"): "NeMo RL's repository",
    ("tests/unit/test_peer_vectors.py", "tests/unit/algorithms/test_loss_functions.py"): "NeMo RL's repository",
    ("tests/unit/test_tool_calls.py", "tests/tool_parsers/test_hermes_tool_parser.py"): "vLLM's repository",
    ("tests/unit/test_episode_conventions.py", "tests/experimental/agent_loop/test_basic_agent_loop.py"):
        "verl's repository",
    ("tests/unit/test_episode_conventions.py", "tests/interactions/test_gsm8k_interaction.py"): "verl's repository",
    ("tests/unit/test_episode_conventions.py", "tests/unit/experience/test_rollouts.py"): "NeMo RL's repository",
    ("tests/unit/test_episode_conventions.py", "tests/unit/test_envs.py"): "NeMo RL's repository",
    ("tests/unit/test_peer_vectors.py", "tests/unit/algorithms/test_utils.py"): "NeMo RL's repository",
    ("tests/unit/test_rewards.py", "tests/unit/environments/test_math_environment.py"): "NeMo RL's repository",
    ("tests/unit/test_cli_cfg_sweep.py", "tests/test_basic_sweeper.py"): "Hydra's repository",
    ("tests/slurm_cluster/up.sh", "sbatch/sacct"): "two commands, not a path",
}


def sources(root: Path = ROOT) -> list[Path]:
    out = [p for d in SCANNED for p in sorted((root / d).rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return out + [p for p in (root / "README.md", root / "pyproject.toml") if p.is_file()]


def prose(path: Path) -> str:
    """What of a file may hold references: all of it, or a .py file's strings and comments."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return text
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            kept.append(tok.string)
    return "\n".join(kept)


@lru_cache(maxsize=None)
def _names(path: Path) -> dict[str, set[str] | None]:
    """A module's top-level names -> the names defined in that class (None: not a class)."""
    out: dict[str, set[str] | None] = {}

    def visit(body):
        for n in body:
            if isinstance(n, ast.ClassDef):
                out[n.name] = {m.name for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef))}
                out[n.name] |= {t.id for m in n.body if isinstance(m, ast.Assign) for t in m.targets
                                if isinstance(t, ast.Name)}
                out[n.name] |= {m.target.id for m in n.body if isinstance(m, ast.AnnAssign)
                                and isinstance(m.target, ast.Name)}
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[n.name] = None
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    for x in ast.walk(t):
                        if isinstance(x, ast.Name):
                            out[x.id] = None
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out[n.target.id] = None
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    out[(a.asname or a.name).split(".")[0]] = None
            elif isinstance(n, (ast.If, ast.Try, ast.With)):
                visit(n.body)
                visit(getattr(n, "orelse", []))
                for h in getattr(n, "handlers", []):
                    visit(h.body)

    visit(ast.parse(path.read_text()).body)
    return out


def _module_file(root: Path, parts: list[str]) -> Path | None:
    p = root.joinpath(*parts)
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def _attrs_resolve(module: Path, attrs: list[str]) -> bool:
    names = _names(module)
    if not attrs:
        return True
    if attrs[0] not in names:
        return False
    members = names[attrs[0]]
    return len(attrs) == 1 or (members is not None and attrs[1] in members and len(attrs) == 2)


def dotted_resolves(ref: str, root: Path = ROOT) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        module = _module_file(root, parts[:i])
        if module is not None:
            return _attrs_resolve(module, parts[i:])
    return False


def path_resolves(ref: str, root: Path = ROOT) -> bool:
    ref = ref.rstrip(".")
    if (root / ref).exists() or (root / f"{ref}.py").is_file():
        return True
    stem, _, attr = ref.rpartition(".")  # x/y.attr: an attribute of x/y.py
    return bool(stem) and (root / f"{stem}.py").is_file() and _attrs_resolve(root / f"{stem}.py", [attr])


def stale(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sources(root):
        rel = str(path.relative_to(root))
        if (rel, "*") in ALLOWED:
            continue
        text = prose(path)
        refs = {m.group(1) for m in DOTTED.finditer(text) if not dotted_resolves(m.group(1), root)}
        refs |= {m.group(1) for m in PATH.finditer(text) if not m.group(2) and not path_resolves(m.group(1), root)}
        bad += [f"{rel}: {ref}" for ref in sorted(refs) if (rel, ref) not in ALLOWED]
    return bad


def test_every_reference_resolves():
    assert stale() == []


def test_the_allowed_exceptions_are_still_there():
    """An entry of ALLOWED whose text is gone is itself stale."""
    for (rel, ref), why in ALLOWED.items():
        assert (ROOT / rel).is_file(), (rel, why)
        assert ref == "*" or ref in (ROOT / rel).read_text(), (rel, ref, why)


def test_stale_references_of_each_kind_are_found(tmp_path):
    """The scan finds a module, an attribute, a method, a file and a file's attribute that are gone."""
    (tmp_path / "launcher" / "cluster").mkdir(parents=True)
    (tmp_path / "launcher" / "__init__.py").write_text("")
    (tmp_path / "launcher" / "cluster" / "__init__.py").write_text("")
    (tmp_path / "launcher" / "cluster" / "stop.py").write_text(
        "import signal\n\nclass Running:\n    def wait(self): ...\n\ndef requeue(): ...\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "launcher.cluster.stop.requeue, launcher.cluster.stop.Running.wait, launcher.cluster.stop.signal and "
        "launcher/cluster/stop.py are there; launcher.job.stop, launcher.cluster.stop.request, "
        "launcher.cluster.stop.Running.go, docs/b.md, notes/moe-on-cpu.md and launcher/cluster/stop.gone are not; "
        "tests/*.py and launcher/<x>.py are patterns.\n")
    (tmp_path / "launcher" / "cluster" / "boot.py").write_text(
        '"""Runs `python -m launcher.bootstrap`."""\nimport launcher.nothing  # code is not prose\n'
        "workers = []\nworkers.index(1)\n")
    assert sorted(stale(tmp_path)) == [
        "docs/a.md: docs/b.md", "docs/a.md: launcher.cluster.stop.Running.go", "docs/a.md: launcher.cluster.stop.request",
        "docs/a.md: launcher.job.stop", "docs/a.md: launcher/cluster/stop.gone", "docs/a.md: notes/moe-on-cpu.md",
        "launcher/cluster/boot.py: launcher.bootstrap"]
