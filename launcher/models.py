"""Where a run's base model lives: `model.path`, or a built-in tiny model built once under
`<run.root>/models/<recipe>` (shared by the runs of that root, on the shared filesystem)."""

from __future__ import annotations

from pathlib import Path

from launcher.schema import Config


def model_dir(cfg: Config) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path).expanduser().resolve()
    return (Path(cfg.run.root).expanduser() / "models" / str(cfg.model.builtin)).resolve()


def ensure(cfg: Config) -> Path:
    """The model directory, building the built-in recipe first if needed (imports torch)."""
    path = model_dir(cfg)
    if cfg.model.path is None:
        from workers import tiny_models

        tiny_models.build(path, str(cfg.model.builtin))
    return path
