"""The suite's tiers, the order they run in, and how `pytest tests` spreads them over the cores.

Tiers run quickest first, so a broken build fails in minutes: unit, integration, e2e, slurm, gpu
(`order`). The unit tests are independent of each other and run on one worker per core
(pytest-xdist), one test module at a time (its module fixtures are built once). Every other tier
starts Ray, vLLM, Megatron or the one Slurm test cluster of the machine, and spends much of its
time waiting on them (its processes use about three quarters of a core, counted by
tests/helpers/process_counts.py): they form STREAMS, each run in order on one more worker of its
own, from the start and next to each other and to the unit modules (`TierScheduling`). `pytest tests` and `pytest tests/unit` start
the workers by themselves (`workers`); `-n 0` runs everything in this process, `-n N` sets the
number. What each tier proves and its time budget: docs/testing.md.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

TIERS = ("unit", "integration", "e2e", "slurm", "gpu")
PARALLEL = ("unit",)            # tiers whose tests may run on any worker, next to each other
# the other tiers: each stream is one work unit, run in order on a worker of its own. They share
# nothing (each worker's `local_ray` is its own; the Slurm test cluster is the slurm stream's), and
# each waits on its processes most of the time, so side by side they fill the cores.
STREAMS = (("integration",), ("e2e",), ("slurm", "gpu"))
SERIAL = "serial-tiers"         # the prefix of a stream's work unit: serial-tiers:<its first tier>
MAX_WORKERS = 4                 # for the unit tier, one per core (CI: 2); more only adds memory


def stream_of(tier: str) -> str:
    """The stream (its first tier's name) a tier other than the unit tier runs in."""
    return next((s[0] for s in STREAMS if tier in s), STREAMS[-1][0])


def tier_of(nodeid: str) -> str:
    """The tier of a test id, 'tests/<tier>/...' ('other' outside them)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "other"


def order(items: list) -> None:
    """Sort the collected tests by tier (stable: within a tier, the collection's order)."""
    rank = {t: i for i, t in enumerate(TIERS)}
    items.sort(key=lambda item: rank.get(tier_of(item.nodeid), len(TIERS)))


def whole_tiers(args: list[str], rootdir: str) -> bool:
    """`pytest tests` (README's command), `pytest` in the repository, or whole tiers (`pytest tests/slurm`)."""
    tests = os.path.join(rootdir, "tests")
    whole = {tests, rootdir, *(os.path.join(tests, t) for t in TIERS)}
    paths = [os.path.abspath(a.rstrip("/")) for a in args if not a.startswith("-")] or [os.getcwd()]
    return any(p in whole for p in paths)


def workers(args: list[str], rootdir: str) -> int:
    """How many workers `pytest ARGS` gets when it names none (0: this process). One per core (at
    most MAX_WORKERS) when the arguments hold the whole unit tier (`tests` or `tests/unit`, nothing
    narrower: a single file or test starts no workers), and with `tests` one more, kept for the
    other tiers (TierScheduling): they run in a process no unit test ran in, as they always have."""
    tests, unit = os.path.join(rootdir, "tests"), os.path.join(rootdir, "tests", "unit")
    paths = [os.path.abspath(a.rstrip("/")) for a in args if not a.startswith("-")] or [os.getcwd()]
    if not any(p in (tests, unit, rootdir) for p in paths):
        return 0
    cores = max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))
    return cores + len(STREAMS) if any(p in (tests, rootdir) for p in paths) and cores > 1 else cores


def scheduler(config, log):
    """The xdist scheduler of the tiers (imported only when xdist runs)."""
    from xdist.scheduler import LoadScopeScheduling

    rank = {s[0]: i for i, s in enumerate(STREAMS)}

    class TierScheduling(LoadScopeScheduling):
        """A unit test module is a work unit, handed to the workers as they ask; each stream of the
        other tiers is one work unit for a worker of its own (the last ones), given to it at once
        and run in collection order (by tier: `order`), next to the other streams and the unit
        modules. With fewer workers than streams + 1, a worker runs several streams one after the
        other; with a single worker, the unit modules come first. A stream's worker gets its streams
        at once and is then told to shut down: an xdist worker holds its last test until it knows
        whether more work comes (the next test's id decides the fixtures' teardown)."""

        _owners: dict | None = None  # stream work unit -> its worker

        def _split_scope(self, nodeid: str) -> str:
            tier = tier_of(nodeid)
            return nodeid.split("::", 1)[0] if tier in PARALLEL else f"{SERIAL}:{stream_of(tier)}"

        def _give(self, node, scope: str) -> None:
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _streams(self) -> list[str]:
            return sorted((s for s in self.workqueue if s.startswith(SERIAL)), key=lambda s: rank[s.split(":", 1)[1]])

        def _assign_work_unit(self, node) -> None:
            streams = self._streams()
            units = [s for s in self.workqueue if not s.startswith(SERIAL)]
            if len(self.nodes) == 1:
                self._give(node, units[0] if units else streams[0])
                return
            if self._owners is None:  # the last workers, one per stream while one is left for the unit modules
                k = max(1, min(len(streams), len(self.nodes) - (1 if units else 0)))
                self._owners = {s: self.nodes[-1 - i % k] for i, s in enumerate(streams)}
            owned = [s for s, n in self._owners.items() if n is node]
            if owned:  # a stream's worker: its streams at once (in order), nothing else
                mine = [s for s in streams if s in owned]
                for scope in mine:
                    self._give(node, scope)
                if mine and not node.shutting_down:
                    node.shutdown()  # it runs its last test only once it knows nothing comes after it
                return
            if units:
                self._give(node, units[0])

    return TierScheduling(config, log)


def summary(reports: list) -> list[str]:
    """One line per tier: tests, the time its tests took (setup + call + teardown) and the wall
    clock from its first test's start to its last test's end."""
    per = defaultdict(lambda: {"tests": set(), "seconds": 0.0, "start": None, "stop": None})
    for r in reports:
        t = per[tier_of(r.nodeid)]
        t["tests"].add(r.nodeid)
        t["seconds"] += getattr(r, "duration", 0.0) or 0.0
        start, stop = getattr(r, "start", None), getattr(r, "stop", None)
        if start and stop:
            t["start"] = start if t["start"] is None else min(t["start"], start)
            t["stop"] = stop if t["stop"] is None else max(t["stop"], stop)
    lines = []
    for tier in sorted(per, key=lambda k: TIERS.index(k) if k in TIERS else len(TIERS)):
        t = per[tier]
        wall = (f", {t['stop'] - t['start']:.0f} s wall ({_clock(t['start'])}-{_clock(t['stop'])})"
                if t["start"] else "")
        lines.append(f"{tier}: {len(t['tests'])} tests, {t['seconds']:.0f} s in tests{wall}")
    return lines


def slowest_modules(reports: list, n: int = 25, unit: bool = False) -> list[str]:
    """The `n` test modules of the tiers other than the unit tier (which runs next to them), or of the
    unit tier with `unit`, that took the most time (setup + call + teardown of their tests, module
    fixtures included), slowest first: where the suite's minutes go, one line each."""
    per = defaultdict(lambda: [0.0, set()])
    for r in reports:
        if (tier_of(r.nodeid) == "unit") != unit:
            continue
        module = per[r.nodeid.split("::", 1)[0]]
        module[0] += getattr(r, "duration", 0.0) or 0.0
        module[1].add(r.nodeid)
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{seconds:7.0f} s  {len(tests):3d} tests  {module}" for module, (seconds, tests) in ranked]


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
