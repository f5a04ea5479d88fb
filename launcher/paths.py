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

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
RUN_NAME_RULE = ("one path component of letters, digits and . _ + - (starting with a letter or digit, "
                 "at most 128 characters)")
# the config keys that hold a path (the saved config has them absolute)
PATH_KEYS = ("run.root", "checkpointing.dir", "model.path")
RESUME_WORDS = re.compile(r"^(latest|step_\d+)$")


def dir_mode(cfg: Config) -> int:
    """The run directory's mode: private by default (0700), group-readable (0750) with
    run.shared_with_group=true. Everything in it (the job's logs, checkpoints, submitit's files)
    is reached only through it; the files the launcher writes get file_mode too. (Not a umask:
    a umask of 077 in the launcher's process breaks the local Ray cluster's token handshake.)"""
    return 0o750 if cfg.run.shared_with_group else 0o700


def file_mode(cfg: Config) -> int:
    return 0o640 if cfg.run.shared_with_group else 0o600


def run_name_error(name: object) -> ConfigError | None:
    if isinstance(name, str) and RUN_NAME.match(name) and name not in (".", ".."):
        return None
    return ConfigError("run.name", f"must be {RUN_NAME_RULE}; got {name!r}")


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
    """`~` expanded, made absolute against the current directory, symlinks resolved."""
    return Path(path).expanduser().resolve()


def run_dir(cfg: Config) -> Path:
    err = run_name_error(cfg.run.name)
    if err is not None:
        raise err
    return absolute(cfg.run.root) / cfg.run.name


def checkpoint_dirs(cfg: Config, run_dir: Path) -> Path:
    return absolute(cfg.checkpointing.dir) if cfg.checkpointing.dir else run_dir / "checkpoints"


def model_dir(cfg: Config) -> Path:
    """`model.path`, or a built-in tiny model built once under `<run.root>/models/<recipe>`
    (shared by the runs of that root, on the shared filesystem)."""
    if cfg.model.path:
        return absolute(cfg.model.path)
    return absolute(cfg.run.root) / "models" / str(cfg.model.builtin)


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
