"""How the ranks of a save or load agree, and the rule that a failure on one rank fails all of them
in bounded time.

Ranks exchange their small messages through the process group's rendezvous store, not through
collectives of the group: a rank that dies can then never leave another blocked in a collective.
Every process bumps a heartbeat counter in the store from a daemon thread. The root (rank 0 of the
group) watches each rank it waits for, the other ranks watch the root, and a peer whose counter has
not moved for `peer_timeout` seconds counts as dead: every survivor raises `RankFailedError`
naming it. A rank whose work fails (any `BaseException`, `KeyboardInterrupt` included) tells the
root, which tells everyone.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError, OlmoChunksError, RankFailedError

__all__ = ["DEFAULT_PEER_TIMEOUT", "Group", "bound_collectives"]

# Seconds without a heartbeat after which a peer counts as dead.
DEFAULT_PEER_TIMEOUT = 45.0
# Longest a waiting rank blocks in the store before it looks at its peers' heartbeats.
_POLL = 0.5


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# Classes a coordination message may name (besides plain containers, strings and numbers).
_MESSAGE_CLASSES = {("olmo_chunks._core", "WrittenChunk"), ("olmo_chunks._core", "TensorSchema")}


class _MessageUnpickler(pickle.Unpickler):
    """Reads the ranks' messages from the store (unauthenticated, like every c10d store): plain
    data and the core's records only, never arbitrary code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MESSAGE_CLASSES:
            return super().find_class(module, name)
        raise OlmoChunksError(f"a coordination message in the rendezvous store names {module}.{name}; refused")


def _loads(data: bytes) -> Any:
    return _MessageUnpickler(io.BytesIO(data)).load()


