"""Nested state dicts <-> flat dotted keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InvalidArgumentError
from .shards import is_chunk_source
from .values import MAX_DEPTH

__all__ = ["Leaf", "flatten"]

# Where the trainer state lives (`trainer_state.py`): `load_trainer_state` restores it, so a strict
# `load` of model and optimizer keys does not count it as unexpected. Each rank's RNG states sit under
# f"{TRAINER_RNG_PREFIX}rank{R:05d}." and a rank holds only its own.
TRAINER_PREFIX = "trainer"
TRAINER_RNG_PREFIX = f"{TRAINER_PREFIX}.rng."


@dataclass
class Leaf:
    """A value at a dotted key, with the container and slot that hold it (to write it back)."""

    value: Any
    container: Any
    slot: Any

    @property
    def is_tensor(self) -> bool:
        return _is_tensorish(self.value)


def _is_tensorish(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or is_chunk_source(v)


def _has_tensor(v: Any, key: str = "", depth: int = 0) -> bool:
    if _is_tensorish(v):
        return True
    if isinstance(v, (Mapping, list, tuple)) and depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{key!r}: nested more than {MAX_DEPTH} containers deep")
    if isinstance(v, Mapping):
        return any(_has_tensor(x, key, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x, key, depth + 1) for x in v)
    return False


def flatten(state_dict: Mapping[str, Any]) -> dict[str, Leaf]:
    """Flattens nested dicts and lists into `{dotted_key: Leaf}`. Containers that hold tensors are
    descended into (list items by index); containers without tensors are kept whole as plain
    values."""
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"state_dict must be a mapping, not {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}

    def visit(prefix: str, container: Any, slot: Any, value: Any, depth: int = 0) -> None:
        items: Iterable[tuple[Any, Any]]
        if isinstance(value, Mapping) and _has_tensor(value, prefix, depth):
            items = value.items()
        elif isinstance(value, (list, tuple)) and _has_tensor(value, prefix, depth):
            items = enumerate(value)
        else:
            if prefix in out:
                raise InvalidArgumentError(f"two values flatten to the same key {prefix!r}")
            out[prefix] = Leaf(value, container, slot)
            return
        for k, v in items:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise InvalidArgumentError(f"{prefix!r}: keys must be str or int, not {type(k).__name__}")
            visit(f"{prefix}.{k}" if prefix else str(k), value, k, v, depth + 1)

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"top-level keys must be str, not {type(k).__name__}")
        visit(k, state_dict, k, v)
    return out
