"""The suite's tiers, the order they run in, and how `pytest tests` spreads them over the cores.

Tiers run quickest first, so a broken build fails in minutes: unit, integration, e2e, slurm, gpu
(`order`). The unit tests are independent of each other and run on every worker (pytest-xdist),
one test module at a time (its module fixtures are built once); every other tier starts Ray,
vLLM, Megatron or the one Slurm test cluster of the machine, so all of their tests run in order on
one worker, alone, once no unit module is left to hand out (`TierScheduling`). `pytest tests` and
`pytest tests/unit` start the workers by themselves (`workers`); `-n 0` runs everything in this
process, `-n N` sets the number. What each tier proves and its time budget: docs/testing.md.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

TIERS = ("unit", "integration", "e2e", "slurm", "gpu")
PARALLEL = ("unit",)            # tiers whose tests may run on any worker, next to each other
SERIAL = "serial-tiers"         # the one work unit that holds every test of the other tiers
MAX_WORKERS = 4                 # one per core (CI: 2); more only adds memory: each imports torch


def tier_of(nodeid: str) -> str:
    """The tier of a test id, 'tests/<tier>/...' ('other' outside them)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "other"


def order(items: list) -> None:
    """Sort the collected tests by tier (stable: within a tier, the collection's order)."""
    rank = {t: i for i, t in enumerate(TIERS)}
    items.sort(key=lambda item: rank.get(tier_of(item.nodeid), len(TIERS)))


def workers(args: list[str], rootdir: str) -> int:
    """How many workers `pytest ARGS` gets when it names none: one per core (at most MAX_WORKERS)
    when the arguments hold the whole unit tier (`tests` or `tests/unit`, nothing narrower), else 0
    (this process: a single file or test starts no workers)."""
    whole = {os.path.join(rootdir, "tests"), os.path.join(rootdir, "tests", "unit")}
    paths = [os.path.abspath(a.rstrip("/")) for a in args if not a.startswith("-")] or [os.getcwd()]
    if not any(p in whole or p == rootdir for p in paths):
        return 0
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def scheduler(config, log):
    """The xdist scheduler of the tiers (imported only when xdist runs)."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        """A unit test module is a work unit; all other tests are one work unit, SERIAL, handed out
        last: the worker that takes it runs them in collection order (by tier, `order`) while the
        others finish their last unit module and stop."""

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0] if tier_of(nodeid) in PARALLEL else SERIAL

        def _assign_work_unit(self, node) -> None:
            if SERIAL in self.workqueue and len(self.workqueue) > 1:
                self.workqueue.move_to_end(SERIAL)
            super()._assign_work_unit(node)

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


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
