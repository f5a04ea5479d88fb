"""The run's base model on disk: `model.path`, or the built-in tiny recipe, built first if missing."""

from __future__ import annotations

from pathlib import Path

from launcher.config.schema import Config
from launcher.paths import model_dir


def ensure(cfg: Config) -> Path:
    """The model directory, building the built-in recipe first if needed (imports torch)."""
    path = model_dir(cfg)
    if cfg.model.path is None:
        from workers import tiny_models

        tiny_models.build(path, str(cfg.model.builtin))
    return path
