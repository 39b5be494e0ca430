"""torch.distributed.checkpoint (DCP) front door: a storage writer, a storage reader and a fast
load planner that write and read the same checkpoint format as `olmo_chunks.save` / `load`.

- `ChunkStoreWriter`: `dcp.save(sd, storage_writer=ChunkStoreWriter(path))` (and `dcp.async_save`)
  writes each rank's chunks from native code in parallel, one data file per rank, with block
  checksums, and commits our manifest last. Tensor keys are DCP's flattened FQNs; roles are
  inferred by `olmo_chunks.roles` (override with `roles=`).
- `ChunkStoreReader`: `dcp.load(sd, storage_reader=ChunkStoreReader(path))` rebuilds DCP's
  `Metadata` from our manifest (flat-range chunks are presented as the boxes they decompose into)
  and serves all of a rank's read items in one batch through the Rust core: parallel reads, each
  needed saved byte read once, copied straight into the tensors the planner resolves.
- `FastLoadPlanner`: a drop-in `DefaultLoadPlanner` whose read items come from the Rust band index
  instead of DCP's sweep line (which degrades to all-pairs on 2-D layouts).

Non-tensor values. DCP's save planner pickles every non-tensor value into a BytesIO. The writer
reads it back with `torch.load(weights_only=True)` (a restricted unpickler that also allows numpy
arrays and scalars of numeric and bool dtypes, and io.BytesIO) and stores the value as tagged JSON
data, grouped the way `olmo_chunks.save` groups plain values, so the native door loads it too.
Values that are not plain data (arbitrary objects) are refused on save with `InvalidArgumentError`.
On load the reader hands the planner a BytesIO that it serialises itself from that JSON data;
nothing pickled in the checkpoint is ever unpickled.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import io
import logging
import os
import pickle
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from . import _core, values
from ._dist import DEFAULT_PEER_TIMEOUT, Group, bound_collectives
from .checkpoint import _write, commit_manifest
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MismatchError,
    MissingDataFileError,
    OlmoChunksError,
    RankFailedError,
    StorageError,
    TruncatedDataError,
    UnsafePathError,
    UnsupportedFormatError,
)
from .fill import Fill, fill
from .roles import resolve_role
from .shards import dtype_name, torch_dtype

__all__ = ["ChunkStoreReader", "ChunkStoreWriter", "FastLoadPlanner", "import_dcp"]

log = logging.getLogger(__name__)

try:  # private helper, present in every supported torch; keeps chunk lists identical to DCP's
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
except ImportError:  # pragma: no cover
    _create_chunk_list = None  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# Plain values: DCP leaves <-> native entries
# --------------------------------------------------------------------------------------------

_TENSOR = object()  # marks a tensor leaf in a path trie


class _Node(dict):
    """An inner node of a path trie (leaves are encoded values, which may be dicts too)."""


def group_entries(
    leaves: Mapping[str, Any], paths: Mapping[str, Any] | None, tensor_keys: Iterable[str]
) -> dict[str, Any]:
    """Native entries (key -> encoded value) from DCP's flattened plain leaves (`leaves`, encoded
    values by FQN) and DCP's flatten mapping (`paths`: FQN -> object path): a container whose
    subtree holds no tensor becomes one entry at its dotted key, as `olmo_chunks.save` stores it."""
    if not paths:
        return dict(leaves)
    root = _Node()
    for key, enc in [*((k, _TENSOR) for k in tensor_keys), *leaves.items()]:
        path = paths.get(key, (key,))
        node = root
        for part in path[:-1]:
            nxt = node.setdefault(part, _Node())
            if not isinstance(nxt, _Node):  # a value and a container at one path: DCP forbids it
                raise InvalidArgumentError(f"{key!r}: a value and a container share the path {path}")
            node = nxt
        node[path[-1]] = enc
    out: dict[str, Any] = {}

    def has_tensor(node: Any) -> bool:
        return node is _TENSOR or (isinstance(node, _Node) and any(has_tensor(v) for v in node.values()))

    def rebuild(node: Any) -> Any:
        if not isinstance(node, _Node):
            return node
        keys = list(node)
        if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
            return [rebuild(node[i]) for i in range(len(keys))]
        items = {k: rebuild(v) for k, v in node.items()}
        if all(isinstance(k, str) and not k.startswith("$") for k in items):
            return items
        return {"$dict": [[k, v] for k, v in items.items()]}

    def visit(prefix: str, node: Any) -> None:
        if node is _TENSOR:
            return
        if isinstance(node, _Node) and has_tensor(node):
            for k, v in node.items():
                visit(f"{prefix}.{k}", v)
        else:
            out[prefix] = rebuild(node)

    for k, v in root.items():
        visit(str(k), v)
    return out


def _dcp_terminal(value: Any) -> bool:
    """DCP's rule (torch >= 2.4 traverse_state_dict): mappings are descended; a list is descended
    only if it holds a mapping or a descended list; everything else is a leaf."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return not any(isinstance(e, (Mapping, list)) and not _dcp_terminal(e) for e in value)
    return True


