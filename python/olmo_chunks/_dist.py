"""How the ranks of a save or load agree, and the rule that a failure on one rank fails all of them
in bounded time.

A step (`Group.exchange`) moves small messages through the job's rendezvous store with O(1)
requests per rank: every rank appends its message to one key and bumps one counter, the last to
arrive wakes the root (rank 0 of the group) with one key, the root reads every message with one
request and publishes the outcome under one key that each rank reads. Bulk data (the read-once
needs and plans, the manifest) moves by the group's collectives, each one bounded: it is waited on
while watching the peers' liveness and abort notes (`Group.wait_work`).

Liveness: every process bumps a heartbeat counter in the store from a native thread of the core
(`_core.Heartbeat`: it beats while Python holds the GIL), started when the package is first used in
a process group. A rank that has never beaten is "not arrived yet" and is waited for up to the
arrival timeout (the process group's timeout, as a collective would); one that beat and went silent
for `peer_timeout` seconds (and for two of its beats, whose interval each process writes beside its
heartbeat) is dead. Either way every survivor raises `RankFailedError` naming it. The root judges itself by the
same measure (`Group.check_awake`): silent long enough that the others may have given up on it,
it fails the operation rather than commit a save they reported failed. A
rank whose work fails (any `BaseException`, `KeyboardInterrupt` included) tells the root, which
tells everyone; work that fails between steps (a load's reads) fails the next step, which the
others wait in or come to (`Group.fail`). The root hosts the store: it leaves an operation only
once every peer has read the last outcome (`Group.close`), so a script that exits right after a
save never turns a committed save into an error on the others.

Cost per step at N ranks: each peer 3 store calls (append, add, wait+get), the root O(1) calls
moving O(N) bytes; see benches/coord_scale.py. Once per process: two connections to the store
(the coordinating thread's and the heartbeat's), each of which torch's server resolves (a reverse
DNS lookup of the peer, in its event loop) when it accepts it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import os
import pickle
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _core
from .errors import (
    InvalidArgumentError,
    OlmoChunksError,
    RankFailedError,
    StorageError,
    env_setting,
    named_error,
    shared_form,
    start_thread,
)

T = TypeVar("T")

__all__ = [
    "DEFAULT_PEER_TIMEOUT", "Group", "bound_collectives", "group_name", "let_collectives_settle", "rank_and_size",
]

# Seconds without a heartbeat after which a peer that had been beating counts as dead.
DEFAULT_PEER_TIMEOUT = 45.0
# The longest peer_timeout (11.6 days: "never give up on a silent peer").
_MAX_PEER_TIMEOUT = 1e6
# Longest interval between two heartbeats of a process, whatever its peer_timeout.
_MAX_BEAT = 2.0
# Longest a waiting rank blocks in the store before it looks at its peers' heartbeats (in groups
# of up to 500 ranks; `Group.poll_interval`).
_POLL = 0.5
# Requests per second that all the waiting ranks of a group ask of the store's host together, at
# most (about 4 per look: the wait's cancel and renewal, the heartbeats, the abort note): at 4,096
# ranks, looking every 0.5 s made 18,500 a second while they waited for one late rank
# (benches/coord_scale.py --straggle).
_WAIT_BUDGET = 4000.0
# The most bytes a store step carries into or out of rank 0 (the store's host) in all: what is
# larger (a load's needs and plans, the manifest, at thousands of ranks) goes by collectives.
INLINE_BYTES = 1 << 20
_HB = "olmo_chunks/hb/"
_STARTED = "olmo_chunks/started"
_AMONG = "olmo_chunks/among/"
# What a group's state says after a peer failed inside one of its collectives.
BROKEN_GROUP = ("the process group is unusable now (a collective is still pending on it): destroy it and create "
                "a new one, or restart the job")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# Classes a coordination message may name (besides plain containers, strings and numbers).
_MESSAGE_CLASSES = {("olmo_chunks._core", name) for name in ("WrittenChunk", "TensorSchema", "Box", "Flat")}


class _MessageUnpickler(pickle.Unpickler):
    """Reads the ranks' messages from the store (unauthenticated, like every c10d store): plain
    data and the core's records only, never arbitrary code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MESSAGE_CLASSES:
            return super().find_class(module, name)
        raise OlmoChunksError(f"a coordination message in the rendezvous store names {module}.{name}; refused")


def _loads(data: bytes) -> Any:
    return _MessageUnpickler(io.BytesIO(data)).load()


def _frames(data: bytes) -> dict[int, tuple[str, Any, str]]:
    """The `(rank, status, payload, op)` messages appended to one key, by rank."""
    out: dict[int, tuple[str, Any, str]] = {}
    i = 0
    while i + 8 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        rank, status, payload, op = _loads(data[i + 8:i + 8 + n])
        out[rank] = (status, payload, op)
        i += 8 + n
    return out


# -- the store ----------------------------------------------------------------------------------


