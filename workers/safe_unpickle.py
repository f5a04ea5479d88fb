"""Checkpoint metadata unpickled without running code: only the classes a checkpoint needs.

torch.distributed.checkpoint's `.metadata` (what megatron-core's torch_dist format writes, and
what the exporter reads) is a pickle, and torch's FileSystemReader.read_metadata loads it with
plain `pickle.load`: a checkpoint folder anyone could write would otherwise run their code in the
driver, the exporter and every trainer rank. `load`/`loads` admit only the globals listed in
ALLOWED (DCP's metadata and planner dataclasses and enums, megatron's save-plan records, torch.Size,
torch dtypes and layouts, paths); anything else raises `Refused` naming the global. `install()` makes
FileSystemReader.read_metadata (and megatron's subclass) use it, in the calling process.

The bytes items of a DCP checkpoint (megatron's common state: trainer info, scheduler, optimizer
param groups) are pickles too, which DCP's DefaultLoadPlanner.load_bytes unpickles with
`torch.load(weights_only=False)`: `install()` replaces it with `weights_only=True` (torch's own
restricted unpickler: tensors and plain containers). Tensor payloads are raw bytes; megatron's
legacy common.pt uses torch.load's default, weights_only=True since torch 2.6.
The list was taken from the globals in real trainer checkpoints (tests/unit/test_safe_unpickle.py
round-trips one); a DCP or megatron upgrade that pickles a new class shows up as `Refused`.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData", "LoadItemType"}),
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreSavePlan", "MCoreMetadata"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),   # StorageMeta.checkpoint_id
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class Refused(pickle.UnpicklingError):
    """The pickle names a global that checkpoint metadata never needs."""

    def __init__(self, module: str, name: str, why: str = "not a checkpoint metadata class"):
        super().__init__(f"refused to unpickle {module}.{name} ({why})")
        self.name = f"{module}.{name}"


def _is_dtype(module: str, name: str) -> bool:
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or _is_dtype(module, name):
            return super().find_class(module, name)
        raise Refused(module, name)


def load(file: IO[bytes]) -> Any:
    return _Restricted(file).load()


def loads(data: bytes) -> Any:
    return load(io.BytesIO(data))


def _read_metadata(self, *args: Any, **kwargs: Any):
    """torch's FileSystemReader.read_metadata with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as f:
        metadata = load(f)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
    """torch's DefaultLoadPlanner.load_bytes with torch.load(weights_only=True): tensors and plain
    containers, no code. DCP's own unpickles every bytes item (megatron's common state: trainer
    info, scheduler, optimizer param groups) with weights_only=False."""
    import re

    import torch

    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        module, _, name = (found.group(1) if found else "an unknown.global").rpartition(".")
        raise Refused(module, name, f"in the bytes item {read_item.dest_index.fqn}: not plain checkpoint "
                                    f"data") from None
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._nested_dict import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def install() -> None:
    """Every FileSystemReader in this process (megatron's readers subclass it) reads `.metadata`
    with the restricted unpickler, and every load planner deriving from DCP's DefaultLoadPlanner
    (megatron's too) reads bytes items with torch.load(weights_only=True). Idempotent."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if getattr(FileSystemReader.read_metadata, "_restricted", False):
        return
    _read_metadata._restricted = True  # type: ignore[attr-defined]
    FileSystemReader.read_metadata = _read_metadata  # type: ignore[method-assign]
    DefaultLoadPlanner.load_bytes = _load_bytes  # type: ignore[method-assign]
