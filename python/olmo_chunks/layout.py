"""Which boxes of a global tensor a DTensor shard holds, and where they sit in the local tensor."""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
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

T = TypeVar("T")

# Half-open [start, stop) range of global indices along one tensor dim.
_Interval = tuple[int, int]

# How torch splits a _StridedShard (`_strided_shard`): its release, not a feature of its API, says.
_CHUNKS_STRIDE_WHOLE = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) < (2, 10)


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


def dtensor_pieces(dt: DTensor, made_by: Reading | None = None) -> list[Piece]:
    """Boxes of the global tensor held by this rank's local shard of `dt` (empty if not in the mesh);
    `made_by` as in `spec_pieces`."""
    spec = _dtensor_spec(dt)
    if spec is None:
        return []
    return list(once_per_spec(_spec_pieces_cached, spec_pieces, (*spec, made_by)))


def _dtensor_spec(dt: DTensor) -> tuple[Any, ...] | None:
    """The arguments of `spec_pieces` for this rank's shard of `dt` (None if not in the mesh)."""
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    return (tuple(dt.shape), tuple(mesh.shape), tuple(coordinate), tuple(dt.placements),
            getattr(dt._spec, "shard_order", None), tuple(dt._local_tensor.shape))


def local_readings(dt: DTensor) -> tuple[bool, bool] | None:
    """Where the two readings of `dt`'s spec (`spec_pieces`) place other elements at this rank's
    coordinate, whether its local shard fits each (`reading_fits`); None where they agree (or the
    rank is not in the mesh). What the ranks say together decides (`agreed_reading`)."""
    if not any(isinstance(p, _StridedShard) for p in dt.placements):
        return None
    spec = _dtensor_spec(dt)
    return None if spec is None else once_per_spec(_local_readings_cached, _local_readings, spec)


@functools.lru_cache(maxsize=4096)
def _local_readings_cached(*spec: Any) -> tuple[bool, bool] | None:
    return _local_readings(*spec)


def _local_readings(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                    placements: tuple[Placement, ...], shard_order: object,
                    local_shape: tuple[int, ...]) -> tuple[bool, bool] | None:
    left_to_right = _pieces(global_shape, mesh_shape, coordinate, placements, range(len(placements)))
    ordered = ordered_reading(global_shape, mesh_shape, coordinate, placements, shard_order)
    if ordered is None or ordered == left_to_right:
        return None
    return reading_fits(global_shape, mesh_shape, coordinate, placements, shard_order, local_shape)


def agreed_reading(what: str, fits: Sequence[tuple[bool, bool]]) -> Reading:
    """The reading of a `_StridedShard` spec that made the tensor (`what`, for the errors), from
    what each rank holding it said of its local shard (`local_readings`, `reading_fits`): the one
    all of them fit. `InvalidArgumentError` where all fit both (no shape tells) or none fits all."""
    left, ordered = all(f[0] for f in fits), all(f[1] for f in fits)
    if left != ordered:
        return LEFT_TO_RIGHT if left else ORDERED
    if left:
        raise InvalidArgumentError(
            f"ambiguous layout of {what}: every rank's local shard fits both readings of its _StridedShard "
            f"placements, {_READINGS}, so no shape tells which made it; make the sharded dims divisible by "
            "the mesh sizes")
    raise InvalidArgumentError(
        f"{what}: the ranks' local shards fit neither reading of its _StridedShard placements together "
        f"({_READINGS})")


_READINGS = ("left to right (as `distribute_tensor` makes it) or in the order the split factors encode (as "
             "`redistribute` and FSDP2 over tensor parallelism do)")


def once_per_spec(cached: Callable[..., T], plain: Callable[..., Any], spec: tuple[Any, ...]) -> T:
    """`cached(*spec)`, or `plain(*spec)` each time for a spec that cannot be hashed (a placement or
    shard order of a torch that makes them unhashable; a TypeError of the call itself comes again
    from `plain`). Not `hash(spec)` first: torch's placements hash in Python, and that doubled the
    cost of a `_StridedShard` key."""
    try:
        return cached(*spec)
    except TypeError:
        return plain(*spec)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=4096)
def _spec_pieces_cached(*spec: object) -> tuple[Piece, ...]:
    """`spec_pieces`, once per distinct spec: a model's layers repeat a few shapes and layouts, and
    computing the pieces was most of a load's cost per key (a 1,000-key load, benches/README)."""
    return tuple(spec_pieces(*spec))  # type: ignore[arg-type]


# The two readings of a spec with `_StridedShard` (`spec_pieces`), by what made the tensor.
Reading = Literal["left to right", "ordered"]
LEFT_TO_RIGHT: Reading = "left to right"
ORDERED: Reading = "ordered"


