"""What the DCP writer and reader share: paths, the process group check, the data step."""


from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._dist import Group, bound_collectives
from ..errors import (
    InvalidArgumentError,
    RankFailedError,
)
from ..location import checkpoint_location

log = logging.getLogger(__name__)


def dcp_extension(name: str) -> type | None:
    """DCP's stream-extension class `name` (`torch.distributed.checkpoint._extension`); None on torch
    2.6, which has no such module (nor the writer's `_extensions` or the reader's registry)."""
    try:
        module = importlib.import_module("torch.distributed.checkpoint._extension")
    except ImportError:
        return None
    cls: type = getattr(module, name)
    return cls


def path_of(checkpoint_id: str | os.PathLike[str] | None, current: str | None) -> str | None:
    """The checkpoint location `checkpoint_id` names, or `current` when it names none."""
    return checkpoint_location(checkpoint_id) if checkpoint_id else current


def is_location(checkpoint_id: str | os.PathLike[str]) -> bool:
    """True if `checkpoint_id` is a local path or a URL of a supported object store."""
    try:
        checkpoint_location(checkpoint_id)
    except InvalidArgumentError:
        return False
    return True


def _other_group(who: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{who}: DCP runs on another process group than this {who}'s; pass the process_group given "
        f"to dcp to {who}(..., process_group=...) too"
    )


def check_group(process_group: dist.ProcessGroup | None, rank: int | None, is_coordinator: bool, who: str) -> None:
    """Refuses, at set-up, a DCP call whose rank for this process (`rank`, where this torch says
    it) is not its rank in the writer's or reader's group (whose ranks coordinate its steps). DCP's
    coordinator is let through: where DCP runs on this process alone (`no_dist=True`, a group of
    one), every rank is one; `runs_alone` tells at the global plan."""
    if dist.is_initialized() and rank is not None and rank != dist.get_rank(process_group) and not (
            rank == 0 and is_coordinator):
        raise _other_group(who)


def runs_alone(process_group: dist.ProcessGroup | None, plans: int, who: str) -> bool:
    """Whether the DCP call whose global plan has `plans` local plans runs on this process alone
    (`no_dist=True`, or a group of one) while the writer's or reader's group is larger: its data
    step then waits for no other rank. Refuses a DCP call on another group of several ranks."""
    size = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if plans not in (1, size):
        raise _other_group(who)
    return plans < size


def data_step(process_group: dist.ProcessGroup | None, peer_timeout: float, fn: Callable[[Group], Any],
              op: str, alone: bool = False) -> Any:
    """Runs this rank's part of a DCP data step, `fn(group)`, whose steps go through `group` (its
    `agree`/`exchange`) so that a failure on any rank, a dead one included (no heartbeat for
    `peer_timeout`), is known to every rank before DCP's next collective; after a death that
    collective is bounded too, where DCP alone would wait for the group's timeout. `alone`: the
    group is this process (`runs_alone`)."""
    try:
        with Group(process_group, peer_timeout, op, alone=alone) as group:
            return fn(group)
    except RankFailedError as exc:
        if exc.dead:
            bound_collectives(process_group, min(peer_timeout, 10.0))
        log.error("olmo-chunks: %s", exc)
        raise
