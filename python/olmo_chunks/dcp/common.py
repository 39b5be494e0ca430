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


def check_group(process_group: dist.ProcessGroup | None, rank: int | None, who: str,
                 size: int | None = None) -> None:
    """Refuses a DCP call on a process group other than the one the writer or reader was given
    (its ranks coordinate on that group)."""
    if not dist.is_initialized():
        return
    mine = (dist.get_rank(process_group), dist.get_world_size(process_group))
    if (rank is not None and rank != mine[0]) or (size is not None and size != mine[1]):
        raise InvalidArgumentError(
            f"{who}: DCP runs on another process group than this {who}'s; pass the process_group given "
            f"to dcp to {who}(..., process_group=...) too"
        )


def data_step(process_group: dist.ProcessGroup | None, peer_timeout: float, fn: Callable[[Group], Any],
              op: str) -> Any:
    """Runs this rank's part of a DCP data step, `fn(group)`, whose steps go through `group` (its
    `agree`/`exchange`) so that a failure on any rank, a dead one included (no heartbeat for
    `peer_timeout`), is known to every rank before DCP's next collective; after a death that
    collective is bounded too, where DCP alone would wait for the group's timeout."""
    try:
        with Group(process_group, peer_timeout, op) as group:
            return fn(group)
    except RankFailedError as exc:
        if exc.dead:
            bound_collectives(process_group, min(peer_timeout, 10.0))
        log.error("olmo-chunks: %s", exc)
        raise
