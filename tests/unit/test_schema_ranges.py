"""Every field of the schema has a checked range or set (launcher/config/ranges.py FIELDS).

The test walks the whole schema (launcher.config.schema.Config): a new field without an entry in
FIELDS fails it, and so does an entry whose bad values pass the pre-submission checks (validate,
plus the Slurm request for the slurm_* topologies). Booleans need no entry: their type is the set,
and typed() refuses anything else.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing

import pytest

from launcher import plan as plan_mod
from launcher.config.compose import ConfigError, compose
from launcher.config.ranges import FIELDS, Free
from launcher.config.schema import Config, typed
from launcher.config.validate import validate
from launcher.job import sbatch


def leaves(tp=Config, prefix=""):
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from leaves(t, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", t


LEAVES = dict(leaves())


def test_every_field_has_an_entry_and_every_entry_a_field():
    missing = sorted(k for k, t in LEAVES.items() if t is not bool and k not in FIELDS)
    assert missing == [], f"schema fields without a range/set in launcher/config/ranges.py FIELDS: {missing}"
    stale = sorted(k for k in FIELDS if k not in LEAVES)
    assert stale == [], f"FIELDS entries for keys the schema does not have: {stale}"


@pytest.fixture(scope="module")
def base():
    return typed(compose(["topology=slurm_3n"]))


def errors(cfg: Config) -> list[ConfigError]:
    errs = validate(cfg, submitting=True)  # files (data, model) are read when submitting
    if not errs:
        try:
            sbatch.job_spec(cfg, plan_mod.build(cfg.topology))
        except ConfigError as e:
            errs = [e]
    return errs


def test_the_base_config_passes(base):
    assert errors(copy.deepcopy(base)) == []


def _set(cfg: Config, key: str, value) -> None:
    *parents, last = key.split(".")
    obj = cfg
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, last, value)


CASES = [(key, bad) for key, rule in FIELDS.items() for bad in rule.bad_values()]


@pytest.mark.parametrize("key,bad", CASES, ids=[f"{k}={b!r}"[:60] for k, b in CASES])
def test_a_bad_value_is_refused_naming_the_key(base, key, bad):
    cfg = copy.deepcopy(base)
    _set(cfg, key, bad)
    named = getattr(FIELDS[key], "reported_as", None) or key
    got = [str(e) for e in errors(cfg)]
    assert any(e.startswith(named + ":") or e.startswith(named + "[") or e.startswith(named + ".")
               for e in got), (key, bad, got)


def test_only_free_entries_have_no_bad_value():
    assert [k for k, r in FIELDS.items() if not r.bad_values() and not isinstance(r, Free)] == []
    assert all(r.why for r in FIELDS.values() if isinstance(r, Free))


@pytest.mark.parametrize("key", [k for k, t in LEAVES.items() if t is float])
def test_every_float_must_be_finite(base, key):
    for bad in (math.inf, math.nan):
        cfg = copy.deepcopy(base)
        _set(cfg, key, bad)
        assert any(str(e).startswith(key + ":") for e in errors(cfg)), (key, bad)


def test_a_bool_field_refuses_other_values():
    with pytest.raises(ConfigError, match="peft.enabled: expected true or false"):
        typed(compose(["peft.enabled=maybe"]))
