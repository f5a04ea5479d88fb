"""`python -m launcher.status [RUN_DIR | SWEEP_DIR | RUN_ROOT | key=value ...] [--watch [S]] [--json]`

For each run: its Slurm job and state (squeue while the controller lists it, then sacct), attempts
(Slurm's restart count) and failures (failures.jsonl), step / max_num_steps, the last reward and
validation reward, seconds per step and an ETA, the newest complete checkpoint, the last failure
line and where the logs are. A run of the local topology is read from its run directory alone
(running while its process holds the lock on RUN/.in_use).
With key=value overrides (`run.name=NAME`, `topology=slurm_3n ...`) the run directory is the one
the launcher would use; with nothing, every run under run.root.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from launcher import paths, progress, records
from launcher import metric_names as names
from launcher.job import slurm_job

# the states after which --watch stops: a Slurm job's instance is over, or a local run ended (status.local_job)
TERMINAL = slurm_job.OVER | {"ENDED"}


# ------------------------------------------------------------------------------- reading a run
def jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file that are JSON objects (a line being written is skipped), read
    with the bounded reader (launcher.config.bounded: a size and a depth limit)."""
    from launcher.config import bounded

    return bounded.jsonl_objects(path)


def in_use(run_dir: Path) -> bool:
    """Whether a process holds the lock on RUN/.in_use: a local run holds it (exclusive) for its whole
    life (launcher.job.run_dir.hold) and the kernel lets it go however the process ends, so it says
    "running" where a pid cannot (a pid of an ended run may now be any other process). Tried with a
    shared non-blocking flock, released at once; the file is opened read-only, never created (status
    writes nothing). A .in_use that is not a regular file, or cannot be opened or locked, is one line."""
    import fcntl

    from launcher.config import bounded

    path = run_dir / paths.IN_USE
    try:
        f = bounded.open_regular(path)  # without blocking: a FIFO there is named, not waited on
    except bounded.FileMissing:
        return False  # no local run has held this directory
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError as e:  # ENOLCK: a filesystem without locks
            raise bounded.FileError(path, "", f"cannot be locked ({paths.os_error_text(e)})") from None
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return False


def local_job(run_dir: Path) -> dict:
    """A local run's state from its newest rendezvous folder ray/local-<pid>.<attempt>/: its `done`
    record, else RUNNING while a process holds RUN/.in_use (in_use), else ENDED. The pid in the
    folder's name is only the job's id: whether that pid lives says nothing (it may be reused)."""
    dirs = sorted((run_dir / paths.RENDEZVOUS).glob("local-*.*"), key=lambda p: p.stat().st_mtime)
    if not dirs:
        return {"job_id": None, "state": "NOT STARTED", "reason": "", "restarts": 0, "source": "run dir"}
    newest = dirs[-1]
    job_id, _, attempt = newest.name.rpartition(".")
    done = newest / paths.DONE
    if done.is_file():
        state = "COMPLETED" if records.load(done, records.DONE)["ok"] else "FAILED"
    elif in_use(run_dir):
        state = "RUNNING"
    else:
        state = "ENDED"  # the process let its lock go without writing `done` (killed)
    return {"job_id": job_id, "state": state, "reason": "", "restarts": int(attempt or 0), "source": "run dir"}