class _TorchStore:
    """A torch Store (FileStore, HashStore: stores the core's client does not speak) with the
    calls of `_core.StoreClient`."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def set_many(self, keys: list[str], values: list[bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.store.set(k, v)

    def append(self, key: str, value: bytes) -> None:
        self.store.append(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(self.store.get(k)) for k in keys]

    def add(self, key: str, delta: int) -> int:
        return int(self.store.add(key, delta))

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check(keys))

    def delete(self, keys: list[str]) -> int:
        return sum(bool(self.store.delete_key(k)) for k in keys)

    def wait(self, keys: list[str], timeout: float) -> bool:
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except Exception as exc:
            if "timeout" in str(exc).lower():
                return False
            raise
        return True


class _PyHeartbeat:
    """The heartbeat of a process whose store the core's client does not speak: a daemon thread
    (it stalls while one C call holds the GIL, so peer_timeout must cover such calls there)."""

    def __init__(self, store: _TorchStore, key: str, interval: float) -> None:
        self.interval = interval
        self.stopped = threading.Event()
        store.add(key, 1)
        self.last, self.every = time.monotonic(), interval
        self.long: list[tuple[float, float]] = []  # as `Silences::long` of the core

        def beat() -> None:
            while not self.stopped.wait(self.interval):
                try:
                    store.add(key, 1)
                except Exception:  # the store is gone: the job is ending
                    return
                now, interval = time.monotonic(), self.interval
                gap, allowed = now - self.last, 2 * max(self.every, interval)
                self.last, self.every = now, interval
                if gap > allowed:
                    kept = [(end, g) for end, g in self.long if g > gap]
                    if len(kept) == 64:
                        gap = kept.pop()[1]
                    self.long = [*kept, (now, gap)]

        start_thread(threading.Thread(target=beat, name="olmo-chunks-heartbeat", daemon=True))

    def set_interval(self, interval: float) -> None:
        self.interval = interval

    def longest_silence(self, within: float) -> float:
        """As `_core.Heartbeat.longest_silence`."""
        now = time.monotonic()
        since = now - within
        going_on = [(now, now - self.last)] if now - self.last > 2 * self.every else []
        return max([0.0] + [end - max(end - gap, since) for end, gap in [*self.long, *going_on] if end > since])

    def stop(self) -> None:
        self.stopped.set()


def _tcp_store(store: Any) -> Any:
    """The TCPStore under `store`'s prefix wrappers, or None."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


class _Link:
    """This process's tie to the job's rendezvous store: one client connection per thread that
    coordinates (each call bounded by the peer_timeout of the group using it), and the heartbeat
    of its global rank."""

    def __init__(self, store: Any, rank: int, interval: float, timeout: float) -> None:
        self.pid = os.getpid()
        self.store = weakref.ref(store)  # a process group made again has another
        self.local = threading.local()
        tcp = _tcp_store(store)
        self.address = (tcp.host, tcp.port) if tcp is not None else None
        self.fallback = _TorchStore(store) if tcp is None else None
        key = f"{_HB}{rank}"
        if self.address is not None:
            self.heartbeat: Any = _core.Heartbeat(self.address[0], self.address[1], key, interval, timeout)
        else:
            assert self.fallback is not None
            self.heartbeat = _PyHeartbeat(self.fallback, key, interval)
        self.interval = interval
        self.every_key = f"{key}/every"
        self.client(timeout).set(self.every_key, str(interval).encode())
        # Peers tell a rank that has not started yet (waited for up to the arrival timeout) from
        # one that went silent (dead after peer_timeout) by this list.
        self.client(timeout).append(_STARTED, struct.pack("<I", rank))

    def client(self, timeout: float) -> Any:
        """This thread's connection, each call bounded by `timeout` seconds: made again if an
        earlier operation lost it (its store's host paused longer than that one's bound)."""
        if self.fallback is not None:
            return self.fallback
        c = getattr(self.local, "client", None)
        if c is not None:
            try:
                c.set_timeout(timeout)
                return c
            except ConnectionError:
                pass
        assert self.address is not None
        c = self.local.client = _core.StoreClient(self.address[0], self.address[1], timeout)
        return c

    def beat_every(self, interval: float, timeout: float) -> None:
        """Beats at least every `interval` seconds from now on, and says so (`_Watch`)."""
        if interval < self.interval:
            self.interval = interval
            self.heartbeat.set_interval(interval)
            self.client(timeout).set(self.every_key, str(interval).encode())


_link: _Link | None = None
_link_lock = threading.Lock()
_calls: dict[str, int] = {}
_calls_lock = threading.Lock()
# Abort notes this process could not leave when it lost the store: `(prefix, note)`, left by its
# next operation, so that a store host that was only paused stops waiting for it in the old one.
_untold: list[tuple[str, bytes]] = []


