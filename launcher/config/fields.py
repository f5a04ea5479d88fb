"""What a schema field allows and what it means, declared on the field itself.

Every leaf field of launcher.config.schema.Config is written `knob(default, check, doc)`: a
dataclasses.field whose metadata holds its checker and a one-line doc, so a key's type, default,
allowed values and meaning sit on one line of schema.py (OmegaConf ignores field metadata: the
structured configs and Hydra's config store see plain defaults). The checkers:

- Range: numbers in [lo, hi] (open ends, nullable); OneOf: a fixed set; Text: one line of free
  text (labels, Slurm names); Filled: a list that must not be empty;
- Free: any value of the declared type is meaningful (`why` says so);
- Elsewhere: the rule needs other fields, files or the environment, and lives where `where` says
  (validate.py, plan.py, paths.py, job/sbatch.py, model_rules.py, driver/data.py, driver/rewards.py).

Booleans need no checker: their type is the set. `say` replaces a checker's message where the
launcher has always said more ('LoRA rank must be at least 1, got 0'); `when` names a boolean
field of the same section that switches the check on (peft.*: only with peft.enabled).
`errors(obj)` runs the checks of a config or of one section (launcher.config.ranges for the run's
config, workers.trainer.config for the sections a trainer receives), `python -m launcher --help
SECTION` prints them (`describe`), and tests/unit/test_schema_ranges.py fails on a leaf without a
checker or a doc.

Imports only the standard library: schema.py imports it, and the workers import schema.py.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    nullable: bool = False
    say: str | None = None    # the message instead of the bounds ('{value}' is the value)

    def error(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must be set"
        low = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if low and high:
            return None
        if self.say:
            return self.say.format(value=value)
        null = " or null" if self.nullable else ""
        if self.lo is None:
            return f"must be {'under' if self.hi_open else 'at most'} {self.hi:g}{null}, got {value}"
        if self.hi is None:
            return f"must be {'more than' if self.lo_open else 'at least'} {self.lo:g}{null}, got {value}"
        return f"must be in {self.span()}{null}, got {value}"

    def span(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def allowed(self) -> str:
        if self.lo is None and self.hi is None:
            text = "any number"
        elif self.lo is None:
            text = f"{'<' if self.hi_open else '<='} {self.hi:g}"
        elif self.hi is None:
            text = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            text = self.span()
        return text + (" or null" if self.nullable else "")


@dataclass(frozen=True)
class OneOf:
    choices: tuple
    nullable: bool = False
    say: str | None = None

    def error(self, value: Any) -> str | None:
        if (value is None and self.nullable) or value in self.choices:
            return None
        if self.say:
            return self.say.format(value=value)
        return f"must be one of {', '.join(map(str, self.choices))}{' or null' if self.nullable else ''}, got {value!r}"

    def allowed(self) -> str:
        return " | ".join(map(_word, self.choices)) + (" | null" if self.nullable else "")


@dataclass(frozen=True)
class Text:
    """A single line of text (a label, a Slurm partition): no newline or NUL, at most 256 characters."""
    nullable: bool = True

    def error(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must be set"
        text = str(value)
        if any(ch in text for ch in "\n\r\0") or len(text) > 256 or not text:
            return f"must be one non-empty line of at most 256 characters, got {text[:40]!r}"
        return None

    def allowed(self) -> str:
        return "one line of text" + (" or null" if self.nullable else "")


@dataclass(frozen=True)
class Filled:
    """A list that must name at least one item."""
    say: str = "must not be empty"

    def error(self, value: Any) -> str | None:
        return None if value else self.say

    def allowed(self) -> str:
        return "a non-empty list"


@dataclass(frozen=True)
class All:
    """Several checkers; the first that refuses speaks."""
    checks: tuple

    def error(self, value: Any) -> str | None:
        return next((m for c in self.checks if (m := c.error(value))), None)

    def allowed(self) -> str:
        """A set among them is the answer; else the bounds of the ranges, joined."""
        sets = [c for c in self.checks if isinstance(c, OneOf)]
        if sets:
            return sets[-1].allowed()
        ranges = [c for c in self.checks if isinstance(c, Range)]
        lo = next((r for r in ranges if r.lo is not None), Range())
        hi = next((r for r in ranges if r.hi is not None), Range())
        return Range(lo.lo, hi.hi, lo.lo_open, hi.hi_open, all(r.nullable for r in ranges)).allowed()


@dataclass(frozen=True)
class Sizes:
    """A non-empty list of integers >= 1 in increasing order, or null (batch sizes)."""

    def error(self, value: Any) -> str | None:
        if value is None:
            return None
        items = list(value)
        if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items) \
                or items != sorted(set(items)):
            return f"must be a list of integers >= 1 in increasing order, or null, got {items}"
        return None

    def allowed(self) -> str:
        return "a list of integers >= 1 in increasing order | null"


@dataclass(frozen=True)
class Elsewhere:
    """Checked by a rule that needs more than the value (other fields, files): `where` names it."""
    where: str
    what: str = ""            # what the rule allows, in words (for --help)

    def error(self, value: Any) -> None:
        return None

    def allowed(self) -> str:
        return f"{self.what + '; ' if self.what else ''}checked in {self.where}"


@dataclass(frozen=True)
class Free:
    """Any value of the declared type is meaningful (free text such as a system prompt); `why` says so."""
    why: str

    def error(self, value: Any) -> None:
        return None

    def allowed(self) -> str:
        return f"any ({self.why})"


Check = Range | OneOf | Text | Filled | All | Sizes | Elsewhere | Free

_MISSING: Any = dataclasses.MISSING


def knob(default: Any, check: Check | None, doc: str, *, when: str | None = None) -> Any:
    """A schema field: its default (a list or dict is copied per instance), its checker (None: a
    boolean) and one line saying what it does; `when`: the name of a boolean field of the same
    section that must be true for the check to apply."""
    meta = {"check": check, "doc": doc, "when": when}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    """A nested section (a dataclass), with a line saying what it holds."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc})


