"""An override the launcher prints for a person to paste reads back as the value it names, whatever
the value holds (launcher/shell.py: `literal`, `override`; launcher/config/compose.py: `resolve`;
launcher/records.py: `load_config`).

A run whose checkpoint folder is `/data/ck-${oc.env:HOME}` was told to continue with
`checkpointing.dir='/data/ck-\\${oc.env:HOME}'`, which came back as `/data/ck-/root`: compose resolved
the config in place with OmegaConf.resolve, which stores the resolved string itself, so the escaped
`${` became an interpolation that every later read resolved again. Here generated names (random mixes
of `$`, `{`, `}`, backslashes, quotes, spaces, `=`, `,`, unicode, `${...}` interpolations, `\\${` and a
trailing backslash) are printed as overrides, pasted into bash, parsed and composed as the launcher
does (launcher.config.compose.compose: Hydra's override parser, Hydra's compose, the resolution) and
read back: exactly the name, in the composed config, in another key interpolating it, in the YAML a
run's config.yaml holds and in the config read back from that file.
"""

from __future__ import annotations

import random
import shlex
import subprocess

import pytest
import yaml
from omegaconf import OmegaConf

from launcher import records, shell
from launcher.config import compose as config_mod

SEED = 45
ATOMS = ["$", "{", "}", "\\", "'", '"', " ", "=", ",", "é", "雪", "🙂", "${oc.env:HOME}", "${run.name}", "${x}",
         "\\${", "\\\\${", "${", "a", "/", ":", "(", ")", "[", "]", "\t", "null", "1e3", "~", "@", "#"]
# the cases, and what broke before: a `${` after backslashes, an unclosed one, a trailing backslash
NAMED = ["/data/ck-${oc.env:HOME}", "/data/ck\\", "/data/\\${oc.env:HOME}", "/x/${y", "it's a \\' \\", "${",
         "\\\\${x}\\\\", "a b,c=d", "true", "8", "", "/data/ck-$HOME/{a}"]


def names(n: int, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 10)))
        out.append(name + "\\" * rng.choice([0, 0, 1, 2, 3]))
    return out


def pasted(commands: list[str]) -> list[str]:
    """The words bash gives a program when these are pasted as its arguments."""
    p = subprocess.run(["bash", "-c", "printf '%s\\0' " + " ".join(commands)], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.decode().split("\0")[:-1]


def test_a_literal_resolves_to_itself():
    """shell.literal(s) in a config is s: read, interpolated by another key, whole or inside a string."""
    for s in NAMED + names(800):
        cfg = OmegaConf.create({"v": shell.literal(s), "ref": "${v}", "inside": "<${v}>"})
        assert (cfg.v, cfg.ref, cfg.inside) == (s, s, f"<{s}>"), s


def test_resolving_in_place_keeps_a_resolved_value_literal():
    """compose.resolve: a key read after the resolution gives its value once, not resolved again,
    whether another key interpolating it was resolved before or after it."""
    for s in NAMED + names(100):
        cfg = OmegaConf.create({"a": {"before": "${b.v}"}, "b": {"v": shell.literal(s), "n": 3},
                                "c": {"after": "${b.v}/x", "n": "${b.n}"}})
        config_mod.resolve(cfg)
        assert (cfg.a.before, cfg.b.v, cfg.c.after, cfg.c.n) == (s, s, f"{s}/x", 3), s
        assert yaml.safe_load(config_mod.to_yaml(cfg)) == {"a": {"before": s}, "b": {"v": s, "n": 3},
                                                           "c": {"after": f"{s}/x", "n": 3}}, s


def test_a_printed_override_pastes_back_to_the_value():
    values = NAMED + names(150)
    keys = ["checkpointing.dir"] + [f"+probe.v{i}" for i in range(1, len(values))]
    printed = [shell.override(k, v) for k, v in zip(keys, values)]
    words = pasted(printed)
    assert words == [w for p in printed for w in shlex.split(p)] and len(words) == len(values)  # one word each
    parsed = config_mod.parse_overrides(words)   # Hydra's override parser, as the launcher parses its command line
    assert [o.get_key_element() for o in parsed] == keys
    # a key added before the values and one after, each interpolating one of them
    cfg = config_mod.compose(["+aaa.before=${probe.v3}", *words, "+zzz.after=${checkpointing.dir}"])
    got = [cfg.checkpointing.dir] + [cfg.probe[f"v{i}"] for i in range(1, len(values))]
    assert got == values
    assert (cfg.aaa.before, cfg.zzz.after) == (values[3], values[0])
    saved = yaml.safe_load(config_mod.to_yaml(cfg))   # what a config.yaml of this config holds
    assert [saved["checkpointing"]["dir"]] + [saved["probe"][f"v{i}"] for i in range(1, len(values))] == values
    assert cfg.checkpointing.dir == "/data/ck-${oc.env:HOME}"


def test_a_saved_config_reads_back_its_values(tmp_path):
    """config.yaml holds the resolved values as text; records.load_config reads them as text, not as
    interpolations to resolve a second time."""
    values = [v for v in NAMED + names(6, seed=SEED + 1) if v and paths_ok(v)][:6]
    for i in range(0, len(values), 2):
        ckpt, root = values[i], values[i + 1]
        words = shlex.split(shell.override("checkpointing.dir", ckpt)) + shlex.split(shell.override("run.root", root))
        config_mod.save(config_mod.compose(words), tmp_path / f"{i}.yaml")
        back = records.load_config(tmp_path / f"{i}.yaml")
        typed = records.load_config(tmp_path / f"{i}.yaml", typed=True)
        assert (back.checkpointing.dir, back.run.root) == (ckpt, root)
        assert (typed.checkpointing.dir, typed.run.root) == (ckpt, root)


def paths_ok(value: str) -> bool:
    from launcher import paths

    return paths.path_error("checkpointing.dir", value) is None


def test_the_run_directorys_config_keeps_the_value(tmp_path):
    from launcher.job import run_dir as run_dir_mod

    raw = config_mod.compose(shlex.split(shell.override("checkpointing.dir", "/data/ck-${oc.env:HOME}")))
    assert run_dir_mod.resolved(raw, tmp_path / "r").checkpointing.dir == "/data/ck-${oc.env:HOME}"
