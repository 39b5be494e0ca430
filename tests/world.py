"""Persistent multi-process gloo worlds for tests.

`run(4, fn, x)` calls module-level `fn(x)` on every rank of a 4-process gloo world and returns the
results in rank order. Each world is spawned on first use and kept for the rest of the session, so
hypothesis can drive many examples through real processes cheaply. Inside `fn`, the default
`torch.distributed` group is the world and `mesh(shape)` gives a cached CPU DeviceMesh.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "WARNINGS_RAISE", "RankFailure", "WorldError", "free_port", "mesh", "run", "shutdown", "sizes", "warning_rules",
]

# Spawning a world imports torch once per rank; on a small machine that takes a while.
STARTUP_TIMEOUT = 300.0
# Once one rank has raised, the others are likely stuck in a collective waiting for it.
FAILURE_GRACE = 5.0


@dataclass(frozen=True)
class RankFailure:
    """An exception raised by `fn` on one rank."""

    rank: int
    type_name: str
    message: str
    traceback: str


class WorldError(RuntimeError):
    """A call on a world failed: ranks raised, died, or did not answer in time."""

    def __init__(self, summary: str, failures: Sequence[RankFailure] = ()) -> None:
        self.summary = summary
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        details = "".join(
            f"\n--- rank {f.rank}: {f.type_name}: {f.message}\n{f.traceback}" for f in self.failures
        )
        super().__init__(summary + details)


def run(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any
) -> list[Any]:
    """Run module-level `fn(*args, **kwargs)` on every rank of a persistent gloo world of `world_size`
    processes and return the per-rank results in rank order.

    Raises WorldError if any rank raises (the world survives), or if a rank dies or the call exceeds
    `timeout` seconds (the world is torn down and respawned on next use).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    # Pickle before touching the world so an unpicklable fn or argument leaves it intact.
    payload = pickle.dumps((fn, args, kwargs))
    world = _worlds.get(world_size)
    if world is None:
        world = _worlds[world_size] = _World(world_size)
    return world.call(payload, timeout)


def mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU DeviceMesh of `shape` over the world, created once per shape; call only inside `fn`.

    Creating a mesh is collective, so every rank must ask for the same shapes in the same order,
    which holds when every rank runs the same `fn`.
    """
    if not dist.is_initialized():
        raise RuntimeError("mesh() is for functions running on a world's ranks")
    shape = tuple(shape)
    if shape not in _meshes:
        _meshes[shape] = init_device_mesh("cpu", shape)
    return _meshes[shape]


# Torch 2.6 has neither `src_data_rank` nor `no_dist` (DCP without a process group runs on one).
_LOCAL_SPLIT = "src_data_rank" in inspect.signature(distribute_tensor).parameters
NO_DIST = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}


def distribute(full: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """`distribute_tensor` of a tensor every rank holds whole, split on each rank without a
    collective. Torch 2.6 scatters from rank 0 instead, and fails to pad an empty shard there: its
    local shard is cut at torch's own offsets (a `_StridedShard`, even there, is scattered)."""
    if _LOCAL_SPLIT:
        return distribute_tensor(full, device_mesh, placements, src_data_rank=None)
    if any(isinstance(p, _StridedShard) for p in placements):
        return distribute_tensor(full, device_mesh, placements)
    shape, offsets = compute_local_shape_and_global_offset(full.shape, device_mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))].clone()
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def sizes() -> list[int]:
    """The sizes of the worlds this process has running."""
    return sorted(size for size, world in _worlds.items() if world.owner == os.getpid())


# What `warning_rules` answers where the suite's rule holds.
WARNINGS_RAISE = {"DeprecationWarning": "raised", "FutureWarning": "raised"}


def warning_rules() -> dict[str, str]:
    """On a rank: whether a DeprecationWarning and a FutureWarning raise there ("raised") or are
    hidden or printed ("hidden"), as the suite's rule (errors) requires everywhere."""
    import warnings

    out = {}
    for category in (DeprecationWarning, FutureWarning):
        try:
            warnings.warn("olmo-chunks hygiene probe", category, stacklevel=1)
            out[category.__name__] = "hidden"
        except category:
            out[category.__name__] = "raised"
    return out


def shutdown() -> None:
    """Stop every world this process started."""
    # A forked child inherits the registry but must leave its parent's worlds alone.
    worlds = [world for world in _worlds.values() if world.owner == os.getpid()]
    _worlds.clear()
    for world in worlds:
        world.stop()
    deadline = time.monotonic() + 5
    for world in worlds:
        world.close(deadline)


