"""The one reader of every file that comes from outside the run's own process, with limits.

A run reads files that anyone could have written or damaged: a checkpoint copied from a
colleague (config.yaml, training_info.json, manifest.json, rollouts.json), a model folder
(config.json, the safetensors headers, the index, the tokenizer files), the records of a run
directory, a sweep's record. A file that is too big, nested too deep, full of YAML aliases that
expand exponentially, cut in half or of the wrong shape must end in one line naming the file
(and the field), never in a hang, a memory blow-up or a traceback. So every such file is read
here, and only here:

  open_regular             the one open: a regular file only (a FIFO, socket, device or directory is one
                           line naming it, and opening never blocks); a dangling link is a missing file
  read_bytes / read_text   at most `limit` bytes (a bigger file is refused before it is read)
  parse_json / json_file   JSON without NaN/Infinity, at most `depth` levels of nesting, every number a float's
  model_json               a model folder's JSON read as transformers reads it: NaN/Infinity as Python's json
                           writes them and transformers 5's {"__float__": "Infinity"} both parse (whether
                           a non-finite value is allowed where it stands: launcher.config.model_facts)
  jsonl_objects            the whole JSON objects of a JSONL file being appended to (others skipped)
  parse_yaml / yaml_file   YAML with the safe loader, without aliases (`*a`, `<<: *a`: this
                           launcher writes none), at most `nodes` nodes and `depth` levels
  safetensors_header       the 8-byte length and the JSON header of a safetensors file, every
                           entry type-checked (dtype, shape, data offsets inside the file)
  protobuf_message         a serialized protobuf message (a sentencepiece tokenizer.model) read
                           to its end: every field whole

Every failure is a FileError: `<file>: <field>: <what>` (a ConfigError, so every command prints
it as its one line and exits 2). The limits are far above what any real file of its kind holds
(LIMITS); docs/security.md lists them. Imports only the standard library and PyYAML/OmegaConf's
loader (no torch): the launcher, the workers and the login node use it alike.
"""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config.schema import ConfigError

MiB = 1 << 20
GiB = 1 << 30
# the most bytes read of each kind of file (far above any real one: a Llama-3 tokenizer.json is 9 MiB,
# a 1T-parameter model's index 2 MiB, the resolved config.yaml 10 KiB, a pipelined checkpoint's
# rollouts of the reference topology (512 samples of 8k tokens, max_lag 2) about 200 MiB)
LIMITS = {"record": 4 * MiB, "log": 256 * MiB, "config": 16 * MiB, "model config": 16 * MiB,
          "index": 256 * MiB, "tokenizer": 512 * MiB, "rollouts": 4 * GiB, "safetensors header": 100 * MiB}
JSON_DEPTH = 64        # a tokenizer.json nests about 8 deep, a record 4
YAML_NODES = 200_000   # a resolved config.yaml holds about 500
YAML_DEPTH = 64


class FileError(ConfigError):
    """A file that is not what its reader expects: `<file>: <field>: <what>` (one line)."""

    def __init__(self, path: Path | str, field: str, what: str):
        super().__init__(str(path), f"{field}: {what}" if field else what)
        self.path = Path(str(path).split(" line ")[0])
        self.field = field


