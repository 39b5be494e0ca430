"""`ChunkStoreWriter`: the DCP storage writer."""


from __future__ import annotations

import dataclasses
import functools
import io
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import _core
from .._dist import DEFAULT_PEER_TIMEOUT, Group
from ..errors import InvalidArgumentError, check_bool, check_int
from ..fill import check_workers
from ..location import checkpoint_location, is_url
from ..roles import check_roles, resolve_role
from ..session import SaveSession, zstd_level
from ..shards import ChunkItem, check_dtype, dtype_name
from .common import check_group, data_step, dcp_extension, is_location, path_of, runs_alone
from .values import encode_object, group_entries

ZSTANDARD = dcp_extension("ZStandard")


def _compression_of(extensions: list[Any], compression: str | None) -> str:
    """The `compression` DCP stream `extensions` ask for: ZStandard is our per-block zstd (the
    checkpoint stays in our format, which DCP's reader cannot read anyway); others are refused."""
    other = [type(e).__name__ for e in extensions if ZSTANDARD is None or not isinstance(e, ZSTANDARD)]
    if other:
        raise InvalidArgumentError(
            f"ChunkStoreWriter: _extensions={other} are not supported: olmo-chunks stores element bytes "
            "with block checksums, compressed per block with zstd (ZStandard() or compression='zstd')"
        )
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(
            f"ChunkStoreWriter: _extensions=[ZStandard()] and compression={compression!r} disagree"
        )
    return "zstd"


@dataclasses.dataclass(frozen=True)
class _ValueWritten:
    encoded: Any


