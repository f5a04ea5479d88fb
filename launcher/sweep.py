"""`python -m launcher -m a=1,2 b=x,y`: a sweep, one run (one Slurm job) per point.

Expansion follows Hydra's BasicSweeper (`split_arguments`): every override is parsed by Hydra's own
override parser and keyed by its key as written (`a`, `+a`, `++a`, `~a`, `group@pkg` are five keys);
a key given again replaces its earlier values, sweep or not, and keeps its first place
(`a=1,2 a=3` is one point, `a=1,2 b=x a=3,4` two with a first). The points are the cartesian
product of the keys' values (`a=1,2`, `choice(...)`, `range(...)`, `glob(...)` over a config group's
options), in that order, each written as Hydra writes it (`optim.lr=1e-4` -> `optim.lr=0.0001`).
`interval()` needs a sampling sweeper: refused. The number of points is worked out before any value
is built (`size`) and compared with `--max-points` first.

Each point's run is named `<its run.name>-<swept values>` (`slurm_2n-tiny_llama-dim8-lr1e-4`):
a name the run-name rule allows (launcher.paths.safe_name), unique within the sweep. Names are seen
by every user of the cluster (`squeue` shows the Slurm job name, which is the run name), so a value
that may be a secret is never in one: the values of SECRET_KEYS (shell lines: `export HF_TOKEN=...`)
and any value holding an assignment (`=`) or naming a token, secret, password or key are left out of
the name (`setup_v2`: the second of the key's swept values) and out of what the sweep prints. The sweep's record is
`<run.root>/sweeps/<sweep>/sweep.jsonl`, one line per point (overrides, run dir, job id).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher import files, paths, records
from launcher.config import compose as config_mod
from launcher.config.compose import parse_overrides
from launcher.config.schema import ConfigError

MAX_POINTS = 64         # --max-points N raises it
NAME_MAX = paths.NAME_MAX


# keys whose values are shell lines or environment values (tokens): never in a name or a printed label
SECRET_KEYS = ("slurm.setup",)
_SECRET_WORDS = re.compile(r"token|secret|passw|api_?key|credential|auth", re.IGNORECASE)


def secret(key: str, value: str) -> bool:
    """A swept value that may hold a secret: of a SECRET_KEYS key, an assignment, or naming one."""
    bare = key.lstrip("+~")
    return (any(bare == k or bare.startswith(k + ".") for k in SECRET_KEYS) or "=" in value
            or _SECRET_WORDS.search(f"{bare} {value}") is not None)


@dataclass
class Point:
    index: int                         # 0-based, command-line order
    overrides: list[str]               # the point's own overrides (no sweep left)
    swept: list[tuple[str, str]]       # (key, value) of the swept keys
    name: str = ""                     # the derived run name
    extra: dict = field(default_factory=dict)
    choices: list[int] = field(default_factory=list)   # each swept value's place among its key's values

    def shown(self) -> list[tuple[str, str]]:
        """(key, value) of the swept keys as printed: a secret's value as `<value N of the sweep>`."""
        return [(k, f"<value {c + 1} of the sweep>" if secret(k, v) else v)
                for (k, v), c in zip(self.swept, self.choices or [0] * len(self.swept))]

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shown())


def sweep_override(overrides: list[str]) -> str | None:
    """The first override that is a sweep (for the message when -m is missing); an override that
    does not parse is left to config.compose, which names it."""
    try:
        parsed = _parse(overrides)
    except ConfigError:
        return None
    for o in parsed:
        if o.is_sweep_override():
            return o.input_line
    return None


