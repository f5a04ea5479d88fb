"""Each default said once: a preset in conf/<group>/*.yaml states only what it changes.

The schema (launcher.config.schema, `knob(default, check, doc)` on every field) holds each key's
default and its doc; Hydra takes a group's section from there first (conf/config.yaml's
`schema/<section>@<section>` entries, registered by launcher.config.compose) and merges the chosen
preset over it. A preset that writes a value equal to the schema's default, or a comment that says
again what the field's doc says, is a second copy that silently wins when the default changes.

What is not a restatement, by mechanism rather than by name:
- an interpolation (`${topology.gpus_per_node}`): a tie between keys, not a value;
- a preset with no value left (conf/slurm/default.yaml): Hydra needs the file the defaults list
  names, and a preset equal to the schema's defaults is one a topology may still choose by name;
- a comment about the value itself (where a number comes from, what it gives in this preset): it
  says something the doc does not (the test measures that by words, below);
- conf/config.yaml's root keys (dry_run, submit): Hydra's root has no schema node, so a root key is
  declared there for `dry_run=true` to need no `+` (its sections hold only interpolations:
  tests/unit/test_config_validation.py). Its comments are checked here with the presets'.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from launcher.config import fields
from launcher.config.compose import CONF_DIR, GROUPS
from launcher.config.schema import Config

LEAVES = {leaf.key: leaf for leaf in fields.leaves(Config)}
SECTIONS = fields.section_docs(Config)
HYDRA_KEYS = ("defaults",)     # Hydra's own entry in a preset, not a value of the section


@dataclass(frozen=True)
class Setting:
    file: Path
    line: int                  # 1-based
    key: str                   # dotted: grpo.loss.ratio_clip_min
    value: object

    def where(self) -> str:
        return f"{self.file.parent.parent.name}/{self.file.parent.name}/{self.file.name}:{self.line}: {self.key}"


def settings(path: Path, section: str) -> list[Setting]:
    """Every leaf value the preset `path` sets in `section` (nested sections walked), with its line.
    Values as OmegaConf reads them (1.0e-5 a float), interpolations unresolved."""
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    node = yaml.compose(path.read_text())
    out: list[Setting] = []

    def walk(mapping: yaml.MappingNode | None, data: dict, prefix: str) -> None:
        for key_node, value_node in (mapping.value if mapping is not None else []):
            name = key_node.value
            if name in HYDRA_KEYS and prefix == f"{section}.":
                continue
            key = prefix + name
            if key in SECTIONS and isinstance(value_node, yaml.MappingNode):
                walk(value_node, data[name], key + ".")
            else:
                out.append(Setting(path, key_node.start_mark.line + 1, key, data[name]))

    walk(node if isinstance(node, yaml.MappingNode) else None, values, f"{section}.")
    return out


def same(value: object, default: object) -> bool:
    """A yaml value equal to the schema default: 32 and 32.0 are, true and 1 are not."""
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    return value == default


def interpolation(value: object) -> bool:
    return isinstance(value, str) and value.startswith("${")


def restated_values(conf: Path) -> list[str]:
    """file:line: key for every preset value equal to the schema's default, and for every key the
    schema lacks (Hydra refuses it too; named here so that no value escapes the check unseen)."""
    found = []
    for group in GROUPS:
        for path in sorted((conf / group).glob("*.yaml")):
            for s in settings(path, group):
                leaf = LEAVES.get(s.key)
                if leaf is None:
                    found.append(f"{s.where()} is not a key of the schema")
                elif not interpolation(s.value) and same(s.value, leaf.default):
                    found.append(f"{s.where()} = {s.value!r} is the schema's default")
    return found


# ------------------------------------------------------------------------ comments that restate a doc
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w]*)\s*:(.*)$")
WORD = re.compile(r"[a-z0-9_+\-]+")
STOP = frozenset("a an the of to and or in on at by for is are be it its this that with from as per no not "
                 "one each every when else only null true false".split())


def words(text: str) -> set[str]:
    """Content words: lower case, split on anything but letters, digits, _ + -, without the stop words;
    a key's parts (micro_batch_size) count as words too."""
    out = set()
    for w in WORD.findall(text.lower()):
        w = w.strip("+-")
        if w and w not in STOP and not (len(w) == 1 and w.isalpha()):
            out.add(w)
            out.update(p for p in w.split("_") if p and p not in STOP)
    return out


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a yaml line: the comment starts at a # at the line's start or after a space,
    outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i], line[i + 1:].strip()
    return line, ""


