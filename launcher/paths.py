"""Every path of a run that more than one part of the job needs, derived from the config alone.

The launcher (job/run_dir.py writes the run directory), the cluster bootstrap (resume after a
requeue), the driver (checkpoints, the base model) and the exporter all read them from here, so
the run directory, its checkpoint folder and the base model's folder are defined once.
"""

from __future__ import annotations

from pathlib import Path

from launcher.config.schema import Config


def run_dir(cfg: Config) -> Path:
    return (Path(cfg.run.root).expanduser() / cfg.run.name).resolve()


def checkpoint_dirs(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpointing.dir).resolve() if cfg.checkpointing.dir else run_dir / "checkpoints"


def model_dir(cfg: Config) -> Path:
    """`model.path`, or a built-in tiny model built once under `<run.root>/models/<recipe>`
    (shared by the runs of that root, on the shared filesystem)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser().resolve()
    return (Path(cfg.run.root).expanduser() / "models" / str(cfg.model.builtin)).resolve()
