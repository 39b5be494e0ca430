"""OLMo-core: a `Checkpointer` that saves and loads the model and optimizer state through olmo-chunks.

The switch is one line of a `TrainerConfig`::

    TrainerConfig(save_folder=..., checkpointer=OlmoChunksCheckpointerConfig())

A checkpoint keeps OLMo-core's layout (`stepN/train/rankR.pt`, `stepN/.metadata.json`) with an
olmo-chunks checkpoint in `stepN/model_and_optim`. The trainer finds the latest one on restart
(stock checkpoints too, so a run can switch mid-way), `save_async` works as OLMo-core's does, and
DCP's plan cache, which OLMo-core turns on, is kept. Stock checkpoints load through OLMo-core's own
reader. Train modules that checkpoint themselves (`save_state_dict_direct`, such as
`OLMoDDPTrainModule`) are refused.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import pickle
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cached_path import cached_path
from olmo_core.aliases import PathOrStr
from olmo_core.distributed.utils import get_rank, is_distributed
from olmo_core.exceptions import OLMoConfigurationError
from olmo_core.io import file_exists, normalize_path
from olmo_core.train.checkpoint import Checkpointer, CheckpointerConfig, CheckpointMetadata
from olmo_core.train.train_module import TrainModule
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .._core import MANIFEST_NAME
from .._dist import DEFAULT_PEER_TIMEOUT
from ..dcp import ChunkStoreReader, ChunkStoreWriter, FastLoadPlanner
from ..dcp.values import SAFE_GLOBALS
from ..errors import InvalidArgumentError, UnsupportedFormatError

__all__ = ["OlmoChunksCheckpointer", "OlmoChunksCheckpointerConfig"]

_MODEL_AND_OPTIM = "model_and_optim"


def _read_trainer_state(path: str) -> Any:
    """OLMo-core's `train/rankR.pt` read as data: numbers, containers, tensors, numpy RNG arrays,
    and OLMo-core's own enums (a data loader's `ShuffleStrategy`), which unpickle by value; never
    other code (the stock checkpointer unpickles anything). An enum in it was refused until
    2026-12-07, so a run of OLMo-core's ComposableDataLoader could not resume."""
    local = cached_path(path, quiet=True)
    allowed: list[Any] = list(SAFE_GLOBALS)
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(local):
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] == "olmo_core":  # OLMo-core's own modules: the trainer's code
            with contextlib.suppress(ImportError):
                cls = getattr(importlib.import_module(module), attr, None)
                if isinstance(cls, type) and issubclass(cls, enum.Enum):
                    allowed.append(cls)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(local, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedFormatError(
            f"{path}: the trainer state holds objects other than data (numbers, containers, tensors, numpy "
            f"arrays, OLMo-core's enums), which olmo-chunks does not unpickle: {str(exc).splitlines()[0]}"
        ) from None


@dataclass
class OlmoChunksCheckpointerConfig(CheckpointerConfig):
    """`CheckpointerConfig` for `TrainerConfig(checkpointer=...)` that builds an
    `OlmoChunksCheckpointer`. `verify` checks block checksums on load; `peer_timeout` is the seconds
    after which a silent rank counts as dead during a save or load."""

    verify: bool = True
    peer_timeout: float = DEFAULT_PEER_TIMEOUT

    def build(self, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> OlmoChunksCheckpointer:
        kwargs = {**self.as_dict(exclude_none=True, recurse=False), **kwargs}
        work_dir = kwargs.pop("work_dir", None)
        if work_dir is None:
            raise OLMoConfigurationError("'work_dir' must be provided to build a Checkpointer")
        return OlmoChunksCheckpointer(work_dir=Path(work_dir), process_group=process_group, **kwargs)


def _save_planner() -> DefaultSavePlanner:
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True, enable_plan_caching=True)  # as OLMo-core's


def _flat_state_dict_module(train_module: TrainModule) -> None:
    if hasattr(train_module, "save_state_dict_direct"):
        raise InvalidArgumentError(
            f"{type(train_module).__name__} checkpoints itself (save_state_dict_direct); "
            "OlmoChunksCheckpointer saves train modules that hand over a state dict"
        )


@dataclass
class OlmoChunksCheckpointer(Checkpointer):
    """OLMo-core's trainer `Checkpointer`, with the model and optimizer state in an olmo-chunks
    checkpoint (`ChunkStoreWriter` / `ChunkStoreReader` under DCP)."""

    verify: bool = True
    peer_timeout: float = DEFAULT_PEER_TIMEOUT

    def _writer(self, path: PathOrStr) -> ChunkStoreWriter:
        if not ChunkStoreWriter.validate_checkpoint_id(path):
            raise InvalidArgumentError(f"{path}: OlmoChunksCheckpointer saves to a filesystem path, not a URL")
        return ChunkStoreWriter(
            path,
            overwrite=self.save_overwrite,
            workers=self.save_thread_count,
            process_group=self.process_group,
            peer_timeout=self.peer_timeout,
        )

    def save(self, dir: PathOrStr, train_module: TrainModule, train_state: dict[str, Any],
             ephemeral: bool = False) -> None:
        _flat_state_dict_module(train_module)
        dir = normalize_path(dir)
        with self._temporary_wd(dir) as wd:
            self._save_train_state(dir, wd, train_state)
            dcp.save(
                train_module.state_dict_to_save(),
                storage_writer=self._writer(wd / _MODEL_AND_OPTIM),
                planner=_save_planner(),
                process_group=self.process_group,
            )
        self._save_metadata(dir, CheckpointMetadata(ephemeral=ephemeral))

    def save_async(self, dir: PathOrStr, train_module: TrainModule, train_state: dict[str, Any],
                   ephemeral: bool = False) -> Future[None]:
        """Returns once this rank's state is staged; the future completes when the checkpoint is
        committed (OLMo-core's metadata file, which marks it complete, is written after that)."""
        _flat_state_dict_module(train_module)
        if is_distributed() and self.process_group is None:
            raise OLMoConfigurationError("a checkpointer process group is required for async checkpointing!")
        dir = normalize_path(dir)
        with self._temporary_wd(dir) as wd:
            self._save_train_state(dir, wd, train_state)
        future = dcp.async_save(
            train_module.state_dict_to_save(),
            storage_writer=self._writer(f"{dir}/{_MODEL_AND_OPTIM}"),
            planner=_save_planner(),
            process_group=self.process_group,
        )
        assert isinstance(future, Future)

        def mark_complete(fut: Future[Any]) -> None:
            if fut.exception() is None:
                self._save_metadata(dir, CheckpointMetadata(ephemeral=ephemeral))

        future.add_done_callback(mark_complete)
        return future

    def load(self, dir: PathOrStr, train_module: TrainModule, *, load_trainer_state: bool | None = None,
             load_optim_state: bool | None = None,
             reset_optimizer_states_on_load: bool | None = None) -> dict[str, Any] | None:
        """Loads an olmo-chunks checkpoint (resharded to this run's layout), or a stock one through
        OLMo-core's own `Checkpointer.load`."""
        dir = normalize_path(dir)
        store = _store_in(dir)
        if store is None:
            return super().load(
                dir,
                train_module,
                load_trainer_state=load_trainer_state,
                load_optim_state=load_optim_state,
                reset_optimizer_states_on_load=reset_optimizer_states_on_load,
            )
        _flat_state_dict_module(train_module)
        trainer_state = None
        if load_trainer_state is not False:
            # this rank's state, else rank 0's (the world size changed), as OLMo-core does
            for path in (f"{dir}/train/rank{get_rank()}.pt", f"{dir}/train/rank0.pt"):
                if file_exists(path):
                    trainer_state = _read_trainer_state(path)
                    break
            if load_trainer_state is True and trainer_state is None:
                raise FileNotFoundError(f"Missing trainer state in checkpoint dir '{dir}'")
        reader = ChunkStoreReader(
            store,
            verify=self.verify,
            workers=self.load_thread_count,
            process_group=self.process_group,
            peer_timeout=self.peer_timeout,
        )
        state_dict = train_module.state_dict_to_load(reader.read_metadata(), optim=load_optim_state)
        dcp.load(state_dict, storage_reader=reader, planner=FastLoadPlanner(), process_group=self.process_group)
        train_module.load_state_dict(state_dict)
        return trainer_state

    @classmethod
    def dir_is_checkpoint(cls, dir: PathOrStr) -> bool:
        """A stock checkpoint, or the same layout with an olmo-chunks `model_and_optim` (or a bare
        olmo-chunks checkpoint of the model and maybe the optimizer)."""
        if super().dir_is_checkpoint(dir):
            return True
        dir = normalize_path(dir)
        if file_exists(f"{dir}/{MANIFEST_NAME}"):
            return True
        return all(
            file_exists(f"{dir}/{name}")
            for name in ("train/rank0.pt", f"{_MODEL_AND_OPTIM}/{MANIFEST_NAME}", cls.METADATA_FNAME)
        )


def _store_in(dir: str) -> str | None:
    """The olmo-chunks checkpoint of OLMo-core checkpoint `dir`, or None for a stock one."""
    for path in (f"{dir}/{_MODEL_AND_OPTIM}", dir):
        if file_exists(f"{path}/{MANIFEST_NAME}"):
            return path
    return None
