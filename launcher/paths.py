"""Every path of a run that more than one part of the job needs, derived from the config alone.

The launcher (job/run_dir.py writes the run directory), the cluster bootstrap (resume after a
requeue), the driver (checkpoints, the base model) and the exporter all read them from here, so
the run directory, its checkpoint folder and the base model's folder are defined once.

Paths from the config are user input on a shared filesystem: `run.name` must be one safe path
component (no `/`, no `..`, no `%` that Slurm would expand in `--output`), and every path key is
made absolute (`~` expanded, relative to the submitting shell's directory) once, at submission,
by `absolute_config`; the job reads only absolute paths from the saved config.yaml.
"""

from __future__ import annotations

import re
from pathlib import Path

from launcher.config.schema import Config, ConfigError

# the run-name rule (run.name, and the names a sweep derives for its points: safe_name)
NAME_CHARS = "A-Za-z0-9._+-"
NAME_MAX = 128
RUN_NAME = re.compile(rf"^[A-Za-z0-9][{NAME_CHARS}]{{0,{NAME_MAX - 1}}}$")
RUN_NAME_RULE = (f"one path component of letters, digits and . _ + - (starting with a letter or digit, "
                 f"at most {NAME_MAX} characters)")
_NOT_IN_NAME = re.compile(rf"[^{NAME_CHARS}]+")
# the config keys that hold a path (the saved config has them absolute)
PATH_KEYS = ("run.root", "checkpointing.dir", "model.path")
RESUME_WORDS = re.compile(r"^(latest|step_\d+)$")

# The names of what a run directory holds, one place for each (their modes: launcher.files; the
# records read back and their schemas: launcher.records).
CONFIG = "config.yaml"              # the resolved config (also in every checkpoint)
PLAN = "plan.txt"
SBATCH_SCRIPT = "ray_job.sbatch"    # the same job for plain `sbatch`
TASK_EPILOG = "task_epilog.sh"      # srun --task-epilog of the job's step (launcher.cluster.task_epilog)
LOGS = "logs"
CHECKPOINTS = "checkpoints"
REWARD_DIR = "reward"               # a reward file copied at submission
ENV_DIR = "env"                     # environment and tool files copied at submission
SUBMISSIONS = "submissions.jsonl"   # one line per Slurm job of the run
FAILURES = "failures.jsonl"         # one line per failure (retry.max_restarts counts them)
METRICS = "metrics.jsonl"
SUMMARY = "summary.txt"
STARTUP = "startup.json"
PLACEMENT = "placement.json"        # the placement smoke's report (run.job=placement_smoke, hold, preflight)
PREFLIGHT_REPORT = "preflight.json" # run.job=preflight: every node's probe, the problems
PREFLIGHT_TABLE = "preflight.txt"   # the same as the table it printed
PREFLIGHT_PROBES = "preflight"      # RUN/preflight/<job>.<attempt>/: the probes' files
RELEASE = "release"                 # run.job=hold: `touch RUN/release` ends it
ACTOR_LOGS = "logs/actors"          # RUN/logs/actors/<host>-pid<pid>.log: every Ray worker's stdout/stderr
RAY_LOGS = "logs/ray"               # RUN/logs/ray/<host>/<session>/: Ray's daemons' logs, kept when its temp dir goes
IN_USE = ".in_use"                  # flock'ed by a local run's process while it lives
STOP_REQUEST = "stop_requested"     # written by `python -m launcher.stop`
STOPPED = "stopped.json"            # written when the driver ended because of it
ABANDONED = "abandoned"             # what a branch resume moved aside
RENDEZVOUS = "ray"                  # RUN/ray/<job>.<attempt>/: where the tasks of one job attempt meet
TOKEN = "token"                     # Ray's per-job token (always 0600)
HEAD = "head.json"                  # the Ray head's address, published by task 0
REGISTERED = "registered"           # every planned node joined: a lost node is now a failure
DONE = "done"                       # the driver ended (ok or error): every task stops its Ray
NODE_REPORT = "failed_node{index}.json"   # a node whose Ray could not join or stopped
NODE_REPORTS = "failed_node*.json"
# a checkpoint step_N/
TRAINING_INFO = "training_info.json"
MANIFEST = "manifest.json"
TRAINER = "trainer"                 # the trainer ranks' torch distributed checkpoint
ROLLOUTS = "rollouts.json"          # a pipelined run's rollouts generated ahead of the checkpoint's step
# a sweep: <run.root>/sweeps/<sweep>/
SWEEPS = "sweeps"
SWEEP_RECORD = "sweep.jsonl"


