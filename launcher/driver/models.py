"""The run's base model on disk: `model.path`, or the built-in tiny recipe, built first if missing,
checked against the run's model facts (resolved at submission, saved in config.yaml)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from launcher import files
from launcher.config import model_facts
from launcher.config.schema import Config, ConfigError
from launcher.paths import model_dir


def ensure(cfg: Config) -> Path:
    """The model directory, building the built-in recipe first if needed (imports torch).

    Raises ConfigError when the checkpoint no longer says what the run's facts say (it changed
    after submission): the trainer and vLLM both load it, so neither would be the run's model."""
    path = model_dir(cfg)
    if cfg.model.path is None:
        from workers import tiny_models

        new = not path.exists()
        tiny_models.build(path, str(cfg.model.builtin))
        if new:  # under run.root: the policy of the run that built it (launcher.files)
            files.seal(path, files.Policy.of(cfg))
    expected = model_facts.of_section(asdict(cfg.model))
    if expected is not None:
        found, _ = model_facts.read(path)
        differ = model_facts.differences(expected, found)
        if differ:
            raise ConfigError("model.path", f"{path}/config.json no longer says what the run's config.yaml "
                                            f"({cfg.model.facts_from}) says: {'; '.join(differ)} (the checkpoint "
                                            f"changed since submission: submit again)")
    return path
