"""Nested state dicts <-> flat dotted keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InvalidArgumentError
from .shards import is_chunk_source
from .values import MAX_DEPTH, MAX_ITEMS

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


def _has_tensor(v: Any, key: str, depth: int, memo: dict[int, bool]) -> bool:
    """Whether `v` holds a tensor; `memo` keeps the answer per container (one held in many places
    is looked into once)."""
    known = memo.get(id(v))  # only containers are kept, and they outlive the call: ids are theirs
    if known is not None:
        return known
    if _is_tensorish(v):
        return True
    if not isinstance(v, (list, tuple, Mapping)):
        return False
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{key!r}: nested more than {MAX_DEPTH} containers deep")
    memo[id(v)] = any(_has_tensor(x, key, depth + 1, memo) for x in (v.values() if isinstance(v, Mapping) else v))
    return memo[id(v)]


def flatten(state_dict: Mapping[str, Any]) -> dict[str, Leaf]:
    """Flattens nested dicts and lists into `{dotted_key: Leaf}`. Containers that hold tensors are
    descended into (list items by index); containers without tensors are kept whole as plain
    values."""
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"state_dict must be a mapping, not {type(state_dict).__name__}")
    out: dict[str, Leaf] = {}
    memo: dict[int, bool] = {}  # the containers of `state_dict` live as long as this call
    left = [MAX_ITEMS]

    def visit(prefix: str, container: Any, slot: Any, value: Any, depth: int = 0) -> None:
        left[0] -= 1
        if left[0] < 0:
            raise InvalidArgumentError(f"{prefix!r}: more than {MAX_ITEMS} items in the state dict (a container "
                                       "held in several places counts each time)")
        items: Iterable[tuple[Any, Any]] | None = None
        if not isinstance(value, torch.Tensor) and _has_tensor(value, prefix, depth, memo):
            if isinstance(value, (list, tuple)):
                items = enumerate(value)
            elif isinstance(value, Mapping):
                items = value.items()
        if items is None:  # a tensor, a chunk source, or a value without tensors
            if prefix in out:
                raise InvalidArgumentError(f"two values flatten to the same key {prefix!r}")
            if not prefix.isascii() and _is_tensorish(value):  # (a plain value's key is JSON text: any str)
                try:
                    prefix.encode()
                except UnicodeEncodeError:
                    raise InvalidArgumentError(f"{prefix!r}: a tensor's key must be valid Unicode text (this one "
                                               "holds a lone surrogate)") from None
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
