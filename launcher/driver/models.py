"""The run's base model on disk: `model.path`, or the built-in tiny recipe, built first if missing."""

from __future__ import annotations

from pathlib import Path

from launcher import files
from launcher.config.schema import Config
from launcher.paths import model_dir


def ensure(cfg: Config) -> Path:
    """The model directory, building the built-in recipe first if needed (imports torch)."""
    path = model_dir(cfg)
    if cfg.model.path is None:
        from workers import tiny_models

        new = not path.exists()
        tiny_models.build(path, str(cfg.model.builtin))
        if new:  # under run.root: the policy of the run that built it (launcher.files)
            files.seal(path, files.Policy.of(cfg))
    return path