class ChunkStoreWriter(StorageWriter):
    """DCP `StorageWriter` that saves into an olmo-chunks checkpoint directory.

    `path` may be left out when `dcp.save(..., checkpoint_id=path)` names it. `roles` overrides the
    inferred role per key or dotted key prefix; `info` is stored as information in the manifest.
    Replicated items are deduplicated by DCP's save planner (balanced across replicas). Planners
    with `enable_plan_caching=True` (as OLMo-core saves) work: every save gets its own save id.

    `FileSystemWriter`'s arguments are accepted with its meaning where they have one here:
    `overwrite=False` refuses (with `CheckpointExistsError`, before any data is written) a path
    holding a committed checkpoint; `thread_count` is `workers`. Every rank always writes one data
    file per rank and fsyncs it, so `single_file_per_rank` and `sync_files` change nothing;
    `per_thread_copy_ahead` and `cache_staged_state_dict` are ignored. olmo-chunks stores element
    bytes, compressed per block with zstd when `compression="zstd"` (at `compression_level`, as
    `olmo_chunks.save`): `_extensions=[ZStandard()]` asks for the same and means
    `compression="zstd"`; any other stream transform, and a `serialization_format` other than the
    default, is refused.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        roles: Mapping[str, str] | None = None,
        info: Mapping[str, Any] | None = None,
        block_size: int = _core.DEFAULT_BLOCK_SIZE,
        workers: int | None = None,
        overwrite: bool = True,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        _extensions: Iterable[Any] | None = None,
        serialization_format: Any = None,
        process_group: dist.ProcessGroup | None = None,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        compression: str | None = None,
        compression_level: int | None = None,
    ) -> None:
        super().__init__()
        if _extensions:
            compression = _compression_of(list(_extensions), compression)
        self.zstd = zstd_level(compression, compression_level)
        if getattr(serialization_format, "value", serialization_format) not in (None, "torch_save"):
            raise InvalidArgumentError(
                f"ChunkStoreWriter: serialization_format={serialization_format} is not supported "
                "(olmo-chunks has its own format; see `olmo-chunks export` for safetensors)"
            )
        if thread_count is not None:
            if thread_count < 1 or workers not in (None, thread_count):
                raise InvalidArgumentError(
                    f"ChunkStoreWriter: thread_count={thread_count} must be positive and agree with "
                    f"workers={workers}"
                )
            workers = thread_count
        self.path = checkpoint_location(path) if path is not None else None
        self.roles = check_roles(roles)
        self.info = dict(info) if info else {}
        self.block_size = check_int("block_size", block_size, 1, 2**64 - 1)  # the core caps it
        self.workers = check_workers(workers)
        self.overwrite = check_bool("overwrite", overwrite)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.process_group = process_group
        self._alone = False  # DCP runs on this process alone (`runs_alone`)
        self.peer_timeout = peer_timeout
        self.save_id: str | None = None
        self.is_coordinator = False
        self._session: SaveSession | None = None  # the coordinator's, begun at global planning

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._abort()
        self.path = path_of(checkpoint_id, self.path)
        self.save_id = None

    def _abort(self) -> None:
        """Drops the save a failed `dcp.save` left begun (its data goes, the lease is released)."""
        if self._session is not None:
            self._session.abort()
            self._session = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.path is None:
            raise InvalidArgumentError("ChunkStoreWriter: no path (pass one, or checkpoint_id to dcp.save)")
        if not kwargs.get("use_collectives", True) and dist.is_initialized() and dist.get_world_size() > 1:
            raise InvalidArgumentError(
                "ChunkStoreWriter commits one manifest for all ranks and needs use_collectives=True"
            )
        check_group(self.process_group, kwargs.get("rank"), is_coordinator, "ChunkStoreWriter")
        self._alone = False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self.path is not None
        if not is_url(self.path) and os.path.exists(self.path) and not os.path.isdir(self.path):
            raise InvalidArgumentError(f"{self.path}: exists and is not a directory")
        for item in plan.items:
            if item.tensor_data is not None:
                check_dtype(item.index.fqn, item.tensor_data.properties.dtype)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.path is not None
        self._abort()
        self._alone = runs_alone(self.process_group, len(plans), "ChunkStoreWriter")
        self._session = self._new_session(0)
        self._session.begin(self.overwrite, self.peer_timeout)
        # The save id does not travel in the plans: DCP's plan cache (`enable_plan_caching`, keyed
        # by planner class) hands a rank a plan kept from an earlier save, ours or FileSystemWriter's.
        # FileSystemWriter's per-rank file prefix keeps a plan cached from this save valid for it.
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = data_step(self.process_group, self.peer_timeout,
                                functools.partial(self._data_step, plan, planner), "dcp.save (ChunkStoreWriter)",
                                self._alone)
        except BaseException:
            self._abort()  # the coordinator's: every rank has stopped writing by now
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _data_step(self, plan: SavePlan, planner: SavePlanner, group: Group) -> list[WriteResult]:
        """Every rank learns the coordinator's save id (the one rank holding the save), then writes."""
        mine = self._session.save_id if self._session is not None else None
        save_id = group.exchange(lambda: mine, lambda held: next((v for v in held if v is not None), None))[1]
        return group.agree(lambda: self._write_items(save_id, plan, planner, group.rank))

    def _write_items(self, save_id: str | None, plan: SavePlan, planner: SavePlanner,
                     rank: int) -> list[WriteResult]:
        assert self.path is not None
        if save_id is None:
            raise InvalidArgumentError("ChunkStoreWriter: no save was begun (was prepare_global_plan bypassed?)")
        self.save_id = save_id
        results: list[WriteResult] = []
        chunks: list[ChunkItem] = []
        chunk_items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                enc = encode_object(item.index.fqn, raw)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=_ValueWritten(enc))
                )
                continue
            td = item.tensor_data
            assert td is not None
            sizes = list(td.chunk.sizes)
            if 0 in sizes:
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                continue
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgumentError(
                    f"{item.index.fqn!r}: the planner resolved a tensor item to {type(tensor).__name__}"
                )
            tensor = tensor.detach()
            if list(tensor.shape) != sizes:
                raise InvalidArgumentError(
                    f"{item.index.fqn!r}: resolved shape {tuple(tensor.shape)} "
                    f"differs from the planned chunk {tuple(sizes)}"
                )
            chunks.append((item.index.fqn, _core.Box(list(td.chunk.offsets), sizes), tensor))
            chunk_items.append(item)
        written = self._new_session(rank, save_id).write(chunks)
        for item, chunk in zip(chunk_items, written, strict=True):
            results.append(WriteResult(index=item.index, size_in_bytes=chunk.nbytes, storage_data=chunk))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.path is not None
        if self._session is None:
            raise InvalidArgumentError(
                "ChunkStoreWriter: no save was begun (was prepare_global_plan bypassed?)"
            )
        schema: dict[str, tuple[Any, ...]] = {}
        leaves: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                role = resolve_role(fqn, torch.empty(0, dtype=dtype), self.roles)
                schema[fqn] = (dtype_name(dtype), list(md.size), role)
        chunks: list[_core.WrittenChunk] = []
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                if isinstance(sd, _core.WrittenChunk):
                    chunks.append(sd)
                elif isinstance(sd, _ValueWritten):
                    leaves[r.index.fqn] = sd.encoded
        paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else None
        entries = group_entries(leaves, paths, schema)
        info = {
            "writer": "olmo_chunks.dcp",
            "world_size": len(results),
            **({"dcp_paths": {k: list(v) for k, v in paths.items()}} if paths else {}),
            **self.info,
        }
        try:
            self._session.commit(schema, chunks, entries, info)
        finally:
            self._abort()  # a no-op once committed

    def _new_session(self, rank: int, save_id: str = "") -> SaveSession:
        assert self.path is not None
        return SaveSession(self.path, rank=rank, save_id=save_id, block_size=self.block_size, workers=self.workers,
                           zstd=self.zstd)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_location(checkpoint_id)