_STOP = pickle.dumps(None)
_worlds: dict[int, _World] = {}
_meshes: dict[tuple[int, ...], DeviceMesh] = {}
atexit.register(shutdown)


class _World:
    """`size` spawned worker processes joined in one gloo process group."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.owner = os.getpid()
        self.tmpdir = tempfile.mkdtemp(prefix=f"olmo-chunks-world{size}-")
        rendezvous = f"tcp://127.0.0.1:{free_port()}"
        ctx = _context()
        self.conns: list[mpc.Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        try:
            with _single_threaded_children():
                for rank in range(size):
                    parent_end, child_end = ctx.Pipe()
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(rank, size, rendezvous, child_end),
                        name=f"world{size}-rank{rank}",
                        daemon=True,
                    )
                    proc.start()
                    child_end.close()
                    self.conns.append(parent_end)
                    self.procs.append(proc)
            self._collect(STARTUP_TIMEOUT, what=f"starting a world of {size}")
        except BaseException:
            self.close()
            raise

    def call(self, payload: bytes, timeout: float) -> list[Any]:
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as e:
            self._discard()
            raise WorldError(f"world of {self.size} is gone: {e}") from e
        return self._collect(timeout, what="call")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """Wait for one answer per rank; tear the world down if a rank dies or time runs out."""
        results: list[Any] = [None] * self.size
        failures: list[RankFailure] = []
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._discard()
                late = sorted(pending)
                if failures:
                    summary = f"{what} raised on some ranks while ranks {late} did not return"
                else:
                    summary = f"{what} got no answer from ranks {late} within {timeout:.0f} s"
                raise WorldError(f"world of {self.size}: {summary}", failures)
            sentinels = {self.procs[rank].sentinel: rank for rank in pending}
            ready = mpc.wait([*pending.values(), *sentinels], timeout=remaining)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    continue  # the sentinel reports the death below
                del pending[rank]
                try:
                    status, value = pickle.loads(data)
                except Exception as e:
                    status, value = "err", _failure(rank, e)
                if status == "ok":
                    results[rank] = value
                else:
                    failures.append(value)
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
            for sentinel, rank in sentinels.items():
                if rank in pending and sentinel in ready:
                    proc = self.procs[rank]
                    proc.join(1)
                    self._discard()
                    raise WorldError(
                        f"world of {self.size}: rank {rank} died (exit code {proc.exitcode}) during {what}",
                        failures,
                    )
        if failures:
            failures.sort(key=lambda f: f.rank)
            names = ", ".join(f"rank {f.rank}: {f.type_name}" for f in failures)
            raise WorldError(f"world of {self.size}: {what} raised on {names}", failures)
        return results

    def _discard(self) -> None:
        """Forget this world and kill its processes; the next run() spawns a fresh one."""
        if _worlds.get(self.size) is self:
            del _worlds[self.size]
        self.close()

    def stop(self) -> None:
        """Ask the workers to leave the world and exit."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(_STOP)

    def close(self, deadline: float | None = None) -> None:
        """Reap the workers, killing those still alive at `deadline` (now if None)."""
        for proc in self.procs:
            if deadline is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a world's rendezvous store (a TCPStore, as torchrun
    jobs have)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context() -> mp.context.BaseContext:
    """Workers fork from a server that has imported torch once (it is single-threaded then), which
    saves each worker the seconds of importing torch itself; fresh interpreters where there is no
    forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "olmo_chunks"])
    return ctx


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    """Have spawned children start with OMP_NUM_THREADS=1, which torch reads at import."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old


def _failure(rank: int, exc: BaseException) -> RankFailure:
    return RankFailure(
        rank=rank,
        type_name=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
    )


def _worker_main(rank: int, size: int, rendezvous: str, conn: mpc.Connection) -> None:
    """Join the gloo world, then run calls from the parent until told to stop."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("err", _failure(rank, e))))
        return
    try:
        conn.send_bytes(pickle.dumps(("ok", None)))
        _serve(rank, conn)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # Tearing down an interpreter that imported torch takes seconds and saves nothing here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _serve(rank: int, conn: mpc.Connection) -> None:
    """Run each call from the parent and send back its result or failure, until told to stop."""
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            message = pickle.loads(payload)
            if message is None:
                return
            fn, args, kwargs = message
            data = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException as e:
            data = pickle.dumps(("err", _failure(rank, e)))
        try:
            conn.send_bytes(data)
        except OSError:
            return  # the parent is gone
