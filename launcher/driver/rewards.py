"""Rewards: `fn(response: str, example: dict) -> float`, `example` holding every field of the record.

`reward.fn` is a built-in (below), `pkg.module:function`, or `path/to/file.py:function`. A file is
copied into `RUN/reward/` at submission and loaded from there, so a requeued job runs the same
code. The user's code cannot end the launcher or a reward worker: at submission it is imported in
a child process (`probe`: an import that exits, crashes or hangs is one line naming the file, and
the launcher goes on), and importing it and calling it catch every exception, `SystemExit`
included (Ctrl-C still interrupts). Calls run in `reward.workers` worker processes (launcher.driver.reward_pool)
with a per-call timeout; an exception, a timeout, or a result that is not a finite real number (a
string, an integer too large for a float, NaN) gives 0 for that sample with
`reward.on_error=zero` (counted, the first traceback in `RUN/logs/reward_errors.log`), or stops the
run with one line naming the record with `fail`.

Built-ins compare with the record's `data.answer_key` field:
- `say_number` / `math_answer`: the two demos' rewards (see launcher.driver.data).
- `math_verify`: HF math-verify called as verl (`reward_score/math_verify.py`) and NeMo RL (the
  math environment) call it: the reference answer, bare LaTeX as MATH-style sets write it
  (`2\\sqrt{3}`, `(1,3]`, `50\\%`) or a GSM8K-style number (`1,000`), is wrapped in `\\boxed{}` and
  read with the LaTeX extractor; the response with the expression and the LaTeX extractors (its
  `\\boxed{}` first). 1 when the two are mathematically equal. A reference answer math-verify
  cannot read is an error (scored 0 and counted, like any failed call), never a crash; a response
  without an answer it can read is 0.
- `exact_match`: 1 when the response equals the answer after normalisation (case, whitespace,
  surrounding punctuation).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from pathlib import Path
from typing import Callable

from launcher.config.schema import ConfigError, Reward

_INT = re.compile(r"-?\d+")


def say_number(response: str, target: list[int]) -> float:
    words = response.split()
    hits = sum(1 for w in words if _INT.fullmatch(w) and target[0] <= int(w) <= target[1])
    return hits / len(words) if words else 0.0


def math_answer(response: str, target: int) -> float:
    m = _INT.search(response)
    return 1.0 if m is not None and int(m.group()) == int(target) else 0.0


def _normalise(text: str) -> str:
    return " ".join(str(text).lower().split()).strip(" .,;:!?\"'`")


def exact_match(response: str, target) -> float:
    return 1.0 if _normalise(response) == _normalise(target) else 0.0


@functools.lru_cache(maxsize=1)
def _math_metric():
    import logging

    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a warning per unreadable response otherwise
    return math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                       pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))


def math_verify(response: str, target) -> float:
    from math_verify.errors import TimeoutException

    gold = "\\boxed{" + str(target) + "}"
    try:
        score, _ = _math_metric()([gold], [response])
    except TimeoutException:  # a BaseException: made an ordinary error the reward pool counts
        raise TimeoutError(f"math-verify timed out comparing with the answer {str(target)!r}") from None
    except ValueError as e:
        if "No gold targets found" in str(e):
            raise ValueError(f"math-verify cannot read the answer {str(target)!r}") from None
        raise
    return float(score)


BUILTIN = {"say_number": say_number, "math_answer": math_answer, "math_verify": math_verify,
           "exact_match": exact_match}


def _on_answer(fn: Callable, answer_key: str, response: str, example: dict) -> float:
    """A built-in as a reward: fn(response, example[answer_key])."""
    return fn(response, example[answer_key])


# ---------------------------------------------------------------------------- resolving reward.fn
def file_part(spec: str) -> Path | None:
    """The file of a `path/to/file.py:function` spec, else None."""
    path, sep, _ = spec.rpartition(":")
    return Path(path) if sep and path.endswith(".py") else None


def run_copy(run_dir: Path, spec: str, room: str | None = None) -> Path:
    """Where the job finds its copy of a file spec: RUN/<room>/<file name> (room: reward/ by default)."""
    from launcher import paths

    return Path(run_dir) / (room or paths.REWARD_DIR) / file_part(spec).name


def copy_into_run(spec: str | None, run_dir: Path, room: str | None = None) -> None:
    """At submission: a file spec is copied into the run directory (the job loads that copy)."""
    src = file_part(spec) if spec else None
    if src is not None:
        from launcher import files

        files.copy(src, run_copy(run_dir, spec, room))  # the run directory's mode


def load(spec: str, answer_key: str = "answer", run_dir: Path | None = None) -> Callable[[str, dict], float]:
    """The reward callable of `spec`; ConfigError('reward.fn', ...) when it cannot be had."""
    if spec in BUILTIN:
        return functools.partial(_on_answer, BUILTIN[spec], answer_key)
    if file_part(spec) is None and ":" not in spec:
        raise ConfigError("reward.fn", f"{spec!r} is not a built-in ({', '.join(BUILTIN)}) nor "
                                       f"pkg.module:function nor path/to/file.py:function")
    path = run_copy(run_dir, spec) if file_part(spec) is not None and run_dir is not None and \
        run_copy(run_dir, spec).is_file() else None
    fn = load_callable(spec, "reward.fn", "reward", path)
    name = spec.rpartition(":")[2]
    try:
        inspect.signature(fn).bind("response", {})
    except TypeError:
        raise ConfigError("reward.fn", f"{spec}: {name}{inspect.signature(fn)} cannot be called as "
                                       f"fn(response, example)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): trust it
    return fn


def load_callable(spec: str, key: str, kind: str, path: Path | None = None) -> Callable:
    """The callable a `path/to/file.py:function` or `pkg.module:function` spec names (the user's code for
    `kind`, "reward" or "tool"); `path` loads another file in place of the spec's (the run directory's copy).
    Importing catches everything the module may raise, sys.exit included (Ctrl-C still interrupts), and
    every failure is ConfigError(key, one line)."""
    src = file_part(spec)
    name = spec.rpartition(":")[2]
    if src is not None:
        path = path or src
        if not path.is_file():
            raise ConfigError(key, f"{path}: no such file")
        mod_name = f"_{kind}_file_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
        try:
            s = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(s)
            sys.modules[mod_name] = module
            s.loader.exec_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's file (sys.exit included): what broke, in one line
            raise ConfigError(key, f"cannot import {path}: {_what(e, kind)}") from None
    elif ":" in spec:
        mod_name = spec.partition(":")[0]
        try:
            module = importlib.import_module(mod_name)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's module (sys.exit included)
            raise ConfigError(key, f"cannot import module {mod_name!r}: {_what(e, kind)}") from None
    else:
        raise ConfigError(key, f"{spec!r} is neither pkg.module:function nor path/to/file.py:function")
    try:
        fn = getattr(module, name, None)
    except Exception as e:  # noqa: BLE001 - a module __getattr__ of the user's
        raise ConfigError(key, f"{spec}: {_what(e, kind)}") from None
    if fn is None:
        raise ConfigError(key, f"{spec}: the module has no {name!r}")
    if not callable(fn):
        raise ConfigError(key, f"{spec}: {name!r} is not callable")
    return fn


def _what(e: BaseException, kind: str = "reward") -> str:
    """An exception of the user's code in one line (`SystemExit(3)` says it exited; `kind` names whose
    module: "reward" or "tool")."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}) (SystemExit): {'an' if kind[:1] in 'aeiou' else 'a'} {kind} module " \
               f"must not exit"
    text = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def as_reward(value) -> tuple[float | None, str]:
    """(the value as a float, '') for a finite real number (int, float, bool, numpy's, a 0-d tensor
    via __float__), else (None, why): a string, None, a list, an integer too large for a float, NaN."""
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return None, f"returned {_short(value)} ({type(value).__name__}), not a number"
    try:
        out = float(value)
    except Exception as e:  # noqa: BLE001 - OverflowError (10**400), a __float__ of the user's
        return None, f"returned {_short(value)}, not a float ({type(e).__name__})"
    if not math.isfinite(out):
        return None, f"returned {out}, not a finite number"
    return out, ""


