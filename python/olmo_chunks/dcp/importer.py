"""`import_dcp`: a checkpoint written by DCP's FileSystemWriter (as torchtitan saves) or OLMo-core's
RemoteFileSystemWriter, converted into the chunk store."""


from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .. import _core
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingDataFileError,
    OlmoChunksError,
    StorageError,
    TruncatedDataError,
    UnsafePathError,
    UnsupportedFormatError,
)
from ..location import checkpoint_location, local_dir
from ..roles import check_roles, resolve_role
from ..session import SaveSession, zstd_level
from ..shards import dtype_name
from .values import encode_object, group_entries

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

# Trainers' own copies of DCP's `_StorageInfo` (a subset of its fields: relative_path, offset,
# length), read as DCP's: their modules are never imported.
_STORAGE_INFO_COPIES = {
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"),  # OLMo-core's RemoteFileSystemWriter
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` pickle, allowing only the classes DCP puts there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _STORAGE_INFO_COPIES:
            return _StorageInfo
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise UnsupportedFormatError(f"DCP metadata names {module}.{name}, which import-dcp does not accept")


def _open_beneath(root: Path, rel: Any, what: str) -> io.BufferedReader:
    """Opens regular file `rel` below directory `root` for reading, as the core opens data files
    (`_core.open_beneath`: normal components only, no symlink below `root` followed, never
    blocking on a FIFO). Refuses anything else with UnsafePathError naming `what`."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{root}: {what}: path {rel!r} is not a relative path inside the checkpoint directory")
    try:
        return open(_core.open_beneath(str(root), rel), "rb")
    except OlmoChunksError as exc:
        raise type(exc)(f"{what}: {exc}") from None


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


def _dims(src: Path, fqn: str, what: str, dims: Any) -> list[int]:
    """`dims` (a size, offsets) as a list of non-negative integers, or CorruptCheckpointError."""
    out = list(dims)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 63 for n in out):
        raise CorruptCheckpointError(f"{src}: {fqn}: bad {what} {tuple(out)} in the DCP metadata")
    return out


def read_dcp_metadata(src: str | os.PathLike[str]) -> Metadata:
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


def import_dcp(  # noqa: PLR0915
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    roles: Mapping[str, str] | None = None,
    overwrite: bool = False,
    block_size: int = _core.DEFAULT_BLOCK_SIZE,
    batch_bytes: int = 256 << 20,
    workers: int | None = None,
    verify: bool = True,
    compression: str | None = None,
    compression_level: int | None = None,
) -> dict[str, Any]:
    """Converts a DCP FileSystemWriter checkpoint at `src` into an olmo-chunks checkpoint at `dst`,
    one saved item at a time (memory stays near `batch_bytes` plus the largest item), then
    verifies coverage and every checksum. Returns a summary. Every read stays inside `src` (see
    `_open_beneath`); a checkpoint already at `dst` is replaced only with `overwrite=True`.
    `compression` and `compression_level` are `olmo_chunks.save`'s."""
    src, dst = local_dir(src, "a DCP FileSystemWriter checkpoint"), checkpoint_location(dst)
    roles = check_roles(roles)
    zstd = zstd_level(compression, compression_level)
    md = read_dcp_metadata(src)
    storage: Mapping[MetadataIndex, Any] = md.storage_data
    schema: dict[str, tuple[Any, ...]] = {}
    leaves: dict[str, Any] = {}
    session = SaveSession(dst, block_size=block_size, workers=workers, zstd=zstd, budget=batch_bytes)
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

    def import_tensor(fqn: str, smd: TensorStorageMetadata) -> None:
        dtype = smd.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{src}: {fqn} has no valid dtype")
        schema[fqn] = (dtype_name(dtype), _dims(src, fqn, "size", smd.size),
                       resolve_role(fqn, torch.empty(0, dtype=dtype), roles))
        for chunk in smd.chunks:
            _dims(src, fqn, "chunk offsets", chunk.offsets)
            if 0 in _dims(src, fqn, "chunk sizes", chunk.sizes):
                continue
            raw = read_raw(fqn, MetadataIndex(fqn, chunk.offsets))
            try:
                t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"{src}: item {fqn} at {tuple(chunk.offsets)} is not a torch.save'd tensor ({exc})"
                ) from None
            del raw
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype or list(
                    t.shape) != list(chunk.sizes):
                raise CorruptCheckpointError(
                    f"{src}: item {fqn} at {tuple(chunk.offsets)} does not match "
                    f"its metadata (a dense {dtype} tensor of {tuple(chunk.sizes)})"
                )
            session.add(fqn, _core.Box(list(chunk.offsets), list(chunk.sizes)), t, owned=True)

    with session:
        session.begin(overwrite)
        with files:
            for fqn, smd in md.state_dict_metadata.items():
                with _bad_metadata(src, repr(fqn)):
                    if isinstance(smd, BytesStorageMetadata):
                        leaves[fqn] = encode_object(fqn, read_raw(fqn, MetadataIndex(fqn)))
                    else:
                        import_tensor(fqn, smd)
            session.flush()
        with _bad_metadata(src, "the object paths (planner_data)"):
            paths = md.planner_data if isinstance(md.planner_data, Mapping) else None
            entries = group_entries(leaves, paths, schema)
            info = {
                "writer": "olmo_chunks.import_dcp",
                "source": str(src),
                "dcp_version": getattr(md, "version", None),  # torch 2.6's metadata has none
                **({"dcp_paths": {k: list(v) for k, v in paths.items()}} if paths else {}),
            }
        m = session.commit(schema, session.written, entries, info)
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
    p.add_argument("--batch-mb", type="mib", default=256, help="bytes staged per data file (MiB)")
    p.add_argument("--workers", type="count", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at dst")
    p.add_argument("--compression", choices=["zstd"], default=None, help="compress every block with zstd")
    p.add_argument("--compression-level", type=int, default=None, help="zstd level (default 3)")


def _import_cmd(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    s = import_dcp(
        args.src, args.dst, overwrite=args.overwrite, batch_bytes=args.batch_mb << 20, workers=args.workers,
        compression=args.compression, compression_level=args.compression_level,
    )
    dt = time.perf_counter() - t0
    print(
        f"OK {args.dst}: {s['tensors']} tensors, {s['values']} values, {s['chunks']} chunks in "
        f"{s['files']} data files, {s['bytes']} bytes verified ({s['bytes'] / max(dt, 1e-9) / 1e9:.2f} GB/s "
        "end to end), exact coverage"
    )
    return 0