def let_collectives_settle() -> None:
    """At the exit of a process whose group was not destroyed: a moment without the GIL for
    torch's gloo worker threads, which release the tensors of a finished collective (a DCP save's
    last broadcast) under it. One that asks for it once the interpreter is finalising ends the
    process in `std::terminate` ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489). Two-rank DCP-door saves whose script returned without
    `dist.destroy_process_group()`, alternated on this VM: 8 of 30 aborted without this, 0 of 30
    with it (3 of 55 with DCP's own FileSystemWriter, olmo-chunks not imported)."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(0.05)


def _process_link(peer_timeout: float) -> _Link:
    """This process's link, made on first use (and again in a forked child); it beats at least
    four times per `peer_timeout` of any group using it."""
    global _link
    interval = min(_MAX_BEAT, max(peer_timeout / 4, 0.05))
    store = dist.distributed_c10d._get_default_store()
    with _link_lock:
        if _link is None or _link.pid != os.getpid() or _link.store() is not store:
            if _link is not None and _link.pid == os.getpid():
                _link.heartbeat.stop()  # of a process group destroyed since
            if _link is None:
                atexit.register(let_collectives_settle)
            _link = _Link(store, dist.get_rank(), interval, peer_timeout)
        _link.beat_every(interval, peer_timeout)
        return _link


def _arrival_timeout(process_group: dist.ProcessGroup | None) -> float:
    """How long a rank that has not started is waited for: `OLMO_CHUNKS_ARRIVAL_TIMEOUT`, else the
    timeout the process group was made with (the longest of its backends'), as its collectives
    would wait; torch's default for its backend where the group does not say (until 2026-12-07
    always that default: 30 min on gloo, whatever `init_process_group(timeout=...)` said)."""
    env = env_setting("OLMO_CHUNKS_ARRIVAL_TIMEOUT", 0.0, float)
    if env:
        return env
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    made = []
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):  # no backend for that device; a torch without the field
            made.append(pg._get_backend(torch.device(device)).options._timeout.total_seconds())
    if made:
        return max(made)
    try:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(process_group)).total_seconds()
    except Exception:
        return 1800.0


# -- liveness -----------------------------------------------------------------------------------


def _seconds(raw: bytes) -> float:
    """A heartbeat interval a peer wrote to the store, at most `_MAX_BEAT` (0 if not a number)."""
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    return min(value, _MAX_BEAT) if value >= 0 else 0.0


class _Watch:
    """Judges the liveness of the ranks a waiting rank waits for, from their heartbeats."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.t0 = time.monotonic()
        self.last: dict[int, tuple[bytes, float]] = {}
        self.started: set[int] = set()
        self.same: set[int] = set()  # global ranks found making their call on this group

    def check(self, ranks: Sequence[int], what: str = "this step") -> None:
        """Raises `RankFailedError` for the first of `ranks` (group ranks) that went silent for
        peer_timeout, or that has not started within the arrival timeout."""
        g = self.group
        store = g.store
        want = {g.global_ranks[r]: r for r in ranks}
        if not want:
            return
        if not want.keys() <= self.started and store.check([_STARTED]):
            raw = store.get(_STARTED)
            self.started = {struct.unpack_from("<I", raw, i)[0] for i in range(0, len(raw) - 3, 4)}
        beating = [gr for gr in want if gr in self.started]
        values = store.multi_get([f"{_HB}{gr}" for gr in beating]) if beating else []
        now = time.monotonic()
        silent: dict[int, float] = {}
        for gr, value in zip(beating, values, strict=True):
            seen, since = self.last.get(gr, (value, now))
            if value != seen:
                since = now
            self.last[gr] = (value, since)
            if now - since > g.peer_timeout:
                silent[want[gr]] = now - since
        if silent:
            # A rank beating less often than this group's peer_timeout asks (its own operations
            # give a longer one) is silent once it missed two beats.
            keys = [f"{_HB}{g.global_ranks[r]}/every" for r in silent]
            every = store.multi_get(keys) if store.check(keys) else [b""] * len(keys)  # (a process of an older release)
            silent = {r: s for (r, s), b in zip(silent.items(), every, strict=True) if s > 2 * _seconds(b)}
        if silent:
            # All of them are dead (a node that went down takes several), so that the end of the
            # operation waits for none of them.
            g.dead.update(silent)
            r = min(silent)
            raise RankFailedError(
                f"rank {r} stopped responding: no heartbeat for {silent[r]:.0f} s "
                f"(peer_timeout={g.peer_timeout:g} s); it died or hung"
                + "".join(f"; so did rank {other}" for other in sorted(silent)[1:]),
                rank=r, dead=True)
        if g.among is not None and now - self.t0 > g.peer_timeout:
            self.same |= g.check_one_group([gr for gr in want if gr not in self.same][:8])
        if now - self.t0 > g.arrival_timeout:
            # One that never started (no heartbeat yet) is doing no part of this operation: it
            # counts as dead, so that nobody waits for it again (rank 0 hearing out the others,
            # the end of the operation), which took twice the timeout plus peer_timeout.
            absent = [want[gr] for gr in want if gr not in self.started]
            r = absent[0] if absent else want[next(iter(want))]
            raise RankFailedError(
                f"rank {r} did not reach {what} within the arrival timeout ({g.arrival_timeout:g} s)", rank=r,
                dead=bool(absent))


# -- the group ----------------------------------------------------------------------------------


