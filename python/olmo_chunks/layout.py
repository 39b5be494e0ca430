"""Which boxes of a global tensor a DTensor shard holds, and where they sit in the local tensor."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Piece", "dtensor_pieces", "shard_pieces", "spec_pieces"]

# Half-open [start, stop) range of global indices along one tensor dim.
_Interval = tuple[int, int]


@dataclass(frozen=True)
class Piece:
    """A box of the global tensor held by the local shard, and where it sits in the local tensor."""

    global_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]


def shard_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> list[Piece]:
    """Boxes of a `global_shape` tensor held at mesh `coordinate` under `placements` (left to right)."""
    return _pieces(global_shape, mesh_shape, coordinate, placements, range(len(placements)))


def dtensor_pieces(dt: DTensor) -> list[Piece]:
    """Boxes of the global tensor held by this rank's local shard of `dt` (empty if not in the mesh)."""
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    spec = (tuple(dt.shape), tuple(mesh.shape), tuple(coordinate), tuple(dt.placements),
            getattr(dt._spec, "shard_order", None))
    try:
        hash(spec)
    except TypeError:  # a placement or shard order that cannot be hashed: computed each time
        return spec_pieces(*spec)
    return list(_spec_pieces_cached(*spec))


@functools.lru_cache(maxsize=4096)
def _spec_pieces_cached(*spec: object) -> tuple[Piece, ...]:
    """`spec_pieces`, once per distinct spec: a model's layers repeat a few shapes and layouts, and
    computing the pieces was most of a load's cost per key (a 1,000-key load, benches/README)."""
    return tuple(spec_pieces(*spec))  # type: ignore[arg-type]


def spec_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: tuple[Placement, ...],
    shard_order: object,
) -> list[Piece]:
    """`shard_pieces` for a DTensor spec, whose `shard_order` (torch >= 2.10) may apply the shardings
    of one tensor dim in an order other than left to right; older torch has no such field.

    Torch 2.10 keeps `_StridedShard` placements and records beside them the shard_order it decodes
    from their split factors: two descriptions of one layout. Both are computed and must agree at
    this coordinate (whichever torch used, these pieces are then the ones it holds); where they do
    not, the spec is ambiguous and refused (`InvalidArgumentError`). They can disagree on a spec
    torch made itself: (_StridedShard(0, sf=2), Shard(0)) of 9 rows on a 4 x 2 mesh, where torch
    2.10's decoded order (1, 0) puts row 8 on coordinate (3, 1) and its `distribute_tensor` on (3, 0),
    while its `redistribute` into that spec puts it on (3, 1): one spec, two layouts of the data.
    """
    left_to_right = list(range(len(placements)))
    if shard_order is None:
        return _pieces(global_shape, mesh_shape, coordinate, placements, left_to_right)
    entries = [tuple(entry.mesh_dims) for entry in shard_order]  # type: ignore[attr-defined]
    if all(list(mesh_dims) == sorted(mesh_dims) for mesh_dims in entries):
        return _pieces(global_shape, mesh_shape, coordinate, placements, left_to_right)
    ordered = _pieces(global_shape, mesh_shape, coordinate, *_decoded(placements, shard_order))
    if not any(isinstance(p, _StridedShard) for p in placements):
        return ordered
    if ordered != _pieces(global_shape, mesh_shape, coordinate, placements, left_to_right):
        raise InvalidArgumentError(
            f"ambiguous layout: _StridedShard in {placements} with shard_order {shard_order}")
    return ordered


def _decoded(placements: tuple[Placement, ...], shard_order: object) -> tuple[tuple[Placement, ...], list[int]]:
    """The placements as plain shards (a `_StridedShard` as the `Shard` it strides) and the order of
    mesh dims in which `shard_order` applies them: shardings of different tensor dims commute, so
    one flat order serves them all."""
    order = [d for entry in shard_order for d in entry.mesh_dims]  # type: ignore[attr-defined]
    order += [d for d in range(len(placements)) if d not in order]
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements), order


def _pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    order: Sequence[int],
) -> list[Piece]:
    """`shard_pieces` with the shardings applied in mesh-dim `order`."""
    ndim = len(global_shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and "
            f"{len(placements)} placements disagree in length"
        )
    for size, c in zip(mesh_shape, coordinate, strict=True):
        if not 0 <= c < size:
            raise ValueError(f"coordinate {tuple(coordinate)} lies outside mesh {tuple(mesh_shape)}")
    if any(size < 0 for size in global_shape):
        raise ValueError(f"negative size in global shape {tuple(global_shape)}")

    held: list[list[_Interval]] = [[(0, size)] if size else [] for size in global_shape]
    for mesh_dim in order:
        placement = placements[mesh_dim]
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        # _StridedShard subclasses Shard in torch 2.6, so it must be tested first.
        if isinstance(placement, _StridedShard):
            d = _tensor_dim(placement.dim, ndim, placement)
            held[d] = _strided_shard(held[d], n, c, int(placement.split_factor))
        elif isinstance(placement, Shard):
            d = _tensor_dim(placement.dim, ndim, placement)
            held[d] = _chunk(held[d], n, c)
        elif isinstance(placement, Partial):
            raise ValueError(f"{placement} is a pending reduction and holds no piece of the tensor")
        elif not isinstance(placement, Replicate):
            raise ValueError(f"unsupported placement {placement!r}")

    per_dim = [list(_with_local_offsets(_merge(intervals))) for intervals in held]
    return [
        Piece(
            global_offsets=tuple(start for start, _, _ in combo),
            sizes=tuple(size for _, size, _ in combo),
            local_offsets=tuple(local for _, _, local in combo),
        )
        for combo in itertools.product(*per_dim)
    ]


def _tensor_dim(dim: int, ndim: int, placement: Placement) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{placement} shards dim {dim} of a {ndim}-d tensor")
    return dim % ndim


def _length(intervals: list[_Interval]) -> int:
    return sum(stop - start for start, stop in intervals)


def _take(intervals: list[_Interval], begin: int, end: int) -> list[_Interval]:
    """Positions [begin, end) of the index sequence that `intervals` spell out."""
    taken = []
    pos = 0
    for start, stop in intervals:
        lo, hi = max(begin, pos), min(end, pos + stop - start)
        if lo < hi:
            taken.append((start + lo - pos, start + hi - pos))
        pos += stop - start
    return taken


def _chunk(intervals: list[_Interval], n: int, c: int) -> list[_Interval]:
    """Chunk `c` of `n`, split the way torch.chunk does (trailing chunks smaller or empty)."""
    length = _length(intervals)
    step = -(-length // n)
    return _take(intervals, min(c * step, length), min((c + 1) * step, length))


def _strided_shard(intervals: list[_Interval], n: int, c: int, split_factor: int) -> list[_Interval]:
    """Chunk `c` of each of the `n`-way chunkings of the `split_factor` chunks, concatenated."""
    held = []
    for j in range(split_factor):
        held.extend(_chunk(_chunk(intervals, split_factor, j), n, c))
    return held


def _merge(intervals: list[_Interval]) -> list[_Interval]:
    """Join neighbours in the sequence that are also neighbours in the global tensor."""
    merged: list[_Interval] = []
    for start, stop in intervals:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


def _with_local_offsets(intervals: list[_Interval]) -> list[tuple[int, int, int]]:
    """(global start, size, local start) of each interval, the local tensor being their concatenation."""
    out = []
    local = 0
    for start, stop in intervals:
        out.append((start, stop - start, local))
        local += stop - start
    return out
