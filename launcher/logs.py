"""The launcher's progress and status lines, through `logging`: one place for their format.

Every package logs through its own named logger (`launcher` for the commands, `launcher.job`,
`launcher.cluster`, `launcher.driver`, ...: `logs.get(__name__)`), all below the `launcher` logger,
which has one handler: stdout, where the lines always went (the driver's log of a Slurm job is task
0's stdout; tests and users read it there). A line reads `[launcher HH:MM:SS] message`; a line
logged with `PLAIN` (a step's progress line, a table, a command's own progress) is the message
alone. The handler looks up `sys.stdout` when it writes, so a redirected or captured stdout gets
the lines, and it flushes each line, so a line is in the log when the event it names happens.

`setup(verbosity)` is the commands' `--quiet` (-1: warnings and errors only) and `-v` (1: debug
lines too); without it the level is INFO. The `launcher` logger does not propagate: a library that
configures the root logger (megatron does at import) neither doubles nor reformats these lines.
"""

from __future__ import annotations

import logging
import sys

ROOT = "launcher"
LINE = "[launcher %(asctime)s] %(message)s"
CLOCK = "%H:%M:%S"
PLAIN = {"plain": True}   # extra= of a line without the prefix
LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "plain", False):
            return record.getMessage()
        return super().format(record)


class _Stdout(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stdout` is when a line is written."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it
        pass


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stdout) for h in root.handlers):
        handler = _Stdout()
        handler.setFormatter(_Format(LINE, CLOCK))
        root.addHandler(handler)
        root.setLevel(LEVELS[0])
        root.propagate = False
    return root


def get(name: str) -> logging.Logger:
    """The logger of the package that `name` (a module's __name__) belongs to: `launcher.driver`
    for launcher.driver.grpo, `launcher` for launcher.status, ..."""
    _root()
    parts = name.split(".")
    if parts[0] != ROOT:
        return logging.getLogger(ROOT)
    return logging.getLogger(".".join(parts[:2]) if len(parts) > 2 else ROOT)


def setup(verbosity: int = 0) -> None:
    """The level of every launcher line: -1 (--quiet) warnings and errors, 0 progress, 1 (-v) debug."""
    _root().setLevel(LEVELS[max(-1, min(1, verbosity))])
