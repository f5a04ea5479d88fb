"""What a run reads from `model.path`, checked before it is submitted (and on every node by the preflight).

The trainers (Megatron-Bridge), the generators (vLLM) and the driver (the tokenizer) read three
things from the base model's folder: `config.json`, the weights in safetensors (one
`model.safetensors`, or `model.safetensors.index.json` whose `weight_map` names shard files in
the same folder) and a tokenizer. A folder that lacks one of them (an interrupted download, a
copy of the wrong folder) would otherwise be found out on the cluster, after the wait in the queue.

Each weight file is checked to be a whole safetensors file from its header alone (8 bytes of
length, a JSON header, data up to the last tensor's end offset): a file cut short by a download is
named. Nothing else is read, so this costs milliseconds on a model of any size.
`problem(path)` is one line (what is missing, where) or None; validate.py turns it into the
`model.path` error of a submission and the note of a dry run, the preflight into a node's problem.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# what transformers' tokenizers load from: a fast tokenizer, a sentencepiece model, BPE vocab + merges,
# a WordPiece vocab, or a tiktoken file
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header


def problem(path: str | Path) -> str | None:
    """What keeps the folder `path` from being a model a run can read, in one line, or None."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory (a local HF checkpoint is needed)"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (a local HF checkpoint is needed)"
    return _weights(path) or _tokenizer(path)


def _weights(path: Path) -> str | None:
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            return f"{index}: not a safetensors index ({type(e).__name__})"
        if not isinstance(weight_map, dict) or not weight_map:
            return f"{index}: weight_map must be an object naming each tensor's shard file"
        shards = sorted(set(map(str, weight_map.values())))
        for name in shards:
            if "/" in name or name in (".", "..") or not name.endswith(".safetensors"):
                return f"{index}: weight_map names {name!r}, not a .safetensors file in {path}"
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return (f"{path}: {missing[0]}{more} of the {len(shards)} weight shards named in {INDEX} "
                    f"missing (an interrupted download?)")
        for name in shards:
            if (err := _whole(path / name)) is not None:
                return err
        return None
    if (path / SINGLE).is_file():
        return _whole(path / SINGLE)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if found:
        return f"{path} has {', '.join(found[:3])} but neither {SINGLE} nor {INDEX} naming them"
    bins = sorted(p.name for p in path.glob("*.bin"))
    hint = f" (it has {bins[0]}: convert the weights to safetensors)" if bins else " (an interrupted download?)"
    return f"{path} has no weights: neither {SINGLE} nor {INDEX}{hint}"


def _whole(f: Path) -> str | None:
    """A safetensors file whose header parses and whose data is all there."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{f}: {size} bytes, not a safetensors file (cut short?)"
            n = struct.unpack("<Q", head)[0]
            if n > min(MAX_HEADER, size - 8):
                return f"{f}: its header says {n} bytes but the file has {size} (cut short, or not safetensors)"
            header = json.loads(fh.read(n))
    except OSError as e:
        return f"{f}: cannot be read ({e.strerror})"
    except (ValueError, UnicodeDecodeError):
        return f"{f}: not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{f}: not a safetensors file (its header is not a JSON object)"
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{f}: {size} bytes, its tensors end at byte {need} (cut short: an interrupted download?)"
    return None


def _tokenizer(path: Path) -> str | None:
    if any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILES):
        return None
    if any(path.glob("*.tiktoken")):
        return None
    return (f"{path} has no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt): the run encodes "
            f"the prompts with the model's own tokenizer")
