"""olmo-chunks: a topology-independent checkpoint store for large PyTorch training runs.

The public names below are imported from their submodules on first use (PEP 562), so that
`import olmo_chunks` and the CLI's `inspect` and `verify` do not import torch."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import errors, roles
from .errors import *  # noqa: F403

# Public name -> the submodule defining it.
_LAZY = {
    "FORMAT_VERSION": "_core",
    "MANIFEST_NAME": "_core",
    "ChunkSource": "shards",
    "TensorShard": "shards",
    "ExpertFlatView": "experts",
    "ExpertLayout": "experts",
    "LoadReport": "checkpoint",
    "load": "checkpoint",
    "save": "checkpoint",
    "async_save": "background",
    "TrainerState": "trainer_state",
    "load_trainer_state": "trainer_state",
    "compute_weights": "weights",
    "dtensor_weight": "weights",
    "expert_weight": "weights",
    "full_weight": "weights",
}

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkSource",
    "ExpertFlatView",
    "ExpertLayout",
    "LoadReport",
    "TensorShard",
    "TrainerState",
    "compute_weights",
    "dtensor_weight",
    "errors",
    "expert_weight",
    "full_weight",
    "load",
    "load_trainer_state",
    "roles",
    "save",
    "async_save",
    *errors.__all__,
]

if TYPE_CHECKING:
    from ._core import FORMAT_VERSION, MANIFEST_NAME
    from .background import async_save
    from .checkpoint import LoadReport, load, save
    from .experts import ExpertFlatView, ExpertLayout
    from .shards import ChunkSource, TensorShard
    from .trainer_state import TrainerState, load_trainer_state
    from .weights import compute_weights, dtensor_weight, expert_weight, full_weight


def __getattr__(name: str) -> Any:
    """Imports the submodule defining public `name` (or submodule `name` itself, as
    `olmo_chunks.dcp`) and caches the value here."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
