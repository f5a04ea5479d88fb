"""The run directory: where a run's config, plan, scripts, logs, checkpoints and metrics live.

`<run.root>/<run.name>/` on a filesystem every node sees. It is stable across submissions so that
`+resume=...` finds the checkpoints; starting a fresh run over existing checkpoints, or over the
results of a run that saved none (its metrics rows), is refused (nothing already written is lost).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher import memory
from launcher import plan as plan_mod
from launcher.config import compose as config_mod
from launcher import files, paths, shell
from launcher.config.schema import Config, ConfigError
from launcher.job import sbatch, slurm_job
from launcher.paths import checkpoint_dirs


def resolved(raw: DictConfig, run_dir: Path) -> DictConfig:
    """The config as saved in the run: every path absolute (`~` expanded), so the job does not
    depend on a cwd or a home directory."""
    from launcher.driver import data

    # resolved once, rewritten as plain data, then made a config with each value's `${` text kept as
    # text (shell.literal_tree): a string set on a DictConfig would be read as an interpolation again
    plain = OmegaConf.to_container(raw, resolve=True)
    paths.absolute_config(_Attrs(plain))
    data.absolute_sources(_Attrs(plain))
    plain["run"]["root"] = str(run_dir.parent)
    plain["dry_run"] = False
    return OmegaConf.create(shell.literal_tree(plain))


class _Attrs:
    """A plain config dict read and written by attribute, as the path rewrites read a Config."""

    def __init__(self, d: dict):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, key: str):
        try:
            v = self._d[key]
        except KeyError:
            raise AttributeError(key) from None
        return _Attrs(v) if isinstance(v, dict) else v

    def __setattr__(self, key: str, value) -> None:
        self._d[key] = value


def active_job(run_dir: Path) -> tuple[str, str] | None:
    """(job id, state) of a job recorded in submissions.jsonl that is still queued or running. The
    record is read with the bounded reader (a line that is not a submission is skipped: it names no
    job; the record's own checks are launcher.records')."""
    from launcher.config import bounded

    try:
        lines = bounded.read_text(run_dir / paths.SUBMISSIONS, bounded.LIMITS["log"], "log").splitlines()[-5:]
    except bounded.FileError:
        return None
    ids = []
    for line in lines:
        try:
            row = bounded.parse_json(line, run_dir / paths.SUBMISSIONS, depth=8)
        except bounded.FileError:
            continue
        job = row.get("job_id") if isinstance(row, dict) else None
        if isinstance(job, (str, int)) and not isinstance(job, bool) and str(job).strip():
            ids.append(str(job))
    for job in reversed(dict.fromkeys(ids)):
        listed = slurm_job.queued(job)
        if listed is not None and listed[0] not in slurm_job.FINISHED:  # still owns the run dir
            return job, listed[0]
    return None


def _claim(cfg: Config, run_dir: Path, ckpts: Path) -> None:
    """Refuse a run directory that another job still uses, or whose checkpoints live elsewhere."""
    job = active_job(run_dir)
    if job is not None:
        raise ConfigError("run.name", f"{run_dir} belongs to job {job[0]} ({job[1]}), which reads its config.yaml "
                                      f"when it starts or requeues; wait for it, {shell.command('scancel', job[0])}, "
                                      f"or use run.name=<new name>")
    saved = run_dir / paths.CONFIG
    if cfg.resume is None and saved.is_file():
        from launcher.config import bounded

        try:  # the bounded reader: a config.yaml of nested aliases hung here
            before = ((bounded.yaml_file(saved) or {}).get("checkpointing") or {}).get("dir")
        except (bounded.FileError, AttributeError):  # an unreadable old config: the checks below still hold
            return
        if before is not None and (not isinstance(before, str) or paths.path_error("checkpointing.dir", before)):
            return  # not a path this launcher writes: nothing of it is used or printed
        old = paths.absolute(before) if before else run_dir / "checkpoints"
        steps = sorted(p.name for p in old.glob("step_*")) if old != ckpts and old.is_dir() else []
        if steps:
            raise ConfigError("checkpointing.dir", f"{run_dir} is a run whose checkpoints are in {old} "
                                                   f"({', '.join(steps[-3:])}); continue it with "
                                                   f"{shell.override('checkpointing.dir', before)} +resume=latest, or "
                                                   f"start fresh with run.name=<new name>")


IN_USE = paths.IN_USE  # flock'ed by the process of a local run while it lives (see hold)
_HELD: dict[Path, int] = {}  # run directories this process holds: path -> the locked file's fd


def hold(cfg: Config, run_dir: Path, keep: bool) -> None:
    """Refuse a run directory that a local run (a process on this machine) is using: that process
    holds an exclusive flock on RUN/.in_use for its lifetime, and the kernel lets it go when the
    process ends, however it ends. `keep`: this process runs the job here and holds it from now on
    (otherwise the lock is only tried). A Slurm job's use is seen in submissions.jsonl (_claim)."""
    import fcntl
    import os
    import socket

    path = run_dir / IN_USE
    if run_dir.resolve() in _HELD:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, files.Policy.of(cfg).file_mode)
    try:
        os.fchmod(fd, files.Policy.of(cfg).file_mode)
    except PermissionError:  # another user's lock file: only tried
        pass
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        from launcher.config import bounded

        try:  # written by the run holding the lock: 4 KiB at most, an object of three fields
            who = bounded.parse_json(os.pread(fd, 4096, 0) or b"{}", path, depth=2)
        except bounded.FileError:
            who = {}
        who = who if isinstance(who, dict) else {}
        os.close(fd)
        raise ConfigError("run.name", f"{run_dir} is in use by a run on this machine (pid {who.get('pid', '?')} on "
                                      f"{who.get('host', '?')}, started {who.get('time', '?')}); wait for it, stop "
                                      f"it (Ctrl-C), or use run.name=<new name>") from None
    if not keep:
        os.close(fd)  # unlocks
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode(), 0)
    _HELD[run_dir.resolve()] = fd