def spec_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: tuple[Placement, ...],
    shard_order: object,
    local_shape: Sequence[int] | None = None,
    made_by: Reading | None = None,
) -> list[Piece]:
    """`shard_pieces` for a DTensor spec, whose `shard_order` (torch >= 2.10) may apply the shardings
    of one tensor dim in an order other than left to right; older torch has no such field.

    A spec with `_StridedShard` tells one layout twice: left to right, each `_StridedShard` striding
    (`distribute_tensor`, and DCP's offsets), and as plain shards applied in the order its split
    factors encode (`redistribute` into the spec; FSDP2 over tensor parallelism, which shards each
    TP shard). Torch 2.10 records that order beside the spec; later releases leave `shard_order`
    None and derive it when asked, as `_strided_order` does here. Both readings are computed and must
    agree at this coordinate (whichever made the data, these pieces are then the ones it holds).
    They disagree on some uneven shapes: (_StridedShard(0, sf=2), Shard(0)) of 9 rows on a 4 x 2
    mesh, where `distribute_tensor` puts row 8 on coordinate (3, 0) and `redistribute` on (3, 1)
    (torch 2.10 and 2.15). There the local shard's shape tells which made it, where just one reading
    holds that many rows; where both do, the spec is ambiguous at this coordinate and refused
    (`InvalidArgumentError`). On a dp x tp mesh with (_StridedShard(0, sf=tp), Shard(0)) that is
    rare from torch 2.10 (89 of the 20,691 uneven row counts below 1,500 on dp 2-8, tp 2-8 have
    such a coordinate, none above 706 rows: 27 rows on 3 x 4 at (2, 2)) and common before it (the
    2.8/2.9 split: 212 of 405 pairings of vocabulary and hidden sizes with dp 2-32 and tp 2-8). The
    ranks then agree it from all their shapes (`local_readings`, `agreed_reading`), which settles
    every such 2.10 case and 66 of those 212 (the rest hold the same shapes under both readings
    everywhere): `made_by` names the agreed reading, for a spec that encodes its shard order.
    """
    left_to_right = _pieces(global_shape, mesh_shape, coordinate, placements, range(len(placements)))
    ordered = ordered_reading(global_shape, mesh_shape, coordinate, placements, shard_order)
    if ordered is None or ordered == left_to_right or not any(isinstance(p, _StridedShard) for p in placements):
        return left_to_right if ordered is None else ordered
    # A shard_order other than the one the split factors encode (a spec torch 2.10 lets one build)
    # describes neither reading: no shape can tell which holds.
    told = shard_order is None or _order_of(shard_order) == _strided_order(placements, mesh_shape, len(global_shape))
    if told and made_by is not None:
        return left_to_right if made_by == LEFT_TO_RIGHT else ordered
    fits = [r for r in (left_to_right, ordered) if told and local_shape is not None and _fits(r, local_shape)]
    if len(fits) == 1:
        return fits[0]
    raise InvalidArgumentError(
        f"ambiguous layout: _StridedShard in {placements} with the shard order it encodes "
        f"({shard_order or 'from its split factors'}): at coordinate {tuple(coordinate)} of mesh "
        f"{tuple(mesh_shape)}, a tensor of shape {tuple(global_shape)} holds other elements when "
        "`distribute_tensor` made it than when `redistribute` or FSDP2 over tensor parallelism did"
        + ("" if local_shape is None else
           f", and its local shard of shape {tuple(local_shape)} fits {'both' if fits else 'neither'}")
        + "; make the sharded dims divisible by the mesh sizes")


def readings_differ(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: tuple[Placement, ...],
                    shard_order: object) -> bool:
    """Whether the two readings of a spec (`spec_pieces`) place other elements at some coordinate of
    the mesh: the same answer on every rank, from the spec alone (once per distinct spec: it visits
    every coordinate)."""
    if not any(isinstance(p, _StridedShard) for p in placements) or splits_evenly(global_shape, mesh_shape, placements):
        return False
    return once_per_spec(_readings_differ_cached, _readings_differ,
                          (tuple(global_shape), tuple(mesh_shape), tuple(placements), shard_order))


def splits_evenly(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: tuple[Placement, ...]) -> bool:
    """Whether every sharded dim of the tensor divides by the product of the mesh dims sharding it:
    then both readings of a spec place every element alike (property-tested against the scan of
    every coordinate), which at 4,096 ranks took 0.36 s per spec."""
    product = [1] * len(global_shape)
    for n, p in zip(mesh_shape, placements, strict=True):
        if isinstance(p, Shard | _StridedShard):
            product[_tensor_dim(p.dim, len(global_shape), p)] *= n
    return all(size % k == 0 for size, k in zip(global_shape, product, strict=True))


@functools.lru_cache(maxsize=1024)
def _readings_differ_cached(*spec: Any) -> bool:
    return _readings_differ(*spec)


def _readings_differ(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                     shard_order: object) -> bool:
    if ordered_reading(global_shape, mesh_shape, (0,) * len(mesh_shape), placements, shard_order) is None:
        return False  # (an order left to right: None at every coordinate)
    return any(
        _pieces(global_shape, mesh_shape, c, placements, range(len(placements)))
        != ordered_reading(global_shape, mesh_shape, c, placements, shard_order)
        for c in itertools.product(*map(range, mesh_shape)))


