"""Full low-precision compute weights rebuilt from restored FP32 main-weight shards.

The checkpoint holds FP32 main weights only; after a load each rank all-gathers its DP (dense
DTensors) or EP-DP (expert flat views) shards into the compute weights it runs with. Shards are cast
to the compute dtype (BF16 by default) before any collective, which halves the traffic. The
collectives are plain `torch.distributed` ones on the shards' own groups: NCCL for CUDA tensors,
gloo for CPU ones.

With `mxfp8=True`, `compute_weights` also builds the MXFP8 caches (`olmo_chunks.mx`) of every
compute weight with two or more dimensions, row-wise and column-wise, from the gathered compute
weight: quantising after the all-gather keeps the collectives exactly those of the BF16 rebuild and
needs no care for MX blocks that straddle a shard boundary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from .errors import InvalidArgumentError
from .experts import ExpertFlatView
from .layout import (
    Piece,
    Reading,
    agreed_reading,
    local_extent,
    once_per_spec,
    reading_fits,
    readings_differ,
    spec_pieces,
)
from .mx import MXFP8Cache, to_mxfp8

__all__ = ["compute_weights", "dtensor_weight", "expert_weight", "full_weight"]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` as a new contiguous tensor (never the main weight's own memory)."""
    out = t.to(dtype).contiguous()
    return out.clone() if out.data_ptr() == t.data_ptr() and out.numel() else out


def _local_numel(pieces: Sequence[Piece]) -> int:
    return sum(math.prod(p.sizes) for p in pieces)


def _all_gather_padded(buf: torch.Tensor, sizes: Sequence[int],
                       group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every peer's 1-D `buf` (peer `j` holds `sizes[j]` elements), via one all_gather of buffers
    padded to the largest size."""
    m = max(sizes)
    if m == 0:
        return [buf[:0] for _ in sizes]
    if buf.numel() < m:
        buf = torch.cat([buf, buf.new_zeros(m - buf.numel())])
    out = [torch.empty(m, dtype=buf.dtype, device=buf.device) for _ in sizes]
    dist.all_gather(out, buf, group=group)
    return [o[:s] for o, s in zip(out, sizes, strict=True)]


def dtensor_weight(dt: DTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The full tensor of `dt` in `dtype`, all-gathered over its sharded mesh dims only (replicated
    dims need no traffic). Uneven Shard and _StridedShard layouts are handled: where a spec reads two
    ways (`layout.spec_pieces`), the ranks first agree which one made the tensor (`_made_by`)."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidArgumentError("this rank is not in the DTensor's mesh")
    placements = tuple(dt.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise InvalidArgumentError(f"{placements}: a Partial DTensor is not a weight (reduce it first)")
    shape = tuple(dt.shape)
    mesh_shape = tuple(mesh.shape)
    shard_order = getattr(dt._spec, "shard_order", None)
    made_by = _made_by(dt, coord) if readings_differ(shape, mesh_shape, placements, shard_order) else None
    memo = once_per_spec(_pieces_by_coordinate, lambda *_: {}, (shape, mesh_shape, placements, shard_order, made_by))

    def pieces(c: Sequence[int]) -> list[Piece]:
        c = tuple(c)
        if c not in memo:
            memo[c] = spec_pieces(shape, mesh_shape, c, placements, shard_order, made_by=made_by)
        return memo[c]

    local = _cast(dt.to_local(), dtype)
    if local.numel() != _local_numel(pieces(coord)):
        raise InvalidArgumentError(
            f"local shard has {local.numel()} elements, its placements {placements} say "
            f"{_local_numel(pieces(coord))}")
    sharded = [d for d, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not sharded:
        return local.reshape(shape)
    held: list[tuple[tuple[int, ...], torch.Tensor]] = [(tuple(coord), local.reshape(-1))]
    for d in sharded:
        peers = [[(*c[:d], j, *c[d + 1 :]) for c, _ in held] for j in range(mesh_shape[d])]
        sizes = [[_local_numel(pieces(c)) for c in cs] for cs in peers]
        bufs = _all_gather_padded(torch.cat([t for _, t in held]), [sum(s) for s in sizes], mesh.get_group(d))
        held = [(c, part) for cs, ss, buf in zip(peers, sizes, bufs, strict=True)
                for c, part in zip(cs, torch.split(buf, ss), strict=True)]
    out = torch.empty(shape, dtype=dtype, device=local.device)
    for c, flat in held:
        ps = pieces(c)
        view = flat.reshape(local_extent(ps, len(shape)))
        for p in ps:
            dst = tuple(slice(o, o + s) for o, s in zip(p.global_offsets, p.sizes, strict=True))
            src = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
            out[dst] = view[src]
    return out


@functools.lru_cache(maxsize=64)
def _pieces_by_coordinate(*spec: object) -> dict[tuple[int, ...], list[Piece]]:
    """The pieces of one spec (shape, mesh, placements, shard order, agreed reading) by mesh
    coordinate, filled as `dtensor_weight` asks: a weight needs those of every coordinate it gathers
    from, twice, and a model's layers share a few specs (every coordinate of a 512 x 8 FSDP-over-TP
    mesh took 239 ms, of a 4,096-rank FSDP one 37 ms, per weight)."""
    return {}


def _made_by(dt: DTensor, coord: Sequence[int]) -> Reading:
    """Which reading of `dt`'s spec made it, where the two place other elements somewhere on its
    mesh (every rank of the mesh calls this, as it knows from the spec alone): the one that every
    rank's local shard fits (`layout.reading_fits`), from one all_reduce (MIN) of two integers per
    mesh dim. A rank's own shape decides it at most coordinates; the others' decide the rest, as in
    a 9-row FSDP2-over-TP weight on a 4 x 2 mesh."""
    mesh, placements, local = dt.device_mesh, tuple(dt.placements), dt.to_local()
    spec = (tuple(dt.shape), tuple(mesh.shape), coord, placements, getattr(dt._spec, "shard_order", None))
    fits = torch.tensor(reading_fits(*spec, tuple(local.shape)), dtype=torch.int32, device=local.device)
    for d, size in enumerate(mesh.shape):
        if size > 1:
            dist.all_reduce(fits, dist.ReduceOp.MIN, group=mesh.get_group(d))
    left, ordered = (bool(v) for v in fits.tolist())
    return agreed_reading(f"a tensor of shape {tuple(dt.shape)} placed {placements} on mesh {tuple(mesh.shape)}",
                          [(left, ordered)])


def expert_weight(view: ExpertFlatView, group: dist.ProcessGroup | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """This EP-MP rank's experts, shape `[num_local_experts, *expert_shape]` in `dtype`, gathered
    over the EP-DP `group` when the flat storage is sharded there (replicas need no traffic)."""
    lo = view.layout
    local = _cast(view.local, dtype)
    if lo.sharded and lo.ep_dp_size > 1:
        if group is None:
            raise InvalidArgumentError(f"{view}: sharded over EP-DP, so the EP-DP group is needed")
        if dist.get_world_size(group) != lo.ep_dp_size or dist.get_rank(group) != lo.ep_dp_rank:
            raise InvalidArgumentError(
                f"{view}: the group has rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                f"the layout says EP-DP rank {lo.ep_dp_rank} of {lo.ep_dp_size}")
        sizes = [b - a for a, b in (lo.block_range(d) for d in range(lo.ep_dp_size))]
        local = torch.cat(_all_gather_padded(local, sizes, group))
    return local.reshape(lo.num_local_experts, *lo.expert_shape)


def full_weight(value: DTensor | ExpertFlatView | torch.Tensor, *,
                ep_dp_group: dist.ProcessGroup | None = None,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The compute weight of one main weight: a DTensor gathered whole, an expert flat view
    gathered to this EP-MP rank's experts, a plain tensor cast."""
    if isinstance(value, DTensor):
        return dtensor_weight(value, dtype)
    if isinstance(value, ExpertFlatView):
        return expert_weight(value, ep_dp_group, dtype)
    if isinstance(value, torch.Tensor):
        return _cast(value, dtype)
    raise InvalidArgumentError(f"{type(value).__name__} is not a main weight")


