"""`ChunkStoreReader`: the DCP storage reader."""


from __future__ import annotations

import functools
import io
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _core, values
from .._dist import DEFAULT_PEER_TIMEOUT, Group
from ..errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    MismatchError,
    check_bool,
)
from ..fill import Fill, check_read_mode, check_workers, fill
from ..location import checkpoint_location, is_url
from ..shards import torch_dtype
from .common import check_group, data_step, dcp_extension, is_location, path_of, runs_alone
from .values import dcp_leaves

EXTENSION_REGISTRY = dcp_extension("ExtensionRegistry")


class ChunkStoreReader(StorageReader):
    """DCP `StorageReader` over an olmo-chunks checkpoint (saved by either front door).

    `verify` checks block checksums of everything read; `workers` bounds the reading threads;
    `read="once"` has each saved block the job needs read by one rank and handed to the others
    through the process group's collectives (see `olmo_chunks.load`), `"direct"` has every rank
    read its own, `"auto"` (the default) takes the one predicted faster.
    `FileSystemReader`'s `_extension_registry` is accepted and unused: olmo-chunks' blocks
    describe their own compression, so there are no stream transforms to undo.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        verify: bool = True,
        workers: int | None = None,
        _extension_registry: Any = None,
        process_group: dist.ProcessGroup | None = None,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        read: str = "auto",
    ) -> None:
        super().__init__()
        check_read_mode(read)
        self.read = read
        if _extension_registry is not None and (EXTENSION_REGISTRY is None
                                                or not isinstance(_extension_registry, EXTENSION_REGISTRY)):
            raise InvalidArgumentError(
                f"ChunkStoreReader: _extension_registry must be an ExtensionRegistry, "
                f"not {type(_extension_registry).__name__}"
            )
        self.path = checkpoint_location(path) if path is not None else None
        self.verify = check_bool("verify", verify)
        self.workers = check_workers(workers)
        self.process_group = process_group
        self._alone = False  # DCP runs on this process alone (`runs_alone`)
        self.peer_timeout = peer_timeout
        self.load_id = uuid.uuid4().hex
        self._manifest: _core.Manifest | None = None
        self._tensors: dict[str, tuple[int, torch.dtype]] = {}
        self._values: dict[str, Any] = {}
        self._value_paths: dict[str, tuple[Any, ...]] = {}

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.path = path_of(checkpoint_id, self.path)
        self.load_id = uuid.uuid4().hex
        self._manifest = None

    def _open(self) -> _core.Manifest:
        if self._manifest is None:
            if self.path is None:
                raise InvalidArgumentError(
                    "ChunkStoreReader: no path (pass one, or checkpoint_id to dcp.load)"
                )
            m = _core.Manifest.open(self.path)
            self._tensors = {t.key: (i, torch_dtype(t.dtype)) for i, t in enumerate(m.tensors)}
            self._values, self._value_paths = {}, {}
            for key, enc in values.entries(m).items():
                for fqn, (path, v) in dcp_leaves(key, values.decode(enc, key)).items():
                    self._values[fqn], self._value_paths[fqn] = v, path
            self._manifest = m
        return self._manifest

    def read_metadata(self) -> Metadata:
        self._manifest = None  # every load starts from the manifest committed now
        m = self._open()
        md: dict[str, Any] = {}
        for i, t in enumerate(m.tensors):
            md[t.key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(t.dtype)), size=torch.Size(t.shape),
                chunks=SavedChunks(m, i),  # type: ignore[arg-type]
            )
        paths: dict[str, tuple[Any, ...]] = {}
        for fqn, path in self._value_paths.items():
            if fqn in md:
                raise CorruptCheckpointError(f"{self.path}: {fqn!r} is both a tensor and a value")
            md[fqn] = BytesStorageMetadata()
            paths[fqn] = path
        saved_info = values.decode(values.parse_json(m.info_json, f"{self.path}: manifest info"),
                                   "info") if m.info_json else None
        saved_paths = saved_info.get("dcp_paths") if isinstance(saved_info, dict) else None
        if isinstance(saved_paths, dict):
            for fqn, p in saved_paths.items():
                if fqn in md and isinstance(p, list) and p:  # the exact object path DCP recorded at save time
                    paths[fqn] = tuple(p)
        for fqn in md:
            paths.setdefault(fqn, (fqn,))
        return Metadata(
            state_dict_metadata=md,
            planner_data=paths,
            storage_data={"olmo_chunks": str(self.path), "save_id": m.save_id},
            storage_meta=StorageMeta(checkpoint_id=str(self.path), save_id=m.save_id, load_id=self.load_id),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        m = self._open()
        check_group(self.process_group, kwargs.get("rank"), is_coordinator, "ChunkStoreReader")
        self._alone = False
        sd = metadata.storage_data
        if isinstance(sd, Mapping) and sd.get("save_id") not in (None, m.save_id):
            raise InvalidArgumentError(
                f"{self.path}: metadata of save {sd.get('save_id')} given for save {m.save_id}"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        self._alone = runs_alone(self.process_group, len(plans), "ChunkStoreReader")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        data_step(self.process_group, self.peer_timeout, lambda group: self._read_items(plan, planner, group),
                  "dcp.load (ChunkStoreReader)", self._alone)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner, group: Group) -> None:
        fills, resolved = group.agree(lambda: self._resolve(plan, planner))
        fill(self._open(), fills, verify=self.verify, workers=self.workers, group=group, read=self.read,
             source=self.path or "", then=lambda: self._commit(plan, planner, resolved))

    def _resolve(self, plan: LoadPlan, planner: LoadPlanner) -> tuple[list[Fill], list[tuple[ReadItem, torch.Tensor]]]:
        """The destinations of `plan`'s tensor reads, from the planner."""
        self._open()
        fills: list[Fill] = []
        resolved: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            fqn = item.storage_index.fqn
            if fqn not in self._tensors:
                raise MismatchError(
                    [f"{fqn}: not a tensor in the checkpoint"], header=f"{self.path}: bad read plan"
                )
            ti, saved_dtype = self._tensors[fqn]
            dest = planner.resolve_tensor(item).detach()
            lengths = list(item.lengths)
            if list(dest.shape) != lengths:
                raise InvalidArgumentError(
                    f"{fqn!r}: planner resolved a tensor of shape {tuple(dest.shape)} "
                    f"for a read of {tuple(lengths)}"
                )
            base = item.storage_index.offset or torch.Size([0] * len(lengths))
            offsets = [int(a) + int(b) for a, b in zip(base, item.storage_offsets, strict=True)]
            fills.append(Fill(fqn, ti, dest, functools.partial(_box_pieces, offsets), saved_dtype))
            resolved.append((item, dest))
        return fills, resolved

    def _commit(self, plan: LoadPlan, planner: LoadPlanner, resolved: list[tuple[ReadItem, torch.Tensor]]) -> None:
        """Hands the filled tensors and the plan's values to the planner."""
        for item, dest in resolved:
            planner.commit_tensor(item, dest)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                fqn = item.storage_index.fqn
                if fqn not in self._values:
                    raise MismatchError(
                        [f"{fqn}: not a value in the checkpoint"], header=f"{self.path}: bad read plan"
                    )
                buf = io.BytesIO()
                torch.save(self._values[fqn], buf)  # serialised here from JSON data, never read from disk
                buf.seek(0)
                planner.load_bytes(item, buf)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        if not is_location(checkpoint_id):
            return False
        location = checkpoint_location(checkpoint_id)
        return is_url(location) or (Path(location) / _core.MANIFEST_NAME).is_file()


