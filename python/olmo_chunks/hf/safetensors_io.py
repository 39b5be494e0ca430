"""Streaming safetensors files: write tensors piece by piece, read any row range back.

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and `data_offsets` (relative to the data section), then the raw little-endian bytes. A
sharded model adds `model.safetensors.index.json` mapping each tensor to its file. Both sides
here work in bounded memory: nothing holds a whole tensor unless the caller asks for one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError, InvalidArgumentError, StorageError
from ..location import local_dir
from . import shapes
from .common import json_object, open_regular, read_json

__all__ = [
    "INDEX_NAME",
    "HFTensor",
    "SafetensorsDir",
    "ShardedWriter",
    "safetensors_dtype",
    "torch_dtype_of",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Same cap as the reference implementation: a header is metadata, never data.
MAX_HEADER_BYTES = 100_000_000

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (`F32`, `BF16`, ...)."""
    try:
        return _ST_NAMES[dtype]
    except KeyError:
        raise InvalidArgumentError(f"dtype {dtype} has no safetensors name") from None


def torch_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown safetensors dtype {name!r}") from None


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a safetensors directory: where its bytes lie."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return shapes.numel(self.shape)


def _parse_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]], int]:  # noqa: PLR0915
    """`(metadata, [(name, entry)] in header order, data_start)` of one safetensors file,
    validated like the reference reader: known dtypes, sizes that match shapes, tensors that tile
    the data section exactly."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
            n = int.from_bytes(raw, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CorruptCheckpointError(f"{path}: header length {n} is invalid for a {size}-byte file")
            header = f.read(n)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: safetensors file is missing") from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{path}: not a regular file (a directory)") from None
    except OSError as exc:
        raise StorageError(f"{path}: {exc}") from exc
    # Keep every (name, entry) pair: a name given twice in one header is a duplicate, not an update.
    pairs: list[list[tuple[str, Any]]] = []

    def keep(kv: list[tuple[str, Any]]) -> dict[str, Any]:
        pairs.append(kv)
        return dict(kv)

    json_object(header, f"{path}: header", object_pairs_hook=keep)
    top = pairs[-1]
    metadata: dict[str, Any] = {}
    entries: list[tuple[str, dict[str, Any]]] = []
    for name, entry in top:
        if name == "__metadata__":
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"{path}: __metadata__ is not an object")
            metadata = entry
            continue
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{path}: entry {name!r} is not an object")
        entries.append((name, entry))
    data_start = 8 + n
    spans = []
    for name, e in entries:
        dt: Any = e.get("dtype")
        shape: Any = e.get("shape")
        offs: Any = e.get("data_offsets")
        # Types exactly as the reference reader takes them: JSON's true is no integer here.
        if not isinstance(dt, str) or dt not in _ST_DTYPES:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} has unknown dtype {dt!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has a bad shape {shape!r:.100} (not a list of non-negative integers)"
            )
        if not (
            isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]
        ):
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has bad data_offsets {offs!r:.100} (not two integers 0 <= begin <= end)"
            )
        want = shapes.numel(shape) * _ST_DTYPES[dt].itemsize
        if offs[1] - offs[0] != want:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has {offs[1] - offs[0]} bytes, shape {shape} {dt} needs {want}"
            )
        spans.append((offs[0], offs[1], name))
    end = 0
    for a, b, name in sorted(spans):
        if a != end:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} starts at {a}, expected {end} (gap or overlap)"
            )
        end = b
    if data_start + end != size:
        raise CorruptCheckpointError(f"{path}: data section is {size - data_start} bytes, header says {end}")
    return metadata, entries, data_start


class SafetensorsDir:
    """The tensors of a safetensors model directory (sharded with an index, or one file), read by
    ranges. Tensors named twice (in two files, or twice in one header) and index entries that
    disagree with the files are recorded in `problems` rather than raised, so a validator can
    name them all; `strict=True` raises the first instead."""

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        self.path = local_dir(path, "a Hugging Face model")
        self.tensors: dict[str, HFTensor] = {}
        self.duplicates: dict[str, list[str]] = {}
        self.problems: list[str] = []
        self.metadata: dict[str, dict[str, Any]] = {}
        self.index: dict[str, Any] | None = None
        if not self.path.is_dir():
            raise InvalidArgumentError(f"{self.path}: not a directory")
        index_path = self.path / INDEX_NAME
        weight_map: dict[str, str] | None = None
        if index_path.exists():
            self.index = read_json(index_path)
            weight_map = self.index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CorruptCheckpointError(f"{index_path}: bad index (weight_map is not a name -> file object)")
            files = sorted(set(weight_map.values()))
            for f in files:
                if f in ("", "..") or Path(f).name != f:
                    raise CorruptCheckpointError(f"{index_path}: file name {f!r} is not a plain name")
        elif (self.path / SINGLE_NAME).exists():
            files = [SINGLE_NAME]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise InvalidArgumentError(f"{self.path}: no safetensors files and no {INDEX_NAME}")
        for fname in files:
            fpath = self.path / fname
            meta, entries, data_start = _parse_header(fpath)
            self.metadata[fname] = meta
            for name, e in entries:
                a, b = e["data_offsets"]
                t = HFTensor(name, _ST_DTYPES[e["dtype"]], tuple(e["shape"]), fpath, data_start + a, b - a)
                if name in self.tensors:
                    self.duplicates.setdefault(name, [self.tensors[name].file.name]).append(fname)
                    self.problems.append(
                        f"{name}: stored more than once ({', '.join(self.duplicates[name])})"
                    )
                    continue
                self.tensors[name] = t
        if weight_map is not None:
            for name, fname in weight_map.items():
                found = self.tensors.get(name)
                if found is None:
                    self.problems.append(f"{name}: listed in {INDEX_NAME} ({fname}) but in no file")
                elif found.file.name != fname and name not in self.duplicates:
                    self.problems.append(f"{name}: index says {fname}, stored in {found.file.name}")
            for name in self.tensors:
                if name not in weight_map:
                    self.problems.append(
                        f"{name}: stored in {self.tensors[name].file.name} but not in the index"
                    )
            for p in sorted(self.path.glob("*.safetensors")):
                if p.name not in files:
                    self.problems.append(f"{p.name}: a safetensors file the index does not name")
        if strict and self.problems:
            raise CorruptCheckpointError(f"{self.path}: {self.problems[0]}")

    def config(self) -> dict[str, Any] | None:
        """The directory's `config.json`, if any."""
        p = self.path / "config.json"
        return read_json(p) if p.exists() else None

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The sub-box `offsets`/`sizes` of tensor `name`, read from disk (only the rows it spans)."""
        t = self.tensors[name]
        shape = list(t.shape)
        if len(offsets) != len(shape) or any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)
        ):
            raise InvalidArgumentError(f"{name}: box {list(offsets)}+{list(sizes)} outside shape {shape}")
        if not shape:
            return self._read_rows(t, 0, 1).reshape(())
        if 0 in sizes:
            return torch.empty(list(sizes), dtype=t.dtype)
        # A box that is one run of the row-major order is read exactly; any other box reads the
        # rows it spans and slices them.
        j = len(shape) - 1
        while j > 0 and sizes[j] == shape[j]:
            j -= 1
        if all(s == 1 for s in sizes[:j]):
            start = sum(o * st for o, st in zip(offsets, shapes.strides(shape), strict=True))
            return self._read_rows(t, start, shapes.numel(sizes)).reshape(list(sizes))
        inner = shapes.numel(shape[1:])
        rows = self._read_rows(t, offsets[0] * inner, sizes[0] * inner).reshape([sizes[0], *shape[1:]])
        idx = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
        out = rows[(slice(None), *idx)]
        return out if out.is_contiguous() else out.contiguous()

    def _read_rows(self, t: HFTensor, start: int, count: int) -> torch.Tensor:
        item = t.dtype.itemsize
        buf = torch.empty(count, dtype=t.dtype)
        if count == 0:
            return buf
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        try:
            with open_regular(t.file) as f:
                pos, done = t.start + start * item, 0
                while done < len(view):
                    n = os.preadv(f.fileno(), [view[done:]], pos + done)
                    if n <= 0:
                        raise CorruptCheckpointError(f"{t.file}: truncated while reading {t.name!r}")
                    done += n
        except OSError as exc:
            raise StorageError(f"{t.file}: {exc}") from exc
        return buf


@dataclass
class _Planned:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: int
    start: int  # offset in the data section
    nbytes: int
    written: int = 0


class ShardedWriter:
    """Writes a planned list of tensors into sharded safetensors files plus the index, each
    tensor streamed in row-major pieces (`write`). Files appear under their final names and the
    index is written last, only when every byte of every tensor has been written (`close`)."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        *,
        max_shard_bytes: int = 5 << 30,
        metadata: dict[str, str] | None = None,
        index_metadata: dict[str, Any] | None = None,
    ) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.index_metadata = dict(index_metadata or {})
        self._plan: dict[str, _Planned] = {}
        groups: list[list[_Planned]] = [[]]
        size = 0
        for name, dtype, shape in tensors:
            if name in self._plan:
                raise InvalidArgumentError(f"tensor {name!r} planned twice")
            nbytes = shapes.numel(shape) * dtype.itemsize
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            p = _Planned(name, dtype, tuple(int(d) for d in shape), len(groups) - 1, size, nbytes)
            groups[-1].append(p)
            self._plan[name] = p
            size += nbytes
        n = len(groups)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._fds: list[int] = []
        self._data_start: list[int] = []
        try:
            for i, group in enumerate(groups):
                header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
                for p in group:
                    header[p.name] = {
                        "dtype": safetensors_dtype(p.dtype),
                        "shape": list(p.shape),
                        "data_offsets": [p.start, p.start + p.nbytes],
                    }
                raw = json.dumps(header, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                path = self.out / self.files[i]
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)
                os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
                self._data_start.append(8 + len(raw))
                os.ftruncate(fd, 8 + len(raw) + sum(p.nbytes for p in group))
        except OSError as exc:
            self.abort()
            raise StorageError(f"{self.out}: {exc}") from exc

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Appends `piece` (the next elements of `name` in row-major order, any shape) to the file."""
        p = self._plan[name]
        if piece.dtype != p.dtype:
            raise InvalidArgumentError(f"{name}: piece is {piece.dtype}, planned {p.dtype}")
        data = piece.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
        if p.written + data.nbytes > p.nbytes:
            raise InvalidArgumentError(f"{name}: more bytes than its shape {list(p.shape)} holds")
        pos = self._data_start[p.file] + p.start + p.written
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fds[p.file], view[done:], pos + done)
        except OSError as exc:
            raise StorageError(f"{self.out / self.files[p.file]}: {exc}") from exc
        p.written += data.nbytes

    def close(self) -> dict[str, Any]:
        """Checks every tensor is complete, syncs the files and writes the index; returns it."""
        short = [p.name for p in self._plan.values() if p.written != p.nbytes]
        if short:
            self.abort()
            raise InvalidArgumentError(f"tensors not fully written: {', '.join(short[:5])}")
        try:
            for fd in self._fds:
                os.fsync(fd)
                os.close(fd)
            self._fds = []
            index = {
                "metadata": {"total_size": sum(p.nbytes for p in self._plan.values()), **self.index_metadata},
                "weight_map": {p.name: self.files[p.file] for p in self._plan.values()},
            }
            tmp = self.out / f".{INDEX_NAME}.tmp"
            tmp.write_text(json.dumps(index, indent=2, sort_keys=False) + "\n")
            os.replace(tmp, self.out / INDEX_NAME)
        except OSError as exc:
            raise StorageError(f"{self.out}: {exc}") from exc
        return index

    def abort(self) -> None:
        """Closes the files without writing an index."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
