"""transformers' config class of a model family, read from its installed source: every field and its default.

Why: a config.json key changes what the network computes only where transformers' class for the family
defines it and the value is not the class's default (an undefined key is stored on the config object
but read by no model code of transformers'). launcher.config.model_facts compares a checkpoint's keys
with these defaults and refuses a non-default value of a key the project does not read
(`unread_differences`), so a checkpoint's unknown feature is never dropped silently.

Why from the source: importing a transformers configuration module imports torch (measured: 8.5 s on
this machine under load), and the launcher stays torch-free (a dry run is instant). transformers 5
declares each config class as a dataclass (`hidden_size: int = 4096`), so its fields and literal
defaults are read with `ast`, as launcher.config.model_facts reads Megatron-Bridge's registrations.
Also read: the class's `attribute_map` (another name for a field: `num_local_experts` ->
`n_routed_experts`) and the legacy spellings its `__post_init__` renames
(`self.n_groups = kwargs.pop("mamba_n_groups") if ...`). The base class PreTrainedConfig's own fields
(output flags, dtype, architectures, labels) are every model's and change no function (`GENERIC`).

Where transformers is not installed (a laptop planning a cluster run) there is no class: nothing is
compared. A default that is not a literal (a computed one) is `COMPUTED`: not compared.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

COMPUTED = object()   # a default this reading cannot evaluate


@dataclass(frozen=True)
class HFClass:
    name: str                                          # e.g. NemotronHConfig
    defaults: dict[str, Any]                           # field -> default (or COMPUTED)
    aliases: dict[str, str] = field(default_factory=dict)   # another name of a field -> the field

    def field_of(self, key: str) -> Optional[str]:
        """The field `key` sets (itself, or the field it is another name of); None: not the class's."""
        if key in self.defaults:
            return key
        other = self.aliases.get(key)
        return other if other in self.defaults else None


def _transformers_dir() -> Optional[Path]:
    try:
        spec = importlib.util.find_spec("transformers")  # finds the package, runs nothing
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).parent if spec and spec.origin else None


@lru_cache(maxsize=None)
def hf_class(family: str) -> Optional[HFClass]:
    """The config class transformers registers for model_type `family`, or None (no transformers, or no
    such class in models/<family>/configuration_<family>.py)."""
    root = _transformers_dir()
    if root is None or not family.replace("_", "").isalnum():
        return None
    file = root / "models" / family / f"configuration_{family}.py"
    if not file.is_file():
        return None
    tree = _parse(file)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)} if tree else {}
    for node in classes.values():
        if _model_type(node) == family:
            defaults, aliases = _fields(node, classes, file)
            return HFClass(node.name, defaults, aliases)
    return None


@lru_cache(maxsize=1)
def generic_fields() -> frozenset[str]:
    """PreTrainedConfig's own fields: what every model's config holds (output flags, dtype, labels, ...)."""
    root = _transformers_dir()
    tree = _parse(root / "configuration_utils.py") if root else None
    for node in tree.body if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == "PreTrainedConfig":
            return frozenset(t.target.id for t in node.body
                             if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name))
    return frozenset()


def _parse(file: Path) -> Optional[ast.Module]:
    try:
        return ast.parse(file.read_text(errors="replace"))
    except (OSError, SyntaxError):
        return None


def _model_type(node: ast.ClassDef) -> Optional[str]:
    for stmt in node.body:
        if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_type" for t in stmt.targets)
                and isinstance(stmt.value, ast.Constant)):
            return stmt.value.value
    return None


def _fields(node: ast.ClassDef, classes: dict[str, ast.ClassDef], file: Path) -> tuple[dict, dict]:
    """(field -> default, alias -> field) of `node` and of its bases defined in the same file (a
    config class built on another family's, e.g. by transformers' modular files, repeats its fields)."""
    defaults: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != node.name:
            d, a = _fields(classes[base.id], classes, file)
            defaults.update(d)
            aliases.update(a)
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            defaults[stmt.target.id] = _default(stmt.value) if stmt.value is not None else COMPUTED
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "attribute_map"
                                                  for t in stmt.targets):
            try:
                aliases.update(ast.literal_eval(stmt.value))
            except ValueError:
                pass
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__post_init__":
            aliases.update(_renamed(stmt))
    return defaults, aliases


def _renamed(func: ast.FunctionDef) -> dict[str, str]:
    """`self.<field> = kwargs.pop("<legacy>") if "<legacy>" in kwargs else ...` -> {legacy: field}."""
    out = {}
    for stmt in ast.walk(func):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
                and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == "self"):
            continue
        for call in ast.walk(stmt.value):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "pop"
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "kwargs" and call.args
                    and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
                out[call.args[0].value] = stmt.targets[0].attr
    return out


def _default(value: ast.expr) -> Any:
    """A literal default; `field(default=...)`, `interval(...)(default=...)` and `field(default_factory=list)`
    too; float("inf") inside a literal; COMPUTED otherwise."""
    try:
        return _literal(value)
    except ValueError:
        pass
    if isinstance(value, ast.Call):
        kw = {k.arg: k.value for k in value.keywords}
        if "default" in kw:
            return _default(kw["default"])
        factory = kw.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
            return [] if factory.id == "list" else {}
    return COMPUTED


def _literal(node: ast.expr) -> Any:
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).lower() in ("inf", "-inf")):
        return math.inf if not str(node.args[0].value).startswith("-") else -math.inf
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def same(value: Any, default: Any) -> bool:
    """A config.json value equals a class default (JSON lists for tuples, 1 == 1.0; infinities are floats
    by then: launcher.config.bounded.special_floats)."""
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(value) == len(default) and all(same(v, d) for v, d in zip(value, default))
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(default)
    return value == default
