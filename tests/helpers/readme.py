"""The commands README.md prints, read from README.md itself (so a test runs what a user reads).

A command is a line of an indented block that starts with a program a user runs here (`python`,
`.venv/bin/python`, `vllm`, `sbatch`, `pip`, `scripts/install.sh`), its `\\` continuation lines
joined, its trailing `# comment` dropped; or inline code `python -m MODULE ARGS...` in the prose.
`block_after(text, name)` is the indented block that follows the prose naming `name` (the example
files README.md shows: `train.jsonl`, `my_reward.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
PROGRAMS = ("python ", ".venv/bin/python ", "vllm ", "sbatch ", "pip ", "scripts/install.sh")
_COMMENT = re.compile(r"\s{2,}#.*$|^#.*$")
_INLINE = re.compile(r"`((?:\.venv/bin/)?python -m \S+ [^`]+)`")


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """(the prose line before it, its lines without the indent) for every indented block."""
    out, prose, current = [], "", None
    for line in text.splitlines():
        if line.startswith("    ") and (current is not None or not line.strip().startswith("-")):
            if current is None:
                current = (prose, [])
                out.append(current)
            current[1].append(line[4:])
        else:
            if line.strip():
                prose, current = line, None
            elif current is not None:
                current[1].append("")
    return out


def commands(text: str | None = None) -> list[str]:
    text = README.read_text() if text is None else text
    found = []
    for _, lines in _blocks(text):
        joined, pending = [], ""
        for line in lines:
            if pending:
                line = pending + " " + line.strip()
                pending = ""
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1].rstrip()
                continue
            joined.append(line)
        for line in joined:
            cmd = _COMMENT.sub("", line).strip()
            if cmd.startswith(PROGRAMS):
                found.append(" ".join(cmd.split()))
    for line in text.splitlines():
        if not line.startswith("    "):
            found += [" ".join(m.split()) for m in _INLINE.findall(line)]
    return list(dict.fromkeys(found))


def block_after(name: str, text: str | None = None) -> str:
    """The indented block right after the prose line that names `name` in backticks."""
    text = README.read_text() if text is None else text
    for prose, lines in _blocks(text):
        if f"`{name}`" in prose:
            return "\n".join(lines).strip("\n") + "\n"
    raise AssertionError(f"README.md shows no block after a line naming `{name}`")