def _mxfp8_cache(key: str, weight: torch.Tensor) -> MXFP8Cache:
    """Both MXFP8 forms of one compute weight (blocks of 32 along its last dim and along its
    second-to-last); a dim that is not a multiple of 32 is refused, naming `key`."""
    try:
        return MXFP8Cache(to_mxfp8(weight, 32, -1), to_mxfp8(weight, 32, -2))
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{key}: {e}") from None


@overload
def compute_weights(main: Mapping[str, DTensor | ExpertFlatView | torch.Tensor], *,
                    ep_dp_group: dist.ProcessGroup | None = ..., dtype: torch.dtype = ...,
                    mxfp8: Literal[False] = ...) -> dict[str, torch.Tensor]: ...
@overload
def compute_weights(main: Mapping[str, DTensor | ExpertFlatView | torch.Tensor], *,
                    ep_dp_group: dist.ProcessGroup | None = ..., dtype: torch.dtype = ...,
                    mxfp8: Literal[True]) -> tuple[dict[str, torch.Tensor], dict[str, MXFP8Cache]]: ...
def compute_weights(main: Mapping[str, DTensor | ExpertFlatView | torch.Tensor], *,
                    ep_dp_group: dist.ProcessGroup | None = None,
                    dtype: torch.dtype = torch.bfloat16, mxfp8: bool = False,
                    ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, MXFP8Cache]]:
    """`full_weight` of every main weight, by key (the same order on every rank: collective).

    With `mxfp8=True`, returns `(weights, caches)`: `caches[key]` is the `MXFP8Cache` of
    `weights[key]` for every weight of two or more dimensions (`rowwise`: blocks along dim -1;
    `colwise`: along dim -2, which is dim 0 of a matrix and each expert's columns of a stacked
    `[experts, out, in]` weight). All gathers happen before any quantisation, so a weight MX cannot
    block (a dim not a multiple of 32) fails every rank alike after the collectives.
    """
    weights = {key: full_weight(v, ep_dp_group=ep_dp_group, dtype=dtype) for key, v in main.items()}
    if not mxfp8:
        return weights
    return weights, {key: _mxfp8_cache(key, w) for key, w in weights.items() if w.ndim >= 2}
