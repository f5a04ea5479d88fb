"""tests/helpers/tiers.py through real pytest runs (with pytest-xdist) of a small tree shaped like
this suite's: tests/unit (three modules), tests/integration, tests/e2e and tests/slurm, wired
with tests/conftest.py's own hooks. Each test appends (worker, test id, start, end) to a log.

- `pytest tests` starts one worker per core and one more per stream of the other tiers
  (integration; e2e; slurm and gpu): the unit modules are spread over the workers, a module whole
  on one worker; each stream runs in tier order on a worker of its own, from the start, next to
  the other streams and the unit modules, and that worker runs no unit test; the terminal ends with the time per tier;
- `-n 0` runs everything in this process in tier order; which arguments start workers (a single
  file starts none): `workers`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tiers

REPO = Path(__file__).resolve().parents[2]
PER_MODULE = 6  # tests per unit module; xdist hands a worker its next module when 2 of its tests are left

CONFTEST = """
from tests.conftest import (pytest_cmdline_main, pytest_collection_modifyitems, pytest_terminal_summary,
                            pytest_xdist_make_scheduler)
"""

TEST = """
import json, os, time

def _log(name, t0):
    with open({log!r}, "a") as f:
        f.write(json.dumps([os.environ.get("PYTEST_XDIST_WORKER", "main"), name, t0, time.time()]) + "\\n")

