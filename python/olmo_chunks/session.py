"""`SaveSession`: one save on one rank, whatever door it comes through (`save`, `async_save`, the DCP
writer, `import_dcp`, `import_hf`).

A save is a transaction in the core (`_core.SaveTransaction`: the path's lease, the save id, then
commit or abort), held by one rank, the coordinator, and data files written by every rank under
that save id. The session owns both sides: the coordinator begins, commits and aborts; every rank
names its data files (through the core, which alone decides what its cleanup recognises) and rolls
to a new one when the bytes it holds for the save reach a budget. Leaving a session's `with` block
without a commit abandons the save: its data goes, the lease is released, the path keeps the
checkpoint it had.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import _core, values
from .errors import InvalidArgumentError
from .fill import STAGING_BYTES
from .shards import ChunkItem

__all__ = ["DEFAULT_ZSTD_LEVEL", "SaveSession", "staging_bytes", "zstd_level"]

DEFAULT_ZSTD_LEVEL = 3


def zstd_level(compression: str | None, level: int | None = None) -> int | None:
    """The zstd level a save's `compression` / `compression_level` arguments ask for (None: raw)."""
    if compression is None:
        if level is not None:
            raise InvalidArgumentError(f"compression_level={level} needs compression='zstd'")
        return None
    if compression != "zstd":
        raise InvalidArgumentError(f"compression={compression!r}: only 'zstd' (or None) is supported")
    return DEFAULT_ZSTD_LEVEL if level is None else level


def staging_bytes(chunks: Iterable[ChunkItem]) -> int:
    """Host bytes that staging `chunks` back to back takes (each starting at a multiple of 64)."""
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for _, _, t in chunks)


class SaveSession:
    """This rank's part of one save into `target`: the data files it writes under `save_id` and,
    on the coordinator (after `begin`), the transaction it commits.

    `add` queues a chunk `(key, region, tensor)` for the current data file; the file is written
    (`flush`) before the bytes the session holds would pass `budget`. Held bytes are those made for
    the save: the host copies of accelerator tensors (staged when their file is written) and the
    tensors passed with `owned=True` (read from elsewhere by an importer). CPU tensors the caller
    still holds are written from their own memory and cost nothing. `written` collects where every
    chunk went, in order."""

    def __init__(self, target: str, *, rank: int = 0, save_id: str = "", block_size: int = _core.DEFAULT_BLOCK_SIZE,
                 workers: int | None = None, zstd: int | None = None, budget: int = STAGING_BYTES) -> None:
        self.target, self.rank, self.save_id = target, rank, save_id
        self.block_size, self.workers, self.zstd, self.budget = block_size, workers, zstd, budget
        self.txn: _core.SaveTransaction | None = None
        self.written: list[_core.WrittenChunk] = []
        self.parts = 0
        self._pending: list[ChunkItem] = []
        self._held = 0

    def begin(self, overwrite: bool, lease_timeout: float | None = None) -> str:
        """Takes the path's lease and starts the save (the coordinator); returns the save id."""
        self.abort()
        timeout = () if lease_timeout is None else (lease_timeout,)
        self.txn = _core.SaveTransaction.begin(self.target, overwrite, *timeout)
        self.save_id = self.txn.save_id
        return self.save_id

    def add(self, key: str, region: Any, tensor: torch.Tensor, *, owned: bool = False) -> None:
        """Queues one chunk; writes the queued ones first if holding this one too would pass the
        budget."""
        cost = tensor.numel() * tensor.element_size() if owned or tensor.device.type != "cpu" else 0
        if self._pending and cost and self._held + cost > self.budget:
            self.flush()
        self._pending.append((key, region, tensor if tensor.device.type != "cpu" else tensor.contiguous()))
        self._held += cost

    def write(self, chunks: Iterable[ChunkItem]) -> list[_core.WrittenChunk]:
        """Writes `chunks` (all of them, in as many files as the budget asks); returns where each went."""
        start = len(self.written)
        for key, region, t in chunks:
            self.add(key, region, t)
        self.flush()
        return self.written[start:]

    def flush(self) -> None:
        """Writes the queued chunks into this rank's next data file, accelerator tensors through
        pinned host buffers."""
        batch, self._pending, self._held = self._pending, [], 0
        if not batch:
            return
        staged: list[ChunkItem] = []
        for key, region, t in batch:
            if t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
                host.copy_(t, non_blocking=True)
                t = host
            staged.append((key, region, t))
        if len(staged) != sum(t.device.type == "cpu" for _, _, t in batch):
            torch.cuda.synchronize()
        self.write_file(staged)

    def write_file(self, chunks: list[ChunkItem]) -> list[_core.WrittenChunk]:
        """Writes contiguous CPU chunks `(key, region, data)` into this rank's next data file."""
        if not self.save_id:
            raise InvalidArgumentError("no save was begun (a data file needs the save id)")
        name = _core.data_file(self.save_id, self.rank, self.parts)
        items = [_core.WriteItem(key, region, t.data_ptr(), t.numel() * t.element_size()) for key, region, t in chunks]
        out = _core.write_chunks(self.target, name, items, self.block_size, self.workers, self.zstd)
        self.parts += 1
        self.written.extend(out)
        return out

    def commit(self, schema: Mapping[str, tuple[Any, ...]], chunks: Iterable[_core.WrittenChunk],
               entries: Mapping[str, Any], info: Mapping[str, Any]) -> _core.Manifest:
        """Commits the save (the coordinator): `schema` maps every key to `(dtype, shape, role)`,
        `chunks` is what every rank wrote, `entries` the encoded plain values, `info` free-form
        information (creation time and torch version are added). The core assembles, checks and
        commits the manifest."""
        if self.txn is None:
            raise InvalidArgumentError("no save was begun on this rank (only the coordinator commits)")
        meta_info = {"created_unix": time.time(), "torch": torch.__version__, **info}
        return self.txn.commit(
            self.block_size,
            [_core.TensorSchema(key, *schema[key]) for key in schema],
            list(chunks),
            json.dumps(entries, allow_nan=False),
            json.dumps(values.encode(meta_info, "info"), allow_nan=False),
        )

    def abort(self) -> None:
        """Abandons the save if it was begun here and not committed (a no-op after the commit)."""
        if self.txn is not None:
            self.txn.abort()
            self.txn = None

    def __enter__(self) -> SaveSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
