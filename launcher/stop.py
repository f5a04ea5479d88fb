"""`python -m launcher.stop RUN_DIR|SWEEP_DIR [--no-wait] [--timeout S]`: stop a run (or every run of
a sweep) after its next checkpoint.

The same path as a preemption inside the job (the driver ends at its step boundary, after saving
a checkpoint), but the job is not requeued: this writes RUN/stop_requested, which the job's
watch loop polls (launcher.job.stop.poll_stop_request). A job still pending is cancelled instead
(it has nothing to checkpoint). Waits until the job has ended and says at which step and
checkpoint it stopped; continue the run later with `+resume=latest`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from launcher import progress
from launcher import status as status_mod
from launcher.job import stop as stop_mod

USAGE = "usage: python -m launcher.stop RUN_DIR|SWEEP_DIR [--no-wait] [--timeout SECONDS]"
ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED", "RESIZING", "STOPPED", "SUBMITTED"}


def _say(msg: str) -> None:
    print(msg, flush=True)


def ask(run_dir: Path, alone: bool = True) -> tuple[str | None, int]:
    """Ask one run to stop: (its job id when it must be waited for, exit code so far). A run that
    is not running is an error when it was named `alone`, a note for a sweep's."""
    info = status_mod.collect(run_dir)
    state, job = info["state"], info["job_id"]
    if state == "PENDING":
        out = subprocess.run(["scancel", str(job)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"error: scancel {job}: {out.stderr.strip()}", file=sys.stderr)
            return None, 1
        _say(f"job {job} ({info['run']}) was still pending: cancelled (nothing to checkpoint; it reached step "
             f"{info['step']})")
        return None, 0
    if state not in ACTIVE:
        if not alone:
            _say(f"{info['run']}: not running (job {job or '-'} {state}); nothing to stop")
            return None, 0
        print(f"error: {run_dir}: not running (job {job or '-'} {state}); nothing to stop", file=sys.stderr)
        return None, 1
    stop_mod.write_stop_request(run_dir, by="python -m launcher.stop")
    _say(f"asked job {job} ({info['run']}, step {info['step']}/{info['max_num_steps']}) to stop after its "
         f"current step and a checkpoint; it will not be requeued")
    return job, 0


def wait_stopped(run_dir: Path, job: str, deadline: float, beat: progress.Heartbeat) -> int:
    """Until the job has ended; then say at which step and checkpoint it stopped."""
    while True:
        info = status_mod.collect(run_dir)
        if info["state"] in status_mod.TERMINAL:
            break
        if time.monotonic() > deadline:
            print(f"error: job {job} has not stopped in time (state {info['state']}, step {info['step']}); the "
                  f"request stays in {run_dir / stop_mod.STOP_FILE}", file=sys.stderr)
            return 1
        beat.tick(f"waiting for job {job} to checkpoint and stop (state {info['state']}, step "
                  f"{info['step']}/{info['max_num_steps']})")
        time.sleep(1.0)
    stopped = info["stopped"] or {}
    ckpt = info["checkpoint"] or "no checkpoint"
    if stopped.get("job") == job:
        _say(f"job {job} stopped at {stopped.get('time')} at step {stopped.get('step')}/{info['max_num_steps']} "
             f"(newest checkpoint {ckpt}); state {info['state']}, not requeued. Continue it with the same "
             f"overrides and +resume=latest")
        return 0
    _say(f"job {job} ended ({info['state']}, step {info['step']}/{info['max_num_steps']}, newest checkpoint "
         f"{ckpt}) before it took the stop request" + (f"; last failure: {info['last_failure']}"
                                                      if info["last_failure"] else ""))
    stop_mod.clear_stop_request(run_dir)
    return 0 if info["state"] == "COMPLETED" else 1


def stop_runs(run_dirs: list[Path], wait: bool = True, timeout: float = 3600.0) -> int:
    """Ask every run first (a sweep's runs stop together), then wait for each."""
    asked, rc = [], 0
    for d in run_dirs:
        job, code = ask(d, alone=len(run_dirs) == 1)
        rc = max(rc, code)
        if job is not None:
            asked.append((d, job))
    if not wait:
        for d, _ in asked:
            _say(f"follow it: python -m launcher.status {d} --watch")
        return rc
    deadline, beat = time.monotonic() + timeout, progress.Heartbeat(_say)
    for d, job in asked:
        rc = max(rc, wait_stopped(d, job, deadline, beat))
    return rc


def main(argv: list[str] | None = None) -> int:
    from launcher.config.compose import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\n" + __doc__.split("\n", 2)[2].strip())
        return 0
    wait, timeout, dirs, i = True, 3600.0, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--no-wait":
            wait = False
        elif a == "--timeout" or a.startswith("--timeout="):
            value = a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in a else 1
            try:
                timeout = float(value)
            except ValueError:
                print(f"error: --timeout: seconds, got {value!r}\n{USAGE}", file=sys.stderr)
                return 2
        elif a.startswith("-"):
            print(f"error: {a}: not an option\n{USAGE}", file=sys.stderr)
            return 2
        else:
            dirs.append(Path(a))
        i += 1
    if len(dirs) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    if not (dirs[0] / "config.yaml").is_file() and not (dirs[0] / "sweep.jsonl").is_file():
        print(f"error: {dirs[0]}: not a run directory (no config.yaml) nor a sweep directory (no sweep.jsonl)",
              file=sys.stderr)
        return 2
    try:
        return stop_runs(status_mod.runs_of([str(dirs[0])]), wait, timeout)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nnot waiting any more; the stop request stays in {dirs[0] / stop_mod.STOP_FILE}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
