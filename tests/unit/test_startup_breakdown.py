"""The start-up breakdown (launcher.driver.startup): its phases add up to the measured total,
concurrent parts are shown but not added, and a group that failed to start takes the others down."""

from __future__ import annotations

import json
import threading
import time

import pytest

from launcher.driver import startup


def test_phases_sum_to_the_measured_total_with_concurrent_parts_not_added(tmp_path):
    began = time.time()
    rec = startup.Startup(began, marks=[])
    time.sleep(0.05)
    rec.mark("ray up")
    requested = time.time()

    class Group:
        def __init__(self, seconds, name):
            t = time.time()
            time.sleep(seconds)
            self.infos = [{"startup": [("process start", t + seconds / 2), (name, time.time())]}]

        def shutdown(self):
            pass

    took = []
    # seconds, not tenths: the claim below (together last less than the sum) keeps a second of margin for
    # a loaded machine's scheduling (CI at load 40 took 0.5 s for two sleeps of 0.2 and 0.25 started together)
    a, b = startup.start_together(lambda: Group(1.0, "build"), lambda: Group(1.2, "engine up"), seconds=took)
    # each group's own wall time, in order (at least its sleep: no upper bound, which a loaded machine breaks)
    assert took[0] >= 1.0 and took[1] >= 1.2
    rec.mark("actors up")
    parts = startup.actor_parts(requested, a.infos, "trainer rank") + startup.actor_parts(requested, b.infos, "engine")
    rec.parts("actors up", parts, concurrent=True)
    time.sleep(0.05)
    rec.mark("step 1")
    measured = time.time() - began

    phases = rec.phases
    assert [p.name for p in phases] == ["ray up", "actors up", "step 1"]
    assert sum(p.seconds for p in phases) == pytest.approx(rec.total, rel=0.05)
    assert rec.total == pytest.approx(measured, rel=0.05)
    # started together: the phase lasts about as long as the slower group, not the sum of both
    actors = phases[1]
    assert actors.concurrent and 1.2 <= actors.seconds < took[0] + took[1]
    assert sum(s for _, s in actors.parts) > actors.seconds  # the parts overlap: never added
    assert [n for n, _ in actors.parts] == ["trainer rank 0: process start", "trainer rank 0: build",
                                            "engine 0: process start", "engine 0: engine up"]
    text = rec.format()
    assert "concurrent: engine 0: engine up" in text and "total (process start -> end of step 1)" in text
    rec.write(tmp_path / "startup.json")
    saved = json.loads((tmp_path / "startup.json").read_text())
    assert sum(p["seconds"] for p in saved["phases"]) == pytest.approx(saved["total_s"], rel=0.05)


def test_first_phase_starts_at_the_process_start_and_marks_before_the_driver_count():
    t0 = startup.process_start_time()
    assert t0 <= time.time()
    rec = startup.Startup.since_process_start([("launcher", t0 + 1.0), ("Ray up", t0 + 3.5)])
    rec.mark("driver", at=t0 + 4.0)
    assert [(p.name, round(p.seconds, 6)) for p in rec.phases] == [("launcher", 1.0), ("Ray up", 2.5),
                                                                   ("driver", 0.5)]
    assert rec.total == pytest.approx(4.0)


def test_summary_names_the_first_steps_warm_up_and_the_step_parts():
    rec = startup.Startup(100.0, [("Ray up", 110.0)])
    row = {"timing/transfer_and_update_weights": 0.2, "timing/generation": 3.0, "timing/logprobs": 0.1,
           "timing/training": 0.3, "timing/total_step": 3.6}
    rec.mark("step 1", at=113.6)
    rec.parts("step 1", startup.step_parts(row), concurrent=False)
    rows = [dict(row, step=1), {"step": 2, "timing/total_step": 0.5}, {"step": 3, "timing/total_step": 0.4},
            {"step": 4, "timing/total_step": 0.6}]
    text = startup.summary_text(rec, rows)
    assert "of which: generation (first: vLLM warm-up)" in text
    assert "step 1 took 3.60 s, later steps 0.50 s (median): +3.10 s" in text
    assert startup.summary_text(None, rows) == ""
    assert startup.warmup(rows[:1]) is None


def test_a_group_that_fails_to_start_shuts_the_others_down_and_its_error_is_raised():
    stopped = threading.Event()

    class Up:
        def shutdown(self):
            stopped.set()

    def fails():
        time.sleep(0.05)
        raise TimeoutError("vLLM engines not up after 1s")

    with pytest.raises(TimeoutError, match="not up"):
        startup.start_together(Up, fails)
    assert stopped.is_set()


def test_a_synchronous_save_gets_a_plain_queue_not_a_spawned_manager():
    """workers.trainer.state gives megatron's FileSystemWriterAsync a queue.Queue before the first
    save, so megatron's get_write_results_queue() returns it instead of starting a Manager (in a
    subprocess: cpu_shim patches the process it runs in)."""
    import subprocess
    import sys

    code = """
import multiprocessing, queue
from workers import cpu_shim
cpu_shim.apply("cpu")
from megatron.core.dist_checkpointing.strategies import filesystem_async
from workers.trainer import state
assert filesystem_async._results_queue is None
state.plain_results_queue()
q = filesystem_async.get_write_results_queue()
assert isinstance(q, queue.Queue) and not multiprocessing.active_children(), (q, multiprocessing.active_children())
state.plain_results_queue()  # once: megatron's cached queue is kept
assert filesystem_async.get_write_results_queue() is q
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
