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

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from . import _core, values
from .errors import InvalidArgumentError, check_int, start_thread
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
    return DEFAULT_ZSTD_LEVEL if level is None else check_int("compression_level", level, -(2**31), 2**31 - 1)


def staging_bytes(chunks: Iterable[ChunkItem]) -> int:
    """Host bytes that staging `chunks` back to back takes (each starting at a multiple of 64)."""
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for _, _, t in chunks)


def _staged(t: torch.Tensor) -> bool:
    """Whether a chunk's tensor is copied into host memory before it is written: an accelerator's,
    a non-contiguous one, or a lazily conjugated or negated view (whose memory holds other values
    than it has: the copy resolves them)."""
    return t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg()


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT held back from this thread (and from those it starts) while the body runs: a Ctrl-C
    then raises `KeyboardInterrupt` right after it, not between two of its statements."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class SaveSession:
    """This rank's part of one save into `target`: the data files it writes under `save_id` and,
    on the coordinator (after `begin`), the transaction it commits.

    `add` queues a chunk `(key, region, tensor)` for the next data file. Held bytes are those made
    for the save: the host copies of accelerator tensors and of non-contiguous CPU tensors (staged
    when their file is written) and the tensors passed with `owned=True` (read from elsewhere by an
    importer). CPU tensors the caller still holds are written from their own memory and cost
    nothing. Files are written double-buffered: once the queued chunks hold half of `budget`, they
    are staged into a host buffer (pinned when any is on an accelerator; the buffer of the file
    before last is reused) and written by a thread of this process while the caller goes on adding
    and staging the next file, so device-to-host copies overlap writes and the bytes held, queued
    and being written, stay within `budget` (or two chunks, where one alone is larger than half of
    it). `flush` writes what is queued and waits for every write; an error of a write is raised by
    the next `add` or `flush`. `written` collects where every chunk went, in order."""

    def __init__(self, target: str, *, rank: int = 0, save_id: str = "", block_size: int = _core.DEFAULT_BLOCK_SIZE,
                 workers: int | None = None, zstd: int | None = None, budget: int = STAGING_BYTES) -> None:
        self.target, self.rank, self.save_id = target, rank, save_id
        self.block_size, self.workers, self.zstd, self.budget = block_size, workers, zstd, budget
        self.txn: _core.SaveTransaction | None = None
        self.written: list[_core.WrittenChunk] = []
        self.parts = 0
        self._pending: list[ChunkItem] = []
        self._held = 0
        self._writing: tuple[threading.Event, list[BaseException], torch.Tensor | None] | None = None
        self._spare: torch.Tensor | None = None  # the staging buffer no write is using

    def begin(self, overwrite: bool, lease_timeout: float | None = None) -> str:
        """Takes the path's lease and starts the save (the coordinator); returns the save id."""
        self.abort()
        timeout = () if lease_timeout is None else (lease_timeout,)
        self.txn = _core.SaveTransaction.begin(self.target, overwrite, *timeout)
        self.save_id = self.txn.save_id
        return self.save_id

    def add(self, key: str, region: Any, tensor: torch.Tensor, *, owned: bool = False) -> None:
        """Queues one chunk; starts writing the queued ones first if holding this one too would
        pass half the budget."""
        cost = tensor.numel() * tensor.element_size() if owned or _staged(tensor) else 0
        if self._pending and cost and self._held + cost > self.budget // 2:
            self._start()
        self._pending.append((key, region, tensor))
        self._held += cost

    def write(self, chunks: Iterable[ChunkItem]) -> list[_core.WrittenChunk]:
        """Writes `chunks` (all of them, in as many files as the budget asks); returns where each went."""
        start = len(self.written)
        try:
            for key, region, t in chunks:
                self.add(key, region, t)
            self.flush()
        except BaseException:
            self._settle()  # no file of the save is still being written when the error is seen
            raise
        return self.written[start:]

    def flush(self) -> None:
        """Writes the queued chunks into this rank's next data file and waits for every write."""
        self._start()
        self._wait()

    def _start(self) -> None:
        """Stages the queued chunks, waits for the write before, and starts writing them."""
        batch, self._pending, self._held = self._pending, [], 0
        if not batch:
            return
        staged, buffer = self._stage(batch)
        self._wait()
        errors: list[BaseException] = []
        done = threading.Event()

        def write() -> None:
            try:
                self.write_file(staged)
            except BaseException as exc:  # raised in the caller's thread by `_wait`
                errors.append(exc)
            finally:
                done.set()

        with _interrupts_deferred():  # a write begun is waited for: `_writing` must name it
            start_thread(threading.Thread(target=write, name="olmo-chunks-save-write"))
            self._writing = (done, errors, buffer)

    def _stage(self, batch: list[ChunkItem]) -> tuple[list[ChunkItem], torch.Tensor | None]:
        """`batch` with its accelerator and non-contiguous tensors copied into one host buffer
        (the spare one when it is large enough and pinned where it must be), and that buffer."""
        copies = [c for c in batch if _staged(c[2])]
        if not copies:
            return batch, None
        need = staging_bytes(copies)
        pinned = torch.cuda.is_available() and any(t.device.type != "cpu" for _, _, t in copies)
        buffer, self._spare = self._spare, None
        if buffer is None or buffer.numel() < need or (pinned and not buffer.is_pinned()):
            buffer = None  # free the old one first
            buffer = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
        staged: list[ChunkItem] = []
        at = 0
        for key, region, t in batch:
            if _staged(t):
                n = t.numel() * t.element_size()
                host = buffer[at : at + n].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=pinned and t.is_cuda)  # pinned: synchronized below
                at += -(-n // 64) * 64
                t = host
            staged.append((key, region, t))
        if pinned:
            torch.cuda.synchronize()
        return staged, buffer

    def _settle(self) -> None:
        """Drops what is queued and waits for the write in flight, whatever its outcome (the save
        is being abandoned for an error already raised)."""
        self._pending, self._held, self._spare = [], 0, None
        with contextlib.suppress(BaseException):
            self._wait()

    def _wait(self) -> None:
        """Waits for the write in flight, keeps its buffer for the next file, raises its error.
        A `KeyboardInterrupt` meanwhile is raised once the write has ended: the save must not be
        abandoned (its files removed, the interpreter finalised) while the core still writes."""
        if self._writing is None:
            return
        done, errors, buffer = self._writing
        interrupted: BaseException | None = None
        while not done.is_set():
            try:
                done.wait()
            except KeyboardInterrupt as exc:  # (a `Thread.join` it interrupted takes the thread for ended)
                interrupted = exc
        self._writing = None
        if buffer is not None and (self._spare is None or buffer.numel() > self._spare.numel()):
            self._spare = buffer
        if interrupted is not None:
            raise interrupted
        if errors:
            raise errors[0]

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

    def check_lease(self) -> None:
        """`CheckpointLockedError` if another save took this one's lease over (the coordinator's;
        a no-op elsewhere)."""
        if self.txn is not None:
            self.txn.check_lease()

    def commit(self, schema: Mapping[str, tuple[Any, ...]], chunks: Iterable[_core.WrittenChunk],
               entries: Mapping[str, Any], info: Mapping[str, Any],
               ready: Callable[[], None] | None = None) -> _core.Manifest:
        """Commits the save (the coordinator): `schema` maps every key to `(dtype, shape, role)`,
        `chunks` is what every rank wrote, `entries` the encoded plain values, `info` free-form
        information (creation time and torch version are added). The core assembles, checks and
        commits the manifest, once `ready()` did not raise: it is called last, right before the
        manifest is renamed into place or PUT."""
        if self.txn is None:
            raise InvalidArgumentError("no save was begun on this rank (only the coordinator commits)")
        meta_info = {"created_unix": time.time(), "torch": torch.__version__, **info}
        encoded = (json.dumps(entries, allow_nan=False), json.dumps(values.encode(meta_info, "info"), allow_nan=False))
        return self.txn.commit(
            self.block_size,
            [_core.TensorSchema(key, *schema[key]) for key in schema],
            list(chunks),
            *encoded,
            ready,
        )

    @property
    def committed(self) -> bool:
        """Whether this rank committed the save (the coordinator's `commit` published its manifest)."""
        return self.txn is not None and self.txn.committed

    def abort(self) -> None:
        """Abandons the save if it was begun here and not committed (a no-op after the commit),
        once no write of this rank is in flight."""
        self._settle()
        if self.txn is not None:
            self.txn.abort()
            self.txn = None

    def __enter__(self) -> SaveSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
