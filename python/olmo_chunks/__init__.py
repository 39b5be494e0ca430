"""olmo-chunks: a topology-independent checkpoint store for large PyTorch training runs."""

from __future__ import annotations

from . import errors, roles
from ._core import FORMAT_VERSION, MANIFEST_NAME
from .checkpoint import LoadReport, load, save
from .errors import *  # noqa: F403
from .experts import ExpertFlatView, ExpertLayout
from .shards import ChunkSource, TensorShard
from .trainer_state import TrainerState, load_trainer_state

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkSource",
    "ExpertFlatView",
    "ExpertLayout",
    "LoadReport",
    "TensorShard",
    "TrainerState",
    "errors",
    "load",
    "load_trainer_state",
    "roles",
    "save",
    *errors.__all__,
]
