"""torchtitan: a `CheckpointManager` that saves and loads through olmo-chunks.

The switch is one line of a torchtitan config function::

    checkpoint=ChunkStoreCheckpointManager.Config(interval=500),  # was CheckpointManager.Config(...)

Every option of `CheckpointManager.Config` keeps its meaning: sync and `async_mode="async"` saves,
`keep_latest_k`, the model-only last save (`export_dtype`), `exclude_from_loading`, `load_step`.
On restart the manager finds the latest `step-N` folder holding an olmo-chunks or a stock
checkpoint; stock DCP checkpoints (an `initial_load_path`, or a run switched over mid-way) and HF
safetensors load and export through torchtitan's own code. `async_mode="async_with_pinned_mem"`
(a separate saving process) is refused.
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .._core import MANIFEST_NAME
from .._dist import DEFAULT_PEER_TIMEOUT
from ..dcp import ChunkStoreReader, ChunkStoreWriter, FastLoadPlanner
from ..errors import InvalidArgumentError

__all__ = ["ChunkStoreCheckpointManager"]


def _is_store(path: str) -> bool:
    return filesystem.isfile(filesystem.join(path, MANIFEST_NAME))


class ChunkStoreCheckpointManager(CheckpointManager):
    """torchtitan's `CheckpointManager` with olmo-chunks checkpoints in its `step-N` folders."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        verify: bool = True
        """Check block checksums of everything loaded."""

        peer_timeout: float = DEFAULT_PEER_TIMEOUT
        """Seconds after which a silent rank counts as dead during a save or load."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        if config.enable and config.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
            raise InvalidArgumentError(
                'ChunkStoreCheckpointManager: async_mode="async_with_pinned_mem" (a separate saving process) '
                'is not supported; use async_mode="async"'
            )
        super().__init__(config, **kwargs)
        self.verify = config.verify
        self.peer_timeout = config.peer_timeout

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future[Any] | AsyncSaveResponse | None:
        if to_hf:  # an HF safetensors export stays torchtitan's
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        pg = self.pg if async_mode == AsyncMode.ASYNC else None
        writer = ChunkStoreWriter(checkpoint_id, process_group=pg, peer_timeout=self.peer_timeout)
        ret: Future[Any] | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=pg)
        else:  # torchtitan's call shapes (its unit tests patch dcp.save and match on them)
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not _is_store(checkpoint_id):  # HF safetensors or a stock DCP checkpoint
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = ChunkStoreReader(checkpoint_id, verify=self.verify, peer_timeout=self.peer_timeout)
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id, planner=FastLoadPlanner())
        if MODEL in self.states:  # the model's entries are flattened into state_dict, as torchtitan does
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The highest step whose `step-N` folder holds a stock or an olmo-chunks checkpoint, or -1."""
        folder = folder or self.folder
        latest = super()._find_load_step(folder)
        if filesystem.isdir(folder):
            for name in filesystem.listdir(folder):
                if (m := re.search(r"step-(\d+)", name)) and _is_store(filesystem.join(folder, name)):
                    latest = max(latest, int(m.group(1)))
        return latest
