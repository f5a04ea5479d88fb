"""`python -m launcher.stop RUN_DIR|SWEEP_DIR [--no-wait] [--timeout S]`: stop a run (or every run of
a sweep) after its next checkpoint.

The same path as a preemption inside the job (the driver ends at its step boundary, after saving
a checkpoint), but the job is not requeued: this writes RUN/stop_requested, which the job's
watch loop polls (launcher.cluster.stop.poll_stop_request). A job still pending is cancelled instead
(it has nothing to checkpoint). Waits until the job has ended and says at which step and
checkpoint it stopped; continue the run later with `+resume=latest`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from launcher import logs, progress, shell
from launcher import status as status_mod
from launcher.cluster import stop as stop_mod
from launcher.job import slurm_job

_log = logs.get(__name__)


def _say(msg: str) -> None:
    """A line of the command's progress, on stdout (launcher.logs: silenced by --quiet)."""
    _log.info(msg, extra=logs.PLAIN)


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
    if state not in slurm_job.ACTIVE:
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
            _say(f"follow it: {shell.command('python', '-m', 'launcher.status', d, '--watch')}")
        return rc
    deadline, beat = time.monotonic() + timeout, progress.Heartbeat(_say)
    for d, job in asked:
        rc = max(rc, wait_stopped(d, job, deadline, beat))
    return rc


def parser():
    import argparse

    from launcher.cli import Parser, positive_seconds

    p = Parser(prog="python -m launcher.stop", description=__doc__.split("\n", 2)[2].strip(),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("where", metavar="RUN_DIR|SWEEP_DIR", help="a run directory, or a sweep's (every run of it)")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="ask, and do not wait for the jobs to stop")
    p.add_argument("--timeout", type=positive_seconds, default=3600.0, metavar="SECONDS",
                   help="how long to wait for the jobs to stop (default 3600)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command, under launcher.cli.run: a mistake in the arguments, the directory or a record
    read back is one line, exit code 2, before any job is asked to stop."""
    from launcher import cli

    return cli.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    from launcher import paths
    from launcher.config.schema import ConfigError

    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    where = Path(args.where)
    if not (where / paths.CONFIG).is_file() and not (where / paths.SWEEP_RECORD).is_file():
        raise ConfigError(str(where), f"not a run directory (no {paths.CONFIG}) nor a sweep directory "
                                      f"(no {paths.SWEEP_RECORD})")
    dirs = status_mod.runs_of([str(where)])
    for d in dirs:  # every run's records read (and checked) before any job is asked to stop
        status_mod.collect(d, slurm=False)
    try:
        return stop_runs(dirs, args.wait, args.timeout)
    except KeyboardInterrupt:
        print(f"\nnot waiting any more; the stop request stays in {where / stop_mod.STOP_FILE}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
