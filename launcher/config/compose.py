"""Compose the Hydra config from conf/ and the command line; save and reload resolved configs.

We use Hydra's compose API rather than @hydra.main: the launcher keeps control of the working
directory, of its own output and of error messages (a user's typo gets one line naming the key,
never a Hydra traceback). Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import Container, DictConfig, OmegaConf

from launcher.config import model_facts
from launcher.config.schema import Config, ConfigError, expected

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("topology", "model", "peft", "grpo", "data", "reward", "env", "optim", "refit", "checkpointing", "slurm")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose(overrides: list[str], notes: list[str] | None = None) -> DictConfig:
    """Compose conf/config.yaml with `overrides`, resolve the model's facts (model_facts.apply: before
    the interpolations, so `run.name`'s default names the checkpoint), resolve every interpolation;
    raise ConfigError. The facts' notes (a conf number the checkpoint contradicts) go to `notes`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    for o in overrides:
        _check_group_choice(o)
    parse_overrides(overrides)  # an override Hydra cannot parse: one line naming it
    _register_schema_sections()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="launcher"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except OverrideParseException:
        raise ConfigError("overrides", "cannot parse them (expected key=value; quote values with special "
                                       "characters: key='a b')") from None
    except (ValueError, OverflowError) as e:  # a number too large for its field's type (int -> float)
        import re

        named = re.search(r"full_key: (\S+)", str(e))  # OmegaConf re-raises others' errors with it in the text
        key = named.group(1) if named else _override_of(e, overrides)
        raise ConfigError(str(key), f"a number too large for this key ({_first_line(e)})") from None
    except MissingConfigException as e:
        raise ConfigError("config", _first_line(e)) from None
    except HydraException as e:
        cause = e.__cause__
        if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):  # a schema section's type
            raise ConfigError(str(cause.full_key), expected(str(cause.full_key), cause.value)) from None
        raise ConfigError(_override_of(e, overrides), _hydra_message(e)) from None
    except OmegaConfBaseException as e:
        raise ConfigError(_key_of(e, overrides, "config"), _first_line(e)) from None
    explicit = {o.partition("=")[0].lstrip("+~") for o in overrides}
    try:
        found = model_facts.apply(cfg, explicit)
    except OmegaConfBaseException as e:  # an interpolation in the model section that cannot resolve
        raise ConfigError(_key_of(e, overrides, "model"), _first_line(e)) from None
    except OSError as e:  # model.path is a path the OS refuses (a name too long, a symlink loop)
        raise ConfigError("model.path", f"{e.filename or cfg.model.path}: {e.strerror or e}") from None
    if notes is not None:
        notes.extend(found)
    try:
        resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_key_of(e, overrides, "config"), _first_line(e)) from None
    if cfg.env.fn is not None and not explicit & {"reward", "reward.fn"}:
        cfg.reward.fn = None  # the default group's demo reward does not score an environment's episodes
    return cfg


def resolve(cfg: Container) -> None:
    """Every interpolation of `cfg` resolved in place, each string it gives stored as its
    shell.literal, so that reading the key (or to_yaml, to_container with resolve=True) gives that
    string once more and not a second resolution of it.

    OmegaConf.resolve stores the resolved string itself: `'\\${oc.env:HOME}'` (an escaped, literal
    `${`) became the value `${oc.env:HOME}`, which every later read resolved again (to `/root`), as
    did a key interpolating it (`${run.root}/x`), and `\\${y` did not parse at all once resolved.
    This is OmegaConf's own walk (omegaconf._impl._resolve) with that one difference."""
    from omegaconf import MISSING, ListConfig, ValueNode
    from omegaconf._utils import _get_value
    from omegaconf.errors import InterpolationToMissingValueError

    from launcher.shell import literal

    for key in range(len(cfg)) if isinstance(cfg, ListConfig) else list(cfg.keys()):
        node = cfg._get_child(key)
        if node._is_interpolation():
            try:
                found = node._dereference_node()
            except InterpolationToMissingValueError:
                node._set_value(MISSING)
                continue
            if isinstance(found, Container):
                resolve(found)
                if isinstance(node, ValueNode):
                    cfg[key] = found
                else:
                    node._set_value(_get_value(found))
            else:
                value = _get_value(found)
                node._set_value(literal(value) if isinstance(value, str) else value)
        elif isinstance(node, Container):
            resolve(node)