def dcp_leaves(key: str, value: Any) -> dict[str, tuple[tuple, Any]]:
    """The DCP leaves `{fqn: (object path, value)}` of native plain entry `key` = `value`."""
    out: dict[str, tuple[tuple, Any]] = {}

    def walk(path: tuple, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk((*path, str(k)), x)
        elif _dcp_terminal(v):
            out[".".join(map(str, path))] = (path, v)
        else:
            for i, x in enumerate(v):
                walk((*path, i), x)

    walk((key,), value)
    return out


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PlanStorage:
    """Per-rank storage data of a global save plan: the save id all ranks share, and the rank."""

    save_id: str
    rank: int


@dataclasses.dataclass(frozen=True)
class _ValueWritten:
    encoded: Any


def _path_of(checkpoint_id: str | os.PathLike | None, current: Path | None) -> Path | None:
    return Path(checkpoint_id) if checkpoint_id else current


class ChunkStoreWriter(StorageWriter):
    """DCP `StorageWriter` that saves into an olmo-chunks checkpoint directory.

    `path` may be left out when `dcp.save(..., checkpoint_id=path)` names it. `roles` overrides the
    inferred role per key or dotted key prefix; `info` is stored as information in the manifest.
    Replicated items are deduplicated by DCP's save planner (balanced across replicas).

    `FileSystemWriter`'s arguments are accepted with its meaning where they have one here:
    `overwrite=False` refuses (with `CheckpointExistsError`, before any data is written) a path
    holding a committed checkpoint; `thread_count` is `workers`. Every rank always writes one data
    file per rank and fsyncs it, so `single_file_per_rank` and `sync_files` change nothing;
    `per_thread_copy_ahead` and `cache_staged_state_dict` are ignored. Stream `_extensions`
    (compression) and a `serialization_format` other than the default are refused: olmo-chunks
    stores raw element bytes.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
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
    ) -> None:
        super().__init__()
        if _extensions:
            raise InvalidArgumentError(
                "ChunkStoreWriter: _extensions (stream transforms such as ZStandard) are not supported; "
                "olmo-chunks stores raw element bytes with block checksums"
            )
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
        self.path = Path(path) if path is not None else None
        self.roles = dict(roles) if roles else None
        self.info = dict(info) if info else {}
        self.block_size = block_size
        self.workers = workers
        self.overwrite = overwrite
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.process_group = process_group
        self.peer_timeout = peer_timeout
        self.save_id: str | None = None
        self.is_coordinator = False
        self._txn: _core.SaveTransaction | None = None  # the coordinator's save, begun at global planning

    @property
    def checkpoint_id(self) -> Path | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._abort()
        self.path = _path_of(checkpoint_id, self.path)
        self.save_id = None

    def _abort(self) -> None:
        """Drops the save a failed `dcp.save` left begun (its data goes, the lease is released)."""
        if self._txn is not None:
            self._txn.abort()
            self._txn = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.path is None:
            raise InvalidArgumentError("ChunkStoreWriter: no path (pass one, or checkpoint_id to dcp.save)")
        if not kwargs.get("use_collectives", True) and dist.is_initialized() and dist.get_world_size() > 1:
            raise InvalidArgumentError(
                "ChunkStoreWriter commits one manifest for all ranks and needs use_collectives=True"
            )
        _check_group(self.process_group, kwargs.get("rank"), "ChunkStoreWriter")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path) if self.path else None, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self.path is not None
        if self.path.exists() and not self.path.is_dir():
            raise InvalidArgumentError(f"{self.path}: exists and is not a directory")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.path is not None
        self._abort()
        _check_group(self.process_group, None, "ChunkStoreWriter", len(plans))
        self._txn = _core.SaveTransaction.begin(str(self.path), self.overwrite, self.peer_timeout)
        save_id = self._txn.save_id
        return [dataclasses.replace(p, storage_data=_PlanStorage(save_id, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = _data_step(self.process_group, self.peer_timeout, lambda: self._write_items(plan, planner))
        except BaseException:
            self._abort()  # the coordinator's: every rank has stopped writing by now
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_items(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        assert self.path is not None
        storage = plan.storage_data
        if not isinstance(storage, _PlanStorage):
            raise InvalidArgumentError(
                "ChunkStoreWriter: the save plan carries no save id (was prepare_global_plan bypassed?)"
            )
        self.save_id = storage.save_id
        own = self.path / "data" / storage.save_id / f"rank-{storage.rank:05d}.bin"
        if own.exists():
            # Only a reused (cached) global plan repeats a save id; writing would clobber live data.
            raise InvalidArgumentError(
                f"{own} exists: the save plan was reused from an earlier save "
                "(DefaultSavePlanner(enable_plan_caching=True) is not supported by ChunkStoreWriter)"
            )
        results: list[WriteResult] = []
        chunks: list[tuple[str, tuple, torch.Tensor]] = []
        chunk_items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                enc = _encode_object(item.index.fqn, raw)
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
            chunks.append((item.index.fqn, ("box", list(td.chunk.offsets), sizes), tensor))
            chunk_items.append(item)
        written = _write(self.path, storage.save_id, storage.rank, chunks, self.block_size, self.workers)
        for item, chunk in zip(chunk_items, written, strict=True):
            results.append(WriteResult(index=item.index, size_in_bytes=chunk.nbytes, storage_data=chunk))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.path is not None
        if self._txn is None:
            raise InvalidArgumentError(
                "ChunkStoreWriter: no save was begun (was prepare_global_plan bypassed?)"
            )
        schema: dict[str, tuple] = {}
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
            commit_manifest(self._txn, self.block_size, schema, chunks, entries, info)
        finally:
            self._abort()  # a no-op once committed

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_local_path(checkpoint_id)


def _is_local_path(checkpoint_id: str | os.PathLike) -> bool:
    s = os.fspath(checkpoint_id)
    return isinstance(s, str) and "://" not in s


def _numpy_globals() -> list[Any]:
    """What numpy arrays, scalars and dtypes of numeric and bool dtypes unpickle through (under
    numpy 1's and numpy 2's module names), and io.BytesIO; never object or structured dtypes."""
    core = getattr(np, "_core", None) or np.core
    out: list[Any] = [np.ndarray, np.dtype, io.BytesIO]
    for fn in (core.multiarray._reconstruct, core.multiarray.scalar):
        out += [(fn, f"{mod}.multiarray.{fn.__name__}") for mod in ("numpy.core", "numpy._core")]
    codes = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
    return out + list({type(np.dtype(c)) for c in codes} - {np.dtype})


_SAFE_GLOBALS = _numpy_globals()


def _encode_object(fqn: str, raw: bytes) -> Any:
    """The plain value DCP pickled for `fqn`, as tagged JSON data; refuses anything that is not."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise InvalidArgumentError(
            f"{fqn!r}: only plain values (numbers, strings, bytes, BytesIO, lists, tuples, dicts, numpy "
            f"arrays) can be stored next to tensors; this one cannot be loaded as data ({exc})"
        ) from None
    return values.encode(value, fqn)


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


