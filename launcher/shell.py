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


def override(key: str, value: object) -> str:
    """`key=value` as a Hydra override to paste onto a command line: one shell word. A value that is
    not a plain word (or reads as null, a boolean or a number) is put in Hydra's single quotes, its
    quotes, the backslashes before them and `${` escaped, so Hydra and OmegaConf give back the value
    itself. A hint that names a value read from a file (a run's checkpointing.dir) is built here."""
    if value is None:
        return shlex.quote(f"{key}=null")
    text = str(value)
    if not _PLAIN.match(text) or text.lower() in ("null", "true", "false") or _number(text):
        text = _BEFORE_QUOTE.sub(lambda m: m.group(1) * 2, text).replace("'", "\\'").replace("${", "\\${")
        text = f"'{text}'"
    return shlex.quote(f"{key}={text}")


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