def rank_and_size(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `process_group` and the group's size; (0, 1) without
    torch.distributed. Makes no `Group`, so it may be called on some ranks only."""
    active = dist.is_available() and dist.is_initialized()
    if process_group is not None and not active:
        raise InvalidArgumentError("a process_group was given but torch.distributed is not initialised")
    return (dist.get_rank(process_group), dist.get_world_size(process_group)) if active else (0, 1)


def group_name(process_group: dist.ProcessGroup | None) -> str:
    """The name under which `process_group`'s operations meet in the store: `None` is the default
    group, as for torch's collectives (ranks passing `None` and `dist.group.WORLD` meet)."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return "default"
        process_group = dist.distributed_c10d._get_default_group()
    return str(getattr(process_group, "group_name", id(process_group)))


class Group:
    """The ranks of one collective save or load (a lone process when torch.distributed is not
    initialised). Ranks call `exchange` the same number of times, in the same order, and `close`
    (or leave the `with` block) at the end of the operation."""

    def __init__(self, process_group: dist.ProcessGroup | None, peer_timeout: float = DEFAULT_PEER_TIMEOUT,
                 op: str = "an olmo-chunks call", *, alone: bool = False) -> None:
        """`op` names the call (`save`, `load`, ...): ranks making different calls on one process
        group fail at the first step with `InvalidArgumentError`. `alone`: this process is the
        group (rank 0 of 1) whatever `process_group` says (a DCP call with `no_dist=True`)."""
        self.op = op
        # A bad argument fails the first step (on every rank at once), not this rank before it.
        self.bad: InvalidArgumentError | None = None
        if isinstance(peer_timeout, bool) or not isinstance(peer_timeout, int | float) or not (
                0 < peer_timeout <= _MAX_PEER_TIMEOUT):
            self.bad = InvalidArgumentError(
                f"peer_timeout must be a positive number of seconds up to {_MAX_PEER_TIMEOUT:g}, got {peer_timeout!r}")
            peer_timeout = DEFAULT_PEER_TIMEOUT
        self.pg = process_group
        self.rank, self.size = (0, 1) if alone else rank_and_size(process_group)
        self.active = dist.is_available() and dist.is_initialized()
        self.peer_timeout = peer_timeout
        self.seq = 0
        self.closed = False
        self.scattered = False
        self.told = False  # whether the others know of a failure of this rank
        self.dead: set[int] = set()  # ranks found dead
        if self.size == 1:
            return
        self.arrival_timeout = _arrival_timeout(process_group)
        name = group_name(process_group)
        self.global_ranks = [dist.get_global_rank(process_group, r) if process_group else r for r in range(self.size)]
        # A call of the main thread has its place among the main thread's calls on groups of these
        # ranks: the same on every rank of a program that makes the same calls (`check_one_group`).
        members = hashlib.sha256(",".join(map(str, sorted(self.global_ranks))).encode()).hexdigest()[:16]
        main = threading.current_thread() is threading.main_thread()
        with _calls_lock:
            call = _calls[name] = _calls.get(name, 0) + 1
            if main:
                ordinal = _calls[_AMONG + members] = _calls.get(_AMONG + members, 0) + 1
        self.name, self.prefix = name, f"olmo_chunks/{name}/{call}"
        self.among = f"{_AMONG}{members}/{ordinal}/" if main else None
        self.said_group = False
        self.since = time.monotonic()
        try:
            self.link: _Link | None = _process_link(peer_timeout)
            self.store: Any = self.link.client(peer_timeout)
        except (ConnectionError, TimeoutError) as exc:
            raise self._store_lost(exc) from exc
        except StorageError as exc:  # this process is out of descriptors, memory or threads
            self._gave_up(str(exc))
            raise
        with _calls_lock:
            untold = _untold[:]
            _untold.clear()
        with contextlib.suppress(Exception):  # best effort, as when they were first due
            if untold:
                self.store.set_many([f"{prefix}/abort" for prefix, _ in untold], [note for _, note in untold])

    def use_this_thread(self) -> None:
        """Goes on with the operation in the calling thread (`async_save`'s), on that thread's own
        store connection: the thread that began it may start others meanwhile."""
        if self.size > 1 and self.active:
            try:
                self.store = _process_link(self.peer_timeout).client(self.peer_timeout)
            except (ConnectionError, TimeoutError) as exc:
                raise self._store_lost(exc) from exc

    @classmethod
    def simulated(cls, rank: int, size: int, store: Any, prefix: str, *, peer_timeout: float,
                  arrival_timeout: float) -> Group:
        """A group rank driven by a benchmark (benches/coord_scale.py): `store` is its own
        `_core.StoreClient`, no torch.distributed world; the global ranks are `range(size)`."""
        g = cls.__new__(cls)
        g.pg, g.active, g.rank, g.size, g.op, g.bad = None, False, rank, size, "a simulated call", None
        g.peer_timeout, g.arrival_timeout = peer_timeout, arrival_timeout
        g.seq, g.closed, g.scattered, g.told, g.dead = 0, False, False, False, set()
        g.store, g.prefix, g.global_ranks, g.link, g.since = store, prefix, list(range(size)), None, 0.0
        g.among = None  # (no main-thread call of a real group: `check_one_group` never runs)
        return g

    @property
    def poll_interval(self) -> float:
        """Seconds a waiting rank lets pass between looks at its peers (liveness, abort notes):
        `_POLL`, longer in groups so large that their waiting ranks together would ask more than
        `_WAIT_BUDGET` requests per second of the store's host (4.1 s at 4,096 ranks), and at most a
        quarter of `peer_timeout`. A silent rank is found dead within peer_timeout plus one
        interval; a failure inside a step reaches the others at once whatever it is."""
        return min(max(_POLL, 4 * self.size / _WAIT_BUDGET), self.peer_timeout / 4)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Leaves the operation on `exc`: the others fail too, at once, if no step has told them
        yet (`_tell`), then `close`."""
        if not self.told and not isinstance(exc, RankFailedError):
            self._tell(exc)
        self.close(failing=True)

    # -- the one primitive ---------------------------------------------------------------------

    def exchange(
        self,
        local: Callable[[], Any] | None,
        root: Callable[[list[Any]], Any] | None = None,
        *,
        scatter: bool = False,
        hear_out: bool = False,
    ) -> tuple[Any, Any]:
        """Runs `local()` on every rank, hands the results (in rank order) to `root(results)` on rank
        0 and returns `(local result, root result)` on every rank; with `scatter`, `root` returns one
        item per rank and each rank gets its own. If anything failed anywhere, every rank raises:
        the original exception where it happened, `RankFailedError` naming the rank elsewhere; an
        error of `root` (the step's outcome: ranks disagreeing on arguments, a locked path) is
        raised as itself on every rank. With `hear_out` (for a `local` that runs no collective),
        rank 0 whose own `local` failed waits for the others' to end before it raises: what its
        caller then cleans up (a save's data) is not removed under their writes."""
        self.seq += 1
        if self.size == 1:
            if self.bad is not None:
                raise self.bad
            mine = local() if local else None
            out: Any = root([mine]) if root else None
            return mine, (out[0] if scatter else out)
        key = f"{self.prefix}/{self.seq}"
        mine = None
        failure: BaseException | None = self.bad
        if failure is None:
            try:
                mine = local() if local else None
            except BaseException as exc:
                failure = exc
        try:
            out = self._step(key, mine, failure, root, scatter, hear_out)
        except BaseException:
            self.told = True  # this step told the others, or they failed first
            raise
        return mine, out

    def _step(self, key: str, mine: Any, failure: BaseException | None,
              root: Callable[[list[Any]], Any] | None, scatter: bool, hear_out: bool) -> Any:
        try:
            if self.rank == 0:
                return self._root_side(key, mine, failure, root, scatter, hear_out)
            return self._peer_side(key, mine if root else None, failure, scatter)
        except RankFailedError as exc:
            self._note_dead(exc)
            raise
        except BaseException as exc:
            if failure is not None:
                raise failure from (None if exc is failure else exc)
            if not self.told:
                self._abort(key, exc)
            if isinstance(exc, ConnectionError | TimeoutError):
                raise self._store_lost(exc) from exc
            if isinstance(exc, Exception) and not isinstance(exc, OlmoChunksError):
                raise RankFailedError(f"lost contact with the other ranks: {_describe(exc)}") from exc
            raise

    def agree(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on every rank and returns its result once every rank has succeeded."""
        result: T = self.exchange(fn)[0]
        return result

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's small `obj`, in rank order, on every rank."""
        results: list[Any] = self.exchange(lambda: obj, lambda results: results)[1]
        return results

    # -- both sides ----------------------------------------------------------------------------

    def _root_side(self, key: str, mine: Any, failure: BaseException | None,
                   root: Callable[[list[Any]], Any] | None, scatter: bool, hear_out: bool) -> Any:
        if failure is not None:
            self._publish(key, ("fail", (f"rank 0 failed: {_describe(failure)}", 0, False, None)))
            if hear_out:
                with contextlib.suppress(RankFailedError):
                    self._arrivals(key, everyone=True)
            raise failure
        results: list[Any] = [mine] + [None] * (self.size - 1)
        try:
            arrived = self._arrivals(key, everyone=False)
            self.check_awake()
            failed = sorted(r for r, (status, *_) in arrived.items() if status == "fail")
            if failed:
                r = failed[0]
                raise RankFailedError(f"rank {r} failed: {arrived[r][1]}", rank=r)
        except RankFailedError as exc:
            self._publish(key, ("fail", (str(exc), exc.rank, exc.dead, None)))
            # Hear out the ranks still working (or their death), so that what the caller cleans up
            # after this failure is not written to again.
            if not exc.dead:
                with contextlib.suppress(RankFailedError):
                    self._arrivals(key, everyone=True)
            raise
        others = {r: op for r, (*_, op) in arrived.items() if op != self.op}
        for r, (_, payload, _) in arrived.items():
            results[r] = payload
        if self.seq > 1:  # every rank has read the last step's outcome: each has arrived since
            self._forget(self.seq - 1)
        try:
            if others:
                raise InvalidArgumentError(
                    f"the ranks of a process group must make the same call: rank 0 called {self.op}, "
                    + ", ".join(f"rank {r} {op}" for r, op in sorted(others.items())[:8]))
            out: Any = root(results) if root else None
        except OlmoChunksError as exc:  # the step's outcome: every rank raises it as itself
            self._abort(key, exc, shared=True)
            raise
        self.scattered = scatter
        if not scatter:
            self._publish(key, ("ok", out))
            return out
        if len(out) != self.size:
            raise InvalidArgumentError(f"scatter needs {self.size} items, got {len(out)}")
        keys = [f"{key}/out/{r}" for r in range(1, self.size)] + [f"{key}/out"]
        self.store.set_many(keys, [pickle.dumps(x) for x in out[1:]] + [pickle.dumps(("ok", None))])
        return out[0]

    def _send(self, key: str, mine: Any, failure: BaseException | None) -> None:
        """A peer's message for step `key`: its result, or its failure (which wakes the root)."""
        sent = (self.rank, "fail", _describe(failure), self.op) if failure is not None else (
            self.rank, "ok", mine, self.op)
        frame = pickle.dumps(sent)
        store = self.store
        store.append(f"{key}/in", struct.pack("<Q", len(frame)) + frame)
        n = store.add(f"{key}/n", 1)
        if n == self.size - 1:
            store.set_many([f"{key}/full", f"{key}/all"], [b"", b""])
        elif failure is not None:
            store.set(f"{key}/all", b"")  # wake the root now

    def _peer_side(self, key: str, mine: Any, failure: BaseException | None, scatter: bool) -> Any:
        store = self.store
        self._send(key, mine, failure)
        if failure is not None:
            raise failure
        out_key = f"{key}/out"
        watch = _Watch(self)
        self._wait([out_key], lambda: watch.check([0]))
        status, payload = _loads(store.get(out_key))
        if status == "fail":
            msg, rank, dead, form = payload
            if form:
                raise named_error(*form)
            raise RankFailedError(msg, rank=rank, dead=dead)
        if scatter:
            payload = _loads(store.get(f"{out_key}/{self.rank}"))
        return payload

    def _arrivals(self, key: str, everyone: bool) -> dict[int, tuple[str, Any, str]]:
        """Rank 0: the messages of this step, once every rank sent one (or, unless `everyone`, as
        soon as one reported a failure); raises `RankFailedError` for a rank that died first."""
        watch = _Watch(self)
        inbox = f"{key}/in"

        def poll() -> bool:
            self._check_abort()
            self.check_awake()
            arrived = _frames(self.store.get(inbox)) if self.store.check([inbox]) else {}
            # Every message in, though not every count: a peer died between its two calls.
            if len(arrived) == self.size - 1 or (not everyone and any(s == "fail" for s, *_ in arrived.values())):
                return True
            watch.check([r for r in range(1, self.size) if r not in arrived])
            return False

        self._wait([f"{key}/full" if everyone else f"{key}/all"], poll)
        return _frames(self.store.get(inbox))

    def _wait(self, keys: list[str], poll: Callable[[], bool | None]) -> None:
        """Blocks until `keys` exist, calling `poll` between waits: it raises to give up, returns
        True when what the keys would say is known otherwise."""
        interval = self.poll_interval
        while not self.store.wait(keys, interval):
            if poll():
                return

    def _forget(self, seq: int) -> None:
        """Deletes the keys of step `seq` (one pipelined request)."""
        k = f"{self.prefix}/{seq}"
        keys = [f"{k}/in", f"{k}/n", f"{k}/all", f"{k}/full", f"{k}/out"]
        if self.scattered:
            keys += [f"{k}/out/{r}" for r in range(1, self.size)]
        self.store.delete(keys)

    def _publish(self, key: str, outcome: tuple[str, Any]) -> None:
        self.store.set(f"{key}/out", pickle.dumps(outcome))

    def check_awake(self) -> None:
        """Rank 0: raises `RankFailedError` if this process went silent in this operation long
        enough that the others may have given up on it: it was frozen (SIGSTOP, a paused VM) or cut
        off from the store. Those that gave up raised, and may never call again: going on, it would
        commit a save they reported failed, or wait for them. Called while it waits, before each
        step's decision and by a save right before its commit. (A freeze before the operation,
        while the others waited in its first step, is not counted: that rank 0 waits in the next
        step for those that left, until they call again, exit, or the arrival timeout.)"""
        silent = self._silence()
        if silent:
            raise RankFailedError(
                f"rank 0 went silent for {silent:.1f} s in this {self.op} (frozen, or cut off from "
                f"the store), long enough for the other ranks to give up on it (peer_timeout={self.peer_timeout:g} "
                "s); so it stops too, rather than go on without them (a save commits nothing)", rank=0)

    def _silence(self) -> float:
        """Rank 0: its longest silence in this operation if the others may have given up on it for
        it, else 0."""
        if self.size == 1 or self.link is None or self.rank != 0:
            return 0.0
        silent = self.link.heartbeat.longest_silence(time.monotonic() - self.since)
        return silent if silent >= self.peer_timeout - self.poll_interval else 0.0

    def check_one_group(self, waited: list[int]) -> set[int]:
        """Raises `InvalidArgumentError` where one of `waited` (global ranks this one waits for)
        makes its call of the same place on another process group of the same ranks: each waits
        for the other in its own group's keys, until the arrival timeout. Called at each look by a
        rank that has waited peer_timeout, with the ranks it waits for that have not said yet (at
        most 8): it says which group it uses there, once, and reads what they said (one or two
        requests each). Both sides of such a mismatch wait, so both find it. Returns those found on
        this group."""
        assert self.among is not None
        if not self.said_group:
            self.store.set(f"{self.among}{self.global_ranks[self.rank]}", self.name.encode())
            self.said_group = True
        same = set()
        for gr in waited:
            key = f"{self.among}{gr}"
            if self.store.check([key]):
                other = self.store.get(key).decode(errors="replace")
                same.add(gr)
                if other != self.name:
                    self._found_other_group(gr)
                    raise InvalidArgumentError(
                        f"the ranks of a call must pass the same process group: global rank {gr} is in its "
                        f"call of this place on process group {other!r}, while this rank (global rank "
                        f"{self.global_ranks[self.rank]}) called {self.op} on {self.name!r}, a group of the "
                        "same ranks (None is the default group); fix the call and restart the job")
        return same

    def _found_other_group(self, gr: int) -> None:
        """Says this rank found global rank `gr` on another group; global rank 0, the store's host,
        first waits (up to peer_timeout) until `gr` has found it too: `gr` reads this rank's word
        through that store, and a script whose rank 0 exits on the error took it away under `gr`,
        which failed on the lost store instead (one CI run of four)."""
        me = self.global_ranks[self.rank]
        with contextlib.suppress(Exception):
            self.store.set(f"{self.among}found/{me}", b"1")
            deadline = time.monotonic() + self.peer_timeout
            while me == 0 and not self.store.check([f"{self.among}found/{gr}"]) and time.monotonic() < deadline:
                time.sleep(self.poll_interval)

    def _check_abort(self) -> None:
        note = f"{self.prefix}/abort"
        if self.store.check([note]):
            msg, rank, dead = _loads(self.store.get(note))
            raise RankFailedError(msg, rank=rank, dead=dead)

    def _abort(self, key: str, exc: BaseException, rank: int | None = None, dead: bool = False,
               shared: bool = False) -> None:
        """Tells the others, best effort, that this rank gave up (or that `rank` died): the root
        publishes the failure, another rank leaves a note the others look for while they wait.
        The others raise the root's `shared` error (a step's outcome: the path is locked) and its
        `InvalidArgumentError` as themselves, anything else as `RankFailedError` naming this rank."""
        form = shared_form(exc) if self.rank == 0 and (shared or isinstance(exc, InvalidArgumentError)) else None
        msg = str(exc) if rank is not None or form else f"rank {self.rank} failed: {_describe(exc)}"
        who = self.rank if rank is None else rank
        self.told = True
        with contextlib.suppress(Exception):
            if self.rank == 0:
                self._publish(key, ("fail", (msg, who, dead, form)))
            self.store.set(f"{self.prefix}/abort", pickle.dumps((msg, who, dead)))

    def _tell(self, exc: BaseException) -> None:
        """This rank leaves the operation on `exc`, raised between steps (its reads failed): the
        others fail in the step they wait in or come to next, at once, instead of finishing without
        it or waiting for it until the process group times out. Best effort."""
        if self.size == 1 or self.closed or self.dead & {0, -1}:
            return
        key = f"{self.prefix}/{self.seq + 1}"
        if self.rank != 0:
            with contextlib.suppress(Exception):
                self._send(key, None, exc)
        self._abort(key, exc)

    def _store_lost(self, exc: BaseException) -> RankFailedError:
        """The error for a store that stopped answering: its host, global rank 0, died or hung."""
        host = self.global_ranks.index(0) if 0 in self.global_ranks else None
        self.dead.add(-1 if host is None else host)
        who = f"rank {host}" if host is not None else "global rank 0"
        if self.rank != 0:
            self._gave_up(f"it lost the rendezvous store ({_describe(exc)})")
        return RankFailedError(f"{who} died or stopped responding: the rendezvous store it hosts is gone "
                               f"({_describe(exc)}); the process group is unusable without it: restart the job",
                               rank=host, dead=True)

    def _gave_up(self, why: str) -> None:
        """Leaves the note that this rank gave up on this operation (`why`) at this process's next
        one, which can reach the store: the others, still waiting in this one, stop then."""
        note = (f"rank {self.rank} gave up on this operation: {why}", self.rank, False)
        with _calls_lock:
            _untold.append((self.prefix, pickle.dumps(note)))

    def check_same(self, gathered: Sequence[dict[str, Any]], what: str) -> None:
        """Rank 0: raises `InvalidArgumentError` if the ranks passed different arguments."""
        diffs = [f"rank {r} passed {k}={v!r}, rank 0 {k}={gathered[0][k]!r}"
                 for r, args in enumerate(gathered) for k, v in args.items() if v != gathered[0].get(k)]
        if diffs:
            raise InvalidArgumentError(f"{what}: the ranks must pass the same arguments; " + "; ".join(diffs[:8])
                                       + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else ""))

    # -- the end of an operation ---------------------------------------------------------------

    def close(self, failing: bool = False) -> None:
        """Ends the operation: each peer acknowledges that it read the last outcome, and the root
        (the store's host) returns once every live peer has, so none of them is left reading from
        a store that is gone. Best effort and bounded; a no-op after a peer died."""
        if self.size == 1 or self.closed:
            return
        self.closed = True
        acks, done = f"{self.prefix}/closed", f"{self.prefix}/closed/all"
        with contextlib.suppress(Exception):
            if self.rank != 0:
                if self.store.add(acks, 1) == self.size - 1:
                    self.store.set(done, b"")
                return
            if self.dead & {0, -1}:
                return  # the store is gone
            live = [r for r in range(1, self.size) if r not in self.dead]
            watch = _Watch(self)
            # After a failure a peer may never get here (stuck in a framework's collective): wait
            # for it no longer than for a silent peer. So after a silence of this rank long enough
            # for the others to give up reading the outcome: they never acknowledge it.
            deadline = time.monotonic() + (self.peer_timeout if failing else float("inf"))
            interval = self.poll_interval
            while not self.store.wait([done], interval):
                if self.store.add(acks, 0) >= len(live) or time.monotonic() > deadline:
                    break
                if deadline == float("inf") and self._silence():
                    deadline = time.monotonic() + self.peer_timeout
                self._check_abort()  # a peer that gave up on the store meanwhile, and came back
                watch.check(live, "the end of the operation")
            self.store.delete([acks, done])
            if self.seq:
                self._forget(self.seq)

    def _note_dead(self, exc: RankFailedError) -> None:
        if exc.dead and exc.rank is not None:
            self.dead.add(exc.rank)

    # -- collectives, bounded ------------------------------------------------------------------

    def devices(self) -> set[str]:
        """Devices whose tensors the group's collectives take: "cpu" with gloo, "cuda" with NCCL."""
        backend = str(dist.get_backend(self.pg)).lower()
        return {d for d, b in (("cpu", "gloo"), ("cuda", "nccl")) if b in backend}

    def wait_work(self, work: Any, what: str, cuda: bool = False) -> None:
        """Waits for the async collective `work` while watching liveness and abort notes: a peer
        that died or stopped fails every rank with `RankFailedError` within about peer_timeout,
        instead of holding it until the process group's timeout. The group is then broken
        (`BROKEN_GROUP`); on NCCL its communicator is aborted."""
        interval = self.poll_interval
        watch = _Watch(self)
        try:
            while True:
                try:
                    if self._work_done(work, interval, cuda):
                        return
                except RuntimeError as exc:  # a peer's connection closed
                    self._culprit(exc, watch)
                self._check_abort()
                self.check_awake()
                self._watch_collective(watch, what)
        except RankFailedError as exc:
            self._note_dead(exc)
            if cuda:
                _abort_nccl(self.pg)
            if exc.rank is not None and self.rank == 0:
                self._abort(f"{self.prefix}/{self.seq}", exc, rank=exc.rank, dead=exc.dead)
            raise RankFailedError(f"{exc} (during {what}; {BROKEN_GROUP})", rank=exc.rank, dead=exc.dead) from None
        except (ConnectionError, TimeoutError) as exc:
            if cuda:
                _abort_nccl(self.pg)
            lost = self._store_lost(exc)  # says the group is unusable without its store
            raise RankFailedError(f"{lost} (during {what})", rank=lost.rank, dead=True) from exc
        except BaseException as exc:
            # This rank gives up inside the collective (KeyboardInterrupt): tell the others.
            self._abort(f"{self.prefix}/{self.seq}", exc)
            raise

    def _work_done(self, work: Any, interval: float, cuda: bool) -> bool:
        if cuda:  # an NCCL wait only orders streams: poll completion instead
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                if work.is_completed():
                    work.wait()
                    return True
                time.sleep(0.001)
            return False
        try:
            work.wait(timedelta(seconds=interval))
            return True
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                return False
            raise

    def _watch_collective(self, watch: _Watch, what: str) -> None:
        """The root watches every peer (and leaves a note naming a dead one); the others watch the
        root and read its notes."""
        watch.check(range(1, self.size) if self.rank == 0 else [0], what)

    def _culprit(self, exc: BaseException, watch: _Watch) -> None:
        """A collective failed (a peer's connection closed): finds which rank died, as the
        heartbeats `watch` has been reading tell within peer_timeout, and raises `RankFailedError`
        naming it."""
        deadline = time.monotonic() + self.peer_timeout + 2 * self.poll_interval
        while time.monotonic() < deadline:
            self._check_abort()
            self._watch_collective(watch, "a collective")
            time.sleep(self.poll_interval)
        raise RankFailedError(f"a collective failed and no rank was found dead: {_describe(exc)}")

    def broadcast_bytes(self, data: bytes | None, n: int) -> bytes:
        """Rank 0's `data` (`n` bytes) on every rank, through the group's collectives (bounded)."""
        device = "cpu" if "cpu" in self.devices() else "cuda"
        if self.rank == 0:
            assert data is not None and len(data) == n
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        buf = buf.to(device)
        work = dist.broadcast(buf, src=self.global_ranks[0], group=self.pg, async_op=True)
        self.wait_work(work, "the broadcast of the manifest", cuda=device == "cuda")
        return data if data is not None else buf.cpu().numpy().tobytes()

    def _all_to_all(self, send: torch.Tensor, ins: list[int], outs: list[int], what: str) -> torch.Tensor:
        """One bounded `all_to_all_single`: `ins[p]` elements of `send` go to rank p, `outs[p]`
        come from it."""
        device = "cpu" if "cpu" in self.devices() else "cuda"
        recv = torch.empty(sum(outs), dtype=send.dtype, device=device)
        work = dist.all_to_all_single(recv, send.to(device), outs, ins, group=self.pg, async_op=True)
        self.wait_work(work, what, cuda=device == "cuda")
        return recv.cpu()

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data` on rank 0 (None elsewhere), by bounded collectives: the sizes, then
        one variable-size all_to_all into rank 0."""
        to_root = [1] + [0] * (self.size - 1)
        from_all = [1] * self.size if self.rank == 0 else [0] * self.size
        sizes = self._all_to_all(torch.tensor([len(data)], dtype=torch.int64), to_root, from_all,
                                 "a gather of sizes").tolist()
        outs = sizes if self.rank == 0 else [0] * self.size
        recv = self._all_to_all(_u8(data), [len(data)] + [0] * (self.size - 1), outs, "a gather")
        if self.rank != 0:
            return None
        raw, out, at = recv.numpy().tobytes(), [], 0
        for n in sizes:
            out.append(raw[at:at + n])
            at += n
        return out

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        """Rank 0's `parts[r]` on each rank r, by bounded collectives: the sizes, then one
        variable-size all_to_all out of rank 0."""
        from_root = [1] + [0] * (self.size - 1)
        if self.rank == 0:
            assert parts is not None and len(parts) == self.size
            counts = [len(p) for p in parts]
            send_sizes, send = torch.tensor(counts, dtype=torch.int64), _u8(b"".join(parts))
        else:
            counts = [0] * self.size
            send_sizes, send = torch.empty(0, dtype=torch.int64), _u8(b"")
        ins = [1] * self.size if self.rank == 0 else [0] * self.size
        (mine,) = self._all_to_all(send_sizes, ins, from_root, "a scatter of sizes").tolist()
        recv = self._all_to_all(send, counts, [mine] + [0] * (self.size - 1), "a scatter")
        return recv.numpy().tobytes()


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _abort_nccl(process_group: dist.ProcessGroup | None) -> None:
    """Aborts the NCCL communicator of `process_group` (best effort), so that the pending
    collective returns instead of holding the GPU until the group's timeout."""
    with contextlib.suppress(Exception):
        pg = process_group or dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda"))
        backend.abort()


def bound_collectives(process_group: dist.ProcessGroup | None, seconds: float) -> None:
    """After a peer died: makes collectives that others (torch DCP) still run on `process_group`
    fail after `seconds` instead of the group's own timeout (30 min by default). The group is
    broken anyway; best effort where torch lacks the hook."""
    set_timeout = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        with contextlib.suppress(Exception):
            set_timeout(timedelta(seconds=seconds), process_group)