class FileMissing(FileError):
    """The file does not exist (a reader that polls for it tells this from a damaged one)."""


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def open_regular(path: Path | str) -> io.BufferedReader:
    """`path` opened for reading in binary, if it is a regular file (after links). Opened without
    blocking (O_NONBLOCK: a FIFO with no writer would block a plain open forever) and checked on the
    open descriptor (no race with a rename), then switched back to blocking reads. FileMissing for a
    path that does not exist or a link to nothing; FileError for anything else."""
    def refuse(mode: int) -> FileError:
        what = next((w for test, w in _KINDS if test(mode)), "not a regular file")
        return FileError(path, "", f"{what}, not a regular file: only files are read")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise FileMissing(path, "", f"unreadable ({_why(e)})") from None
    except OSError as e:  # a socket cannot be opened at all (ENXIO): name what it is
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise refuse(mode) from None
        raise FileError(path, "", f"unreadable ({_why(e)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: Path | str, limit: int, kind: str = "file") -> bytes:
    """The bytes of `path`, refused (FileError) when it holds more than `limit` or cannot be read."""
    try:
        with open_regular(path) as f:  # one open, no stat first: some files are polled every tick
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise FileError(path, "", f"{size:,} bytes, more than the {limit:,} read from a {kind}")
            data = f.read(limit + 1)
    except FileError:
        raise
    except FileNotFoundError as e:
        raise FileMissing(path, "", f"unreadable ({_why(e)})") from None
    except OSError as e:
        raise FileError(path, "", f"unreadable ({_why(e)})") from None
    if len(data) > limit:  # grew while it was read
        raise FileError(path, "", f"more than the {limit:,} bytes read from a {kind}")
    return data


def read_text(path: Path | str, limit: int, kind: str = "file") -> str:
    data = read_bytes(path, limit, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(path, "", f"not UTF-8 text (byte {e.start}: cut or binary?)") from None


# ----------------------------------------------------------------------------------------- JSON
def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


FLOAT_MAX = 1.7976931348623157e308  # sys.float_info.max: every number read from a file converts to a float


# a \\u escape of a UTF-16 surrogate in JSON text: the only way a JSON string holds one (UTF-8 text cannot)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _shape_error(obj: Any, limit: int, strings: bool = True) -> str | None:
    """What is wrong with the shape of a parsed file: nested deeper than `limit`, a number that
    does not convert to a float (a 400-digit integer), or (`strings`) a string or key that is not
    Unicode text; None when nothing is. Iterative: no recursion."""
    todo = [(obj, 1, "")]
    while todo:
        x, d, at = todo.pop()
        if isinstance(x, dict):
            items = [(f"{at}.{k}" if at else str(k), v) for k, v in x.items()]
        elif isinstance(x, list):
            items = [(f"{at}[{i}]", v) for i, v in enumerate(x)]
        else:
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > FLOAT_MAX:
                return f"{at or 'the value'}: a number of {len(str(abs(x)))} digits (no field takes more than a float)"
            if strings and isinstance(x, str) and not _unicode(x):
                return f"{at or 'the value'}: a string that is not Unicode text (a lone surrogate escape, \\ud800)"
            continue
        if d > limit:
            return f"nested more than {limit} levels deep"
        if strings and isinstance(x, dict) and any(isinstance(k, str) and not _unicode(k) for k in x):
            return f"{at or 'the object'}: a key that is not Unicode text (a lone surrogate escape, \\ud800)"
        todo.extend((v, d + 1, k) for k, v in items if isinstance(v, (dict, list, int)) or strings and isinstance(v, str))
    return None


def _unicode(text: str) -> bool:
    """Whether `text` is Unicode text: JSON's \\ud800 escapes (and YAML's) give lone surrogates, which no
    file or terminal can hold (printing or writing one raises)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# the floats JSON cannot hold, as Python's json writes them (literals) and as transformers 5 does
# (PreTrainedConfig._encode_special_floats: {"__float__": "Infinity"}); transformers reads both
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
FLOAT_TAG = "__float__"


def special_floats(obj: Any) -> Any:
    """A copy of `obj` with every {"__float__": "Infinity" | "-Infinity" | "NaN"} replaced by its float,
    as transformers' PreTrainedConfig._decode_special_floats does (other objects kept). Called on
    values parse_json has bounded in depth."""
    if isinstance(obj, dict):
        if len(obj) == 1 and isinstance(obj.get(FLOAT_TAG), str) and obj[FLOAT_TAG] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[obj[FLOAT_TAG]]
        return {k: special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [special_floats(v) for v in obj]
    return obj


def parse_json(data: str | bytes, where: Path | str, depth: int = JSON_DEPTH, special: bool = False) -> Any:
    """JSON text -> its value; FileError naming `where` when it is not JSON (NaN and Infinity are
    not, unless `special`: then both spellings of SPECIAL_FLOATS read as floats), nests deeper than
    `depth` or holds a number too large for a float. Bytes are read as the job's components read a
    JSON file (transformers, vLLM, json.load on a file opened as UTF-8): UTF-8 text without a
    byte-order mark; json.loads would have guessed UTF-16 or skipped the mark."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FileError(where, "", f"not UTF-8 text (byte {e.start}): JSON files are read as UTF-8") from None
    if data.startswith("\ufeff"):
        raise FileError(where, "", "starts with a byte-order mark (U+FEFF), which transformers' and Python's JSON "
                                   "readers refuse: save it as UTF-8 without one")
    try:
        obj = json.loads(data, parse_constant=SPECIAL_FLOATS.__getitem__ if special else _no_constant)
    except RecursionError:
        raise FileError(where, "", f"nested more than {depth} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FileError(where, "", f"not valid JSON ({str(e).splitlines()[0][:80]})") from None
    wrong = _shape_error(obj, depth, strings=_SURROGATE_ESCAPE.search(data) is not None)  # a tokenizer's 8 MiB: 0.3 s
    if wrong:
        raise FileError(where, "", wrong)
    return special_floats(obj) if special else obj


def json_file(path: Path | str, limit: int = LIMITS["record"], kind: str = "record", depth: int = JSON_DEPTH,
              obj: bool = False, special: bool = False) -> Any:
    """A whole JSON file, bounded; `obj`: it must hold an object; `special`: as parse_json."""
    value = parse_json(read_bytes(path, limit, kind), path, depth, special)
    if obj and not isinstance(value, dict):
        raise FileError(path, "", f"must hold a JSON object, got {type(value).__name__}")
    return value


def model_json(path: Path | str, kind: str = "model file", obj: bool = False) -> Any:
    """A JSON file of a model folder (config.json, the index, the tokenizer's files), bounded by
    LIMITS[kind] and read as transformers reads it: the non-finite floats in both spellings."""
    return json_file(path, LIMITS.get(kind, LIMITS["tokenizer"]), kind, obj=obj, special=True)


def jsonl_objects(path: Path | str, limit: int = LIMITS["log"], kind: str = "log", depth: int = 8) -> list[dict]:
    """The JSON objects of a JSONL file that is appended to while it is read (metrics.jsonl): a line
    that is not a whole JSON object within `depth` (one being written, one edited by hand) is
    skipped; none when the file does not exist. The file's size is bounded like every other."""
    try:
        text = read_text(path, limit, kind)
    except FileMissing:
        return []
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = parse_json(line, path, depth)
        except FileError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------- YAML
def _loader():
    """OmegaConf's own safe loader (its float and duplicate-key rules) that refuses aliases and
    counts nodes and depth as it composes them."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    base = get_yaml_loader()

    class Bounded(base):  # type: ignore[misc, valid-type]
        nodes = 0
        level = 0
        budget = YAML_NODES
        max_depth = YAML_DEPTH

        def compose_node(self, parent, index):
            event = self.peek_event()
            line = event.start_mark.line + 1 if event.start_mark else 0
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(f"an alias (*{event.anchor}) at line {line}: aliases are not read (this launcher "
                               f"writes none)")
            self.nodes += 1
            if self.nodes > self.budget:
                raise _Refused(f"more than {self.budget:,} YAML nodes (at line {line})")
            self.level += 1
            try:
                if self.level > self.max_depth:
                    raise _Refused(f"nested more than {self.max_depth} levels deep (at line {line})")
                return super().compose_node(parent, index)
            finally:
                self.level -= 1

    return Bounded


class _Refused(Exception):
    pass


def parse_yaml(text: str, where: Path | str, nodes: int = YAML_NODES, depth: int = YAML_DEPTH) -> Any:
    """YAML text -> plain Python values with the safe loader, no aliases, bounded; FileError."""
    import yaml

    try:  # the loader reads its first characters when it is made: a control character is refused there
        loader = _loader()(text)
    except yaml.YAMLError as e:
        raise FileError(where, "", f"not a config this launcher writes ({str(e).splitlines()[0]})") from None
    loader.budget, loader.max_depth = nodes, depth
    try:
        obj = loader.get_single_data()
        wrong = _shape_error(obj, depth)
        if wrong:
            raise _Refused(wrong)
        return obj
    except _Refused as e:
        raise FileError(where, "", str(e)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise FileError(where, "", f"not a config this launcher writes ({problem}{at}; it is read with the safe "
                                   f"YAML loader)") from None
    except RecursionError:
        raise FileError(where, "", f"nested more than {depth} levels deep") from None
    except (ValueError, OverflowError) as e:  # a number of more digits than Python converts
        raise FileError(where, "", f"a number too long to read ({str(e).split(';')[0]})") from None
    finally:
        loader.dispose()


def yaml_file(path: Path | str, limit: int = LIMITS["config"], kind: str = "config") -> Any:
    return parse_yaml(read_text(path, limit, kind), path)


# ----------------------------------------------------------------------------------- safetensors
# safetensors' dtypes (safetensors/src/tensor.rs Dtype) and their sizes in bits
SAFETENSORS_DTYPES = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
                      "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                      "I64": 64, "U64": 64, "F64": 64, "C64": 64}


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    begin: int          # byte offsets in the data section (after the header)
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    data_start: int     # 8 + the header's length
    size: int           # the file's size

    @property
    def data_end(self) -> int:
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def safetensors_header(path: Path | str, limit: int = LIMITS["safetensors header"]) -> Header:
    """The header of the safetensors file `path`, every entry checked as safetensors itself does
    (a dtype it knows, a shape of counts, data offsets [begin, end] in order and of the shape's
    size, inside the file); FileError naming the file and the tensor otherwise. Reads 8 + the
    header's bytes, whatever the file's size."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise FileError(path, "", f"{size} bytes, not a safetensors file (cut short?)")
            n = struct.unpack("<Q", head)[0]
            if n > min(limit, size - 8):
                raise FileError(path, "", f"its header says {n} bytes but the file has {size} (cut short, or not "
                                          f"safetensors)")
            raw = f.read(n)
    except FileError:
        raise
    except OSError as e:
        raise FileError(path, "", f"cannot be read ({_why(e)})") from None
    try:
        header = parse_json(raw, path, depth=3)
    except FileError as e:
        raise FileError(path, "", f"not a safetensors file (its header: {e.message})") from None
    if not isinstance(header, dict):
        raise FileError(path, "", "not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileError(path, "__metadata__", "must map names to strings")
    tensors = {name: _tensor(path, name, entry) for name, entry in header.items()}
    out = Header(tensors, metadata, 8 + n, size)
    if size < out.data_end:
        raise FileError(path, "", f"{size} bytes, its tensors end at byte {out.data_end} (cut short: an interrupted "
                                  f"download?)")
    _library_reads(path)
    return out


def _library_reads(path: Path | str) -> None:
    """The safetensors library, which the job's components open the file with, reads its header
    (it refuses more than the checks above: tensors that overlap or leave gaps, bytes after the
    last tensor). It maps the file and reads the header only, never a tensor."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        raise FileError(path, "", f"the safetensors library refuses it ({str(e).splitlines()[0][:120]})") from None


def _tensor(path: Path | str, name: str, e: Any) -> Tensor:
    where = f"tensor {name[:80]!r}"
    if not isinstance(e, dict):
        raise FileError(path, where, f"must be an object with dtype, shape and data_offsets, got {type(e).__name__}")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise FileError(path, where, f"dtype must be one of safetensors' ({', '.join(SAFETENSORS_DTYPES)}), got "
                                     f"{str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise FileError(path, where, f"shape must be a list of integers >= 0, got {str(shape)[:60]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(x) for x in offsets)
            and offsets[0] <= offsets[1]):
        raise FileError(path, where, f"data_offsets must be two integers [begin, end], begin <= end, got "
                                     f"{str(offsets)[:60]}")
    elements = 1
    for d in shape:
        elements *= d
    if (elements * SAFETENSORS_DTYPES[dtype] + 7) // 8 != offsets[1] - offsets[0]:
        raise FileError(path, where, f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its shape "
                                     f"{shape} of {dtype} needs {(elements * SAFETENSORS_DTYPES[dtype] + 7) // 8}")
    return Tensor(dtype, tuple(shape), offsets[0], offsets[1])


# -------------------------------------------------------------------------------------- protobuf
def protobuf_message(data: bytes, where: Path | str) -> None:
    """`data` is a whole serialized protobuf message: each field's tag, and its value (a varint,
    8 or 4 bytes, or a length and that many bytes) complete, ending exactly at the end. A file
    cut short ends inside a field (unless cut exactly between two; nested messages are not read)."""
    i, n = 0, len(data)
    if not n:
        raise FileError(where, "", "empty (a serialized protobuf, e.g. a sentencepiece model, was expected)")

    def varint(at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            if at >= n or shift > 63:
                raise FileError(where, "", f"not a whole protobuf message (a number cut at byte {at} of {n}: cut "
                                           f"short?)")
            b = data[at]
            value |= (b & 0x7F) << shift
            at += 1
            shift += 7
            if not b & 0x80:
                return value, at

    while i < n:
        tag, i = varint(i)
        wire = tag & 7
        if tag >> 3 == 0 or wire not in (0, 1, 2, 5):
            raise FileError(where, "", f"not a protobuf message (field tag {tag} at byte {i} of {n})")
        if wire == 0:
            _, i = varint(i)
            continue
        if wire == 2:
            length, i = varint(i)
        else:
            length = 8 if wire == 1 else 4
        if i + length > n:
            raise FileError(where, "", f"not a whole protobuf message (a field of {length} bytes at byte {i} runs "
                                       f"past the end at {n}: cut short?)")
        i += length
