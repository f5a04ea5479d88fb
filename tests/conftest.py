"""Shared fixtures: locally built tiny models (cached per session) and a local Ray cluster.

Tests are grouped by what they start: tests/unit (no Ray, no model processes), tests/integration
(local Ray, real Megatron, real vLLM), tests/slurm (the local Slurm cluster), tests/e2e (whole runs).
They run in that order, the unit tests on every core (tests/helpers/tiers.py, docs/testing.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
# submitit's import runs logging.config.dictConfig, which closes every logging handler already made:
# absl's (which a module importing megatron or vLLM brings) closes the stream it holds, pytest's
# captured stderr, and the next test of that worker fails on a closed file and its report kills the
# worker ("lost sys.stderr"). Imported first, its dictConfig finds no handler to close.
import submitit  # noqa: F401

from launcher.cluster.ray_node import DAEMON_ENV

# Keep every test process to one thread per library: the CI machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
for _key, _value in DAEMON_ENV.items():  # local_ray's daemons get what every `ray start` of the launcher gets
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]
_LOCAL_RAY: dict = {}  # the last test id of each stream that uses local_ray; its temp dir while it runs
_TEMP: dict = {}       # the temp dir's listing when the whole suite started
_COUNTS: dict = {}     # where the processes the tests start are counted (tests/helpers/process_counts.py)


# ------------------------------------------------------------------------ order and workers
@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest tests` (README's command) and `pytest tests/unit` start one worker per core (before
    xdist reads the option); an explicit -n/--dist, a narrower selection or a worker itself: as given."""
    from tests.helpers import tiers

    if (os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist")
            or config.getoption("collectonly") or config.option.numprocesses is not None
            or config.option.dist != "no"):
        return
    n = tiers.workers(config.args, str(config.rootpath))
    if n > 1:
        config.option.numprocesses = n


def pytest_configure(config):
    """`pytest tests` or a whole tier counts the processes its tests start, by kind and module
    (tests/helpers/process_counts.py; the table ends the output). Set up before xdist's workers
    start, so that they and everything below them inherit it."""
    from tests.helpers import process_counts, tiers

    if (not os.environ.get("PYTEST_XDIST_WORKER") and process_counts.ENV not in os.environ
            and tiers.whole_tiers(config.args, str(config.rootpath))):
        _COUNTS["folder"] = process_counts.enable()


def pytest_unconfigure(config):
    from tests.helpers import process_counts

    if "folder" in _COUNTS:
        process_counts.disable(_COUNTS.pop("folder"))


def pytest_sessionstart(session):
    """The whole suite (`pytest tests`), or a whole tier, leaves nothing new in the temp dir
    (tests/helpers/temp_listing.py): listed here, compared in pytest_sessionfinish (in the controller;
    xdist's workers are below it)."""
    from tests.helpers import temp_listing, tiers

    config = session.config
    if not os.environ.get("PYTEST_XDIST_WORKER") and tiers.whole_tiers(config.args, str(config.rootpath)):
        _TEMP["before"] = temp_listing.listing()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    from tests.helpers import temp_listing

    if "before" not in _TEMP:
        return
    left = temp_listing.left_behind(_TEMP.pop("before"))
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test run left {len(left)} new entries in the temp dir: {', '.join(left[:20])}"
        if reporter is not None:
            reporter.write_sep("=", "left in the temp dir", red=True)
            reporter.write_line(message)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_xdist_make_scheduler(config, log):
    """The unit tier on every worker, then every other test on one (tests/helpers/tiers.py)."""
    from tests.helpers import tiers

    return tiers.scheduler(config, log) if config.getvalue("dist") == "load" else None


def pytest_collection_modifyitems(config, items):
    from tests.helpers import tiers

    tiers.order(items)
    last = {}
    for item in items:
        if "local_ray" in getattr(item, "fixturenames", ()):
            last[tiers.stream_of(tiers.tier_of(item.nodeid))] = item.nodeid
    _LOCAL_RAY["last"] = set(last.values())


