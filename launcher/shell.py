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

import shlex


def command(*words: object) -> str:
    """The words as one shell command line, each quoted exactly once."""
    return shlex.join(str(w) for w in words)


def assignment(name: str, value: object) -> str:
    """`NAME=value` for an environment variable, the value quoted."""
    return f"{name}={shlex.quote(str(value))}"
