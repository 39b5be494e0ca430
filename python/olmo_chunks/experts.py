"""Expert flat views: an EP-MP rank's local experts, held as flat optimizer storage, as chunks of
the global expert tensor.

A global expert tensor has the logical shape `[num_experts, *expert_shape]` and the canonical
(row-major, so expert-major) element order. EP-MP rank `m` of `M` holds a contiguous block of the
expert axis; its local block, flattened, is further split over the `D` EP-DP ranks (`sharded`) or
held whole by each of them (replicated). Both splits follow `torch.chunk` (the convention of
DTensor `Shard`): blocks of `ceil(n / parts)`, the last ones shorter or empty, so uneven splits are
fine. Each EP-MP x EP-DP rank therefore holds one flat range of the global canonical order, which
is what `ExpertFlatView` hands to `save` and `load`: the live storage itself, never a copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import InvalidArgumentError
from .roles import ROLES
from .shards import TensorShard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertFlatView", "ExpertLayout", "chunk_range"]


def chunk_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of part `index` when `total` items are split into `parts` as `torch.chunk`
    does (parts of `ceil(total / parts)`, trailing parts shorter or empty)."""
    if parts < 1 or not 0 <= index < parts:
        raise InvalidArgumentError(f"part {index} of {parts} does not exist")
    size = -(-total // parts)
    start = min(index * size, total)
    return start, min(start + size, total)


def _int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class ExpertLayout:
    """Where one rank's slice of an expert tensor lies in the global tensor.

    `experts` overrides the EP-MP block (`[start, stop)` of the expert axis) when it is not the
    `torch.chunk` one; every EP-MP rank must then say so consistently.
    """

    num_experts: int
    expert_shape: tuple[int, ...]
    ep_mp_rank: int = 0
    ep_mp_size: int = 1
    ep_dp_rank: int = 0
    ep_dp_size: int = 1
    sharded: bool = True
    experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _int("num_experts", self.num_experts, 1)
        if not isinstance(self.expert_shape, Sequence) or isinstance(self.expert_shape, str):
            raise InvalidArgumentError(f"expert_shape must be a sequence of ints, got {self.expert_shape!r}")
        shape = tuple(_int("expert_shape entry", d, 0) for d in self.expert_shape)
        object.__setattr__(self, "expert_shape", shape)
        _int("ep_mp_size", self.ep_mp_size, 1)
        _int("ep_dp_size", self.ep_dp_size, 1)
        if not 0 <= _int("ep_mp_rank", self.ep_mp_rank, 0) < self.ep_mp_size:
            raise InvalidArgumentError(f"ep_mp_rank {self.ep_mp_rank} is outside EP-MP size "
                                       f"{self.ep_mp_size}")
        if not 0 <= _int("ep_dp_rank", self.ep_dp_rank, 0) < self.ep_dp_size:
            raise InvalidArgumentError(f"ep_dp_rank {self.ep_dp_rank} is outside EP-DP size "
                                       f"{self.ep_dp_size}")
        if self.experts is not None:
            start, stop = (_int("experts bound", x, 0) for x in self.experts)
            if not start <= stop <= self.num_experts:
                raise InvalidArgumentError(f"experts {self.experts} is not a range of 0..{self.num_experts}")
            object.__setattr__(self, "experts", (start, stop))
        elif self.ep_mp_size > self.num_experts:
            raise InvalidArgumentError(
                f"{self.num_experts} experts cannot be spread over EP-MP size {self.ep_mp_size}")

    @classmethod
    def from_mesh(
        cls,
        mesh: DeviceMesh,
        num_experts: int,
        expert_shape: Sequence[int],
        *,
        sharded: bool = True,
        ep_mp_dim: str = "ep_mp",
        ep_dp_dim: str | None = "ep_dp",
    ) -> ExpertLayout:
        """The layout of this rank on a mesh with named EP-MP and (optionally) EP-DP dims."""
        names = mesh.mesh_dim_names or ()
        for dim in (ep_mp_dim, ep_dp_dim):
            if dim is not None and dim not in names:
                raise InvalidArgumentError(f"mesh has no dim named {dim!r} (it has {names})")
        mp_mesh = mesh[ep_mp_dim]
        dp = (0, 1)
        if ep_dp_dim is not None:
            dp_mesh = mesh[ep_dp_dim]
            dp = (dp_mesh.get_local_rank(), dp_mesh.size())
        return cls(num_experts, tuple(expert_shape), mp_mesh.get_local_rank(), mp_mesh.size(), *dp, sharded)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the global expert tensor."""
        return (self.num_experts, *self.expert_shape)

    @property
    def expert_numel(self) -> int:
        return math.prod(self.expert_shape)

    @property
    def expert_range(self) -> tuple[int, int]:
        """`[start, stop)` of the experts this EP-MP rank holds."""
        if self.experts is not None:
            return self.experts
        return chunk_range(self.num_experts, self.ep_mp_size, self.ep_mp_rank)

    @property
    def num_local_experts(self) -> int:
        start, stop = self.expert_range
        return stop - start

    @property
    def block_numel(self) -> int:
        """Elements of the EP-MP rank's whole local expert block."""
        return self.num_local_experts * self.expert_numel

    def block_range(self, ep_dp_rank: int | None = None) -> tuple[int, int]:
        """`[start, stop)` within the local block held by EP-DP rank `ep_dp_rank` (this one by
        default): a `torch.chunk` part when sharded, the whole block when replicated."""
        d = self.ep_dp_rank if ep_dp_rank is None else ep_dp_rank
        if not self.sharded:
            if not 0 <= d < self.ep_dp_size:
                raise InvalidArgumentError(f"EP-DP rank {d} of {self.ep_dp_size} does not exist")
            return 0, self.block_numel
        return chunk_range(self.block_numel, self.ep_dp_size, d)

    @property
    def local_numel(self) -> int:
        """Elements of this rank's flat storage."""
        start, stop = self.block_range()
        return stop - start

    @property
    def flat_range(self) -> tuple[int, int]:
        """`(global start, length)` of this rank's storage in the canonical order."""
        start, stop = self.block_range()
        return self.expert_range[0] * self.expert_numel + start, stop - start

    def empty(self, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
        """Uninitialised flat storage for this rank."""
        return torch.empty(self.local_numel, dtype=dtype, device=device)

    def view(self, storage: torch.Tensor, *, role: str | None = None, offset: int = 0) -> ExpertFlatView:
        """An `ExpertFlatView` of `storage` (elements `offset ..` of a contiguous tensor)."""
        return ExpertFlatView(self, storage, role=role, offset=offset)


class ExpertFlatView:
    """A checkpoint-only view of one rank's flat expert storage as a flat range of the global
    expert tensor. It aliases `storage`: saving reads it in place, loading writes into it."""

    def __init__(self, layout: ExpertLayout, storage: torch.Tensor, *, role: str | None = None,
                 offset: int = 0) -> None:
        if not isinstance(layout, ExpertLayout):
            raise InvalidArgumentError(f"layout must be an ExpertLayout, not {type(layout).__name__}")
        if not isinstance(storage, torch.Tensor):
            raise InvalidArgumentError(f"storage must be a tensor, not {type(storage).__name__}")
        if not storage.is_contiguous():
            raise InvalidArgumentError("expert storage must be contiguous (it is written and read in place)")
        _int("offset", offset, 0)
        if offset + layout.local_numel > storage.numel():
            raise InvalidArgumentError(
                f"expert storage has {storage.numel()} elements; the layout needs {layout.local_numel} "
                f"from offset {offset} ({layout.num_local_experts} experts of {layout.expert_shape}, EP-DP "
                f"{'shard' if layout.sharded else 'replica'} {layout.ep_dp_rank}/{layout.ep_dp_size})")
        if role is not None and role not in ROLES:
            raise InvalidArgumentError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        self.layout = layout
        self.storage = storage
        self.role = role
        self.offset = offset

    @classmethod
    def build(
        cls,
        storage: torch.Tensor,
        *,
        num_experts: int,
        expert_shape: Sequence[int],
        ep_mp_rank: int = 0,
        ep_mp_size: int = 1,
        ep_dp_rank: int = 0,
        ep_dp_size: int = 1,
        sharded: bool = True,
        role: str | None = None,
        offset: int = 0,
    ) -> ExpertFlatView:
        """One call for the common case: the layout from ranks and sizes, viewing `storage`."""
        layout = ExpertLayout(num_experts, tuple(expert_shape), ep_mp_rank, ep_mp_size, ep_dp_rank,
                              ep_dp_size, sharded)
        return cls(layout, storage, role=role, offset=offset)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def local(self) -> torch.Tensor:
        """This rank's elements: a 1-D view of the storage."""
        return self.storage.reshape(-1)[self.offset : self.offset + self.layout.local_numel]

    def tensor_shard(self) -> TensorShard:
        # `local` is just this view's range, so a loader staging it (e.g. from CUDA) copies back
        # only these elements and never the rest of a larger storage.
        start, length = self.layout.flat_range
        return TensorShard(self.storage.dtype, self.layout.shape, self.local, flat=[(start, length, 0)],
                           role=self.role)

    def __repr__(self) -> str:
        lo = self.layout
        start, length = lo.flat_range
        return (f"ExpertFlatView(shape={lo.shape}, experts={lo.expert_range}, "
                f"flat=[{start}, {start + length}), "
                f"ep_mp={lo.ep_mp_rank}/{lo.ep_mp_size}, ep_dp={lo.ep_dp_rank}/{lo.ep_dp_size} "
                f"{'shard' if lo.sharded else 'replica'}, dtype={self.dtype})")
