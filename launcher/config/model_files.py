"""What a run reads from `model.path`, checked before it is submitted (and on every node by the preflight).

The trainers (Megatron-Bridge), the generators (vLLM) and the driver (the tokenizer) read three
things from the base model's folder: `config.json`, the weights in safetensors (one
`model.safetensors`, or `model.safetensors.index.json` whose `weight_map` names shard files in
the same folder) and a tokenizer. A folder that lacks one of them (an interrupted download, a
copy of the wrong folder) would otherwise be found out on the cluster, after the wait in the queue.

Every file is read with the one bounded reader (launcher.config.bounded). Each weight file is
checked to be a whole safetensors file from its header alone (8 bytes of length, a JSON header
whose every entry has a known dtype, a shape and data offsets of that size, data up to the last
tensor's end offset): a file cut short by a download is named; no tensor is read, so this costs
milliseconds on a model of any size. Every tokenizer file there, and every other JSON file
(generation_config.json, chat_template.json, ...: transformers and vLLM read them when the job
starts), is read whole and parsed as what it is (JSON objects where transformers expects one;
merges.txt, vocab.txt, *.tiktoken, *.jinja: UTF-8 text; tokenizer.model: a whole protobuf
message), so one cut in half is named too.
`problem(path)` is one line (what is missing, where) or None; validate.py turns it into the
`model.path` error of a submission and the note of a dry run, the preflight into a node's problem.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher import paths
from launcher.config import bounded

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# what transformers' tokenizers load from: a fast tokenizer, a sentencepiece model, BPE vocab + merges,
# a WordPiece vocab, or a tiktoken file
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
# JSON files beside the tokenizer that transformers reads when they are there
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json")
TOKENIZER_TEXT = ("merges.txt", "vocab.txt")
# other JSON files of a model folder that transformers or vLLM read as an object when they are there
OBJECT_JSON = ("config.json", "generation_config.json", "chat_template.json", "preprocessor_config.json",
               "processor_config.json")


def problem(path: str | Path) -> str | None:
    """What keeps the folder `path` from being a model a run can read, in one line, or None."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory (a local HF checkpoint is needed)"
    try:  # a link to nothing would be skipped below as absent, and the job run without the file it was given
        dangling = next((f for f in sorted(path.iterdir()) if f.is_symlink() and not f.exists()), None)
    except OSError as e:
        return f"{path}: unreadable ({paths.os_error_text(e)})"
    if dangling is not None:
        return (f"{dangling}: a link to nothing ({os.readlink(dangling)}): the file it names is missing (an "
                f"interrupted download, or a cache moved?)")
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (a local HF checkpoint is needed)"
    return _weights(path) or _tokenizer(path)


def _weights(path: Path) -> str | None:
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = bounded.model_json(index, "index", obj=True).get("weight_map")
        except bounded.FileError as e:
            return f"{index}: not a safetensors index ({e.message})"
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
    """A safetensors file whose header parses, every entry well formed, and whose data is all there."""
    try:
        bounded.safetensors_header(f)
    except bounded.FileError as e:
        return str(e)
    return None


def _tokenizer(path: Path) -> str | None:
    present = any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILES)
    if not present and not any(path.glob("*.tiktoken")):
        return (f"{path} has no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt): the run "
                f"encodes the prompts with the model's own tokenizer")
    return next((err for f in sorted(path.iterdir()) if f.is_file() and (err := _tokenizer_file(f))), None)


def _tokenizer_file(f: Path) -> str | None:
    """One file of the model folder read whole as what it is (launcher.config.bounded); None when it
    is whole or not one the job reads: every `*.json` (the tokenizer's, generation_config.json,
    chat_template.json, ...: transformers and vLLM parse each one there when the job starts) and the
    tokenizer's text and sentencepiece files."""
    limit = bounded.LIMITS["tokenizer"]
    try:
        if f.name == INDEX:
            return None  # _weights read it
        if f.name in TOKENIZER_JSON or f.name in OBJECT_JSON:
            bounded.model_json(f, "tokenizer", obj=True)
        elif f.suffix == ".json":
            bounded.model_json(f, "model file")
        elif f.name in TOKENIZER_TEXT or f.suffix in (".tiktoken", ".jinja"):
            bounded.read_text(f, limit, "tokenizer")
        elif f.name == "tokenizer.model":
            bounded.protobuf_message(bounded.read_bytes(f, limit, "tokenizer"), f)
    except bounded.FileError as e:
        what = "a tokenizer file" if f.name in TOKENIZER_JSON + TOKENIZER_TEXT or f.suffix == ".tiktoken" \
            or f.name == "tokenizer.model" else "a file of the model"
        return f"{e} ({what} cut short or damaged: the run could not read it when it starts)"
    return None