class ChunkStoreReader(StorageReader):
    """DCP `StorageReader` over an olmo-chunks checkpoint (saved by either front door).

    `verify` checks block checksums of everything read; `workers` bounds the reading threads.
    `FileSystemReader`'s `_extension_registry` is accepted when empty (there are no stream
    transforms to undo).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        verify: bool = True,
        workers: int | None = None,
        _extension_registry: Any = None,
        process_group: dist.ProcessGroup | None = None,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    ) -> None:
        super().__init__()
        if _extension_registry is not None:
            raise InvalidArgumentError(
                "ChunkStoreReader: _extension_registry is not supported; olmo-chunks stores raw "
                "element bytes, with no stream transforms to undo"
            )
        self.path = Path(path) if path is not None else None
        self.verify = verify
        self.workers = workers
        self.process_group = process_group
        self.peer_timeout = peer_timeout
        self.load_id = uuid.uuid4().hex
        self._manifest: _core.Manifest | None = None
        self._tensors: dict[str, tuple[int, torch.dtype]] = {}
        self._values: dict[str, Any] = {}
        self._value_paths: dict[str, tuple] = {}

    @property
    def checkpoint_id(self) -> Path | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.path = _path_of(checkpoint_id, self.path)
        self.load_id = uuid.uuid4().hex
        self._manifest = None

    def _open(self) -> _core.Manifest:
        if self._manifest is None:
            if self.path is None:
                raise InvalidArgumentError(
                    "ChunkStoreReader: no path (pass one, or checkpoint_id to dcp.load)"
                )
            m = _core.Manifest.open(str(self.path))
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
            chunks = []
            for c in m.chunks(i):
                if c.kind == "box":
                    if 0 not in c.sizes:
                        chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
                else:  # a flat range, presented as the boxes it decomposes into
                    for offs, sizes, _, _ in _core.flat_pieces(list(t.shape), c.offsets[0], c.sizes[0]):
                        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
            md[t.key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(t.dtype)), size=torch.Size(t.shape), chunks=chunks
            )
        paths: dict[str, tuple] = {}
        for fqn, path in self._value_paths.items():
            if fqn in md:
                raise CorruptCheckpointError(f"{self.path}: {fqn!r} is both a tensor and a value")
            md[fqn] = BytesStorageMetadata()
            paths[fqn] = path
        saved_info = values.parse_json(m.info_json, f"{self.path}: manifest info") if m.info_json else None
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
        _check_group(self.process_group, kwargs.get("rank"), "ChunkStoreReader")
        sd = metadata.storage_data
        if isinstance(sd, Mapping) and sd.get("save_id") not in (None, m.save_id):
            raise InvalidArgumentError(
                f"{self.path}: metadata of save {sd.get('save_id')} given for save {m.save_id}"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        _check_group(self.process_group, None, "ChunkStoreReader", len(plans))
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        _data_step(self.process_group, self.peer_timeout, lambda: self._read_items(plan, planner))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        m = self._open()
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
        fill(m, fills, verify=self.verify, workers=self.workers)
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
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_local_path(checkpoint_id) and (Path(checkpoint_id) / _core.MANIFEST_NAME).is_file()


def _check_group(process_group: dist.ProcessGroup | None, rank: int | None, who: str,
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


def _data_step(process_group: dist.ProcessGroup | None, peer_timeout: float, fn: Callable[[], Any]) -> Any:
    """Runs this rank's part of a DCP data step so that a failure on any rank, a dead one included
    (no heartbeat for `peer_timeout`), is known to every rank before DCP's next collective; after a
    death that collective is bounded too, where DCP alone would wait for the group's timeout."""
    try:
        return Group(process_group, peer_timeout).agree(fn)
    except RankFailedError as exc:
        if exc.dead:
            bound_collectives(process_group, min(peer_timeout, 10.0))
        log.error("olmo-chunks: %s", exc)
        raise