def key_comments(path: Path, section: str) -> list[tuple[int, str, str]]:
    """(line, dotted key, comment) for each comment that belongs to a key: on its line, the comment
    lines right above it (no blank line between), and comment-only lines right below it indented
    past the key (a continued comment). A comment before the first key of the file speaks of the
    preset as a whole and belongs to no key."""
    lines = path.read_text().splitlines()
    out: list[tuple[int, str, str]] = []
    stack: list[tuple[int, str]] = []     # (indent, name) of the keys enclosing the current line
    above: list[str] = []                 # the comment lines since the last key or blank line
    seen_key = False
    last: tuple[int, str, int] | None = None   # (line, key, indent of its key) of the last key line
    for number, text in enumerate(lines, 1):
        code, comment = split_comment(text)
        if not code.strip():
            if not comment:
                above, last = [], None
            elif last and len(text) - len(text.lstrip()) > last[2]:
                out.append((number, last[1], comment))      # a continued comment below its key
            elif seen_key:
                above.append(comment)
            continue
        m = KEY_LINE.match(code)
        if not m:
            above, last = [], None
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, name))
        key = ".".join(([section] if section else []) + [n for _, n in stack])
        for c in above:
            out.append((number, key, c))
        if comment:
            out.append((number, key, comment))
        above, last, seen_key = [], (number, key, indent), True
    return out


def schema_words(key: str) -> set[str]:
    """What the schema already says of `key`: its doc, what it allows, its checks' own words, its
    default, its name, and the docs of its section's other keys that speak of it (`max_lag: 1  # the
    rollout of step N comes from the weights after step N-1-max_lag` repeats grpo.pipeline.enabled's
    doc); for a section, its doc line."""
    leaf = LEAVES.get(key)
    if leaf is None:
        return words(SECTIONS.get(key, "")) | words(key.replace(".", " "))
    checks = getattr(leaf.check, "checks", (leaf.check,))
    says = " ".join(getattr(c, "say", None) or "" for c in checks)   # a check's own words ('must be 1.0 ...')
    section, _, name = key.rpartition(".")
    neighbours = " ".join(x.doc for x in LEAVES.values() if x.key.rpartition(".")[0] == section and name in x.doc)
    return (words(leaf.doc) | words(fields.allowed(leaf)) | words(says) | words(str(leaf.default))
            | words(key.replace(".", " ")) | words(neighbours))


def restates(comment: str, key: str) -> bool:
    """A comment restates the schema when at least half of its content words (and two or more)
    are already in what the schema says of its key."""
    said = words(comment)
    return len(said) >= 2 and len(said & schema_words(key)) * 2 >= len(said)


def restated_docs(conf: Path) -> list[str]:
    """file:line: key for every comment (the lines that belong to one key taken together) that says
    again what the schema says of the key; conf/config.yaml's comments too."""
    found = []
    files = [(conf / "config.yaml", "")] + [(p, g) for g in GROUPS for p in sorted((conf / g).glob("*.yaml"))]
    for path, section in files:
        said: dict[str, tuple[int, list[str]]] = {}
        for line, key, comment in key_comments(path, section):
            said.setdefault(key, (line, []))[1].append(comment)
        for key, (line, comments) in said.items():
            text = " ".join(comments)
            if restates(text, key):
                found.append(f"{conf.name}/{path.relative_to(conf)}:{line}: {key}: '# {text}' restates the schema")
    return found


