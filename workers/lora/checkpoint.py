"""LoRA factors out of a trainer checkpoint, without a Megatron model, a process group or the base weights.

`MegatronTrainer.save_state(dir)` writes megatron-core dist_checkpointing in torch_dist format: a
torch.distributed.checkpoint (DCP) directory (`.metadata`, `__<rank>_<i>.distcp`, megatron's
`metadata.json`; the common state is the `common_state` entry inside the DCP, or `common.pt` in older
megatron-core). Tensors are stored under their ShardedTensor keys, which are global (TP/PP-free):
  homogeneous GPT stacks       `decoder.layers.<rest>` with a leading layer axis [num_layers, ...]
  hybrid stacks (Nemotron-H)   `decoder.layers.<N>.<rest>`, one entry per layer
  gated linear_fc1 LoRA-B      rows [gate; up] at any TP size (megatron's swiglu sharded factory)
  Mamba in_proj LoRA-B         five entries `<B key>.z`, `.x`, `.B`, `.C`, `.dt` (Megatron-Bridge splits it
                               like megatron's mixer splits in_proj itself: each part is TP-sharded on
                               its own), joined here in that order: HF's in_proj row order
So the tensors read back are the TP=1 layout, whatever TP/PP the run used. Only the LoRA keys are
requested from DCP; its file reader then reads just their byte ranges (counted in `bytes_read`, from
the executed read plan), so base weights and optimizer state are never loaded and the checkpoint of a
model far larger than this machine exports in seconds.

Used by `workers.lora.export` (the post-training HF PEFT adapter exporter). torch is imported lazily:
the launcher package must stay torch-free at import time.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# names of the LoRA factors of a wrapped linear: A = linear_in [r, in], B = linear_out [out, r]
LORA_A_SUFFIX = ".adapter.linear_in.weight"
LORA_B_SUFFIX = ".adapter.linear_out.weight"
LORA_SUFFIXES = (LORA_A_SUFFIX, LORA_B_SUFFIX)
_LAYER_INDEX = re.compile(r"(^|\.)layers\.\d+\.")
# the parts of a Mamba in_proj's LoRA-B as stored (megatron's _split_tensor_factory names), in row order
IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")
_IN_PROJ_PART = re.compile(re.escape(LORA_B_SUFFIX) + r"\.(" + "|".join(IN_PROJ_PARTS) + r")$")

# why an entry is not exported, by key prefix (first match wins); anything else: not a LoRA tensor
SKIP_REASONS = (
    ("optimizer.", "optimizer state"),
    ("common_state", "common state (scheduler, step, trainer info)"),
)
NOT_LORA = "not a LoRA tensor"


class LoraCheckpointError(ValueError):
    """The checkpoint cannot give LoRA factors (one line: which file or entry and why)."""


@dataclass
class Scan:
    """What a DCP directory holds: the LoRA entries (key -> shape, dtype) and the rest, by reason."""

    directory: Path
    lora: dict[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    total_bytes: int = 0


def scan(directory: str | Path) -> Scan:
    """Classify every entry of the DCP at `directory` from its metadata alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from workers import safe_unpickle

    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        raise LoraCheckpointError(f"{directory}: no torch distributed checkpoint here (no .metadata)")
    safe_unpickle.install()  # `.metadata` is a pickle: checkpoint classes only, no code
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except safe_unpickle.Refused as e:
        raise LoraCheckpointError(f"{directory / '.metadata'}: {e}; nothing was run") from None
    except Exception as e:  # a truncated or foreign .metadata
        raise LoraCheckpointError(f"{directory / '.metadata'}: unreadable ({type(e).__name__})") from None
    out = Scan(directory, total_bytes=sum(s.length for s in (metadata.storage_data or {}).values()))
    for key, md in metadata.state_dict_metadata.items():
        reason = next((why for prefix, why in SKIP_REASONS if key.startswith(prefix)), None)
        if reason is None and (key.endswith(LORA_SUFFIXES) or _IN_PROJ_PART.search(key)) \
                and isinstance(md, TensorStorageMetadata):
            out.lora[key] = (tuple(md.size), md.properties.dtype)
            continue
        if reason is None and ".adapter." in key:
            raise LoraCheckpointError(f"{key}: not a plain LoRA factor (adapter.linear_in/linear_out); "
                                      "only LoRA adapters can be exported")
        out.skipped.setdefault(reason or NOT_LORA, []).append(key)
    return out


def _counting_reader(path: str):
    """A DCP FileSystemReader that adds up the bytes of every item its read plans ask for."""
    from torch.distributed.checkpoint import FileSystemReader

    class CountingReader(FileSystemReader):
        bytes_read = 0

        def read_data(self, plan, planner):
            self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
            return super().read_data(plan, planner)

    return CountingReader(path)


def load_lora(found: Scan) -> tuple[dict[str, Any], int]:
    """({per-layer Megatron name: tensor}, bytes read) for the LoRA entries of `found`.

    Names are those of the trainer's `adapter_state()`: `decoder.layers.<N>.<module>.adapter.linear_in.weight`.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in found.lora.items()}
    reader = _counting_reader(str(found.directory))
    with warnings.catch_warnings():  # "torch.distributed ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    out: dict[str, Any] = {}
    for key, tensor in _joined_in_proj_parts(state).items():
        out.update(_per_layer(key, tensor))
    return out, reader.bytes_read


def _joined_in_proj_parts(state: dict[str, Any]) -> dict[str, Any]:
    """The five stored parts of each Mamba in_proj LoRA-B joined into one B (rows z, x, B, C, dt)."""
    import torch

    out, parts = {}, {}
    for key, tensor in state.items():
        m = _IN_PROJ_PART.search(key)
        if m is None:
            out[key] = tensor
        else:
            parts.setdefault(key[: m.start()] + LORA_B_SUFFIX, {})[m.group(1)] = tensor
    for key, found in parts.items():
        missing = [p for p in IN_PROJ_PARTS if p not in found]
        if missing:
            raise LoraCheckpointError(f"{key}: the checkpoint holds the Mamba in_proj LoRA-B without its "
                                      f"part(s) {', '.join(missing)}")
        out[key] = torch.cat([found[p] for p in IN_PROJ_PARTS], dim=-2)  # rows (a layer axis may lead)
    return out


def _per_layer(key: str, tensor) -> dict[str, Any]:
    """One stored entry -> {Megatron parameter name: 2-D factor}, unstacking a leading layer axis."""
    per_layer = bool(_LAYER_INDEX.search(key)) or "layers." not in key  # hybrid stacks key each layer
    if tensor.dim() != (2 if per_layer else 3) and ".experts." in key:  # expert adapters carry an expert axis
        raise LoraCheckpointError(f"{key}: the checkpoint has LoRA on MoE experts, which the PEFT exporter does "
                                  f"not write yet (docs/moe.md); adapters on attention export (peft.target_modules"
                                  f"=[linear_qkv, linear_proj])")
    if per_layer:
        if tensor.dim() != 2:
            raise LoraCheckpointError(f"{key}: shape {tuple(tensor.shape)} is not a 2-D LoRA factor")
        return {key: tensor}
    if tensor.dim() != 3:
        raise LoraCheckpointError(f"{key}: shape {tuple(tensor.shape)} is not [layers, rows, cols] "
                                  "(only dense-layer LoRA can be exported)")
    head, tail = key.split("layers.", 1)
    return {f"{head}layers.{i}.{tail}": tensor[i] for i in range(tensor.shape[0])}
