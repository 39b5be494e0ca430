"""olmo-chunks: a topology-independent checkpoint store for large PyTorch training runs."""

from __future__ import annotations

from . import errors, roles
from ._core import FORMAT_VERSION, MANIFEST_NAME
from .checkpoint import LoadReport, load, save
from .errors import *  # noqa: F403
from .shards import ChunkSource, TensorShard

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkSource",
    "LoadReport",
    "TensorShard",
    "errors",
    "load",
    "roles",
    "save",
    *errors.__all__,
]