def reading_fits(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: tuple[Placement, ...], shard_order: object,
                 local_shape: Sequence[int]) -> tuple[bool, bool]:
    """Whether a local shard of `local_shape` at `coordinate` fits the left-to-right reading of the
    spec and the ordered one. The reading that every rank's shard fits, where just one does, is the
    one that made the tensor: ranks that must agree on it reduce these with a minimum."""
    if shard_order is not None and _order_of(shard_order) != _strided_order(placements, mesh_shape,
                                                                           len(global_shape)):
        raise InvalidArgumentError(
            f"ambiguous layout: _StridedShard in {placements} with the shard order {shard_order}, which "
            "contradicts the order its split factors encode: neither reading holds")
    left_to_right = _pieces(global_shape, mesh_shape, coordinate, placements, range(len(placements)))
    ordered = ordered_reading(global_shape, mesh_shape, coordinate, placements, shard_order)
    return _fits(left_to_right, local_shape), _fits(left_to_right if ordered is None else ordered, local_shape)


def _fits(pieces: list[Piece], local_shape: Sequence[int]) -> bool:
    """Whether `pieces` tile a local tensor of `local_shape`."""
    if not pieces:
        return math.prod(local_shape) == 0
    return local_extent(pieces, len(local_shape)) == tuple(local_shape)


def local_extent(pieces: Sequence[Piece], ndim: int) -> tuple[int, ...]:
    """The shape of the local tensor `pieces` tile (all zeros where there are none)."""
    if not pieces:
        return (0,) * ndim
    return tuple(max(p.local_offsets[i] + p.sizes[i] for p in pieces) for i in range(ndim))


def ordered_reading(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: tuple[Placement, ...],
    shard_order: object,
) -> list[Piece] | None:
    """The pieces with each `_StridedShard` as the `Shard` it strides and the shardings applied in
    the order `shard_order` gives or, where it is None, the split factors encode; None where that
    order is left to right, or no order gives the split factors."""
    per_dim: dict[int, list[int]] | None
    if shard_order is not None:
        per_dim = _order_of(shard_order)
    elif any(isinstance(p, _StridedShard) for p in placements):
        per_dim = _strided_order(placements, mesh_shape, len(global_shape))
    else:
        return None
    if per_dim is None or all(mesh_dims == sorted(mesh_dims) for mesh_dims in per_dim.values()):
        return None
    # Shardings of different tensor dims commute, so one flat order serves them all.
    order = [d for mesh_dims in per_dim.values() for d in mesh_dims]
    order += [d for d in range(len(placements)) if d not in order]
    plain = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
    return _pieces(global_shape, mesh_shape, coordinate, plain, order)


def _order_of(shard_order: object) -> dict[int, list[int]]:
    """A DTensor spec's `shard_order` as the mesh dims sharding each tensor dim, in order."""
    return {int(e.tensor_dim): list(e.mesh_dims) for e in shard_order}  # type: ignore[attr-defined]


def _strided_order(placements: tuple[Placement, ...], mesh_shape: Sequence[int],
                   ndim: int) -> dict[int, list[int]] | None:
    """The mesh dims sharding each tensor dim, in the order their shardings apply, as `_StridedShard`
    split factors encode it (torch derives the same where a spec leaves `shard_order` None): from the
    right, each sharding of a tensor dim goes where the mesh dims ordered before it multiply to its
    split factor (1 for a `Shard`). None where no order gives the split factors."""
    per_dim: dict[int, list[int]] = {}
    for mesh_dim in reversed(range(len(placements))):
        p = placements[mesh_dim]
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        order = per_dim.setdefault(_tensor_dim(p.dim, ndim, p), [])
        want = int(p.split_factor) if isinstance(p, _StridedShard) else 1
        product = 1
        for at in range(len(order) + 1):
            if product == want:
                order.insert(at, mesh_dim)
                break
            if at < len(order):
                product *= mesh_shape[order[at]]
        else:
            return None
    return dict(sorted(per_dim.items()))


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


def _strided_shard(intervals: list[_Interval], n: int, c: int, split_factor: int,
                   whole: bool | None = None) -> list[_Interval]:
    """Chunk `c` of each of the `n`-way chunkings of the `split_factor` chunks, concatenated (torch
    2.10 and later); before 2.10 (`whole`), chunks `c`, `c + n`, ... of the `n * split_factor`-way
    chunking. The two agree where every chunking is even, the only case torch 2.6 and 2.7 accept."""
    if _CHUNKS_STRIDE_WHOLE if whole is None else whole:
        return [i for j in range(split_factor) for i in _chunk(intervals, n * split_factor, c + j * n)]
    return [i for j in range(split_factor) for i in _chunk(_chunk(intervals, split_factor, j), n, c)]


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
