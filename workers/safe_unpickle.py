"""Checkpoint metadata unpickled without running code: only the classes a checkpoint needs.

torch.distributed.checkpoint's `.metadata` (what megatron-core's torch_dist format writes, and
what the exporter reads) is a pickle, and torch's FileSystemReader.read_metadata loads it with
plain `pickle.load`: a checkpoint folder anyone could write would otherwise run their code in the
driver, the exporter and every trainer rank. `load`/`loads` admit only the globals listed in
ALLOWED (DCP's metadata and planner dataclasses and enums, megatron's save-plan records, torch.Size,
torch dtypes and layouts, paths); anything else raises `Refused` naming the global. `install()` makes
FileSystemReader.read_metadata (and megatron's subclass) use it, in the calling process.

Tensor payloads are not affected: DCP reads them with `torch.load(weights_only=True)`, and
megatron's legacy common.pt uses torch.load's default, weights_only=True since torch 2.6.
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

    def __init__(self, module: str, name: str):
        super().__init__(f"refused to unpickle {module}.{name} (not a checkpoint metadata class)")
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


def install() -> None:
    """Every FileSystemReader in this process (megatron's readers subclass it) reads `.metadata`
    with the restricted unpickler. Idempotent."""
    from torch.distributed.checkpoint import FileSystemReader

    if getattr(FileSystemReader.read_metadata, "_restricted", False):
        return
    _read_metadata._restricted = True  # type: ignore[attr-defined]
    FileSystemReader.read_metadata = _read_metadata  # type: ignore[method-assign]