def _box_pieces(offsets: list[int], buf: torch.Tensor) -> list[tuple[list[int], list[int], int, list[int]]]:
    """The core target piece of the box at `offsets` of `buf`'s shape, filling all of `buf`."""
    return [(offsets, list(buf.shape), 0, list(buf.stride()))]


# --------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------


class FastLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose read items come from the Rust band index: the same items (one
    per overlap of a saved chunk and a local chunk), planned in `O((S + L) log S + overlaps)` per
    tensor on 1-D and 2-D layouts alike. Works with any storage reader."""

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata
        assert md is not None
        if self.flatten_state_dict:
            self._match_pre_2_4_keys(md)
        strict = not self.allow_partial_load
        requests: list[ReadItem] = []
        batch: list[tuple[str, torch.Size, list[ChunkStorageMetadata], list[ChunkStorageMetadata], int]] = []
        for fqn, obj in self.state_dict.items():
            if fqn not in md.state_dict_metadata:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            smd = md.state_dict_metadata[fqn]
            if isinstance(smd, BytesStorageMetadata):
                requests.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=MetadataIndex(fqn),
                        dest_offsets=torch.Size((0,)),
                        storage_index=MetadataIndex(fqn),
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
                continue
            if getattr(obj, "size", None) is not None:
                global_shape = getattr(obj, "global_shape", None)  # DCP's CheckpointableTensor
                obj_size = torch.Size(global_shape) if global_shape is not None else obj.size()
                if smd.size != obj_size:
                    raise ValueError(
                        f"Size mismatch between saved {smd.size} and current: {obj_size} for {fqn}"
                    )
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            local = _local_chunks(fqn, obj)
            batch.append((fqn, smd.size, list(smd.chunks), local, len(requests)))
            requests.append(None)  # type: ignore[arg-type]  # placeholder, keeps state-dict order
        slots = dict(
            zip(
                (slot for *_, slot in batch),
                read_items_for_chunk_lists(
                    [(fqn, size, saved, local) for fqn, size, saved, local, _ in batch]
                ),
                strict=True,
            )
        )
        out: list[ReadItem] = []
        for i, r in enumerate(requests):
            out.extend(slots[i] if r is None else [r])
        return LoadPlan(out)

    def _match_pre_2_4_keys(self, md: Metadata) -> None:
        """As DefaultLoadPlanner does: if checkpoint keys are missing from the flattened state
        dict, try DCP's pre-2.4 flattening, which keys checkpoints saved by torch <= 2.3."""
        missing = set(md.state_dict_metadata) - set(self.state_dict)
        if not missing:
            return
        try:
            from torch.distributed.checkpoint import _version
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        except ImportError:  # pragma: no cover
            return
        _version._derived_version = "2_3"
        try:
            old_sd, old_mappings = flatten_state_dict(self.original_state_dict)
        finally:
            _version._derived_version = None
        if set(old_sd) & missing:
            self.state_dict, self.mappings = old_sd, old_mappings