def results(run_dir: Path) -> list[str]:
    """What a run that trained left in `run_dir` and a fresh launch there would lose, in words (empty:
    nothing). A fresh run's job rewrites config.yaml, drops every row of metrics.jsonl (one per step
    trained: launcher.driver.metrics) and rewrites startup.json (written after its first step) and
    summary.txt. Only rows or startup.json count: a step ran. summary.txt is named with them but does
    not count alone (a run stopped during its driver's start-up writes an empty one, and its closing
    line says the same command starts it again), nor do the records of a job that trained nothing
    (ray/<job>.<attempt>/, logs, failures.jsonl, a placement smoke's or preflight's report: the
    preflight uses the real run's name), which a new job leaves where they are. metrics.jsonl is read
    with the bounded reader; one it cannot read (too large, a FIFO) is named as such."""
    from launcher.config import bounded

    found = []
    try:
        steps = [r["step"] for r in bounded.jsonl_objects(run_dir / paths.METRICS) if type(r.get("step")) is int]
    except bounded.FileError as e:  # a missing file is no rows (jsonl_objects)
        steps = []
        found.append(f"{paths.METRICS} unread: {e.message}")
    if steps:
        found.append(f"{len(steps)} metrics row{'s' if len(steps) != 1 else ''} up to step {max(steps)}")
    if (run_dir / paths.STARTUP).is_file():
        found.append(paths.STARTUP)
    if found and (run_dir / paths.SUMMARY).is_file():
        found.append(paths.SUMMARY)
    return found


def check(cfg: Config, run_dir: Path) -> tuple:
    """Every refusal of a submission on this run directory, writing nothing: another job or a local
    run uses it, its checkpoints live elsewhere, it holds checkpoints or a run's results (results)
    and this is not a resume, or anything the job would refuse when it starts
    (launcher.driver.start_check: the checkpoint to resume, its records and schedule, the run done).
    A sweep checks every point before it writes any. Returns (the checkpoint folder, the resume's
    manager and checkpoint, or None)."""
    from launcher.driver import start_check  # torch-free: what the job checks when it starts, run here first

    ckpts = checkpoint_dirs(cfg, run_dir)
    for key, d in (("run.name", run_dir), ("checkpointing.dir", ckpts)):  # links followed: the folder it is
        try:
            err = files.not_yours(d)
        except (OSError, RuntimeError) as e:  # a name too long, a symlink loop
            raise ConfigError(key, f"{d}: {paths.os_error_text(e)}") from None
        if err is not None:
            raise ConfigError(key, str(err))
    _claim(cfg, run_dir, ckpts)
    resumed = start_check.check(cfg, run_dir)  # the same function the job runs before Ray (bootstrap)
    existing = sorted(p.name for p in ckpts.glob("step_*")) if ckpts.is_dir() else []
    if existing and cfg.resume is None:
        raise ConfigError("run.name", f"{run_dir} already holds checkpoints ({', '.join(existing[-3:])}); "
                                      f"continue it with +resume=latest, or start fresh with run.name=<new name>")
    if (run_dir / IN_USE).is_file():
        hold(cfg, run_dir, keep=False)  # only tries the lock a local run on this machine holds
    found = results(run_dir) if cfg.resume is None else []
    if found:  # no checkpoint (refused above): +resume=latest would fail, only another name keeps them
        raise ConfigError("run.name", f"{run_dir} holds the results of a run ({', '.join(found)}) but no "
                                      f"checkpoint in {ckpts}, so +resume cannot continue it; start fresh with "
                                      f"run.name=<new name>")
    return ckpts, resumed