# ------------------------------------------------------------------------------------------ the tests
def test_no_preset_states_a_schema_default():
    assert restated_values(CONF_DIR) == []


def test_no_comment_in_conf_restates_the_schema():
    assert restated_docs(CONF_DIR) == []


def test_a_restated_default_or_doc_is_caught(tmp_path):
    """A copy of conf/ with defaults and docs planted back fails both checks, each named by file,
    line and key; what is not a restatement stays unflagged (an interpolation, a value that differs,
    a comment about where a value comes from)."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    doc = LEAVES["topology.train.micro_batch_size"].doc
    lag = "the rollout of step N comes from the weights after step N-1-max_lag"   # grpo.pipeline.enabled's doc
    slurm_3n = conf / "topology" / "slurm_3n.yaml"
    slurm_3n.write_text(slurm_3n.read_text().replace(
        "train:\n", f"train:\n  micro_batch_size: 0        # {doc}\n  ranks_per_node: ${{topology.nodes}}\n"))
    (conf / "grpo" / "ultra.yaml").write_text((conf / "grpo" / "ultra.yaml").read_text()
                                              + f"pipeline:\n  max_lag: 1  # {lag}\n  enabled: true\n")
    (conf / "peft" / "none.yaml").write_text((conf / "peft" / "none.yaml").read_text() + "lora_dtype: null\n")
    (conf / "peft" / "lora_all_linear.yaml").write_text(
        (conf / "peft" / "lora_all_linear.yaml").read_text() + "alpha: 32   # 32 = 2 x dim, the Bridge's recipe\n")
    (conf / "checkpointing" / "ultra.yaml").write_text("higher_is_better: 1\n")   # an int is not the bool true
    line = slurm_3n.read_text().splitlines().index(f"  micro_batch_size: 0        # {doc}") + 1
    grpo = (conf / "grpo" / "ultra.yaml").read_text().splitlines()
    assert restated_values(conf) == [
        f"conf/topology/slurm_3n.yaml:{line}: topology.train.micro_batch_size = 0 is the schema's default",
        f"conf/peft/lora_all_linear.yaml:3: peft.alpha = 32 is the schema's default",
        "conf/peft/none.yaml:6: peft.lora_dtype = None is the schema's default",
        f"conf/grpo/ultra.yaml:{grpo.index(f'  max_lag: 1  # {lag}') + 1}: grpo.pipeline.max_lag = 1 is the "
        "schema's default",
    ]
    assert restated_docs(conf) == [
        f"conf/topology/slurm_3n.yaml:{line}: topology.train.micro_batch_size: '# {doc}' restates the schema",
        f"conf/grpo/ultra.yaml:{grpo.index(f'  max_lag: 1  # {lag}') + 1}: grpo.pipeline.max_lag: '# {lag}' "
        "restates the schema",
    ]


def test_a_preset_wins_over_the_schema():
    """The schema's sections come first in conf/config.yaml's defaults list and the chosen presets
    merge over them: the reference case composes to every value its presets state (the model's
    facts aside: launcher.config.model_facts resolves those after composing)."""
    from launcher.config.compose import compose

    cfg = OmegaConf.to_container(compose(["topology=ultra_6n4g", "refit=adapter"]))

    def at(key: str) -> object:
        value = cfg
        for part in key.split("."):
            value = value[part]
        return value

    chosen = {"topology": "ultra_6n4g", "peft": "ultra_attention", "grpo": "ultra", "data": "math_add",
              "reward": "math_answer", "optim": "adam_constant", "refit": "adapter", "checkpointing": "ultra",
              "slurm": "default"}
    stated = [s for group, name in chosen.items() for s in settings(CONF_DIR / group / f"{name}.yaml", group)]
    assert len(stated) >= 20
    for s in stated:   # an interpolation (${topology.gpus_per_node}): the value of the key it names
        assert at(s.key) == (at(s.value[2:-1]) if interpolation(s.value) else s.value), s.where()