def read_items_for_chunk_lists(
    tensors: list[tuple[str, torch.Size, list[ChunkStorageMetadata], list[ChunkStorageMetadata]]],
) -> list[list[ReadItem]]:
    """Per `(fqn, global size, saved chunks, local chunks)`: the read items DCP's
    `create_read_items_for_chunk_list` makes (one per overlapping saved/local pair, same indices
    and offsets), computed in one call to the Rust band index for all tensors."""
    # torch.Size is a tuple: the binding reads it as is
    overlaps = (
        _core.box_overlaps(
            [
                (len(size), [(c.offsets, c.sizes) for c in saved], [(c.offsets, c.sizes) for c in local])
                for _, size, saved, local in tensors
            ]
        )
        if tensors
        else []
    )
    out = []
    for (fqn, _, saved, local), hits in zip(tensors, overlaps, strict=True):
        items = []
        for s, w, offs, sizes in hits:
            sc, lc = saved[s], local[w]
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, lc.offsets, w),
                    dest_offsets=torch.Size([o - b for o, b in zip(offs, lc.offsets, strict=True)]),
                    storage_index=MetadataIndex(fqn, sc.offsets, s),
                    storage_offsets=torch.Size([o - b for o, b in zip(offs, sc.offsets, strict=True)]),
                    lengths=torch.Size(sizes),
                )
            )
        out.append(items)
    return out


def _local_chunks(fqn: str, obj: Any) -> list[ChunkStorageMetadata]:
    """The chunks of the global tensor this rank holds in `obj`, exactly as DCP lists them."""
    if _create_chunk_list is not None:
        try:
            return _create_chunk_list(obj)
        except ValueError as exc:
            raise ValueError(
                f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata "
                f"but found a tensor entry"
            ) from exc
    if hasattr(obj, "__create_chunk_list__"):  # pragma: no cover  (DTensor)
        return obj.__create_chunk_list__()
    if isinstance(obj, torch.Tensor):  # pragma: no cover
        return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
    raise ValueError(f"{fqn}: unsupported type {type(obj).__name__}")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# import-dcp
# --------------------------------------------------------------------------------------------

# Globals a DCP `.metadata` pickle may name; anything else is refused.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch.distributed.checkpoint._nested_dict", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` pickle, allowing only the classes DCP puts there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise UnsupportedFormatError(f"DCP metadata names {module}.{name}, which import-dcp does not accept")


