"""What one rank holds of each global tensor, as plain boxes and flat ranges for the core."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from . import _core
from .errors import InvalidArgumentError
from .layout import Piece, Reading, dtensor_pieces

__all__ = ["ChunkItem", "ChunkSource", "Region", "TensorShard", "check_dtype", "describe", "dtype_name",
           "is_chunk_source", "is_dense", "region_numel", "torch_dtype"]


# A chunk's region of its tensor.
Region = _core.Box | _core.Flat
# One chunk to write: its tensor's key, its region, its elements.
ChunkItem = tuple[str, Region, torch.Tensor]


def region_numel(region: Region) -> int:
    return region.len if isinstance(region, _core.Flat) else math.prod(region.sizes)


@dataclass
class TensorShard:
    """The part of a global tensor held in `local`: boxes (`pieces`, at their local offsets) and/or
    flat ranges of the canonical order (`flat`: global start, length, element offset in `local`,
    which must then be contiguous)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    local: torch.Tensor
    pieces: list[Piece] = field(default_factory=list)
    flat: list[tuple[int, int, int]] = field(default_factory=list)
    role: str | None = None

    def regions(self) -> Iterator[tuple[Region, torch.Tensor]]:
        """`(region, data)` per held piece: data a view of `local` holding the region's elements in
        storage order (made contiguous by the writer)."""
        for p in self.pieces:
            if 0 in p.sizes:
                continue
            view = self.local[tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))]
            yield _core.Box(list(p.global_offsets), list(p.sizes)), view
        flat_local = self.local.reshape(-1) if self.flat else None
        for start, length, off in self.flat:
            if length:
                yield _core.Flat(start, length), flat_local[off : off + length]  # type: ignore[index]

    def core_pieces(self, local: torch.Tensor) -> list[_core.Piece]:
        """Target pieces for loading into `local` (which has the shape of `self.local`)."""
        strides = list(local.stride())
        out = []
        for p in self.pieces:
            if 0 in p.sizes:
                continue
            start = sum(o * s for o, s in zip(p.local_offsets, strides, strict=True))
            out.append(_core.Piece(list(p.global_offsets), list(p.sizes), start, strides))
        for start, length, off in self.flat:
            if length:
                out.extend(q.shifted(off) for q in _core.flat_pieces(list(self.shape), start, length))
        return out


@runtime_checkable
class ChunkSource(Protocol):
    """Anything that can describe itself as a `TensorShard` (e.g. an expert flat view)."""

    def tensor_shard(self) -> TensorShard: ...


def is_chunk_source(value: Any) -> bool:
    """`isinstance(value, ChunkSource)`, without the protocol check's cost (3.6 us a call against
    0.08, twice per expert view in every save and load)."""
    return callable(getattr(value, "tensor_shard", None))


def describe(key: str, value: Any, made_by: Reading | None = None) -> TensorShard:
    """The `TensorShard` of a state-dict value: a DTensor (`made_by`: which reading of a
    `_StridedShard` spec the ranks agreed, `layout.agreed_reading`), a plain tensor (the whole
    global tensor, the same on every rank that has it) or a `ChunkSource`."""
    if isinstance(value, DTensor):
        try:
            pieces = dtensor_pieces(value, made_by)
        except ValueError as exc:
            raise InvalidArgumentError(f"{key!r}: {exc}") from None
        local = value.to_local()
        if any(len(p.sizes) != local.dim()
               or any(o + n > m for o, n, m in zip(p.local_offsets, p.sizes, local.shape, strict=True))
               for p in pieces):
            # A DTensor built by hand (from_local without run_check): its bytes would not fill its pieces.
            raise InvalidArgumentError(
                f"{key!r}: the local shard of shape {tuple(local.shape)} is smaller than what "
                f"{tuple(value.placements)} of a {tuple(value.shape)} tensor place on this rank: "
                f"{[(p.global_offsets, p.sizes) for p in pieces]}")
        shard = TensorShard(value.dtype, tuple(value.shape), _plain(key, local), pieces)
    elif isinstance(value, torch.Tensor):
        value = _plain(key, value)
        shape = tuple(value.shape)
        shard = TensorShard(value.dtype, shape, value, [Piece((0,) * len(shape), shape, (0,) * len(shape))])
    elif is_chunk_source(value):
        shard = value.tensor_shard()
    else:
        raise InvalidArgumentError(f"{key!r}: {type(value).__name__} is not a tensor")
    check_dtype(key, shard.dtype)
    return shard


_DTYPES = frozenset(_core.DTYPES)


def check_dtype(key: str, dtype: torch.dtype) -> None:
    """Refuses a dtype the format does not store (`InvalidArgumentError` naming `key`)."""
    if dtype_name(dtype) not in _DTYPES:
        raise InvalidArgumentError(f"{key!r}: dtype {dtype_name(dtype)} cannot be checkpointed (the format stores "
                                   f"{', '.join(_core.DTYPES)})")


def _plain(key: str, t: torch.Tensor) -> torch.Tensor:
    """`t` if it is a strided tensor with data (expanded ones included: their logical values are
    saved); sparse, nested, quantized and meta tensors are refused."""
    kind = (
        "a nested" if t.is_nested
        else f"a {t.layout} (not strided)" if t.layout != torch.strided
        else "a quantized" if t.is_quantized
        else "a meta (data-less)" if t.device.type == "meta"
        else None
    )
    if kind:
        raise InvalidArgumentError(f"{key!r}: {kind} tensor cannot be checkpointed (use a dense tensor with data)")
    return t


def is_dense(t: torch.Tensor) -> bool:
    """True if no two elements of `t` share memory (so bytes can be written straight into it)."""
    if t.is_contiguous():
        return True
    extent = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda x: x[1]):
        if size == 1:
            continue
        if stride < extent:
            return False
        extent = stride * size
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype {name!r} is not known to this torch")
    return dtype
