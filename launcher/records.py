"""Every record the launcher writes and later reads back, with its schema, checked where it is read.

A record read back is input like any other: a checkpoint copied from a colleague, a run directory
on a shared filesystem, a line edited by hand, a file cut short by a full disk. Each record has one
schema here (the keys, their types and ranges); `load` / `load_lines` read it through the one
bounded reader (launcher.config.bounded: a size limit per kind, no NaN or Infinity, a depth limit)
and check it, and a failure is one `RecordError` naming the file (and line) and the key: a
ConfigError, so every command ends it in one line with exit code 2, and the job meets it before
Ray and the actors start. Rules that tie records together live with the reader that has them all
(a checkpoint's step: its folder's N, its training_info.json and its trainer state agree, in
`launcher.driver.checkpoints.verify`).

The saved config.yaml (a run's and every checkpoint's) has the config's own schema:
`load_config` reads it with the bounded safe YAML loader (a python tag, an alias or a file too big
or too deep is refused, in one line), merges it into `launcher.config.schema.Config` (types,
unknown keys), checks every field's range (`launcher.config.ranges`) and the rules of names and
paths (`launcher.paths`: a run.name from a file passes the run-name rule before it is printed
or used).
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from launcher import paths, shell
from launcher.config import bounded, fields
from launcher.config.schema import ConfigError, Pipeline

# the lag a pipelined run records: 0 (no pipeline) up to grpo.pipeline.max_lag's bound in the schema
MAX_LAG = int(fields.leaf(Pipeline, "max_lag").check.hi)

RecordError = bounded.FileError   # a record that is not what this launcher writes: `<file>: <key>: <what>`


Rule = Callable[[Any], "str | None"]   # what is wrong with a value, or None


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = True
    null: bool = False
    rule: Rule | None = None

    def error(self, value: Any) -> str | None:
        if value is None:
            return None if self.null else "must not be null"
        if isinstance(value, bool) and bool not in self.types:
            return f"must be {_words(self.types)}, got {value!r}"
        if not isinstance(value, self.types):
            return f"must be {_words(self.types)}, got {type(value).__name__} {_short(value)}"
        return self.rule(value) if self.rule else None


@dataclass(frozen=True)
class Record:
    name: str                  # the file name (a pattern for node reports)
    fields: dict[str, Field]

    def check(self, obj: Any, where: str | Path) -> dict:
        """`obj` if it has this record's schema; RecordError naming `where` and the key otherwise."""
        if not isinstance(obj, dict):
            raise RecordError(where, "", f"must hold a JSON object, got {type(obj).__name__}")
        for key, f in self.fields.items():
            if key not in obj:
                if f.required:
                    raise RecordError(where, key, "is missing")
                continue
            what = f.error(obj[key])
            if what:
                raise RecordError(where, key, what)
        return obj