def _open_beneath(root: Path, rel: Any, what: str) -> io.BufferedReader:
    """Opens regular file `rel` below directory `root` for reading: a relative path of normal
    components, no symlink below `root` followed (each component opened with O_NOFOLLOW from its
    parent's descriptor), never blocking on a FIFO or device. Refuses anything else with
    UnsafePathError (a CorruptCheckpointError) naming `what`."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise UnsafePathError(f"{root}: {what}: path {rel!r} points outside the checkpoint directory")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fds = []
    try:
        fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        for part in parts[:-1]:
            fds.append(os.open(part, flags | os.O_DIRECTORY, dir_fd=fds[-1]))
        fd = os.open(parts[-1], flags, dir_fd=fds[-1])
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise MissingDataFileError(f"{root / rel}: {what}: no such file") from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(
                f"{root}: {what}: path {rel!r} goes through a symlink or a non-directory"
            ) from None
        raise StorageError(exc.errno, f"{root / rel}: {what}: {exc.strerror}") from None
    finally:
        for d in fds:
            os.close(d)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{root}: {what}: {rel!r} is not a regular file")
    os.set_blocking(fd, True)
    return open(fd, "rb")


@contextlib.contextmanager
def _bad_metadata(src: Path, what: str) -> Iterator[None]:
    """Turns the errors that malformed DCP metadata causes while interpreting it into
    CorruptCheckpointError naming `what`."""
    try:
        yield
    except OlmoChunksError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise CorruptCheckpointError(f"{src}: bad DCP metadata for {what}: {exc}") from None


def read_dcp_metadata(src: str | os.PathLike) -> Metadata:
    """The `Metadata` of a checkpoint written by DCP's FileSystemWriter, read without running
    arbitrary pickled code."""
    path = Path(src) / ".metadata"
    try:
        if not Path(src).is_dir():
            raise MissingDataFileError(f"{src}: not a directory")
        f = _open_beneath(Path(src), ".metadata", "DCP metadata")
    except (MissingDataFileError, StorageError) as exc:
        raise CheckpointNotFoundError(f"{src}: not a DCP FileSystemWriter checkpoint ({exc})") from None
    with f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsupportedFormatError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{path}: cannot read DCP metadata: {exc}") from None
    if (
        not isinstance(md, Metadata)
        or not isinstance(md.storage_data, Mapping)
        or not isinstance(md.state_dict_metadata, Mapping)
    ):
        raise CorruptCheckpointError(f"{path}: not DCP FileSystemWriter metadata")
    return md


def import_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    roles: Mapping[str, str] | None = None,
    overwrite: bool = False,
    block_size: int = _core.DEFAULT_BLOCK_SIZE,
    batch_bytes: int = 256 << 20,
    workers: int | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Converts a DCP FileSystemWriter checkpoint at `src` into an olmo-chunks checkpoint at `dst`,
    one saved item at a time (memory stays near `batch_bytes` plus the largest item), then
    verifies coverage and every checksum. Returns a summary. Every read stays inside `src` (see
    `_open_beneath`); a checkpoint already at `dst` is replaced only with `overwrite=True`."""
    src, dst = Path(src), Path(dst)
    md = read_dcp_metadata(src)
    storage: Mapping[MetadataIndex, Any] = md.storage_data
    schema: dict[str, tuple] = {}
    leaves: dict[str, Any] = {}
    written: list[_core.WrittenChunk] = []
    pending: list[tuple[str, tuple, torch.Tensor]] = []
    pending_bytes = 0
    nfile = 0
    handles: dict[str, Any] = {}
    files = contextlib.ExitStack()

    def read_raw(fqn: str, index: MetadataIndex) -> bytes:
        what = f"item {fqn} at {tuple(index.offset or ())}"
        sinfo = storage.get(index)
        if sinfo is None:
            raise CorruptCheckpointError(f"{src}: no storage entry for {what}")
        if getattr(sinfo, "transform_descriptors", None):
            raise UnsupportedFormatError(
                f"{src}: {what} was written with stream transforms "
                f"{sinfo.transform_descriptors}, which import-dcp does not read"
            )
        rel, offset, length = (getattr(sinfo, a, None) for a in ("relative_path", "offset", "length"))
        if not (isinstance(rel, str) and type(offset) is int and type(length) is int and min(offset, length) >= 0):
            raise CorruptCheckpointError(f"{src}: {what}: bad storage entry {sinfo!r}")
        f = handles.get(rel)
        if f is None:
            f = handles[rel] = files.enter_context(_open_beneath(src, rel, what))
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:  # checked before allocating: a crafted length may be huge
            raise TruncatedDataError(
                f"{src / rel}: {what} spans bytes {offset}..{offset + length}, past the end of the file ({size})"
            )
        try:
            f.seek(offset)
            raw = f.read(length)
        except OSError as exc:
            raise StorageError(exc.errno, f"{src / rel}: {what}: {exc.strerror or exc}") from None
        if len(raw) != length:
            raise TruncatedDataError(f"{src / rel}: truncated at {what}")
        return raw

    def flush() -> None:
        nonlocal pending, pending_bytes, nfile
        if pending:
            out = _write(dst, txn.save_id, nfile, pending, block_size, workers)
            written.extend(out)
            nfile += 1
        pending, pending_bytes = [], 0

    def import_tensor(fqn: str, smd: TensorStorageMetadata) -> None:
        nonlocal pending_bytes
        dtype = smd.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{src}: {fqn} has no valid dtype")
        schema[fqn] = (dtype_name(dtype), list(smd.size), resolve_role(fqn, torch.empty(0, dtype=dtype), roles))
        for chunk in smd.chunks:
            if 0 in list(chunk.sizes):
                continue
            raw = read_raw(fqn, MetadataIndex(fqn, chunk.offsets))
            try:
                t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"{src}: item {fqn} at {tuple(chunk.offsets)} is not a torch.save'd tensor ({exc})"
                ) from None
            del raw
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or list(t.shape) != list(chunk.sizes):
                raise CorruptCheckpointError(
                    f"{src}: item {fqn} at {tuple(chunk.offsets)} does not match "
                    f"its metadata ({dtype}, {tuple(chunk.sizes)})"
                )
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > batch_bytes:
                flush()
            pending.append((fqn, ("box", list(chunk.offsets), list(chunk.sizes)), t.contiguous()))
            pending_bytes += nbytes

    txn = _core.SaveTransaction.begin(str(dst), overwrite)
    try:
        with files:
            for fqn, smd in md.state_dict_metadata.items():
                with _bad_metadata(src, repr(fqn)):
                    if isinstance(smd, BytesStorageMetadata):
                        leaves[fqn] = _encode_object(fqn, read_raw(fqn, MetadataIndex(fqn)))
                    else:
                        import_tensor(fqn, smd)
            flush()
        with _bad_metadata(src, "the object paths (planner_data)"):
            paths = md.planner_data if isinstance(md.planner_data, Mapping) else None
            entries = group_entries(leaves, paths, schema)
            info = {
                "writer": "olmo_chunks.import_dcp",
                "source": str(src),
                "dcp_version": md.version,
                **({"dcp_paths": {k: list(v) for k, v in paths.items()}} if paths else {}),
            }
        m = commit_manifest(txn, block_size, schema, written, entries, info)
    finally:
        txn.abort()  # a no-op once committed
    m.check_coverage()
    nbytes = m.verify_data(workers) if verify else 0
    return {
        "tensors": len(schema),
        "values": len(entries),
        "chunks": m.num_chunks,
        "bytes": nbytes,
        "files": len(m.files),
    }


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="checkpoint directory written by DCP's FileSystemWriter")
    p.add_argument("dst", help="olmo-chunks checkpoint directory to write")
    p.add_argument("--batch-mb", type=int, default=256, help="bytes staged per data file (MiB)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at dst")


def _import_cmd(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = import_dcp(
        args.src, args.dst, overwrite=args.overwrite, batch_bytes=args.batch_mb << 20, workers=args.workers
    )
    dt = time.perf_counter() - t0
    print(
        f"OK {args.dst}: {s['tensors']} tensors, {s['values']} values, {s['chunks']} chunks in "
        f"{s['files']} data files, {s['bytes']} bytes verified ({s['bytes'] / max(dt, 1e-9) / 1e9:.2f} GB/s "
        "end to end), exact coverage"
    )
    return 0
