"""How a running job stops: every signal it reacts to, the one stop event the driver watches, the
stop request file, and the requeue.

This is the cluster's side (every task of the job runs it: the bootstrap, each node's Ray, Ray's
worker setup hook); the commands read and write the same files through it (`python -m launcher`
clears an earlier job's request at submission, `launcher.status` and `launcher.stop` read them).

- The driver runs in a thread (cluster.bootstrap.run_driver); the main thread takes the signals
  and sets `stop` on the running driver, which ends at its next step boundary after a checkpoint.
  The handlers are in place (`armed`) from the start of the job's start-up to the end of its
  clean-up, so a signal means the same whatever phase it lands in: one that lands before the
  driver's first step stops it there (nothing to save), one after the driver ended changes nothing.
- Slurm's preemption warning (SIGTERM), the time-limit warning (USR2 with plain sbatch; submitit
  takes USR2 itself and calls JobTask.checkpoint), Ctrl-C on a local run: the first finishes the
  step and saves; only a second one at least AGAIN_AFTER_S later, while the driver still runs,
  stops at once. One Ctrl-C often arrives twice within microseconds: GNU `timeout` (and job
  wrappers like it) forwards a signal to its child's pid and then to its whole process group,
  which holds the child; the kernel drops the copy only while the first is still pending, so
  when another thread of this process took the first (Ray's and the pipeline's threads run on
  the other cores) the copy is delivered too, and was taken for the second Ctrl-C of "stop now".
- Slurm signals every process of the job: Ray's daemons block the job's signals (the mask is set
  in the child before exec and inherited), actors and worker tasks ignore them, so only the
  bootstrap of node 0 reacts, and Ray is stopped by PID afterwards.
- A stopped plain-sbatch job, or a failed one with restarts left, requeues itself (`requeue`).
- `python -m launcher.stop RUN_DIR` writes RUN/stop_requested; the bootstrap's watch loop polls it
  (`poll_stop_request`) and stops the driver the same way, but the job does not requeue; when the
  driver has ended, RUN/stopped.json says when and at which step (`finish_stop_request`).
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from launcher import files, logs, paths, records

JOB_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
AGAIN_AFTER_S = 1.0   # a Ctrl-C sooner after the first is that one delivered again, not a person's second
_log = logs.get(__name__)
_say = _log.warning   # why the run stops: said also under --quiet


@dataclass
class RunningDriver:
    """The stop of this process's job, from its start-up (`armed`) to the end of its clean-up."""

    stop: threading.Event
    thread: threading.Thread | None = None   # the driver's, once started (`running`)
    ended: bool = False                      # the driver has returned or failed: only clean-up is left
    ctrl_c_at: float | None = None           # time.monotonic() of the first Ctrl-C
    sigints: Iterator[int] = field(default_factory=itertools.count)   # SIGINTs so far (next() is atomic)
    handlers: dict = field(default_factory=dict)


CURRENT: RunningDriver | None = None  # the job armed in this process, for signal handlers


def block_job_signals() -> None:
    """preexec_fn of a Ray node's process tree: Ray's daemons and workers would otherwise shut down
    (or die: USR2's default action) in the middle of the step that is being checkpointed."""
    signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)


