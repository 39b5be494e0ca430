"""The few collectives save and load need, and the rule that a failure on one rank fails all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import RankFailedError

T = TypeVar("T")


class Group:
    """A process group (or a lone process when torch.distributed is not initialised)."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.pg = process_group
        self.active = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.active:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self.rank = dist.get_rank(process_group) if self.active else 0
        self.size = dist.get_world_size(process_group) if self.active else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere): metadata flows to one rank, not to all."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._root, group=self.pg)
        return out

    @property
    def _root(self) -> int:
        return dist.get_global_rank(self.pg, 0) if self.pg is not None else 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.pg)
        return box[0]

    def agree(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on every rank; if it raised anywhere, raises on every rank (the original
        exception where it happened, `RankFailedError` elsewhere)."""
        try:
            result, failure = fn(), None
        except Exception as exc:
            result, failure = None, exc
        if self.size > 1:
            report = None if failure is None else f"{type(failure).__name__}: {failure}"
            reports = self.all_gather(report)
            if failure is None and any(reports):
                bad = next(r for r, msg in enumerate(reports) if msg)
                raise RankFailedError(f"rank {bad} failed: {reports[bad]}")
        if failure is not None:
            raise failure
        return result  # type: ignore[return-value]

    def on_root(self, fn: Callable[[], Any], *, scatter: bool = False) -> Any:
        """Runs `fn` on rank 0 and hands its result (or its failure) to every rank. With `scatter`,
        `fn` returns one item per rank and each rank receives only its own."""
        if self.size == 1:
            return fn()[0] if scatter else fn()
        result: Any = None
        failure: Exception | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as exc:
                failure = exc
        report = None if failure is None else f"{type(failure).__name__}: {failure}"
        report, value = self.broadcast((report, None if scatter else result))
        if failure is not None:
            raise failure
        if report is not None:
            raise RankFailedError(f"rank 0 failed: {report}")
        if not scatter:
            return value
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, result if self.rank == 0 else None, src=self._root, group=self.pg)
        return mine[0]
