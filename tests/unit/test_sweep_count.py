"""A sweep's size is known before its values are built (launcher/sweep.py: `size`, `expand`).

`python -m launcher -m grpo.seed=range(0,1000000000000)` once built a list of 10^12 values before it
compared their number with --max-points (a hang, then the memory gone). Here: every range's count,
worked out by arithmetic, is the number of values Hydra's own iterator gives (generated ranges:
integer and float bounds, positive and negative steps, empty ones, Hydra's Decimal steps on exact
boundaries); a sweep over the limit is refused in one line naming its exact count, before anything
is enumerated; a range Hydra cannot enumerate (a zero step, NaN, an infinite bound) is one line too.
"""

from __future__ import annotations

import random

import pytest

from launcher import sweep as sweep_mod
from launcher.config.compose import parse_overrides
from launcher.config.schema import ConfigError

SEED = 45


def _number(rng: random.Random) -> int | float:
    kind = rng.random()
    if kind < 0.4:
        return rng.randint(-30, 30)
    if kind < 0.7:
        return round(rng.uniform(-30, 30), rng.randint(0, 3))
    return rng.choice([0.1, 0.2, 0.3, 0.7, 1e-3, 2.5, 1 / 3, 0.0, 1e-1, 3e-1, 7 / 3]) * rng.choice([1, -1])


def generated_ranges(n: int, seed: int = SEED) -> list[str]:
    """`x=range(...)` overrides of at most 400 values each, written every way Hydra accepts."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b, step = _number(rng), _number(rng), _number(rng)
        if step == 0 or abs(b - a) / abs(step) > 400:
            continue
        if rng.random() < 0.15:   # a step that lands on the stop exactly (Hydra's Decimal sums may drift there)
            b = a + step * rng.randint(0, 12)
        args = rng.choice([f"{b}", f"{a},{b}", f"{a},{b},{step}", f"{a},{b},step={step}",
                           f"start={a},stop={b},step={step}"])
        if rng.random() < 0.1:
            args = f"sort(range({args}),reverse={rng.choice(['true', 'false'])})"
        else:
            args = f"range({args})"
        out.append(f"x={args}")
    return out


def test_a_range_is_counted_as_hydra_enumerates_it():
    ranges = generated_ranges(1500)
    counts = []
    for line in ranges:
        (o,) = parse_overrides([line])
        hydras = len(list(o.sweep_string_iterator()))
        assert sweep_mod.size(o, limit=400) == hydras, line
        counts.append(hydras)
    assert 0 in counts and max(counts) > 100   # empty ranges and long ones were generated
    assert any("-" in line.split(",")[-1] for line in ranges)   # and negative steps


def test_counts_on_hydras_decimal_boundaries():
    """FloatRange adds in Decimal rounded to 28 digits: range(0,1/3,1/3) gives two values, not the
    exact one; range(0,1,0.1) ten."""
    for line, count in [("x=range(0,0.3333333333333333,0.3333333333333333)", 2), ("x=range(0,1,0.1)", 10),
                        ("x=range(1,0,-0.25)", 4), ("x=range(5)", 5), ("x=range(10,-10,-3)", 7),
                        ("x=range(-5,5,-1)", 0), ("x=range(2.5)", 3), ("x=range(true,3)", 2)]:
        (o,) = parse_overrides([line])
        assert (sweep_mod.size(o), len(list(o.sweep_string_iterator()))) == (count, count), line


@pytest.mark.timeout(5)
@pytest.mark.parametrize("overrides, message", [
    (["grpo.seed=range(0,1000000000000)"],
     "-m: the sweep has 1000000000000 points (1000000000000); the limit is 64 "
     "(raise it with --max-points=1000000000000)"),
    (["grpo.seed=range(1000000000000,0,-1)", "peft.dim=8,16"],
     "-m: the sweep has 2000000000000 points (1000000000000 x 2); the limit is 64 "
     "(raise it with --max-points=2000000000000)"),
    (["optim.lr=range(0,1000,1e-9)"],
     "-m: the sweep has 1000000000000 points (1000000000000); the limit is 64 "
     "(raise it with --max-points=1000000000000)"),
    (["optim.lr=shuffle(range(0,1e300,1e-300))", "peft.dim=8,16"],
     "-m: the sweep has about 10^600 points (about 10^600 x 2); the limit is 64"),
    (["grpo.seed=range(0,1000000000000)", "grpo.seed=range(0,65)"],   # the last override of a key counts
     "-m: the sweep has 65 points (65); the limit is 64 (raise it with --max-points=65)"),
])
def test_a_huge_sweep_is_refused_before_a_value_is_built(overrides, message, monkeypatch):
    """Refused in one line, its exact count named, and no value of it built: Hydra's iterator is
    never asked for one (the timeout marker: the old list of 10^12 values never ends)."""
    from hydra.core.override_parser.types import Override

    def enumerated(self):
        raise AssertionError(f"{self.input_line} enumerated")

    monkeypatch.setattr(Override, "sweep_string_iterator", enumerated)
    monkeypatch.setattr(Override, "sweep_iterator", enumerated)
    with pytest.raises(ConfigError) as e:
        sweep_mod.expand(overrides)
    assert str(e.value) == message


def test_a_sweep_at_the_limit_is_built():
    points = sweep_mod.expand(["grpo.seed=range(10,-6,-4)", "optim.lr=range(0.5,0,-0.125)"], max_points=16)
    assert [p.swept for p in points][:5] == [
        [("grpo.seed", "10"), ("optim.lr", "0.5")], [("grpo.seed", "10"), ("optim.lr", "0.375")],
        [("grpo.seed", "10"), ("optim.lr", "0.25")], [("grpo.seed", "10"), ("optim.lr", "0.125")],
        [("grpo.seed", "6"), ("optim.lr", "0.5")]]
    assert len(points) == 16
    with pytest.raises(ConfigError) as e:
        sweep_mod.expand(["grpo.seed=range(10,-6,-4)", "optim.lr=range(0.5,0,-0.125)"], max_points=15)
    assert str(e.value) == "-m: the sweep has 16 points (4 x 4); the limit is 15 (raise it with --max-points=16)"


@pytest.mark.timeout(5)
@pytest.mark.parametrize("override, message", [
    ("grpo.seed=range(0,10,0)", "grpo.seed=range(0,10,0): range(start, stop, step) needs a step other than 0"),
    ("optim.lr=range(0.5,1,0)", "optim.lr=range(0.5,1,0): range(start, stop, step) needs a step other than 0"),
    ("grpo.seed=range(0,inf)", "grpo.seed=range(0,inf): range(start, stop, step) needs finite numbers, "
                               "got range(0, inf, 1)"),
    ("grpo.seed=range(nan,3)", "grpo.seed=range(nan,3): range(start, stop, step) needs finite numbers, "
                               "got range(nan, 3, 1)"),
    ("grpo.seed=range(5,1)", "grpo.seed=range(5,1): this sweep has no values"),
])
def test_a_range_hydra_cannot_enumerate_is_one_line(override, message):
    """Python's range raised ValueError on a zero step, Hydra's FloatRange a HydraException, a NaN
    decimal.InvalidOperation (tracebacks), and range(0,inf) never ended."""
    with pytest.raises(ConfigError) as e:
        sweep_mod.expand([override])
    assert str(e.value) == message
