"""Joining the job's Ray cluster at any node count: when a worker starts `ray start`, and how long
the driver waits for the nodes to register. Pure functions of the clock and a random source, so
the rules can be checked for 1 or 1,024 nodes without starting anything.

Why no order among the workers: every worker starts `ray start` as soon as the head answers, as
NeMo RL's `ray.sub` and verl's Slurm scripts do. A start-up with `sleep(c * node_index)` in it
makes the last of 1,000 nodes wait c * 999 s before it even tries; no fixed budget covers that.
What can go wrong when many nodes start at once is Ray refusing some of them: `ray start` waits
30 s for its node to appear in the GCS ("The current node timed out during startup ... or the GCS
has become overloaded"), and the raylet waits a fixed 15 s (Ray 2.60, not configurable) for its
dashboard agent, a Python process, to report its port; a node whose CPUs are shared by many
starting nodes misses that (on the 2-core test machine, from about 12 nodes at once:
docs/benchmarks.md). Such a node retries after a random delay in [0, ray.join_jitter_s), so a herd
of refused nodes spreads its retries over that window instead of arriving together again. A node's
whole join is then bounded by ray.join_retries x (one attempt + ray.join_jitter_s), whatever the
node count.

The driver's deadline follows progress, not a budget fixed at the head's start: it waits while
nodes keep registering (1,000 nodes at 100 per second take 10 s; stragglers that wait for a retry
take longer, and neither is a reason to fail) and fails, naming the missing nodes, only when no
further node has registered for ray.register_timeout_s, or at once when a node reports that it
could not join (bootstrap's failed_node<i>.json).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence


def retry_delay(attempt: int, jitter_s: float, rng: random.Random) -> float:
    """Seconds a worker waits before its `ray start` attempt number `attempt` (1-based): none
    before the first (no term in the node's index or the node count), a random delay in
    [0, jitter_s) before each retry."""
    if attempt <= 1 or jitter_s <= 0:
        return 0.0
    return rng.uniform(0.0, jitter_s)


class JoinDeadline:
    """The driver's rule while the planned nodes register: `observe` what Ray lists, then
    `complete` (all there) or `expired` (none new for `stall_s`: fail naming `missing`)."""

    def __init__(self, planned: Sequence[int], stall_s: float, now: float):
        self.planned = list(planned)
        self.stall_s = stall_s
        self.started = now
        self.last_progress = now        # the head's start, then each time a node registers for the first time
        self.seen: set[int] = set()     # every planned node ever listed
        self.registered: set[int] = set()  # the planned nodes listed in the last observation

    def observe(self, registered: Iterable[int], now: float) -> None:
        current = set(registered).intersection(self.planned)
        if current - self.seen:
            self.last_progress = now
            self.seen |= current
        self.registered = current

    @property
    def missing(self) -> list[int]:
        return [i for i in self.planned if i not in self.registered]

    def complete(self) -> bool:
        return not self.missing

    def stalled_for(self, now: float) -> float:
        return now - self.last_progress

    def expired(self, now: float) -> bool:
        return not self.complete() and self.stalled_for(now) > self.stall_s


def index_ranges(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8': a thousand missing nodes in a line a person can read."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