class SavedChunks(Sequence[ChunkStorageMetadata]):
    """A tensor's saved chunks as DCP's `ChunkStorageMetadata` list (empty boxes left out, a flat
    range as the boxes it decomposes into), made on first use: `FastLoadPlanner` plans from the
    manifest (`Manifest.overlaps`) and never makes them, so a checkpoint of millions of chunks
    costs no Python object per chunk. Pickles as a plain list."""

    def __init__(self, manifest: _core.Manifest, tensor: int) -> None:
        self.manifest = manifest
        self.tensor = tensor
        self._items: list[ChunkStorageMetadata] | None = None

    def items(self) -> list[ChunkStorageMetadata]:
        if self._items is None:
            self._items = [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
                           for b in self.manifest.saved_boxes(self.tensor)]
        return self._items

    def __len__(self) -> int:
        return len(self.items())

    @overload
    def __getitem__(self, i: int) -> ChunkStorageMetadata: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...
    def __getitem__(self, i: int | slice) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        return self.items()[i]

    def __eq__(self, other: object) -> bool:
        return self.items() == (other.items() if isinstance(other, SavedChunks) else other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.items(),))


def _box_pieces(offsets: list[int], buf: torch.Tensor) -> list[_core.Piece]:
    """The core target piece of the box at `offsets` of `buf`'s shape, filling all of `buf`."""
    return [_core.Piece(offsets, list(buf.shape), 0, list(buf.stride()))]