def expand(overrides: list[str], max_points: int = MAX_POINTS) -> list[Point]:
    """The sweep's points; ConfigError naming the override for anything Hydra cannot enumerate,
    or when there are more than `max_points` points.

    Every swept key's number of values is known before any of them is built (`size`: a range's by
    arithmetic, a choice's list, a glob's filtered group options), and their product is compared
    with `max_points` first: `grpo.seed=range(0,1000000000000)` is refused in one line, never
    enumerated."""
    last: dict = {}   # key -> its last override; a key keeps its first place (dicts keep insertion order)
    sizes: dict[str, int] = {}   # swept key -> its number of values
    for o in _parse(overrides):
        key = o.get_key_element()
        last[key] = o
        sizes.pop(key, None)
        if o.is_sweep_override():   # every sweep written is checked, a replaced one too
            sizes[key] = size(o, max_points)
            if sizes[key] == 0:
                raise ConfigError(o.input_line, "this sweep has no values")
    _check_count([sizes[k] for k in last if k in sizes], max_points)
    axes: dict[str, tuple[list[str], bool]] = {}   # key -> (its values as overrides, swept)
    for key, o in last.items():
        if key not in sizes:
            axes[key] = ([f"{key}={o.get_value_element_as_str()}"], False)
            continue
        values = _values(o, sizes[key])
        if len(values) != sizes[key]:   # not expected (size steps a float range's own iterator): checked anyway
            sizes[key] = len(values)
            _check_count([sizes[k] for k in last if k in sizes], max_points)
        axes[key] = ([f"{key}={v}" for v in values], True)
    points = []
    for i, combo in enumerate(itertools.product(*(v for v, _ in axes.values()))):
        swept = [(key, line[len(key) + 1:]) for (key, (_, s)), line in zip(axes.items(), combo) if s]
        choices = [values.index(line) for (values, s), line in zip(axes.values(), combo) if s]
        points.append(Point(i, list(combo), swept, choices=choices))
    return points


def size(o, limit: int = MAX_POINTS) -> int:
    """How many values the sweep override `o` has, without building them; ConfigError (naming the
    override) for a sweep Hydra cannot enumerate.

    range(start, stop, step) iterates as Hydra's RangeSweep does: Python's range when all three are
    integers, else Hydra's FloatRange (start, start+step, ... while < stop, or > stop for a negative
    step): ceil((stop - start) / step) values, none when that is not positive, computed with the
    numbers' exact values (Fraction). FloatRange adds in Decimal rounded to 28 digits, so on an exact
    boundary (range(0,1/3,1/3)) it may take one value more or fewer: a float range of at most
    `limit` + 1 values is counted by stepping Hydra's own iterator (no list is built, at most that
    many + 2 steps); a longer one is over the limit whichever way it rounds. A zero step, NaN or an
    infinite bound is refused (Python's range raises, FloatRange raises or never ends). choice()
    and a=1,2 are lists already; glob() filters the config group's options (a few files)."""
    from fractions import Fraction

    from hydra.core.override_parser.types import ChoiceSweep, Glob, RangeSweep

    if o.is_interval_sweep():
        raise ConfigError(o.input_line, "interval() needs a sampling sweeper; list the values "
                                        "(a=1,2,3) or use range(start,stop,step)")
    value = o.value()
    if isinstance(value, Glob):
        return len(_glob_values(o))
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    if isinstance(value, list):
        return len(value)
    if not isinstance(value, RangeSweep):
        raise ConfigError(o.input_line, "not a sweep this launcher enumerates (a=1,2, choice, range or glob)")
    bounds = (value.start, value.stop, value.step)
    if not all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds):
        raise ConfigError(o.input_line, "range(start, stop, step) needs finite numbers, got "
                                        f"range({', '.join(str(b) for b in bounds)})")
    if value.step == 0:
        raise ConfigError(o.input_line, "range(start, stop, step) needs a step other than 0")
    start, stop, step = (Fraction(b) for b in bounds)
    exact = max(0, math.ceil((stop - start) / step))
    if isinstance(value.range(), range) or exact > limit + 1:
        return exact
    return sum(1 for _ in itertools.islice(value.range(), exact + 2))


def _values(o, count: int) -> list[str]:
    """The sweep's values as Hydra writes them; at most `count` + 1 are built (a float range's
    Decimal arithmetic may give one more or one fewer than the exact count)."""
    from hydra.core.override_parser.types import Glob

    if isinstance(o.value(), Glob):
        return _glob_values(o)
    return list(itertools.islice(o.sweep_string_iterator(), count + 1))


def _glob_values(o) -> list[str]:
    group = o.key_or_group
    if group not in config_mod.GROUPS:
        raise ConfigError(o.input_line, f"glob() sweeps the options of a config group "
                                        f"({', '.join(config_mod.GROUPS)}); {group} is not one")
    return o.value().filter(config_mod.group_options(group))


def _check_count(sizes: list[int], max_points: int) -> None:
    """ConfigError when the product of the swept keys' sizes is over `max_points`."""
    count = math.prod(sizes)
    if count > max_points:
        raise_it = f" (raise it with --max-points={count})" if count < _EXACT else ""
        raise ConfigError("-m", f"the sweep has {_number(count)} points ({' x '.join(_number(n) for n in sizes)}); "
                                f"the limit is {max_points}{raise_it}")


