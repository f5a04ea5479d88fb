"""The real groups and refit objects satisfy the Protocols the GRPO loop is written against
(workers.contracts), read from the classes without starting anything: every member the loop
calls exists, with the Protocol's parameters in the same order (a default where it has one), and
every data member is declared on the class. The fakes of test_grpo_loop.py are checked against
the same Protocols, so a loop test on fakes is a test of what the real parts are asked to do."""

from __future__ import annotations

import inspect
import typing

import pytest

from workers import contracts
from workers.generator.group import GeneratorGroup
from workers.refit.control import BroadcastRefit, ObjectStoreRefit
from workers.trainer.group import TrainerGroup


def members(proto: type) -> tuple[dict, set[str]]:
    """(methods by name, data member names) that a Protocol declares itself."""
    methods = {k: v for k, v in vars(proto).items() if inspect.isfunction(v) and not k.startswith("_")}
    return methods, set(vars(proto).get("__annotations__", {}))


def declared(cls: type, name: str) -> bool:
    """A class attribute, a property or an annotation of the class or a base."""
    return any(name in vars(k) or name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def problems(cls: type, proto: type) -> list[str]:
    methods, data = members(proto)
    out = [f"{cls.__name__}.{n}: not declared" for n in sorted(data) if not declared(cls, n)]
    for name, want in methods.items():
        have = getattr(cls, name, None)
        if not callable(have):
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        wanted = list(inspect.signature(want).parameters.values())[1:]
        got = list(inspect.signature(have).parameters.values())[1:]
        if [p.name for p in got[:len(wanted)]] != [p.name for p in wanted]:
            out.append(f"{cls.__name__}.{name}{inspect.signature(have)}: parameters differ from "
                       f"{inspect.signature(want)}")
            continue
        out += [f"{cls.__name__}.{name}: {p.name} has no default" for p, q in zip(got, wanted)
                if q.default is not inspect.Parameter.empty and p.default is inspect.Parameter.empty]
        out += [f"{cls.__name__}.{name}: extra parameter {p.name} without a default" for p in got[len(wanted):]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return out


@pytest.mark.parametrize("cls, proto", [(TrainerGroup, contracts.Trainers), (GeneratorGroup, contracts.Generators),
                                        (ObjectStoreRefit, contracts.WeightSync),
                                        (BroadcastRefit, contracts.WeightSync)])
def test_the_real_parts_satisfy_the_loops_protocols(cls, proto):
    assert problems(cls, proto) == []


def test_the_checker_finds_a_missing_member_and_a_changed_signature():
    class Broken:
        infos: list
        peft_statistics = ""

        def logprobs(self, tokens, adapters=True): ...
        def train(self, batch, extra): ...
        def save_state(self, directory): ...
        def load_state(self, directory): ...

    found = problems(Broken, contracts.Trainers)
    assert any("logprobs" in p and "parameters differ" in p for p in found)
    assert any("train: extra parameter extra" in p for p in found)
    assert any("shutdown: missing" in p for p in found)


def test_the_batch_and_the_infos_are_typed():
    assert set(contracts.TrainerBatch.__annotations__) == {"input_ids", "loss_mask", "advantages",
                                                           "generation_logprobs", "prev_logprobs",
                                                           "reference_logprobs"}
    assert contracts.TrainerBatch.__required_keys__ == {"input_ids", "loss_mask", "advantages", "generation_logprobs"}
    assert typing.get_type_hints(contracts.TrainerInfo)["num_parameters"] is contracts.NumParameters
    from launcher.driver.rollout import Rollout, build_batch

    batch = build_batch(Rollout([[1, 2]], [[3]], [[-0.5]], [1.0]), [0.5], pad_id=0)
    assert set(batch) == contracts.TrainerBatch.__required_keys__
    assert batch["loss_mask"].tolist() == [[0.0, 0.0, 1.0]] and batch["generation_logprobs"][0, 2] == -0.5