def _short(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the user's __repr__
        return type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def check(r: Reward, submitting: bool) -> list[ConfigError]:
    errs = []  # timeout_s, workers, on_error: checked on their fields (launcher.config.schema.Reward)
    if r.fn is None:
        return errs  # only with env.fn (launcher.driver.environments.check)
    if r.fn == "math_verify" and importlib.util.find_spec("math_verify") is None:
        errs.append(ConfigError("reward.fn", "math_verify needs the math-verify package (pip install math-verify)"))
    src = file_part(r.fn)
    if src is not None and not src.exists() and not submitting:
        return errs  # a dry run may plan for a filesystem this machine does not see
    if r.fn in BUILTIN:
        return errs
    err = probe(r.fn)
    return errs + ([err] if err is not None else [])


# ---------------------------------------------------------------------------- loading it at submission
IMPORT_TIMEOUT_S = 120.0   # what importing the user's module at submission may take


def probe(spec: str, timeout_s: float = IMPORT_TIMEOUT_S, loader: str = f"{__name__}:load",
          key: str = "reward.fn", what: str = "a reward module") -> ConfigError | None:
    """`loader(spec)` (`load` by default) in a child process (`python -m launcher.driver.rewards`, with this process's cwd
    and sys.path): the user's module runs its import there, so nothing it does (sys.exit,
    os._exit, a crash, a hang, a thread left running) can end or stop the launcher. The
    ConfigError `load` gives, one for a child that ended without an answer or took longer than
    `timeout_s`, or None."""
    import json
    import os
    import signal
    import subprocess

    where = file_part(spec) or spec.partition(":")[0]
    proc = subprocess.Popen([sys.executable, "-m", "launcher.driver.rewards"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps({"spec": spec, "path": sys.path, "loader": loader, "key": key}),
                                    timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ConfigError(key, f"importing {where} took more than {timeout_s:g} s (stopped): {what} must not block "
                                f"at import")
    finally:  # its process group: whatever the module started goes with it (Ctrl-C here included)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    answer = out.rpartition(_ANSWER)[2].strip() if _ANSWER in out else ""
    if answer:
        got = json.loads(answer)
        return None if got is None else ConfigError(got[0], got[1])
    how = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else \
        f"exit code {proc.returncode}"
    last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), "")
    return ConfigError(key, f"importing {where} ended its process ({how}) before it was loaded"
                            f"{f' ({last[:200]})' if last else ''}: {what} must not exit or crash at import")


_ANSWER = "\n@@reward-probe@@ "


def _probe_main() -> None:
    """The child of `probe`: load the spec given on stdin, answer on stdout after a marker (the module's
    own output goes to stderr), and end at once (no exit handler or thread of the module runs)."""
    import json
    import os

    request = json.loads(sys.stdin.read())
    sys.path[:] = request["path"]
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    module, _, name = request["loader"].partition(":")
    try:
        getattr(importlib.import_module(module), name)(request["spec"])
        got = None
    except ConfigError as e:
        got = [e.key, e.message]
    except BaseException as e:  # noqa: BLE001 - the module's own KeyboardInterrupt (load passes it on)
        got = [request["key"], f"cannot import {file_part(request['spec']) or request['spec']}: {_what(e)}"]
    answer.write(_ANSWER + json.dumps(got) + "\n")
    answer.flush()
    os._exit(0)


# ---------------------------------------------------------------------------- calling it
_FN: Callable | None = None
_LOAD_ERROR: str | None = None


def init_worker(spec: str, answer_key: str, run_dir: str | None) -> None:
    """In a reward worker (launcher.driver.reward_pool), once: load the function."""
    global _FN, _LOAD_ERROR
    try:
        _FN = load(spec, answer_key, Path(run_dir) if run_dir else None)
    except BaseException as e:  # noqa: BLE001 - reported on each call (the worker stays up)
        _LOAD_ERROR = _what(e)


def call(response: str, example: dict) -> tuple:
    """("ok", value) or ("error", one line, traceback)."""
    if _FN is None:
        return ("error", f"reward.fn could not be loaded: {_LOAD_ERROR}", _LOAD_ERROR or "")
    try:
        value = _FN(response, example)
    except BaseException as e:  # noqa: BLE001 - the user's code: an exception or sys.exit scores as an error
        return ("error", _what(e), traceback.format_exc())
    out, why = as_reward(value)
    return ("ok", out) if why == "" else ("error", why, "")


class RewardFailed(Exception):
    """reward.on_error=fail and a call failed: one line naming the record."""


class Rewards:
    """Scores responses: `reward.workers` worker processes (reward_pool), per-call timeout, on_error."""

    def __init__(self, r: Reward, answer_key: str, run_dir: Path):
        self.r, self.answer_key, self.run_dir = r, answer_key, Path(run_dir)
        self.log_path = self.run_dir / "logs" / "reward_errors.log"
        self.pool = None
        self._init_args = (r.fn, answer_key, str(run_dir))

    def score(self, responses: list[str], examples: list) -> tuple[list[float], int]:
        """(rewards, errors) for responses[i] of examples[i] (Example objects with .record / .where)."""
        from launcher.driver.reward_pool import WorkerPool

        calls = [(t, ex.record) for t, ex in zip(responses, examples)]
        if self.pool is None:
            self.pool = WorkerPool(self.r.workers, __name__, self._init_args)
        results = [("error", f"timed out after {self.r.timeout_s:g}s (reward.timeout_s)", "")
                   if res == WorkerPool.TIMED_OUT else res for res in self.pool.call_all(calls, self.r.timeout_s)]
        rewards, errors = [], 0
        for res, ex in zip(results, examples):
            if res[0] == "ok":
                rewards.append(res[1])
                continue
            errors += 1
            rewards.append(0.0)
            if self.r.on_error == "fail":
                raise RewardFailed(f"reward.fn {self.r.fn} failed on {ex.where}: {res[1]} (reward.on_error=fail; "
                                   f"reward.on_error=zero scores it 0 and goes on)")
            if not self.log_path.exists():
                from launcher import files

                files.write(self.log_path, f"reward.fn {self.r.fn} on {ex.where}: {res[1]}\n{res[2]}")
        return rewards, errors

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


if __name__ == "__main__":  # launcher.driver.rewards.probe's child
    _probe_main()