def run_name_error(name: object) -> ConfigError | None:
    if isinstance(name, str) and RUN_NAME.match(name) and name not in (".", ".."):
        return None
    return ConfigError("run.name", f"must be {RUN_NAME_RULE}; got {name!r}")


def safe_name(text: str, limit: int = NAME_MAX) -> str:
    """`text` as a name the run-name rule allows: other characters as `_`, no . _ + - at either end,
    at most `limit` characters (a longer one is cut and ends with a digest of the whole)."""
    import hashlib

    name = _NOT_IN_NAME.sub("_", text).strip("._+-") or "run"
    if len(name) > limit:
        name = name[: limit - 9].rstrip("._+-") + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def path_error(key: str, value: object) -> ConfigError | None:
    """A path key whose value Slurm or the shell would reinterpret (`%` patterns, newlines)."""
    if value is None:
        return None
    text = str(value)
    if text == "":
        return ConfigError(key, "is empty: give a directory, or null for the default")
    for ch, why in (("%", "Slurm expands % patterns in log paths"), ("\n", "a path must be one line"),
                    ("\0", "a path cannot hold a NUL byte")):
        if ch in text:
            return ConfigError(key, f"must not contain {ch!r} ({why}); got {text!r}")
    return None


def absolute(path: str | Path) -> Path:
    """`~` expanded, made absolute against the current directory, symlinks resolved. A symlink loop
    is an OSError (ELOOP) like every other error of a path (Python 3.11's resolve raises RuntimeError)."""
    try:
        return Path(path).expanduser().resolve()
    except RuntimeError as e:
        if "Symlink loop" not in str(e):
            raise
        import errno
        import os

        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None


def os_error_text(e: BaseException) -> str:
    """An OS error of a path in words ('File name too long', 'Too many levels of symbolic links')."""
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


class PathProblem(ConfigError):
    """A path the OS refuses (ENAMETOOLONG, ELOOP, ...): `<key>: <path>: <what the OS said>`."""


def path_problem(key: str, value: object) -> ConfigError | None:
    """A path key whose value the OS refuses as a path (a name too long, a symlink loop, ...): the
    one line naming the key, before anything reads or writes there."""
    if value is None or value == "":
        return None
    try:
        absolute(str(value)).exists()
    except OSError as e:
        return PathProblem(key, f"{value}: {os_error_text(e)}")
    return None


def run_dir(cfg: Config) -> Path:
    err = run_name_error(cfg.run.name)
    if err is not None:
        raise err
    return absolute(cfg.run.root) / cfg.run.name


def checkpoint_dirs(cfg: Config, run_dir: Path) -> Path:
    return absolute(cfg.checkpointing.dir) if cfg.checkpointing.dir else run_dir / CHECKPOINTS


def model_dir(cfg: Config) -> Path:
    """`model.path`, or a built-in tiny model built once under `<run.root>/models/<recipe>`
    (shared by the runs of that root, on the shared filesystem)."""
    if cfg.model.path:
        return absolute(cfg.model.path)
    return absolute(cfg.run.root) / "models" / str(cfg.model.builtin)


def actor_log(actor_logs: str | Path, pid: int, host: str | None = None) -> str:
    """The log file of the Ray worker process `pid` on `host` (default: this one), in RUN/logs/actors/."""
    import socket

    return str(Path(actor_logs) / f"{host or socket.gethostname()}-pid{pid}.log")


STEP = re.compile(r"^step_(\d+)$")   # a checkpoint's folder


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `step_N` folders under `root` (complete or not), oldest first; cheap: nothing is read."""
    return sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                  if (m := STEP.match(p.name)) and p.is_dir())


def resume_path(spec: str, root: Path) -> Path | None:
    """The folder `+resume=spec` names: `latest` the newest `step_N` under `root` (None when there is
    none; whether it is complete is the checkpoint's own check), `step_N` that one, else a path."""
    if spec == "latest":
        saved = step_dirs(root)
        return saved[-1][1] if saved else None
    return root / spec if STEP.match(spec) else absolute(spec)


def resume_spec(spec: str | None) -> str | None:
    """`+resume`: `latest` and `step_N` as they are, a path made absolute."""
    if spec is None or RESUME_WORDS.match(str(spec)):
        return spec
    return str(absolute(str(spec)))


def absolute_config(cfg) -> None:
    """Rewrite, in place, every path of a composed config (DictConfig or Config) as an absolute path."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(cfg, section), name, str(absolute(value)))
    if getattr(cfg, "resume", None) is not None:
        cfg.resume = resume_spec(cfg.resume)