_EXACT = 10 ** 30   # counts from here on are written as a power of ten (a str of 4300+ digits is an error)


def _number(n: int) -> str:
    return str(n) if n < _EXACT else f"about 10^{int(n.bit_length() * math.log10(2))}"


def run_name(base: str, point: Point) -> str:
    """`<base>-<label><value>...`: numbers as `dim8`, other values as `mode_adapter`, a group's
    choice as its option (`slurm_2n`, left out when the base already says it); a swept run.name
    is the base itself; a value that may be a secret is left out (`setup_v2`: which of the key's
    values, not what it is)."""
    labels = _labels([k for k, _ in point.swept])
    parts = []
    choices = point.choices or [0] * len(point.swept)
    for (key, value), label, choice in zip(point.swept, labels, choices):
        bare = key.lstrip("+~")
        value = value.strip("'\"")
        if bare == "run.name":
            continue
        if secret(key, value):
            parts.append(f"{label}_v{choice + 1}")
            continue
        if bare in config_mod.GROUPS:
            if value not in base.split("-"):
                parts.append(value)
        elif re.match(r"^[-+]?[0-9.]", value):
            parts.append(f"{label}{_compact(value)}")
        else:
            parts.append(f"{label}_{value}")
    return paths.safe_name("-".join([base, *parts]) if parts else base)


def name_points(points: list[Point], bases: list[str]) -> None:
    """Set every point's run name; points that would share one get `-p<index>`."""
    names = [run_name(b, p) for p, b in zip(points, bases)]
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    for p, n in zip(points, names):
        if seen[n] > 1:
            suffix = f"-p{p.index}"
            n = n[: NAME_MAX - len(suffix)] + suffix
        p.name = n


def _compact(value: str) -> str:
    """Small floats as Hydra users write them: 0.0001 -> 1e-4, 0.0003 -> 3e-4; others as given."""
    try:
        v = float(value)
    except ValueError:
        return value
    if v == 0 or abs(v) >= 1e-2 or not re.fullmatch(r"[-+]?[0-9.eE+-]+", value):
        return value
    mantissa, _, exp = f"{v:.6e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


def _labels(keys: list[str]) -> list[str]:
    """peft.dim -> dim; the full key (dots as _) where two keys would share a label."""
    short = [k.lstrip("+~").split("@")[0].rsplit(".", 1)[-1] for k in keys]
    return [k.lstrip("+~").replace(".", "_") if short.count(s) > 1 else s for k, s in zip(keys, short)]


def sweep_dir(run_root: Path, base: str) -> Path:
    """`<run.root>/sweeps/<base>-<YYYYmmdd-HHMMSS>` (a fresh folder per sweep)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    d = run_root / paths.SWEEPS / f"{paths.safe_name(base)}-{stamp}"
    n = 1
    while d.exists():
        n += 1
        d = run_root / paths.SWEEPS / f"{paths.safe_name(base)}-{stamp}-{n}"
    return d


def record(path: Path, point: Point, run_dir: Path, job_id: str | None, state: str) -> None:
    """One line of sweep.jsonl (launcher.files: the sweep folder's mode, made by the launcher with
    the points' run directory policy; launcher.records.SWEEP_POINT: its schema)."""
    files.append_line(path, {"point": point.index, "overrides": point.overrides, "swept": dict(point.swept),
                             "run_name": point.name, "run_dir": str(run_dir), "job_id": job_id, "state": state,
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")})


def read(sweep_dir: Path) -> list[dict]:
    """The sweep's points (the last line per point wins); RecordError naming a bad line."""
    rows: dict[int, dict] = {}
    for r in records.load_lines(sweep_dir / paths.SWEEP_RECORD, records.SWEEP_POINT):
        rows[r["point"]] = r
    return [rows[k] for k in sorted(rows)]


def table(points: list[Point], rows: list[dict]) -> str:
    """point | swept values | run name | job/state."""
    keys = [k for k, _ in points[0].swept] if points else []
    head = ["#", *keys, "run", "job"]
    body = [[str(p.index), *[v for _, v in p.shown()], p.name, r.get("job_id") or r.get("state", "")]
            for p, r in zip(points, rows)]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row) for row in [head, *body])


def _parse(overrides: list[str]):
    return parse_overrides(overrides, "expected key=value or a sweep a=1,2; quote values with special "
                                      "characters: key='a b'")
