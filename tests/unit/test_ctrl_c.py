"""One Ctrl-C finishes the step and saves, whatever phase it lands in; only a second one, pressed at
least a second later, stops at once (launcher.cluster.stop). In-process, no Ray: the local
launcher's own path (`launcher.__main__._run_here` -> job.submit.run_local -> cluster.bootstrap.run_head
-> run_driver -> stop.running) with Ray's start, connection and clean-up replaced by no-ops and a fake
driver in place of launcher.driver.grpo.run. The test sends SIGINT to its own process, as `kill -INT`
does, at a chosen point of each phase: the start-up (the head's, on the main thread; the driver's,
on its thread), a step, a rollout generated ahead on a thread of its own (the pipeline), the save
and the clean-up. Once, and twice within milliseconds: one Ctrl-C that GNU `timeout` (or a job
wrapper) forwards to the pid and then to its process group arrives twice, and the second copy was
taken for the person's second Ctrl-C, which stopped the run at once, without its checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from launcher import __main__ as launcher_main
from launcher import plan as plan_mod
from launcher.cluster import bootstrap
from launcher.cluster import stop as stop_mod
from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.driver import jobs, startup
from launcher.driver.grpo import outcome

STEPS, SAVE_PERIOD = 6, 4


def ctrl_c(times: int, held: bool = False) -> None:
    """SIGINT to this process, as `kill -INT` sends it; the second copy once the first was handled (the
    main thread ran the handler: the stop is set) and a few milliseconds at most after it (`held`: in
    a clean-up that holds Ctrl-C, stop.ctrl_c_held, 2 ms after it)."""
    os.kill(os.getpid(), signal.SIGINT)
    if times == 2:
        deadline = time.monotonic() + (0.002 if held else 5)
        while (held or not stop_mod.stopping()) and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert held or stop_mod.stopping(), "the first SIGINT was not handled"
        os.kill(os.getpid(), signal.SIGINT)


class FakeDriver:
    """launcher.driver.grpo.run's stand-in: its start-up, then steps of a few ms, each with the next
    step's rollout generated ahead on a thread (the pipeline), a checkpoint every SAVE_PERIOD steps
    and when stopping, the same outcome. `at(phase, step)` is called at each point of interest."""

    def __init__(self, at):
        self.at = at
        self.saved: list[int] = []
        self.generated: list[int] = []
        self.ran = threading.Event()

    def __call__(self, cfg, plan, ctx, stop: threading.Event) -> dict:
        self.at("driver start-up", 0)  # actors starting, in the driver thread
        step, last_saved = 0, 0
        while step < STEPS and not stop.is_set():
            step += 1
            ahead = threading.Thread(target=self.generate, args=(step + 1,), name="generation", daemon=True)
            ahead.start()
            self.at("step", step)
            time.sleep(0.005)
            ahead.join()
            if stop.is_set() or step % SAVE_PERIOD == 0 or step == STEPS:
                self.at("save", step)
                time.sleep(0.02)  # the trainers write
                self.saved.append(step)
                last_saved = step
        self.ran.set()
        stopped = stop.is_set() and step < STEPS
        return outcome(step, stopped, last_saved or None, bool(self.saved))

    def generate(self, step: int) -> None:
        self.at("rollout in flight", step)
        time.sleep(0.005)
        self.generated.append(step)


@pytest.fixture
def local_run(tmp_path, monkeypatch):
    """_run_here on this machine's default config with Ray's parts replaced; returns run(at) ->
    (exit code, stderr, stdout, the fake driver, whether the clean-up ran)."""
    cfg = typed(compose([f"run.root={tmp_path}", "run.name=r"]))
    plan = plan_mod.build(cfg.topology)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    cleaned: list[bool] = []
    hooks: dict = {}
    monkeypatch.setattr(startup, "warm_imports", lambda: None)
    monkeypatch.setattr(bootstrap, "resolve_ip", lambda host: "127.0.0.1")
    monkeypatch.setattr(bootstrap, "start_ray", lambda *a, **k: None)
    monkeypatch.setattr(bootstrap, "wait_port", lambda *a, **k: None)
    monkeypatch.setattr(bootstrap, "connect", lambda *a, **k: hooks["at"]("head start-up", 0))
    monkeypatch.setattr(bootstrap, "wait_for_nodes", lambda *a, **k: None)
    monkeypatch.setattr(bootstrap, "disconnect", lambda: None)
    monkeypatch.setattr(bootstrap, "stop_node", lambda ctx, proc: (hooks["at"]("clean-up", 0), cleaned.append(True)))

    class NoWatch:
        def __init__(self, *a, **k):
            pass

        def tick(self, now):
            pass

    monkeypatch.setattr(bootstrap, "HeadWatch", NoWatch)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (xdist's workers ignore it)

    def run(at, capsys):
        hooks["at"] = at
        driver = FakeDriver(at)
        monkeypatch.setattr(jobs, "run", driver)
        code = launcher_main._run_here(cfg, plan, run_dir)
        out = capsys.readouterr()
        return code, out.err, out.out, driver, bool(cleaned)

    yield run
    signal.signal(signal.SIGINT, previous)
    assert stop_mod.CURRENT is None


def at_point(phase: str, step: int, times: int):
    fired: list = []

    def at(where: str, n: int) -> None:
        if where == phase and n == step and not fired:
            fired.append((where, n))
            ctrl_c(times, held=phase == "clean-up")
            # the handler runs now, in the middle of the phase: the main thread runs it at its next
            # bytecode, which on a loaded machine can be more than the 10 ms this once slept
            deadline = time.monotonic() + 5
            while phase != "clean-up" and not stop_mod.stopping() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.01)
    return at, fired


@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice within ms"])
@pytest.mark.parametrize("phase, step, stops_at, saved", [
    ("head start-up", 0, 0, []),            # Ray starting, the driver not yet: nothing to save
    ("driver start-up", 0, 0, []),          # actors starting in the driver thread
    ("step", 2, 2, [2]),                    # the step finishes, then its checkpoint
    ("rollout in flight", 3, 2, [2]),       # the next step's rollout generated ahead, during step 2
    ("save", 4, 4, [4]),                    # the periodic save at step 4 completes; nothing more to save
])
def test_one_ctrl_c_finishes_the_step_and_saves_whatever_phase_it_lands_in(local_run, capsys, phase, step,
                                                                            stops_at, saved, times):
    at, fired = at_point(phase, step, times)
    code, err, out, driver, cleaned = local_run(at, capsys)
    assert fired, f"the run never reached {phase} {step}"
    assert code == 130, err + out
    assert "stopped at once" not in err and driver.ran.is_set() and cleaned  # no KeyboardInterrupt anywhere
    assert out.count("Ctrl-C: stopping after the current step and saving a checkpoint") == 1, out
    assert driver.saved == saved
    if saved:
        assert err.strip().splitlines()[-1] == (f"stopped at step {stops_at} after saving a checkpoint; continue with "
                                                f"the same command and +resume=latest")
    else:  # nothing was saved: the closing line does not send the user to a +resume that fails
        assert err.strip().splitlines()[-1] == ("stopped at step 0: nothing was saved (before step 1); the same "
                                                "command starts the run again from step 1")


@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice within ms"])
def test_a_ctrl_c_during_the_clean_up_after_the_last_step_changes_nothing(local_run, capsys, times):
    at, fired = at_point("clean-up", 0, times)
    code, err, out, driver, cleaned = local_run(at, capsys)
    assert fired and code == 0 and cleaned and driver.saved == [4, STEPS]
    assert "stopped at once" not in err and "finished in" in out
    assert "Ctrl-C: the driver has already ended; stopping Ray" in out and "saving a checkpoint" not in out


def test_a_second_ctrl_c_a_second_later_stops_at_once(local_run, capsys):
    release = threading.Event()

    def at(where: str, n: int) -> None:
        if (where, n) == ("step", 2):
            ctrl_c(1)
            time.sleep(stop_mod.AGAIN_AFTER_S + 0.2)  # a person's second Ctrl-C, while the step still runs
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(10)

    code, err, out, driver, cleaned = local_run(at, capsys)
    assert code == 130 and cleaned, err + out
    assert "interrupted: stopped at once" in err
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the interpreter's exit is not interrupted again
    assert driver.saved == [] and not driver.ran.is_set()  # the driver was abandoned in its step
    release.set()
    driver.ran.wait(5)


def test_a_second_ctrl_c_during_the_start_up_stops_at_once(local_run, capsys):
    def at(where: str, n: int) -> None:
        if where == "head start-up":
            ctrl_c(1)
            time.sleep(stop_mod.AGAIN_AFTER_S + 0.2)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # KeyboardInterrupt here

    code, err, out, driver, cleaned = local_run(at, capsys)
    assert code == 130 and cleaned and "interrupted: stopped at once" in err, err + out
    assert not driver.ran.is_set()


def test_a_ctrl_c_after_a_stop_request_is_the_same_stop(local_run, capsys, tmp_path):
    """`python -m launcher.stop` asked first: Ctrl-C then is a first Ctrl-C, not a second one."""
    def at(where: str, n: int) -> None:
        if (where, n) == ("step", 2):
            assert stop_mod.request_stop("stop requested (test)")
            ctrl_c(2)

    code, err, out, driver, cleaned = local_run(at, capsys)
    assert code == 130 and "stopped at once" not in err and driver.saved == [2], err + out
    assert "Ctrl-C: already stopping after the current step" in out


@pytest.mark.parametrize("where", ["at its start", "while it logs"])
def test_the_copy_handled_inside_the_first_handler_is_still_the_same_ctrl_c(monkeypatch, capsys, where):
    """Python runs a signal handler between any two bytecodes of the main thread, also inside another
    handler: the copy of one Ctrl-C (microseconds behind) can run inside the first's handler, at its very
    start (before it has noted anything) or while it writes its line. Either way: one stop, no KeyboardInterrupt."""
    nested: list = []

    def copy_now():
        if not nested:
            nested.append(True)
            stop_mod._on_sigint(signal.SIGINT, None)

    if where == "at its start":
        real = time.monotonic
        monkeypatch.setattr(stop_mod.time, "monotonic", lambda: (copy_now(), real())[1])
    else:
        warning = stop_mod._log.warning
        monkeypatch.setattr(stop_mod._log, "warning", lambda *a, **k: (copy_now(), warning(*a, **k)))
    previous = signal.getsignal(signal.SIGINT)
    try:
        with stop_mod.armed(stop_mod.local_handlers()) as current:
            stop_mod._on_sigint(signal.SIGINT, None)
            assert nested and current.stop.is_set()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().out.count("Ctrl-C: stopping after the current step") == 1


@pytest.mark.parametrize("result, line", [
    ({"step": 5, "stopped": True, "checkpoint": 5, "saved": True},
     "stopped at step 5 after saving a checkpoint; continue with the same command and +resume=latest"),
    ({"step": 0, "stopped": True, "checkpoint": None, "saved": False},
     "stopped at step 0: nothing was saved (before step 1); the same command starts the run again from step 1"),
    ({"step": 3, "stopped": True, "checkpoint": None, "saved": False},
     "stopped at step 3: nothing was saved (checkpointing.enabled=false); the same command with run.name=<new name> "
     "starts it again from step 1"),
    ({"step": 4, "stopped": True, "checkpoint": 4, "saved": False},
     "stopped at step 4, before running a step: nothing new was saved; the same command continues from that "
     "checkpoint (step_4) again"),
    ({"step": 7, "stopped": True, "checkpoint": 4, "saved": False},
     "stopped at step 7; the newest checkpoint is step_4 (checkpointing.enabled=false): continue with the same "
     "command and +resume=latest, which runs steps 5-7 again"),
])
def test_the_closing_line_says_what_was_saved(result, line):
    assert launcher_main.closing_line(result) == line
    assert launcher_main.closing_line(result, asked=True) == line.replace("stopped", "stopped on request", 1)


def test_the_driver_starts_once_the_warm_up_imports_are_through(local_run, capsys, monkeypatch):
    """The warm-up thread imports transformers while the head starts; a driver importing it at the same
    time can be handed a half-initialised module by importlib's deadlock guard ("cannot import name
    'AutoTokenizer'", seen under load). So the driver starts only after that thread ended."""
    ended: list[float] = []

    def warm():
        def imports():
            time.sleep(0.3)  # longer than the stand-in head start: the driver would otherwise start first
            ended.append(time.monotonic())
        thread = threading.Thread(target=imports, name="warm-imports", daemon=True)
        thread.start()
        return thread

    monkeypatch.setattr(startup, "warm_imports", warm)
    started: list[float] = []
    code, err, out, driver, cleaned = local_run(
        lambda where, n: started.append(time.monotonic()) if where == "driver start-up" else None, capsys)
    assert code == 0, err + out
    assert ended and started and started[0] >= ended[0]
