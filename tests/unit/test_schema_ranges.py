"""Every field of the schema has a checked range or set and a doc, declared on the field itself.

The test walks the whole schema (launcher.config.schema.Config, its fields' metadata:
launcher.config.fields): a leaf without a checker or a doc fails it, and so does a bad value that
passes the pre-submission checks (validate, plus the Slurm request for the slurm_* topologies).
Booleans need no checker: their type is the set, and typed() refuses anything else.

The bad values live here, not in production: derived from each Range (one step outside each
bound) and OneOf ('no-such-choice') and Text (two lines), and, for the fields whose rule lives
elsewhere (validate.py, plan.py, paths.py, ...), from the table ELSEWHERE below (each key -> values
that rule must refuse, and the key the refusal names when it names another). ALSO_BAD adds values
a Range's bounds let through but a rule elsewhere refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Optional

import pytest

from launcher import plan as plan_mod
from launcher.config import ranges
from launcher.config.compose import compose
from launcher.config.fields import All, Elsewhere, Filled, Free, OneOf, Range, Sizes, Text, knob, leaves, section_docs
from launcher.config.schema import Config, ConfigError, typed
from launcher.config.validate import validate
from launcher.job import sbatch

LEAVES = {leaf.key: leaf for leaf in leaves(Config)}

# key -> (values the rule elsewhere must refuse, the key its error names when not this one)
ELSEWHERE: dict[str, tuple[tuple, Optional[str]]] = {
    "model.path": (("/no/such/model%j",), None),
    "model.builtin": (("no_such_recipe",), None),
    "model.family": (("gpt9",), None),
    "model.rope_scaling": (({"rope_type": "dynamic", "factor": 2.0},), None),
    "model.family_facts": (({"use_sliding_window": True},), None),
    "grpo.max_total_sequence_length": ((1,), None),
    "grpo.reward_scaling.source_min": ((5.0,), "grpo.reward_scaling.source_max"),
    "grpo.reward_scaling.source_max": ((-5.0,), None),
    "grpo.reward_scaling.target_min": ((5.0,), "grpo.reward_scaling.target_max"),
    "grpo.reward_scaling.target_max": ((-5.0,), None),
    "grpo.loss.ratio_clip_min": ((-1.0,), None),
    "grpo.loss.ratio_clip_max": ((-1.0,), "grpo.loss.ratio_clip_min"),
    "grpo.loss.ratio_clip_c": ((0.5,), None),
    "grpo.loss.truncated_importance_sampling_ratio": ((0.0,), None),
    "grpo.loss.kl_input_clamp_value": ((0.0,), None),
    "grpo.loss.kl_output_clamp_value": ((-1.0,), None),
    "grpo.overlong_penalty.buffer_tokens": ((0, 10_000), None),
    "data.train": (("/no/such/prompts.jsonl",), None),
    "data.validation": (("/no/such/val.jsonl",), None),
    "reward.fn": (("no_such_module:fn",), None),
    "env.fn": (("no_such_module:Env", "not_a_spec"), None),
    "env.tools": ((["no_such_module:fn"],), None),
    "checkpointing.dir": (("ck%j",), None),
    "slurm.signal_delay_s": ((-1, 10**9), None),
    "slurm.setup": ((["echo 'a"],), None),
    "slurm.extra_sbatch": (({"time": 5},), None),
    "run.name": (("../conf",), None),
    "run.root": (("/tmp/%u",), None),
    "resume": (("ck%j",), None),
}
# values inside a Range's bounds that a rule elsewhere refuses
ALSO_BAD = {
    "model.head_dim": (24,),          # model_rules: vLLM on CPU
    "vllm.max_model_len": (64,),      # below grpo.max_total_sequence_length (ranges._cross)
    "grpo.top_p": (0.9,),             # in (0, 1] but not 1.0 (the All's OneOf)
    "topology.nvlink_domain_nodes": (2, 4),  # must divide the base's 3 nodes (job.sbatch.job_spec: --segment)
}


def bad_values(check) -> list:
    """Values just outside what a checker allows."""
    if isinstance(check, Range):
        out = []
        if check.lo is not None:
            out.append(check.lo if check.lo_open else check.lo - 1)
        if check.hi is not None:
            out.append(check.hi if check.hi_open else check.hi + 1)
        return out
    if isinstance(check, OneOf):
        return ["no-such-choice"]
    if isinstance(check, Text):
        return ["a\nb"]
    if isinstance(check, Filled):
        return [[]]
    if isinstance(check, Sizes):
        return [[0], [4, 2]]
    if isinstance(check, All):  # ranges: each one's; a set inside a range: the range's (ALSO_BAD adds the set's)
        return [v for c in check.checks if isinstance(c, Range) for v in bad_values(c)]
    return []


def cases(table: dict) -> list[tuple[str, object]]:
    out = []
    for key, leaf in table.items():
        bads = bad_values(leaf.check) + list(ALSO_BAD.get(key, ()))
        bads += list(ELSEWHERE.get(key, ((), None))[0])
        out += [(key, bad) for bad in bads]
    return out


CASES = cases(LEAVES)


def unchecked(table: dict) -> list[str]:
    """Leaves a user could set to anything: no checker (not a boolean), or a rule elsewhere with no
    bad value here to prove it refuses."""
    out = []
    for key, leaf in table.items():
        if leaf.check is None and leaf.type is not bool:
            out.append(f"{key}: no checker")
        elif isinstance(leaf.check, Elsewhere) and key not in ELSEWHERE:
            out.append(f"{key}: Elsewhere({leaf.check.where!r}) but no bad value in ELSEWHERE")
        elif not isinstance(leaf.check, (Elsewhere, Free)) and leaf.check is not None and not bad_values(leaf.check):
            out.append(f"{key}: a checker with no bad value")
    return out


def test_every_field_has_a_checker_and_every_table_entry_a_field():
    assert unchecked(LEAVES) == [], "schema fields without a range/set (knob(default, check, doc) in schema.py)"
    stale = sorted(k for k in [*ELSEWHERE, *ALSO_BAD] if k not in LEAVES)
    assert stale == [], f"test table entries for keys the schema does not have: {stale}"
    assert all(isinstance(LEAVES[k].check, Elsewhere) for k in ELSEWHERE), "a key with a checker of its own"


def test_every_rule_elsewhere_names_a_function_that_exists():
    """Elsewhere('validate._model, ...'): each named function is there (launcher.<module>.<name>)."""
    import importlib

    missing = []
    for leaf in LEAVES.values():
        if not isinstance(leaf.check, Elsewhere):
            continue
        for where in leaf.check.where.split(" (")[0].split(", "):
            module, _, name = where.rpartition(".")
            candidates = [f"launcher.{module}", f"launcher.config.{module}", f"launcher.job.{module}"]
            found = False
            for c in candidates:
                try:
                    found = found or hasattr(importlib.import_module(c), name)
                except ImportError:
                    pass
            if not found:
                missing.append(f"{leaf.key}: {where}")
    assert missing == []


def test_every_leaf_has_a_one_line_doc():
    bad = [k for k, leaf in LEAVES.items() if not leaf.doc.strip() or "\n" in leaf.doc]
    assert bad == [], f"schema fields without a one-line doc (knob's third argument): {bad}"
    sections = [k for k, doc in section_docs(Config).items() if not doc.strip()]
    assert sections == [], f"sections without a doc (section(cls, doc) in schema.py): {sections}"
    assert all(r.check.why for r in LEAVES.values() if isinstance(r.check, Free))


def test_a_field_without_a_checker_is_caught():
    """The planted case: a new field with no checker, one whose rule elsewhere has no bad value here."""
    @dataclasses.dataclass
    class Planted:
        count: int = knob(3, None, "a count")
        flag: bool = knob(False, None, "a flag")
        path: str = knob("x", Elsewhere("somewhere"), "a path")
        level: int = knob(1, Range(0, 9), "a level")
    assert unchecked({leaf.key: leaf for leaf in leaves(Planted)}) == [
        "count: no checker", "path: Elsewhere('somewhere') but no bad value in ELSEWHERE"]


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
    assert base.peft.enabled  # the peft checks apply (when=peft.enabled)
    assert errors(copy.deepcopy(base)) == []


def _set(cfg: Config, key: str, value) -> None:
    *parents, last = key.split(".")
    obj = cfg
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def refused(base: Config, key: str, bad) -> bool:
    cfg = copy.deepcopy(base)
    _set(cfg, key, bad)
    named = ELSEWHERE.get(key, ((), None))[1] or key
    return any(str(e).startswith((named + ":", named + "[", named + ".")) for e in errors(cfg))


@pytest.mark.parametrize("key,bad", CASES, ids=[f"{k}={b!r}"[:60] for k, b in CASES])
def test_a_bad_value_is_refused_naming_the_key(base, key, bad):
    assert refused(base, key, bad), key


def test_an_accepted_bad_value_would_fail_the_walk(base, monkeypatch):
    """The planted case: with a checker too lax for a bad value (reward.workers allowing 0), that
    value is accepted, so test_a_bad_value_is_refused_naming_the_key would fail on it."""
    from types import MappingProxyType

    from launcher.config.schema import Reward

    leaf = LEAVES["reward.workers"]
    assert bad_values(leaf.check)[0] == 0 and refused(base, leaf.key, 0)
    field = next(f for f in dataclasses.fields(Reward) if f.name == "workers")
    monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata, "check": Range(0, 1024)}))
    assert not refused(base, leaf.key, 0)


def test_the_peft_checks_apply_only_with_peft_enabled(base):
    cfg = copy.deepcopy(base)
    cfg.peft.enabled, cfg.peft.dim, cfg.peft.alpha, cfg.peft.target_modules = False, 0, 0.0, []
    cfg.refit.mode = "merged"
    assert [e for e in errors(cfg) if e.key.startswith("peft.")] == []
    cfg.peft.enabled = True
    assert {e.key for e in ranges.check(cfg)} == {"peft.dim", "peft.alpha", "peft.target_modules"}


@pytest.mark.parametrize("key", [k for k, leaf in LEAVES.items() if leaf.type in (float, Optional[float])])
def test_every_float_must_be_finite(base, key):
    for bad in (math.inf, math.nan):
        cfg = copy.deepcopy(base)
        _set(cfg, key, bad)
        assert any(str(e).startswith(key + ":") for e in errors(cfg)), (key, bad)


def test_a_bool_field_refuses_other_values():
    with pytest.raises(ConfigError, match="peft.enabled: expected true or false"):
        typed(compose(["peft.enabled=maybe"]))
