"""Every command the launcher prints or writes for a person to paste: built from quoted words.

A printed command holds paths (run.root may hold spaces, `$`, quotes), names read from files (a
checkpoint's run.name, a job id from submissions.jsonl) and values from the config. Pasted into a
shell as the README says, an unquoted word is split or expanded there: a forged name would run a
command. So a command is built here from its words, each quoted for a POSIX shell (shlex), and
never by formatting a string; names that come from files pass the run-name rule where they are
read (launcher.records.load_config, launcher.export). tests/unit/test_printed_commands.py pastes
each command the launcher prints into bash (its programs replaced by a recorder) and requires the
words it meant and nothing else run.
"""

from __future__ import annotations

import re
import shlex


def command(*words: object) -> str:
    """The words as one shell command line, each quoted exactly once."""
    return shlex.join(str(w) for w in words)


def assignment(name: str, value: object) -> str:
    """`NAME=value` for an environment variable, the value quoted."""
    return f"{name}={shlex.quote(str(value))}"


_PLAIN = re.compile(r"^[A-Za-z0-9_./+-]+$")
_BEFORE_QUOTE = re.compile(r"(\\+)(?='|$)")   # backslashes Hydra reads as escapes: before a quote or at the end
_INTERPOLATION = re.compile(r"(\\*)\$\{")      # `${` and the backslashes right before it


def literal(text: str) -> str:
    """`text` as an OmegaConf string value that resolves to `text` itself, never to an interpolation.

    OmegaConf reads a string holding `${` with its grammar, and there only a `${` and the backslashes
    right before it are special: n backslashes then `${` are written as 2n+1 backslashes then `${`
    (`${x}` -> `\\${x}`, `a\\${x}` -> `a\\\\\\${x}`); every other character, backslashes included, reads as
    itself. A string without `${` is never parsed: it is its own literal. Used wherever a resolved
    value goes back into a config (launcher.config.compose.compose, launcher.records.load_config)
    and by `override` below."""
    return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", text) if "${" in text else text


def literal_tree(obj: object) -> object:
    """A plain (resolved) container with every string made `literal`: `OmegaConf.create` of it holds
    the same values, where `OmegaConf.create` of `obj` itself would resolve each `${...}` again."""
    if isinstance(obj, str):
        return literal(obj)
    if isinstance(obj, dict):
        return {k: literal_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [literal_tree(v) for v in obj]
    return obj


def printable(text: str) -> str:
    """`text` with every character a terminal line cannot show as itself (a newline, \\x0b, \\x85, a lone
    surrogate \\udcff) written as its escape: a value echoed in a message stays on its line and shows what
    it holds."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def override(key: str, value: object) -> str:
    """`key=value` as a Hydra override to paste onto a command line: one shell word. A value that is
    not a plain word (or reads as null, a boolean or a number) is made `literal` for OmegaConf first
    (its `${` escaped, with the backslashes before them), then put in Hydra's single quotes, its
    quotes and the backslashes before them or at its end doubled, so Hydra's parser and then
    OmegaConf's resolution give back the value itself (tests/unit/test_override_round_trip.py). A
    hint that names a value read from a file (a run's checkpointing.dir) is built here."""
    if value is None:
        return shlex.quote(f"{key}=null")
    text = str(value)
    if not _PLAIN.match(text) or text.lower() in ("null", "true", "false") or _number(text):
        text = _BEFORE_QUOTE.sub(lambda m: m.group(1) * 2, literal(text)).replace("'", "\\'")
        text = f"'{text}'"
    return shlex.quote(f"{key}={text}")


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