# ------------------------------------------------------------------------------ field kinds
def _words(types: tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object",
             list: "a list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def count(at_most: int | None = None, required: bool = True, null: bool = False) -> Field:
    """A whole number >= 0 (and <= at_most)."""
    def rule(v: int) -> str | None:
        if v < 0:
            return f"must be an integer >= 0, got {v}"
        if at_most is not None and v > at_most:
            return f"must be at most {at_most}, got {v}"
        return None
    return Field((int,), required, null, rule)


def number(required: bool = True) -> Field:
    return Field((int, float), required, rule=lambda v: None if math.isfinite(v) else f"must be finite, got {v}")


def text(required: bool = True, null: bool = False, one_line: bool = True) -> Field:
    def rule(v: str) -> str | None:
        if not v:
            return "must not be empty"
        if one_line and ("\n" in v or "\0" in v):
            return f"must be one line, got {_short(v)}"
        return None
    return Field((str,), required, null, rule)


def _port(v: int) -> str | None:
    return None if 1 <= v <= 65535 else f"must be a port in [1, 65535], got {v}"


def _ip(v: str) -> str | None:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return f"must be an IP address, got {_short(v)}"
    return None


def _metrics(v: dict) -> str | None:
    """The step's numbers (what the driver keeps of a metrics row: numbers and flags)."""
    for k, x in v.items():
        if not isinstance(x, (int, float)) or not math.isfinite(x):
            return f"{k!r} must be a finite number or a flag, got {_short(x)}"
    return None


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _manifest_files(v: dict) -> str | None:
    for rel, e in v.items():
        if not isinstance(e, dict):
            return f"entry {rel!r} must be an object with size and sha256, got {_short(e)}"
        size, digest = e.get("size"), e.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"entry {rel!r}: size must be an integer >= 0, got {_short(size)}"
        if not isinstance(digest, str) or not _SHA256.match(digest):
            return f"entry {rel!r}: sha256 must be 64 lowercase hex digits, got {_short(digest)}"
    return None


def _strings(v: list) -> str | None:
    bad = next((x for x in v if not isinstance(x, str)), None)
    return None if bad is None else f"must be a list of strings, holds {_short(bad)}"


def _run_name(v: str) -> str | None:
    err = paths.run_name_error(v)
    return None if err is None else err.message


def _absolute(v: str) -> str | None:
    return None if v.startswith("/") and "\0" not in v and "\n" not in v else f"must be an absolute path, got {_short(v)}"


def _pipeline(v: dict) -> str | None:
    """training_info.json's `pipeline`: the max_lag it ran with, the steps generated ahead of it."""
    lag, ahead = v.get("max_lag"), v.get("ahead")
    if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= MAX_LAG:
        return f"max_lag must be an integer in [0, {MAX_LAG}], got {_short(lag)}"
    if not isinstance(ahead, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in ahead):
        return f"ahead must be a list of step numbers, got {_short(ahead)}"
    return None


def _int_rows(v: Any, what: str) -> str | None:
    if not isinstance(v, list) or any(not isinstance(row, list) or any(isinstance(x, bool) or not isinstance(x, int)
                                                                        or x < 0 for x in row) for row in v):
        return f"{what} must be lists of token ids"
    return None


def _rollouts(v: list) -> str | None:
    """rollouts.json's `rollouts`: each step's samples as the engines produced them (what a resumed
    pipelined run trains on instead of generating again)."""
    for i, r in enumerate(v):
        if not isinstance(r, dict):
            return f"[{i}] must be an object, got {_short(r)}"
        for key in ("step", "version", "position"):
            x = r.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                return f"[{i}].{key} must be an integer >= 0, got {_short(x)}"
        if not isinstance(r.get("metrics"), dict) or not isinstance(r.get("refit"), dict):
            return f"[{i}]: metrics and refit must be objects"
        s = r.get("rollout")
        if not isinstance(s, dict):
            return f"[{i}].rollout must be an object, got {_short(s)}"
        n = len(s.get("rewards") or [])
        for key, what in (("prompt_ids", "prompt ids"), ("response_ids", "response ids")):
            err = _int_rows(s.get(key), what)
            if err or len(s[key]) != n:
                return f"[{i}].rollout.{key}: {err or f'{len(s[key])} rows for {n} rewards'}"
        lps = s.get("generation_logprobs")
        if (not isinstance(lps, list) or len(lps) != n
                or any(not isinstance(row, list) or len(row) != len(ids) or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in row)
                    for row, ids in zip(lps, s["response_ids"]))):
            return f"[{i}].rollout.generation_logprobs must be one finite number per response token"
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in s["rewards"]):
            return f"[{i}].rollout.rewards must be finite numbers"
        texts, truncated = s.get("texts", []), s.get("truncated", [])
        if not isinstance(texts, list) or any(not isinstance(t, str) for t in texts):
            return f"[{i}].rollout.texts must be strings"
        if not isinstance(truncated, list) or any(not isinstance(t, bool) for t in truncated):
            return f"[{i}].rollout.truncated must be true or false"
        errs = s.get("reward_errors", 0)
        if isinstance(errs, bool) or not isinstance(errs, int) or errs < 0:
            return f"[{i}].rollout.reward_errors must be an integer >= 0"
        mask = s.get("response_mask", [])
        if not isinstance(mask, list) or (mask and (len(mask) != n or any(
                not isinstance(row, list) or len(row) != len(ids) or any(x not in (0, 1) or isinstance(x, bool)
                                                                         for x in row)
                for row, ids in zip(mask, s["response_ids"])))):
            return f"[{i}].rollout.response_mask must be empty or one 0 or 1 per response token"
        eps = s.get("episodes", [])
        if not isinstance(eps, list) or (eps and len(eps) != n) or any(
                not isinstance(m, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                               or not math.isfinite(v) for v in m.values()) for m in eps):
            return f"[{i}].rollout.episodes must be empty or one object of finite numbers per sample"
        extra = set(s) - {"prompt_ids", "response_ids", "generation_logprobs", "rewards", "texts", "truncated",
                          "reward_errors", "response_mask", "episodes"}
        if extra:
            return f"[{i}].rollout has unknown keys {sorted(extra)}"
    return None


# ------------------------------------------------------------------------------ the records
TRAINING_INFO = Record(paths.TRAINING_INFO, {
    "step": count(), "consumed_prompts": count(),
    "metrics": Field((dict,), required=False, rule=_metrics), "time": number(required=False),
    "pipeline": Field((dict,), required=False, rule=_pipeline)})
ROLLOUTS = Record(paths.ROLLOUTS, {"max_lag": count(MAX_LAG), "sampling": Field((dict,)),
                                   "rollouts": Field((list,), rule=_rollouts)})
MANIFEST = Record(paths.MANIFEST, {"files": Field((dict,), rule=_manifest_files)})
HEAD = Record(paths.HEAD, {"ip": Field((str,), rule=_ip), "port": Field((int,), rule=_port), "host": text()})
NODE_REPORT = Record(paths.NODE_REPORTS, {"node_index": count(4095), "host": text(), "reason": text(one_line=False),
                                          "log": text()})