def prepare(cfg: Config, raw: DictConfig, plan: plan_mod.Plan, run_dir: Path, spec: sbatch.JobSpec | None,
            runs_here: bool = True) -> None:
    """Check the run directory may be used (check), then write config.yaml, plan.txt and ray_job.sbatch.
    `runs_here`: a local run's job runs in this process (False: a local sweep's child runs it)."""
    ckpts, resumed = check(cfg, run_dir)
    policy = files.Policy.of(cfg)
    try:
        for d in (run_dir, run_dir / paths.LOGS, ckpts):  # also a run dir written before with wider modes:
            files.make_dir(d, policy)  # what is inside (the job's logs, checkpoints, ...) is reachable only through it
    except OSError as e:
        raise ConfigError("run.root", f"cannot create {run_dir}: {paths.os_error_text(e)}") from None
    hold(cfg, run_dir, keep=runs_here and spec is None and cfg.submit)  # before anything in it changes
    if resumed is not None:  # before the job can start or requeue: it must see only this branch
        manager, ckpt = resumed
        aside = manager.start_branch(ckpt, run_dir)
        if aside is not None:
            moved = f"the newer checkpoints were moved to {aside}, " if aside.is_dir() else ""
            print(f"note: resuming from step {ckpt.step} starts a new branch: {moved}later metrics rows to "
                  f"{run_dir / 'abandoned' / aside.name} (nothing deleted)", file=sys.stderr)
    from launcher.driver import rewards

    rewards.copy_into_run(cfg.reward.fn, run_dir)  # a reward file: the job loads this copy
    for source in (cfg.env.fn, *cfg.env.tools):  # and the environment's and tools' files theirs
        rewards.copy_into_run(source, run_dir, paths.ENV_DIR)
    config_mod.save(resolved(raw, run_dir), run_dir / paths.CONFIG)
    files.write(run_dir / paths.PLAN, plan.describe() + "\n" + memory.plan_memory(cfg, plan).describe() + "\n")
    if spec is not None:
        files.write(run_dir / paths.SBATCH_SCRIPT, sbatch.render(spec, plan, run_dir), executable=True)
        files.write(run_dir / paths.TASK_EPILOG, sbatch.task_epilog_script(spec, run_dir), executable=True)


def written(run_dir: Path, spec: sbatch.JobSpec | None) -> str:
    """What submit=false says: the run directory is written, nothing runs (on any executor)."""
    if spec is None:
        return (f"wrote {run_dir} (config.yaml, plan.txt); nothing was run (submit=false). Run it on this "
                f"machine with the same command and submit=true")
    return (f"wrote {run_dir} (config.yaml, plan.txt, ray_job.sbatch); submit it with:\n  "
            f"{shell.command('sbatch', run_dir / paths.SBATCH_SCRIPT)}")


def resume_note(cfg: Config, run_dir: Path) -> str | None:
    """For the dry run: a +resume checkpoint this machine cannot see (existence only: reading it
    would hash every file and import torch)."""
    if cfg.resume is None:
        return None
    root = checkpoint_dirs(cfg, run_dir)
    path = paths.resume_path(cfg.resume, root)
    if path is not None and path.is_dir():
        return None
    listing = ", ".join(p.name for _, p in paths.step_dirs(root)[-3:]) or "none"
    return (f"+resume={cfg.resume}: no checkpoint {path or 'in ' + str(root)} on this machine (checkpoints in "
            f"{root}: {listing}); submission requires it")


def record_submission(run_dir: Path, job_id: str) -> None:
    files.append_line(run_dir / paths.SUBMISSIONS, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job_id": job_id,
                                                    "argv": sys.argv[1:]})