@dataclass(frozen=True)
class Leaf:
    key: str                  # dotted: grpo.loss.ratio_clip_c
    type: Any
    default: Any
    check: Check | None
    doc: str
    when: str | None          # dotted key of the boolean that switches the check on


def leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf field of the dataclass `cls`, nested sections walked, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from leaves(tp, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not _MISSING else f.default
        when = f.metadata.get("when")
        yield Leaf(f"{prefix}{f.name}", tp, default, f.metadata.get("check"), f.metadata.get("doc", ""),
                   f"{prefix}{when}" if when else None)


def leaf(cls: type, key: str) -> Leaf:
    """The leaf `key` (dotted, below `cls`) of the dataclass `cls`: its default, check and doc."""
    return next(x for x in leaves(cls) if x.key == key)


INT_BOUND = 2**63  # every integer of a config fits 64 bits: the trainer's tensors, Slurm and Ray take no more


def errors(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, message) for each leaf of the dataclass instance `obj` (nested sections walked)
    whose checker refuses its value, each float that is not finite and each integer that does not
    fit 64 bits."""
    out = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += errors(value, key + ".")
            continue
        if isinstance(value, float) and not math.isfinite(value):
            out.append((key, f"must be a finite number, got {value}"))
            continue
        if isinstance(value, int) and not isinstance(value, bool) and not -INT_BOUND <= value < INT_BOUND:
            out.append((key, f"must fit 64 bits (below 2**63), got a number of {len(str(abs(value)))} digits"))
            continue
        check, when = f.metadata.get("check"), f.metadata.get("when")
        if check is None or (when is not None and not getattr(obj, when)):
            continue
        message = check.error(value)
        if message:
            out.append((key, message))
    return out


def section_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """The doc line of every nested section, by dotted key."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f"{prefix}{f.name}"] = f.metadata.get("doc", "")
            out.update(section_docs(hints[f.name], f"{prefix}{f.name}."))
    return out


def type_word(tp: Any) -> str:
    """A declared type in the words of the YAML a user writes: int, float, bool, str, list, ..."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return type_word(args[0]) + "?"
    if typing.get_origin(tp) in (list, dict):
        return typing.get_origin(tp).__name__
    return getattr(tp, "__name__", str(tp)).replace("Any", "any")


def _word(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _default(value: Any) -> str:
    if isinstance(value, str):
        return value if value else "''"
    return _word(value)


def allowed(leaf: Leaf) -> str:
    """What a leaf allows, in words."""
    text = leaf.check.allowed() if leaf.check is not None else "true | false"
    return text + (f" (checked when {leaf.when}=true)" if leaf.when else "")


def summary(cls: type, key: str) -> str:
    """One key in two lines of help: the key and what it allows, then its doc."""
    one = leaf(cls, key)
    return f"  {key:<22}  {allowed(one)}\n  {'':<22}  {one.doc}"


def describe(cls: type, prefix: str = "") -> str:
    """The keys under `prefix` (a section or one key; '' = all): key, type, default, allowed
    values and doc, two lines each. Empty when no key matches."""
    rows = [leaf for leaf in leaves(cls) if not prefix or leaf.key == prefix or leaf.key.startswith(prefix + ".")]
    out = []
    for leaf in rows:
        out.append(f"  {leaf.key}: {type_word(leaf.type)} = {_default(leaf.default)}    allowed: {allowed(leaf)}\n"
                   f"      {leaf.doc}")
    return "\n".join(out)
