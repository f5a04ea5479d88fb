"""The one wrapper every command of the launcher runs under, and its argument parser.

`python -m launcher` (and its sweep, `-m`), `python -m launcher.export`, `python -m launcher.status`
and `python -m launcher.stop` each parse their arguments and then check what they will read before
they do anything (the config and its files; a checkpoint and its records; a run or sweep directory
and its records): a user mistake found there is a `ConfigError` (a config key, an argument, or a
record's file and key: launcher.records.RecordError), or one of the command's own error types.
`run(main, argv, user_errors)` ends any of them the same way: one line `error: ...` on stderr and
exit code 2, no traceback; so does an OS error on a path that no check named first (a name too
long, a symlink loop: `<path>: <what the OS said>`). Ctrl-C is exit code 130 without a traceback,
and a reader that left (`... | head`) is not an error.

`Parser` is argparse whose mistakes (an unknown option, a missing or malformed value) are such a
one-line ConfigError naming the option, instead of argparse's usage block and exit code 2 of its own.
Every command's parser has `-q/--quiet` (warnings and errors only: no progress lines) and
`-v/--verbose` (debug lines too), applied to the launcher's loggers (launcher.logs) as it parses.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

from launcher.config.schema import ConfigError
from launcher.shell import printable


class UsageError(ConfigError):
    """A mistake in a command's arguments: `<option>: <what>; see <prog> --help`."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_verbosity(self)

    def parse_known_args(self, args=None, namespace=None):
        from launcher import logs

        parsed, rest = super().parse_known_args(args, namespace)
        logs.setup(getattr(parsed, "verbosity", 0))
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        key, sep, what = message.partition(": ")
        if not (sep and key.startswith(("-", "argument "))):
            key, what = self.prog, message
        raise UsageError(key.removeprefix("argument "), f"{what}; see {self.prog} --help")


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-q/--quiet and -v/--verbose, as `verbosity` -1 / 1 (default 0): launcher.logs.setup's levels."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=0,
                       help="only warnings and errors: no progress lines")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                       help="also debug lines (the Slurm and Ray commands run, ...)")


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"seconds (a number > 0), got {text!r}")
    return value


def one_line(e: BaseException | str) -> str:
    """An error's text on one line that shows every character it holds: its lines joined (a library's
    message of several lines), then each character a terminal line cannot show as itself written as
    its escape (a value echoed from the command line or a file: a control character, \\x85, a lone
    surrogate \\udcff)."""
    text = str(e).strip() or type(e).__name__
    return printable(" | ".join(line.strip() for line in text.splitlines() if line.strip()))


def error(e: BaseException | str) -> None:
    """The one way a command says a mistake: `error: <one line>` on stderr."""
    print(f"error: {one_line(e)}", file=sys.stderr, flush=True)


def _not_text(argv: Sequence[str]) -> None:
    """An argument that is not UTF-8 text (a byte the locale could not decode reaches Python as a lone
    surrogate) is refused before anything reads it: it could be neither written to a file nor printed."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            key = arg.partition("=")[0] if "=" in arg else "argument"
            raise ConfigError(printable(key), f"not UTF-8 text (character {e.start + 1} of '{printable(arg)[:80]}': "
                                              f"a byte the locale could not decode)") from None


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None,
        user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """`main(argv)`, with every user mistake one line and exit code 2. Whatever the command prints
    shows a character it cannot encode as its escape instead of ending in a traceback."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        _not_text(sys.argv[1:] if argv is None else argv)
        return main(argv)
    except (ConfigError, *user_errors) as e:
        error(e)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # the reader of stdout left (`| head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a path the OS refuses (a name too long, a symlink loop) that no check named first
        if e.filename is None:
            raise
        error(f"{e.filename}: {e.strerror or e}")
        return 2
    except RuntimeError as e:  # Python 3.11's Path.resolve() on a symlink loop
        if "Symlink loop" not in str(e):
            raise
        error(f"{str(e).split(' from ', 1)[-1].strip(chr(39))}: a symlink loop")
        return 2
