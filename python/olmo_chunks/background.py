"""`async_save`: a save whose training stall is the copy of this rank's bytes, nothing else.

At the call, every rank describes its state and learns its share (as `save` does; replicated
chunks are written once), and copies the bytes of that share, exactly as they are at the call, into
a host staging pool that is reused from one save to the next (pinned when any source is on an
accelerator; device-to-host copies on a side stream). The call then returns: the caller may change
every tensor, expert flat views and trainer state included. A thread of this process writes the
pool to storage (the core releases the GIL) and takes part in the commit; coordination goes
through the process group's rendezvous store, never through the group's collectives, so training
collectives cannot interleave with it.

The pool holds at most `pool_bytes`. When this rank's share is larger, the call takes the path's
lease, writes what the pool holds, waits for that write and goes on filling the pool: the stall
then includes those writes. A single chunk larger than the pool is written from its own memory
during the call. Otherwise the lease, like every write, is taken in the background.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from . import _core
from ._dist import DEFAULT_PEER_TIMEOUT, Group, group_name, let_collectives_settle
from .checkpoint import SaveSteps
from .errors import OlmoChunksError, check_int, env_setting, parse_bytes, start_thread
from .session import staging_bytes
from .shards import ChunkItem

__all__ = ["DEFAULT_POOL_BYTES", "async_save"]

log = logging.getLogger(__name__)

# Host memory kept for staging async saves, per process group.
DEFAULT_POOL_BYTES = env_setting("OLMO_CHUNKS_POOL_BYTES", 4 << 30, parse_bytes)
_ALIGN = 64


class _Slot:
    """The in-flight save and the staging pool of one process group."""

    def __init__(self) -> None:
        self.future: Future[None] | None = None
        self.pool: torch.Tensor | None = None
        self.lock = threading.Lock()

    def buffer(self, want: int, cap: int, pinned: bool) -> torch.Tensor:
        """A staging buffer of at least `min(want, cap)` bytes, kept for later saves (grown, or
        re-made pinned, only when this one is too small)."""
        want = min(want, cap)
        pool = self.pool
        if pool is None or pool.numel() < want or (pinned and not pool.is_pinned()):
            self.pool = None  # free the old one first
            pool = self.pool = torch.empty(want, dtype=torch.uint8, pin_memory=pinned)
        return pool


_slots: dict[str, _Slot] = {}
_threads: set[threading.Thread] = set()


def _forget_parents_saves() -> None:
    """In a forked child: the parent's saves in flight (and their threads) are not the child's."""
    _slots.clear()
    _threads.clear()


os.register_at_fork(after_in_child=_forget_parents_saves)


def settle(process_group: dist.ProcessGroup | None) -> None:
    """Waits for the async save in flight on `process_group`, if any (`save` does, first)."""
    slot = _slots.get(group_name(process_group))
    if slot is not None:
        with slot.lock:
            if slot.future is not None:
                _wait(slot.future)


def async_save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    pool_bytes: int = DEFAULT_POOL_BYTES,
    roles: Mapping[str, str] | None = None,
    info: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    block_size: int = _core.DEFAULT_BLOCK_SIZE,
    workers: int | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    compression: str | None = None,
    compression_level: int | None = None,
) -> Future[None]:
    """Starts saving `state_dict` to `path` (see the module docstring and `save` for the options);
    returns once this rank's bytes are captured, with a `concurrent.futures.Future` whose
    `result()` returns when the checkpoint is committed, or raises the `OlmoChunksError` that
    failed it on any rank (the checkpoint that was at `path` then stays). A new call on the same
    process group first waits for the previous one; interpreter exit waits for the last one."""
    slot = _slots.setdefault(group_name(process_group), _Slot())
    with slot.lock:  # held until this save is under way: two threads' calls must not share the pool
        if slot.future is not None:
            _wait(slot.future)
        t0 = time.perf_counter()
        group = Group(process_group, peer_timeout, "async_save")
        try:  # a bad path on one rank fails every rank at once, as in `save`
            steps = SaveSteps(group, path, roles=roles, info=info, overwrite=overwrite, block_size=block_size,
                              workers=workers, compression=(compression, compression_level))
            steps.checks.append(lambda: check_int("pool_bytes", pool_bytes, 0, 2**63 - 1))
        except BaseException as exc:
            group.fail(exc)
            raise

        def abandon(exc: BaseException) -> None:
            steps.__exit__(None, None, None)
            steps.group.fail(exc)

        try:
            chunks = steps.plan(state_dict, defer_lease_within=pool_bytes)
            batch = _stage(steps, chunks, slot, pool_bytes)
        except BaseException as exc:
            abandon(exc)
            raise
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        slot.future = future

        def write() -> list[_core.WrittenChunk]:
            if batch:
                steps.session.write_file(batch)
            return steps.session.written

        def finish() -> None:
            try:
                with steps.group, steps:
                    steps.group.use_this_thread()
                    steps.lease()
                    steps.commit(write)
                steps.log(t0)
                future.set_result(None)
            except BaseException as exc:
                _failed(future, steps.target, exc)
            finally:
                _threads.discard(threading.current_thread())

        thread = threading.Thread(target=finish, name="olmo-chunks-async-save")
        _threads.add(thread)  # before it starts: it removes itself as it ends
        try:
            start_thread(thread)
        except BaseException as exc:
            _threads.discard(thread)
            slot.future = None
            abandon(exc)
            raise
        return future


def _stage(steps: SaveSteps, chunks: list[ChunkItem], slot: _Slot, pool_bytes: int) -> list[ChunkItem]:
    """Copies `chunks` into the pool, writing it out (through the session) whenever it is full.
    Returns the batch left in the pool for the background write."""
    cuda = any(t.is_cuda for _, _, t in chunks)
    need = staging_bytes(chunks)
    pool = slot.buffer(need, pool_bytes, cuda and torch.cuda.is_available()) if need else None
    room = min(pool.numel(), pool_bytes) if pool is not None else 0  # a kept pool may be larger
    stream = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]  # torch leaves it untyped
    batch: list[ChunkItem] = []
    at = 0

    def flush(items: list[ChunkItem]) -> None:
        if stream is not None:
            stream.synchronize()
        steps.session.write_file(items)

    for key, region, t in chunks:
        n = t.numel() * t.element_size()
        if pool is None or n > room:  # larger than the whole pool: written from itself
            src = t if t.device.type == "cpu" else t.to("cpu")
            flush([(key, region, src.resolve_conj().resolve_neg().contiguous())])
            continue
        at = -(-at // _ALIGN) * _ALIGN
        if at + n > room:
            flush(batch)
            batch, at = [], 0
        dst = pool[at : at + n].view(t.dtype).view(t.shape)
        if stream is not None and t.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                dst.copy_(t, non_blocking=True)
        else:
            dst.copy_(t)
        batch.append((key, region, dst))
        at += n
    if stream is not None:
        stream.synchronize()
    return batch


def _wait(future: Future[None]) -> None:
    """Waits for `future` to end, whatever its outcome (its caller sees that)."""
    future.exception()


def _failed(future: Future[None], target: str, exc: BaseException) -> None:
    """Fails `future` on `exc`, and says so in the log: a future nobody asks for its result would
    keep the failure silent (the script ended as if the checkpoint had been saved)."""
    failure = exc if isinstance(exc, OlmoChunksError) else _wrapped(exc)
    log.error("olmo-chunks: async_save to %s failed: %s: %s", target, type(failure).__name__, failure)
    future.set_exception(failure)


def _wrapped(exc: BaseException) -> OlmoChunksError:
    err = OlmoChunksError(f"async save failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


@atexit.register
def _drain() -> None:
    """Interpreter exit waits for saves in flight (then lets their collectives settle: this may
    run after `_dist`'s own hook)."""
    threads = list(_threads)
    for thread in threads:
        thread.join()
    if threads:
        let_collectives_settle()
