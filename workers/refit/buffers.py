"""A pool of tensors a refit sender lends to the export and takes back once their bucket is sent.

The merged export (workers.trainer.merged_export) writes each merged weight into a tensor from the
pool; `wire.stream_buckets` gives a bucket's tensors back once the transport has copied them out
(`ray.put`, or packed and broadcast), so the next bucket and the next refit write into memory that
is already there. On a CPU a fresh allocation faults in every page when first written, which made
a copy into new memory several times a copy into memory touched before (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Iterable

import torch


class BufferPool:
    """Tensors lent by (shape, dtype, device) and given back for reuse; holds what is given back."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: dict[int, tuple] = {}   # data_ptr -> key of a tensor out on loan

    def take(self, shape: torch.Size | tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        free = self._free.get(key)
        tensor = free.pop() if free else torch.empty(key[0], dtype=dtype, device=key[2])
        if tensor.numel():   # an empty tensor has no memory of its own to keep
            self._lent[tensor.data_ptr()] = key
        return tensor

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """Return the pool's own tensors among `tensors` (others are ignored): reusable from now on."""
        for t in tensors:
            key = self._lent.pop(t.data_ptr(), None) if isinstance(t, torch.Tensor) else None
            if key is not None and tuple(t.shape) == key[0] and t.dtype == key[1]:
                self._free.setdefault(key, []).append(t)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of the tensors waiting in the pool to be reused."""
        free = self._free.get((tuple(t.shape), t.dtype, t.device), [])
        return any(f is t for f in free)

    def clear(self) -> None:
        self._free.clear()
        self._lent.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse (not counting those on loan)."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