class _Heartbeat:
    """One daemon thread per process that bumps `olmo_chunks/hb/<global rank>` in the store."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.interval = 2.0
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def ensure(self, store: Any, rank: int, interval: float) -> None:
        with self.lock:
            self.interval = min(self.interval, max(interval, 0.05))
            if self.thread is not None and self.thread.is_alive():
                return
            key = f"olmo_chunks/hb/{rank}"
            store.add(key, 1)

            def beat() -> None:
                while not self.stop.wait(self.interval):
                    try:
                        store.add(key, 1)
                    except Exception:  # the store is gone: the job is ending
                        return

            self.thread = threading.Thread(target=beat, name="olmo-chunks-heartbeat", daemon=True)
            self.thread.start()


_heartbeat = _Heartbeat()
atexit.register(_heartbeat.stop.set)
_calls: dict[str, int] = {}
_calls_lock = threading.Lock()


class Group:
    """The ranks of one collective save or load (a lone process when torch.distributed is not
    initialised). Ranks call `exchange` the same number of times, in the same order."""

    def __init__(self, process_group: dist.ProcessGroup | None, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
        if not peer_timeout > 0:
            raise InvalidArgumentError(f"peer_timeout must be positive, got {peer_timeout}")
        self.pg = process_group
        self.active = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.active:
            raise InvalidArgumentError("a process_group was given but torch.distributed is not initialised")
        self.rank = dist.get_rank(process_group) if self.active else 0
        self.size = dist.get_world_size(process_group) if self.active else 1
        self.peer_timeout = peer_timeout
        self.seq = 0
        if self.size == 1:
            return
        self.store: Any = dist.distributed_c10d._get_default_store()  # takes bytes values too
        name = "default" if process_group is None else str(getattr(process_group, "group_name", id(process_group)))
        with _calls_lock:
            call = _calls[name] = _calls.get(name, 0) + 1
        self.prefix = f"olmo_chunks/{name}/{call}"
        self.global_ranks = [dist.get_global_rank(process_group, r) if process_group else r for r in range(self.size)]
        _heartbeat.ensure(self.store, dist.get_rank(), peer_timeout / 4)

    # -- the one primitive ---------------------------------------------------------------------

    def exchange(
        self,
        local: Callable[[], Any] | None,
        root: Callable[[list[Any]], Any] | None = None,
        *,
        scatter: bool = False,
    ) -> tuple[Any, Any]:
        """Runs `local()` on every rank, hands the results (in rank order) to `root(results)` on rank
        0 and returns `(local result, root result)` on every rank; with `scatter`, `root` returns one
        item per rank and each rank gets its own. If anything failed anywhere, every rank raises:
        the original exception where it happened, `RankFailedError` naming the rank elsewhere."""
        self.seq += 1
        if self.size == 1:
            mine = local() if local else None
            out: Any = root([mine]) if root else None
            return mine, (out[0] if scatter else out)
        key = f"{self.prefix}/{self.seq}"
        mine, failure = None, None
        try:
            mine = local() if local else None
        except BaseException as exc:
            failure = exc
        try:
            if self.rank == 0:
                out = self._root_side(key, mine, failure, root, scatter)
            else:
                out = self._peer_side(key, mine if root else None, failure, scatter)
        except RankFailedError:
            raise
        except BaseException as exc:
            if failure is not None:
                raise failure from (None if exc is failure else exc)
            self._abort(key, exc)
            if isinstance(exc, Exception) and not isinstance(exc, OlmoChunksError):
                raise RankFailedError(f"lost contact with the other ranks: {_describe(exc)}") from exc
            raise
        return mine, out

    def agree(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on every rank and returns its result once every rank has succeeded."""
        return self.exchange(fn)[0]

    def devices(self) -> set[str]:
        """Devices whose tensors the group's collectives take: "cpu" with gloo, "cuda" with NCCL."""
        backend = str(dist.get_backend(self.pg)).lower()
        return {d for d, b in (("cpu", "gloo"), ("cuda", "nccl")) if b in backend}

    def broadcast_bytes(self, data: bytes | None, n: int) -> bytes:
        """Rank 0's `data` (`n` bytes) on every rank, through the group's collectives."""
        if self.rank == 0:
            assert data is not None and len(data) == n
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        if "cpu" not in self.devices():
            buf = buf.to("cuda")
        dist.broadcast(buf, src=self.global_ranks[0], group=self.pg)
        return data if data is not None else buf.cpu().numpy().tobytes()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        return self.exchange(lambda: obj, lambda results: results)[1]

    # -- both sides ----------------------------------------------------------------------------

    def _root_side(self, key: str, mine: Any, failure: BaseException | None,
                   root: Callable[[list[Any]], Any] | None, scatter: bool) -> Any:
        if failure is not None:
            self._publish(key, ("fail", (f"rank 0 failed: {_describe(failure)}", 0, False)))
            raise failure
        results: list[Any] = [mine] + [None] * (self.size - 1)
        gather = self._gather(key)
        try:
            for r, (status, payload) in gather:
                if status == "fail":
                    raise RankFailedError(f"rank {r} failed: {payload}", rank=r)
                results[r] = payload
        except RankFailedError as exc:
            self._publish(key, ("fail", (str(exc), exc.rank, exc.dead)))
            # Hear out the ranks still working (or their death), so that what the caller cleans up
            # after this failure is not written to again.
            with contextlib.suppress(RankFailedError):
                for _ in gather:
                    pass
            raise
        if self.seq > 1:  # every rank has read it: each has sent this step's message since
            self.store.delete_key(f"{self.prefix}/{self.seq - 1}/out")
        out: Any = root(results) if root else None
        if not scatter:
            self._publish(key, ("ok", out))
            return out
        if len(out) != self.size:
            raise InvalidArgumentError(f"scatter needs {self.size} items, got {len(out)}")
        for r in range(1, self.size):
            self.store.set(f"{key}/out/{r}", pickle.dumps(out[r]))
        self._publish(key, ("ok", None))
        return out[0]

    def _peer_side(self, key: str, mine: Any, failure: BaseException | None, scatter: bool) -> Any:
        sent = ("fail", _describe(failure)) if failure is not None else ("ok", mine)
        self.store.set(f"{key}/in/{self.rank}", pickle.dumps(sent))
        if failure is not None:
            raise failure
        out_key = f"{key}/out"
        self._wait_for([out_key], {0: out_key})
        status, payload = _loads(self.store.get(out_key))
        if status == "fail":
            msg, rank, dead = payload
            raise RankFailedError(msg, rank=rank, dead=dead)
        if scatter:
            mine_key = f"{out_key}/{self.rank}"
            payload = _loads(self.store.get(mine_key))
            self.store.delete_key(mine_key)
        return payload

    def _publish(self, key: str, outcome: tuple[str, Any]) -> None:
        self.store.set(f"{key}/out", pickle.dumps(outcome))

    def _abort(self, key: str, exc: BaseException) -> None:
        """Tells the others, best effort, that this rank gave up: the root publishes the failure,
        another rank leaves a note the root looks for while it waits."""
        msg = f"rank {self.rank} failed: {_describe(exc)}"
        with contextlib.suppress(Exception):
            if self.rank == 0:
                self._publish(key, ("fail", (msg, 0, False)))
            else:
                self.store.set(f"{self.prefix}/abort", pickle.dumps((msg, self.rank)))

    def _gather(self, key: str):
        """Yields `(rank, message)` of every other rank as the messages arrive (a failure as soon
        as it is seen); raises `RankFailedError` for a rank that died before sending."""
        missing = {r: f"{key}/in/{r}" for r in range(1, self.size)}
        while missing:
            self._wait_for(list(missing.values()), missing, return_early=True)
            for r in [r for r, k in missing.items() if self.store.check([k])]:
                k = missing.pop(r)
                msg = _loads(self.store.get(k))
                self.store.delete_key(k)
                yield r, msg

    def _wait_for(self, keys: list[str], watched: dict[int, str], return_early: bool = False) -> None:
        """Blocks until every key in `keys` exists (or, with `return_early`, until at least one of
        them does), raising `RankFailedError` when a rank in `watched` (rank -> the key it would
        set) stops beating before setting its key."""
        last: dict[int, tuple[int, float]] = {}
        poll = timedelta(seconds=min(_POLL, self.peer_timeout / 4))
        while True:
            try:
                self.store.wait(keys, poll)
                return
            except Exception as exc:
                if "timeout" not in str(exc).lower():
                    raise
            if self.rank == 0 and self.store.check([f"{self.prefix}/abort"]):
                msg, rank = _loads(self.store.get(f"{self.prefix}/abort"))
                raise RankFailedError(msg, rank=rank)
            now = time.monotonic()
            for r, k in watched.items():
                if self.store.check([k]):
                    if return_early:
                        return
                    continue
                beat = self.store.add(f"olmo_chunks/hb/{self.global_ranks[r]}", 0)
                seen, since = last.get(r, (beat, now))
                if beat != seen:
                    since = now
                last[r] = (beat, since)
                if now - since > self.peer_timeout:
                    raise RankFailedError(
                        f"rank {r} stopped responding: no heartbeat for {now - since:.0f} s "
                        f"(peer_timeout={self.peer_timeout:g} s); it died or hung",
                        rank=r,
                        dead=True,
                    )


def bound_collectives(process_group: dist.ProcessGroup | None, seconds: float) -> None:
    """After a peer died: makes collectives that others (torch DCP) still run on `process_group`
    fail after `seconds` instead of the group's own timeout (30 min by default). The group is
    broken anyway; best effort where torch lacks the hook."""
    set_timeout = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        with contextlib.suppress(Exception):
            set_timeout(timedelta(seconds=seconds), process_group)