def pytest_runtest_setup(item):
    """A test of a later stream that uses `local_ray`, in the process whose Ray stopped after an
    earlier stream (`-n 0`, or fewer workers than streams): its Ray starts again."""
    if "local_ray" in getattr(item, "fixturenames", ()) and _LOCAL_RAY.get("made") and "temp" not in _LOCAL_RAY:
        _start_local_ray()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of its stream (tests/helpers/tiers.py STREAMS) that uses `local_ray`,
    its Ray stops: its daemons would otherwise take a share of the two cores through the tiers
    after it, which start Rays of their own."""
    yield
    if item.nodeid in _LOCAL_RAY.get("last", ()) and "temp" in _LOCAL_RAY:
        _stop_local_ray()


def pytest_terminal_summary(terminalreporter):
    from tests.helpers import tiers

    reports = [r for key in ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "")  # "": passed setups
               for r in terminalreporter.stats.get(key, []) if hasattr(r, "nodeid") and r.nodeid]
    if reports:
        for title, slowest in (("the slowest modules of the other tiers", tiers.slowest_modules(reports)),
                               ("the slowest modules of the unit tier", tiers.slowest_modules(reports, 15, unit=True))):
            if slowest:
                terminalreporter.write_sep("=", title)
                for line in slowest:
                    terminalreporter.write_line(line)
        if "folder" in _COUNTS:
            from tests.helpers import process_counts

            terminalreporter.write_sep("=", "processes started, by kind (tests/helpers/process_counts.py)")
            for line in process_counts.table(_COUNTS["folder"], reports):
                terminalreporter.write_line(line)
        terminalreporter.write_sep("=", "time per tier")
        for line in tiers.summary(reports):
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """The session's tiny models; under pytest-xdist one folder for all workers (a model another
    worker built is reused: workers.tiny_models writes a model whole, once)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp("models")
    shared = tmp_path_factory.getbasetemp().parent / "models"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def tiny_model(model_cache):
    """tiny_model(recipe="tiny_llama", seed=0) -> Path of a locally built HF checkpoint dir (a built-in
    recipe or a test-only one: tests/helpers/recipes.py)."""
    from tests.helpers.recipes import RECIPES
    from workers import tiny_models

    def build(recipe: str = "tiny_llama", seed: int = 0) -> Path:
        return tiny_models.build(model_cache / f"{recipe}-s{seed}", recipe, seed=seed, spec=RECIPES[recipe])

    return build


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray instance for the integration tests of a session (of each stream: tests/helpers/
    tiers.py), with both role resources. Its temp dir (Ray's session, and the TMPDIR of its workers:
    vLLM's rendezvous files) is a fresh one, removed at the end, as a launcher run removes its own
    (launcher.cluster.reaper)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        _start_local_ray()
    yield ray
    if "temp" in _LOCAL_RAY:
        _stop_local_ray()


def _start_local_ray() -> None:
    import tempfile

    import ray

    temp = tempfile.mkdtemp(prefix="ray-tests-")  # short: Ray's socket paths must stay under 108 characters
    os.mkdir(f"{temp}/tmp")
    ray.init(num_cpus=8, resources={"train_slot": 4, "generation_slot": 2}, include_dashboard=False,
             object_store_memory=512 * 2**20, log_to_driver=True, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1", "TMPDIR": f"{temp}/tmp"}})
    _LOCAL_RAY.update(temp=temp, made=True)


def _stop_local_ray() -> None:
    """After the last test of a stream that uses local_ray (pytest_runtest_teardown), or at the end."""
    import shutil

    import ray

    ray.shutdown()
    shutil.rmtree(_LOCAL_RAY.pop("temp"), ignore_errors=True)


def ray_processes_of(job: str) -> list[str]:
    """Processes still running for a job's Ray nodes (found by the job's Ray temp dir /tmp/ray_<job>_...)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/tmp/ray_{job}_" in cmd:
                out.append(f"{d}: {cmd[:100]}")
    return out


@pytest.fixture
def no_ray_left():
    """no_ray_left(job): assert that no process of the job's Ray nodes remains (waits up to 15 s)."""

    def check(job: str, wait_s: float = 15.0) -> None:
        deadline = time.time() + wait_s
        while ray_processes_of(job) and time.time() < deadline:
            time.sleep(0.5)
        assert ray_processes_of(job) == []

    return check