{tests}
"""


def _tree(root: Path) -> Path:
    log = root / "log.jsonl"
    files = {"unit/test_u1.py": PER_MODULE, "unit/test_u2.py": PER_MODULE, "unit/test_u3.py": PER_MODULE,
             "slurm/test_s.py": 1, "e2e/test_e.py": 2, "integration/test_i.py": 2}  # not in tier order
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "tests").mkdir()
    (root / "tests" / "conftest.py").write_text(CONFTEST)
    for rel, n in files.items():
        path = root / "tests" / rel
        path.parent.mkdir(exist_ok=True)
        body = "\n".join(f"def test_{k}():\n    t0 = time.time()\n    time.sleep(0.3)\n    _log('{rel}::{k}', t0)\n"
                         for k in range(n))
        path.write_text(TEST.format(log=str(log), tests=body))
    return log


def _pytest(root: Path, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = root / "log.jsonl"
    return p, [json.loads(line) for line in log.read_text().splitlines()]


def test_the_whole_tree_spreads_the_unit_modules_and_runs_each_stream_on_a_worker_of_its_own(tmp_path):
    pytest.importorskip("xdist")
    _tree(tmp_path)
    p, log = _pytest(tmp_path, str(tmp_path / "tests"), "--rootdir", str(tmp_path))
    cores = max(1, min(len(os.sched_getaffinity(0)), tiers.MAX_WORKERS))
    expected_workers = cores + len(tiers.STREAMS) if cores > 1 else cores
    unit = [x for x in log if x[1].startswith("unit/")]
    serial = [x for x in log if not x[1].startswith("unit/")]
    assert len(unit) == 3 * PER_MODULE and len(serial) == 5
    # a unit module runs whole on one worker
    for module in ("unit/test_u1.py", "unit/test_u2.py", "unit/test_u3.py"):
        assert len({w for w, name, *_ in unit if name.startswith(module)}) == 1, unit
    streams = {}
    for w, name, t0, end in serial:
        streams.setdefault(name.split("/")[0], []).append((w, name, t0, end))
    assert [n for _, n, *_ in streams["integration"]] == ["integration/test_i.py::0", "integration/test_i.py::1"]
    assert [n for _, n, *_ in streams["e2e"]] == ["e2e/test_e.py::0", "e2e/test_e.py::1"]
    assert [n for _, n, *_ in streams["slurm"]] == ["slurm/test_s.py::0"]
    owners = {tier: {w for w, *_ in rows} for tier, rows in streams.items()}
    assert all(len(w) == 1 for w in owners.values()), owners  # a stream runs whole on one worker
    if expected_workers > 1:
        assert len(set().union(*owners.values())) == 3, owners  # each on a worker of its own
        assert not set().union(*owners.values()) & {w for w, *_ in unit}, log  # no unit test on them
        # started at once, next to the unit modules: before any unit worker was through its first module
        firsts = [min(t0 for _, _, t0, _ in rows) for rows in streams.values()]
        unit_only = {w for w, *_ in unit} - set().union(*owners.values())
        ends = {w: sorted(end for w2, _, _, end in unit if w2 == w) for w in unit_only}
        assert unit_only and max(firsts) < min(e[PER_MODULE - 1] for e in ends.values()), log
    summary = p.stdout.split("time per tier", 1)[1].splitlines()
    assert [line.split(":")[0] for line in summary[1:5]] == ["unit", "integration", "e2e", "slurm"], p.stdout
    assert summary[1].startswith(f"unit: {3 * PER_MODULE} tests, ") and " s wall (" in summary[1]
    other, rest = p.stdout.split("the slowest modules of the other tiers", 1)[1].split(
        "the slowest modules of the unit tier", 1)
    names = [line.split()[-1] for line in other.splitlines()[1:-1]]  # 2 tests of 0.3 s, 2 of them, then 1
    assert sorted(names[:2]) == ["tests/e2e/test_e.py", "tests/integration/test_i.py"], p.stdout
    assert names[2:] == ["tests/slurm/test_s.py"], p.stdout
    unit_lines = rest.split("\n", 1)[1].split("=====", 1)[0].splitlines()  # after its title, up to the next
    unit_names = [line.split()[-1] for line in unit_lines if line.strip()]
    assert sorted(unit_names) == [f"tests/unit/test_u{i}.py" for i in (1, 2, 3)], p.stdout  # in a list of its own


def test_n0_runs_every_tier_in_order_in_this_process(tmp_path):
    _tree(tmp_path)
    p, log = _pytest(tmp_path, str(tmp_path / "tests"), "--rootdir", str(tmp_path), "-n", "0")
    assert {w for w, *_ in log} == {"main"} and "bringing up nodes" not in p.stdout
    tiers_in_order = [name.split("/")[0] for _, name, *_ in log]
    assert tiers_in_order == ["unit"] * 3 * PER_MODULE + ["integration"] * 2 + ["e2e"] * 2 + ["slurm"]


@pytest.mark.parametrize("args,expected", [
    (["tests"], "all"), (["tests/"], "all"), ([], "all"), (["tests/unit"], "unit"),
    (["tests/unit/test_tiers.py"], 0), (["tests/e2e"], 0), (["tests/unit", "-k", "x"], "unit"),
])
def test_workers_for_the_arguments(args, expected, monkeypatch):
    monkeypatch.chdir(REPO)
    cores = max(1, min(len(os.sched_getaffinity(0)), tiers.MAX_WORKERS))
    want = {"all": cores + len(tiers.STREAMS) if cores > 1 else cores, "unit": cores, 0: 0}[expected]
    assert tiers.workers(args, str(REPO)) == want


def test_tier_of_and_order():
    assert tiers.tier_of("tests/e2e/test_x.py::test_y[a/b]") == "e2e"
    assert tiers.tier_of("tests/helpers/test_x.py::t") == "other" and tiers.tier_of("test_x.py::t") == "other"

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item(n) for n in ("tests/slurm/a.py::t", "tests/unit/b.py::t", "tests/gpu/c.py::t", "tests/e2e/d.py::t",
                               "tests/unit/a.py::t", "tests/integration/e.py::t", "x.py::t")]
    tiers.order(items)
    assert [i.nodeid for i in items] == ["tests/unit/b.py::t", "tests/unit/a.py::t", "tests/integration/e.py::t",
                                         "tests/e2e/d.py::t", "tests/slurm/a.py::t", "tests/gpu/c.py::t", "x.py::t"]


def test_the_local_ray_stops_after_the_last_test_of_a_stream_that_uses_it(tmp_path):
    """The integration tier's Ray (tests/conftest.py local_ray) is not left running through the tiers
    after it: a Ray's daemons take a share of the two cores. In one process (-n 0), a later stream's
    test that uses it gets it started again, and it stops after that one."""
    pytest.importorskip("ray")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    (tmp_path / "tests" / "e2e").mkdir()
    (tmp_path / "tests" / "slurm").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "from tests.conftest import (local_ray, pytest_collection_modifyitems, pytest_runtest_setup,\n"
        "                            pytest_runtest_teardown)\n")
    (tmp_path / "tests" / "e2e" / "test_e.py").write_text(
        "import ray\n\ndef test_after():\n    assert not ray.is_initialized()\n\n"
        "def test_again(local_ray):\n    assert local_ray.is_initialized()\n")
    (tmp_path / "tests" / "slurm" / "test_s.py").write_text(
        "import ray\n\ndef test_last():\n    assert not ray.is_initialized()\n")
    (tmp_path / "tests" / "integration" / "test_i.py").write_text(
        "def test_one(local_ray):\n    assert local_ray.is_initialized()\n\n"
        "def test_two(local_ray):\n    assert local_ray.is_initialized()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", str(tmp_path / "tests"),
                        "--rootdir", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "5 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def test_what_a_run_leaves_in_the_temp_dir_is_named_and_only_the_kept_entries_are_not(tmp_path, monkeypatch):
    import tempfile

    from tests.helpers import temp_listing, tiers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # this test's own "system temp dir"
    (tmp_path / "before").mkdir()
    before = temp_listing.listing()
    for name in ("ray_4242_0_1", "vllm_dist_0a1b", "pytest-of-root", "torchinductor_root", "slurm-test.lock"):
        (tmp_path / name).mkdir()
    assert temp_listing.left_behind(before) == [str(tmp_path / "ray_4242_0_1"), str(tmp_path / "vllm_dist_0a1b")]
    root = str(tmp_path / "repo")
    assert tiers.whole_tiers([f"{root}/tests"], root) and tiers.whole_tiers([f"{root}/tests/slurm/", "-x"], root)
    assert not tiers.whole_tiers([f"{root}/tests/unit/test_tiers.py"], root)
