"""The process counter of the suite (tests/helpers/process_counts.py): every interpreter started
with the probe writes a record, sorted into its kind and charged to the test that started it."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from tests.helpers import process_counts

SELF = "tests/unit/test_process_counts.py::test_x"


def _run(env: dict, *args: str) -> None:
    subprocess.run([sys.executable, *args], env=env, check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_each_interpreter_writes_one_record_with_its_kind_cpu_and_test():
    env = {k: v for k, v in os.environ.items() if k != process_counts.ENV}
    env["PYTEST_CURRENT_TEST"] = SELF + " (call)"
    folder = process_counts.enable(env)
    try:
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
        _run(env, "-c", busy)
        _run(env, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)")
        recs = process_counts.records(folder)
        assert len(recs) == 3, recs
        assert {r["test"] for r in recs} == {SELF + " (call)"}
        assert max(r["cpu"] for r in recs) >= 1.5  # the busy one, written at its exit
        assert [process_counts.kind(r) for r in recs] == ["python"] * 3
        per = process_counts.counts(recs, reports=[])
        row = per["tests/unit/test_process_counts.py"]
        assert list(per) == ["tests/unit/test_process_counts.py"] and row["python"][0] == 3
        assert row["python"][1] == row["cpu"] >= 1.5 and row["slurm jobs"] == 0
        assert all(row[k] == [0, 0.0] for k in process_counts.KINDS if k != "python")
        lines = process_counts.table(folder, reports=[])
        assert lines[1].split()[:3] == ["tier", "unit", "0/0"] and lines[1].split()[-2] == "0"  # no Slurm job
        assert lines[-1].split()[-3:] == ["3", "x", "-c"]  # what the three were: `python -c`
    finally:
        process_counts.disable(folder, env)
    assert not os.path.exists(folder) and process_counts.ENV not in env
    assert str(process_counts.PROBE) not in env.get("PYTHONPATH", "")


def test_kinds_from_command_lines_and_imports():
    def rec(cmd, mods="000", title="", worker=""):
        return {"cmd": cmd, "mods": mods, "title": title or cmd[0], "worker": worker}

    py = "/venv/bin/python"
    assert process_counts.kind(rec([py, "-m", "launcher", "topology=local"])) == "launcher"
    assert process_counts.kind(rec([py, "/venv/bin/ray", "start", "--head", "--block"], mods="001")) == "ray node"
    worker = [py, "/venv/lib/ray/_private/workers/default_worker.py", "--node-ip-address=1"]
    assert process_counts.kind(rec(worker, mods="101", title="ray::MegatronTrainer")) == "megatron"
    assert process_counts.kind(rec(worker, mods="011", title="ray::VllmGenerator")) == "vllm"
    assert process_counts.kind(rec(worker, mods="001", title="ray::RewardWorker")) == "ray worker"
    assert process_counts.kind(rec([py, "/venv/bin/vllm", "serve", "m"], mods="010")) == "vllm"
    assert process_counts.kind(rec([py, "-m", "pytest", "tests"])) is None
    assert process_counts.kind(rec([py, "-c", "import sys;exec(eval(sys.stdin.readline()))"])) is None
    assert process_counts.kind(rec([py, "-c", "pass"], worker="gw0")) == "python"  # a unit test's subprocess


def test_other_tiers_charge_a_process_to_the_test_running_when_it_started():
    """A Ray worker inherits the environment of its raylet (started by an earlier test), so the
    time it started decides, not the test named in its environment."""
    reports = [SimpleNamespace(nodeid="tests/integration/test_trainer.py::t", start=10.0, stop=20.0),
               SimpleNamespace(nodeid="tests/integration/test_moe.py::t", start=20.0, stop=30.0),
               SimpleNamespace(nodeid="tests/e2e/test_moe_local.py::t", start=5.0, stop=40.0),  # beside them
               SimpleNamespace(nodeid="tests/unit/test_grpo_loss.py::t", start=21.0, stop=22.0)]
    phases = process_counts._phases(reports)
    stale = "tests/integration/test_trainer.py::t (setup)"
    assert process_counts.module_of({"t0": 25.0, "test": stale}, phases) == "tests/integration/test_moe.py"
    assert process_counts.module_of({"t0": 12.0, "test": stale}, phases) == "tests/integration/test_trainer.py"
    e2e = "tests/e2e/test_moe_local.py::t (call)"
    assert process_counts.module_of({"t0": 25.0, "test": e2e}, phases) == "tests/e2e/test_moe_local.py"
    assert process_counts.module_of({"t0": 21.5, "test": "tests/unit/test_grpo_loss.py::t (call)"}, phases) == \
        "tests/unit/test_grpo_loss.py"
    assert process_counts.module_of({"t0": 1.0, "test": ""}, phases) == "(outside any test)"