DONE = Record(paths.DONE, {"ok": Field((bool,)), "error": text(required=False, null=True, one_line=False)})
STOP_REQUEST = Record(paths.STOP_REQUEST, {"time": text(), "by": text()})
STOPPED = Record(paths.STOPPED, {"time": text(), "job": text(), "step": count(null=True), "stopped": Field((bool,)),
                                 "requested": Field((dict,))})
SUBMISSION = Record(paths.SUBMISSIONS, {"time": text(), "job_id": Field((str, int), rule=lambda v: None if str(v).strip()
                                                                          else "must not be empty"),
                                        "argv": Field((list,), required=False, rule=_strings)})
FAILURE = Record(paths.FAILURES, {"time": text(), "job": text(), "error": Field((str,))})
SWEEP_POINT = Record(paths.SWEEP_RECORD, {
    "point": count(), "overrides": Field((list,), rule=_strings), "swept": Field((dict,)),
    "run_name": Field((str,), rule=_run_name), "run_dir": Field((str,), rule=_absolute),
    "job_id": Field((str, int), null=True), "state": text(), "time": text()})


# ------------------------------------------------------------------------------ reading
# how big each record may be (launcher.config.bounded.LIMITS): rollouts.json holds token ids, the
# JSONL logs grow with the run, every other record is a few lines
_LIMIT = {paths.ROLLOUTS: ("rollouts", 16), paths.MANIFEST: ("index", 8), paths.SUBMISSIONS: ("log", 8),
          paths.FAILURES: ("log", 8), paths.SWEEP_RECORD: ("log", 8)}


def _limit(record: Record) -> tuple[int, str, int]:
    kind, depth = _LIMIT.get(record.name, ("record", 8))
    return bounded.LIMITS[kind], kind, depth


def load(path: Path, record: Record, missing_ok: bool = False) -> dict | None:
    """A whole-file JSON record, checked; RecordError naming the file and key. `missing_ok`: None
    when there is no such file (one open, no stat first: a file polled every tick)."""
    limit, kind, depth = _limit(record)
    try:
        data = bounded.read_bytes(path, limit, kind)
    except bounded.FileMissing:
        if missing_ok:
            return None
        raise
    return record.check(bounded.parse_json(data, path, depth), path)


def load_lines(path: Path, record: Record) -> list[dict]:
    """The rows of a JSONL record (none if the file does not exist), each checked. A last line
    without its newline is being written: skipped. Any other bad line is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    limit, kind, depth = _limit(record)
    data = bounded.read_text(path, limit, kind)
    lines = data.split("\n")
    complete, partial = lines[:-1], lines[-1]
    rows = []
    for n, line in enumerate(complete, start=1):
        if line.strip():
            where = f"{path} line {n}"
            rows.append(record.check(bounded.parse_json(line, where, depth), where))
    del partial  # being written (an append in flight): its writer finishes it
    return rows


# ------------------------------------------------------------------------------ config.yaml
def load_config(path: Path, typed: bool = False):
    """A saved config.yaml: the DictConfig (`typed`: the schema.Config) after the bounded safe YAML
    loader (launcher.config.bounded: no aliases, a size, node and depth limit), the schema's types,
    every field's range and the rules of names and paths; RecordError naming the file and key."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from launcher.config import ranges
    from launcher.config.schema import typed as to_typed

    path = Path(path)
    if not path.is_file():
        raise RecordError(path, "", "no resolved config here (is this a run directory or a checkpoint?)")
    plain = bounded.yaml_file(path)
    if not isinstance(plain, dict):
        raise RecordError(path, "", f"must hold a YAML mapping of config sections, got a "
                                    f"{'ListConfig' if isinstance(plain, list) else type(plain).__name__}")
    try:  # the values as saved: a `${` in one is text (shell.literal), not an interpolation to resolve again
        raw = OmegaConf.create(shell.literal_tree(plain))
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise RecordError(path, "", f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None
    if not isinstance(raw, DictConfig):
        raise RecordError(path, "", f"must hold a YAML mapping of config sections, got a {type(raw).__name__}")
    try:
        cfg = to_typed(raw)
    except ConfigError as e:
        raise RecordError(path, e.key, e.message) from None
    except OmegaConfBaseException as e:  # an interpolation that does not resolve, ...
        raise RecordError(path, str(getattr(e, "full_key", "") or ""), str(e).splitlines()[0]) from None
    errors = ranges.check(cfg) or _names_and_paths(cfg)
    if errors:
        raise RecordError(path, errors[0].key, errors[0].message)
    return cfg if typed else raw


def _names_and_paths(cfg) -> list[ConfigError]:
    """What the launcher checks of names and paths at submission, checked again on a config read back:
    its run.name is printed (the exporter's `vllm serve` line) and names folders."""
    errs = [paths.run_name_error(cfg.run.name)]
    errs += [paths.path_error(key, getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]))
             for key in paths.PATH_KEYS]
    return [e for e in errs if e is not None]