def ignore_job_signals() -> None:
    """A worker task (or an actor) must outlive the checkpoint; it stops when the head says done."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Clean-up that must finish (a node's Ray stopped, its temp dir removed): a Ctrl-C pressed during
    it is handled when it ends, by the handler that was in place (the second Ctrl-C of "stop now"
    would otherwise abandon the clean-up half done). Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, None)


@contextmanager
def armed(handlers: dict) -> Iterator[RunningDriver]:
    """`handlers` {signal: handler} installed and the stop event made, for the whole job: its
    start-up (Ray, the driver's actors), the driver (`running`) and its clean-up. A signal that
    lands before the driver starts sets the same event, and the driver stops before its first
    step. Nested (the local launcher arms before each attempt's run_head does): the same stop,
    and a new attempt's start-up begins - its driver has not started."""
    global CURRENT
    if CURRENT is not None:
        CURRENT.thread, CURRENT.ended = None, False
        yield CURRENT
        return
    CURRENT = RunningDriver(threading.Event(), handlers=dict(handlers))  # first: the handlers read it
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield CURRENT
    finally:
        for sig, handler in previous.items():  # first: a signal from now on finds the handler of before
            signal.signal(sig, handler)
        CURRENT = None


def reinstall() -> None:
    """The armed handlers installed again: ray.init, called after the job armed them, installs its
    own SIGTERM handler (exit), which would abort the process instead of letting it checkpoint."""
    if CURRENT is not None:
        for sig, handler in CURRENT.handlers.items():
            signal.signal(sig, handler)


def stopping() -> bool:
    """Whether this process's job was asked to stop (a signal, a stop request)."""
    return CURRENT is not None and CURRENT.stop.is_set()


def request_stop(why: str) -> bool:
    """Ask the job's driver to stop after its current step (before its first when it has not started);
    False if no job is armed here (or the stop was already asked for)."""
    running = CURRENT
    if running is None or running.stop.is_set():
        return False
    _say(why)
    running.stop.set()
    return True


def _on_job_signal(signum, frame) -> None:
    request_stop(f"{signal.Signals(signum).name}: stopping after the current step (a checkpoint is saved first)")


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: the first finishes the step and saves (whatever phase it lands in); the same one
    delivered again within AGAIN_AFTER_S (module docstring) changes nothing; a second one later
    stops at once, while the driver runs or its start-up does. Once the driver has ended only the
    clean-up is left, which must finish (ctrl_c_held): a Ctrl-C then stops nothing more (nor restarts).
    The copy can run this handler inside the first's (Python runs a handler between any two
    bytecodes of the main thread): which call is the first is decided by one atomic count."""
    current = CURRENT
    if current is None:
        raise KeyboardInterrupt  # not armed (a handler left behind): Python's own behaviour
    n = next(current.sigints)
    now = time.monotonic()
    if n == 0:
        current.ctrl_c_at = now
        if current.ended:
            _log.warning("\nCtrl-C: the driver has already ended; stopping Ray", extra=logs.PLAIN)
            current.stop.set()  # and no restart
        elif current.stop.is_set():  # a preemption or `launcher.stop` came first
            _log.warning("\nCtrl-C: already stopping after the current step and saving a checkpoint (Ctrl-C again "
                         "to stop now)", extra=logs.PLAIN)
        else:
            _log.warning("\nCtrl-C: stopping after the current step and saving a checkpoint (Ctrl-C again to stop "
                         "now)", extra=logs.PLAIN)
            current.stop.set()
        return
    first = current.ctrl_c_at  # None: the first is being handled right now, under this call
    if first is None or now - first < AGAIN_AFTER_S:
        _log.debug(f"SIGINT again {now - (first or now):.3f}s after the first: the same Ctrl-C delivered twice (a "
                   f"wrapper such as `timeout` sends it to the pid and to its process group), ignored")
        return
    if current.ended:
        _log.warning("\nCtrl-C: the driver has already ended; stopping Ray", extra=logs.PLAIN)
        return
    raise KeyboardInterrupt  # the second Ctrl-C: stop now


def job_handlers(plain_sbatch: bool) -> dict:
    """Slurm task 0: SIGTERM (preemption) stops after a checkpoint; under plain sbatch USR2 (the
    time-limit warning, #SBATCH --signal=USR2@...) too - under submitit, submitit's handler has it."""
    handlers = {signal.SIGTERM: _on_job_signal}
    if plain_sbatch:
        handlers[signal.SIGUSR2] = _on_job_signal
    return handlers


def local_handlers() -> dict:
    return {signal.SIGINT: _on_sigint}


@contextmanager
def running(target: Callable[[threading.Event], None], handlers: dict) -> Iterator[RunningDriver]:
    """Start `target(stop)` in the driver thread, under the job's `armed` stop (armed here with
    `handlers` when the caller has not), its handlers installed again (`reinstall`)."""
    with armed(handlers) as current:
        reinstall()
        stop = current.stop
        current.thread = threading.Thread(target=lambda: target(stop), name="driver", daemon=True)
        current.ended = False
        current.thread.start()
        try:
            yield current
        finally:
            current.ended = True


def stop_and_wait(budget_s: float) -> None:
    """submitit's checkpoint hook on USR2: stop the driver at the end of its step, wait for the save."""
    running_now = CURRENT
    if running_now is None:
        return
    request_stop("USR2: checkpointing at the end of this step, then requeueing")
    # also when the stop was already asked for (a preemption sends SIGTERM just before USR2):
    # requeueing before the save has finished would kill the step being checkpointed
    if running_now.thread is not None:  # None: still starting up; its driver stops before step 1
        running_now.thread.join(timeout=budget_s)


STOP_FILE = paths.STOP_REQUEST   # written by `python -m launcher.stop`
STOPPED_FILE = paths.STOPPED     # written when the driver ended because of it


def write_stop_request(run_dir: Path, by: str) -> None:
    files.write_json(Path(run_dir) / STOP_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "by": by})


def stop_requested(run_dir: Path) -> dict | None:
    """The stop request (launcher.records.STOP_REQUEST), None when there is none; RecordError
    naming the file when it is not one."""
    return records.load(Path(run_dir) / STOP_FILE, records.STOP_REQUEST, missing_ok=True)


def clear_stop_request(run_dir: Path) -> None:
    """At submission: a stop asked of an earlier job of this run is not for the new one."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def _asked(run_dir: Path) -> dict | None:
    """In the job: the file is the request; a content that is not a request's still asks to stop."""
    try:
        return stop_requested(run_dir)
    except records.RecordError as e:
        _say(f"{e} (taken as a stop request all the same)")
        return {"by": "an unreadable stop request", "time": "?"}


def poll_stop_request(run_dir: Path) -> bool:
    """The bootstrap's watch loop: a stop request file stops the driver after its current step."""
    asked = _asked(run_dir)
    return bool(asked) and request_stop(f"stop requested ({asked.get('by', 'python -m launcher.stop')} at "
                                        f"{asked.get('time')}): stopping after the current step (a checkpoint "
                                        f"is saved first); the job will not be requeued")


def finish_stop_request(run_dir: Path, job_id: str, result: dict) -> bool:
    """After the driver ended: if a stop request ended it, record RUN/stopped.json (and consume
    the request); True then, and the job must not requeue."""
    asked = _asked(run_dir)
    if asked is None:
        return False
    step = result.get("step")
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job": str(job_id),
              "step": step if isinstance(step, int) else None, "stopped": bool(result.get("stopped")),
              "requested": asked}
    files.write_json(Path(run_dir) / STOPPED_FILE, record, indent=None)
    clear_stop_request(run_dir)
    _say(f"stopped on request at step {result.get('step')}; not requeued")
    return True


def read_stopped(run_dir: Path) -> dict | None:
    """RUN/stopped.json (launcher.records.STOPPED), None when there is none."""
    return records.load(Path(run_dir) / STOPPED_FILE, records.STOPPED, missing_ok=True)


def requeue(job_id: str) -> None:
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