def _key_of(e: Exception, overrides: list[str], default: str) -> str:
    """The key an OmegaConf error is about: its full_key when OmegaConf knows it (it is None for an
    interpolation that fails while the whole config resolves), else the override that wrote the
    interpolation it names, else `default`."""
    key = getattr(e, "full_key", None)
    if key:
        return str(key)
    text = str(e)
    written = [o for o in overrides if "${" in o]
    named = [o for o in written if any(f"'{part}'" in text for part in _interpolations(o))]
    pick = named or written
    return pick[0].partition("=")[0].lstrip("+~") if pick else default


def _interpolations(override: str) -> list[str]:
    import re

    return re.findall(r"\$\{([^}]*)\}", override)


def _register_schema_sections() -> None:
    """conf/config.yaml's `schema/<section>@<section>` defaults: every section's keys, types and
    defaults, from the schema (the one place). A group's preset merges over its section and states
    only what it changes (tests/unit/test_defaults_once.py); run, vllm, ray, retry and logging
    (SCHEMA_SECTIONS) have no group, conf/config.yaml ties a few of their keys to others."""
    import dataclasses
    import typing

    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    hints = typing.get_type_hints(Config)
    sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])]
    if all(f"{name}.yaml" in store.repo.get("schema", {}) for name in sections):
        return  # stored by an earlier compose of this process (the store outlives GlobalHydra's clear)
    for name in sections:
        store.store(group="schema", name=name, node=hints[name])


def _check_group_choice(override: str) -> None:
    """`topology=foo` for a group that has no foo.yaml: say which options exist."""
    key, sep, value = override.partition("=")
    key = key.lstrip("+~")
    if sep and key in GROUPS and not (CONF_DIR / key / f"{value}.yaml").exists():
        raise ConfigError(key, f"no option {value!r}; available: {', '.join(group_options(key))}")


PARSE_HINT = "expected key=value; quote values with special characters: key='a b'"


def parse_overrides(overrides: list[str], hint: str = PARSE_HINT) -> list:
    """Hydra's parse of each override (its Override objects); ConfigError naming the first it cannot
    parse, a number of more digits than Python converts (4300) among them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from launcher.shell import printable

    parser = OverridesParser.create()
    out = []
    for o in overrides:
        try:
            out.extend(parser.parse_overrides([o]))
        except OverrideParseException:
            raise ConfigError(printable(o[:200]), f"cannot parse this override ({hint})") from None
        except ValueError as e:  # int("1" * 5000): Python's limit on the digits of a number
            raise ConfigError(o.partition("=")[0].lstrip("+~")[:200],
                              f"a number too long to read ({_first_line(e).split(';')[0]})") from None
    return out


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _override_of(e: Exception, overrides: list[str]) -> str:
    text = str(e)
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if f"'{key}'" in text or f"'{o}'" in text:
            return key
    return "overrides"


def _hydra_message(e: Exception) -> str:
    text = str(e)
    if ("Key '" in text and "is not in struct" in text) or "To append to your config use +" in text:
        return "unknown key (check the spelling, or use +key=value to add a new key)"
    if "Could not append to config. An item is already at" in text:
        return "already exists: drop the leading '+' to change it"
    if "Could not override" in text and "No match in the defaults list" in text:
        return "unknown config group"
    return _first_line(e)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def save(cfg: DictConfig, path: Path) -> None:
    """A resolved config as the run's config.yaml (launcher.files: atomic, the run directory's mode)."""
    from launcher import files

    files.write(path, to_yaml(cfg))


def load(path: Path) -> DictConfig:
    """A saved config.yaml (a run's or a checkpoint's), checked against the schema
    (launcher.records.load_config: safe YAML, types, ranges; one line naming the file and key)."""
    from launcher import records

    return records.load_config(Path(path))


def load_typed(path: Path) -> Config:
    """A saved config.yaml (a run's or a checkpoint's) as the typed Config."""
    from launcher import records

    return records.load_config(Path(path), typed=True)