def newest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest step_N with its manifest (written last: the checkpoint is complete)."""
    found = [p for _, p in paths.step_dirs(ckpt_root) if (p / paths.MANIFEST).is_file()]
    return found[-1] if found else None


def collect(run_dir: Path, slurm: bool = True) -> dict:
    """Everything the status view shows of one run, as plain data (what --json prints)."""
    from launcher.config import compose as config_mod
    from launcher.cluster import stop as stop_mod

    run_dir = Path(run_dir).resolve()
    cfg = config_mod.load_typed(run_dir / paths.CONFIG)  # launcher.records: each record read here has its schema
    total = cfg.grpo.max_num_steps
    executor = cfg.topology.executor
    submissions = records.load_lines(run_dir / paths.SUBMISSIONS, records.SUBMISSION)
    failures = records.load_lines(run_dir / paths.FAILURES, records.FAILURE)
    if executor == "slurm":
        job_id = str(submissions[-1]["job_id"]) if submissions else None
        job = {"state": "NOT SUBMITTED", "reason": "", "restarts": 0, "source": None}
        if job_id and slurm:
            job = slurm_job.state(str(job_id))
        job["job_id"] = job_id
    else:
        job = local_job(run_dir)
    rows = [r for r in jsonl(run_dir / paths.METRICS) if isinstance(r.get("step"), int)]
    last = rows[-1] if rows else {}
    vals = [v for r in rows if (v := progress.val_reward(r)) is not None]
    sps = progress.seconds_per_step(rows)
    step = int(last.get("step", 0))
    ckpt = newest_checkpoint(paths.checkpoint_dirs(cfg, run_dir))
    stopped = stop_mod.read_stopped(run_dir)
    if stopped and stopped.get("job") != job.get("job_id"):
        stopped = None  # an earlier job of this run was stopped, not this one
    jid = job.get("job_id")
    logs = [p for p in ([*slurm_job.task_logs(run_dir, jid), run_dir / paths.LOGS / f"sbatch-{jid}.out"]
                        if jid else []) if p.is_file()]
    return {
        "run": run_dir.name, "run_dir": str(run_dir), "executor": executor,
        "job_id": jid, "state": job["state"], "reason": job["reason"], "source": job["source"],
        "attempts": job["restarts"] + 1 if jid else 0, "requeues": job["restarts"],
        "submissions": len(submissions), "failures": len(failures),
        "last_failure": _last_failure(failures, job["state"], logs),
        "step": step, "max_num_steps": total,
        "reward": last.get(names.REWARD), "val_reward": vals[-1] if vals else None,
        "seconds_per_step": sps, "eta_s": progress.eta(step, total, sps) if job["state"] == "RUNNING" else None,
        "checkpoint": str(ckpt) if ckpt else None,
        "stop_requested": stop_mod.stop_requested(run_dir), "stopped": stopped,
        "logs": [str(p) for p in logs] + [str(run_dir / paths.LOGS)],
        "last_row": last,
    }


def _last_failure(failures: list[dict], state: str, logs: list[Path]) -> str | None:
    if failures:
        f = failures[-1]
        return f"{f.get('time', '')} job {f.get('job', '?')}: {str(f.get('error', '')).splitlines()[0]}"
    if state in slurm_job.FAILED or state == "ENDED":
        for log in reversed(logs):
            errors = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("error:")]
            if errors:
                return errors[-1]
    return None


# ------------------------------------------------------------------------------- which runs
def runs_of(args: list[str]) -> list[Path]:
    """RUN_DIR, SWEEP_DIR (its sweep.jsonl), a folder of runs, or key=value overrides (the run
    directory the launcher would use; only run.root=R: every run under R)."""
    from launcher import paths
    from launcher.config import compose as config_mod
    from launcher.config.schema import ConfigError
    from launcher.config.schema import typed
    from launcher.sweep import read as read_sweep

    overrides = [a for a in args if "=" in a and not Path(a).exists()]
    folders = [Path(a) for a in args if a not in overrides]
    if overrides or not folders:
        root_only = all(o.startswith("run.root=") for o in overrides)  # every run under that root
        cfg = typed(config_mod.compose(overrides))
        if not root_only:
            return [paths.run_dir(cfg)]
        folders = [Path(cfg.run.root).expanduser().resolve()]
    out: list[Path] = []
    for d in folders:
        if (d / paths.CONFIG).is_file():
            out.append(d.resolve())
        elif (d / paths.SWEEP_RECORD).is_file():
            out += [Path(r["run_dir"]) for r in read_sweep(d)]
        elif d.is_dir():
            found = sorted(p.parent for p in d.glob("*/config.yaml"))
            if not found:
                raise ConfigError(str(d), "no run directory here (no config.yaml, sweep.jsonl or runs below)")
            out += found
        else:
            raise ConfigError(str(d), "does not exist (give a run directory, a sweep directory or run.name=NAME)")
    return out


# ------------------------------------------------------------------------------- showing
def render(infos: list[dict]) -> str:
    head = ["run", "job", "state", "attempts", "step", "reward", "val_reward", "s/step", "ETA", "checkpoint"]
    body = []
    for i in infos:
        state = i["state"] + (f" ({i['reason']})" if i["reason"] else "")
        state += ", stop requested" if i["stop_requested"] else ", stopped on request" if i["stopped"] else ""
        body.append([i["run"], str(i["job_id"] or "-"), state, str(i["attempts"]), f"{i['step']}/{i['max_num_steps']}",
                     _num(i["reward"]), _num(i["val_reward"]),
                     f"{i['seconds_per_step']:.1f}" if i["seconds_per_step"] is not None else "-",
                     progress.duration(i["eta_s"]), Path(i["checkpoint"]).name if i["checkpoint"] else "-"])
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), *(fmt.format(*b) for b in body), ""]
    for i in infos:
        lines.append(f"{i['run']}: {i['run_dir']}")
        if i["last_row"]:
            lines.append("  " + progress.step_line(i["step"], i["max_num_steps"], i["last_row"], i["seconds_per_step"],
                                                   running=i["state"] == "RUNNING"))
        if i["checkpoint"]:
            lines.append(f"  newest checkpoint: {i['checkpoint']}")
        if i["failures"] or i["last_failure"]:
            lines.append(f"  failures: {i['failures']}; last: {i['last_failure']}")
        if i["stopped"]:
            s = i["stopped"]
            lines.append(f"  stopped on request at {s.get('time')} (job {s.get('job')}, step {s.get('step')})")
        lines.append(f"  logs: {'  '.join(i['logs'])}")
    return "\n".join(lines)


def _num(v) -> str:
    return f"{float(v):.3f}" if isinstance(v, (int, float)) else "-"


def parser():
    import argparse

    from launcher.cli import Parser, positive_seconds

    p = Parser(prog="python -m launcher.status", description=__doc__.split("\n", 2)[2].strip(),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("where", nargs="*", metavar="RUN_DIR | SWEEP_DIR | RUN_ROOT | key=value",
                   help="the runs to show (default: every run under run.root)")
    p.add_argument("--watch", nargs="?", const=5.0, type=positive_seconds, metavar="SECONDS",
                   help="refresh every SECONDS (default 5) until every run has ended")
    p.add_argument("--json", action="store_true", help="one JSON list per refresh, for scripts")
    return p


def _watch_value_given(argv: list[str]) -> list[str]:
    """`--watch RUN_DIR`: --watch takes the next word only when it is a number."""
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--watch" and (i + 1 >= len(argv) or not re.fullmatch(r"[0-9]*\.?[0-9]+", argv[i + 1])):
            out[-1] = "--watch=5"
    return out


def main(argv: list[str] | None = None) -> int:
    """The command, under launcher.cli.run: a mistake in the arguments, a run directory or a record
    read back is one line, exit code 2."""
    from launcher import cli

    return cli.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(_watch_value_given(sys.argv[1:] if argv is None else list(argv)))
    dirs = runs_of(args.where)   # every run named, before any is read
    while True:
        infos = [collect(d) for d in dirs]
        if args.json:
            print(json.dumps(infos, default=str))
        else:
            if args.watch is not None and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print(f"{time.strftime('%H:%M:%S')}  {len(infos)} run(s)\n" + render(infos), flush=True)
        if args.watch is None or all(i["state"] in TERMINAL for i in infos):
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
