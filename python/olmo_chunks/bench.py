"""Save and resharded-load throughput of olmo-chunks against torch DCP and the machine's own limits.

One world of real processes (gloo) holds a synthetic OLMo-like state (dense layers and MoE experts:
FP32 main weights, exp_avg, exp_avg_sq), saves it on N ranks in layout A and loads it on M ranks
in layout B, for several pairs, through every contender on the same data:

- `native`: `olmo_chunks.save` / `olmo_chunks.load` (experts as `ExpertFlatView`s; loads with the
  default `read="auto"`, whose choice the load rows show, then `read=once` (each saved block read
  once per job) and `read=direct` (every rank reads what it needs itself); the auto row's `of best`
  is its GB/s over the better of the two),
- `ours-dcp`: `dcp.save` / `dcp.load` with `ChunkStoreWriter` / `ChunkStoreReader` + `FastLoadPlanner`,
- `dcp-fs t=K`: `dcp.save` with `FileSystemWriter(thread_count=K)` (K = 1 and the core count), and
  `dcp.load` with `FileSystemReader`,
- the roofline: one file per saving rank written and fsynced in parallel (raw write), and the
  bytes of `native`'s own data files read from the page cache into preallocated memory by the
  loading ranks, each its share of them (raw read): the same bytes in the same pages. How the page
  cache holds a file changes how fast it reads, and it is decided when the file is written: a
  file written in 4 KiB writes, or while memory is short of free 2 MiB blocks, is held in 4 KiB
  pages, one written in large writes into free memory in 2 MiB folios. A `pread` of 1 GiB then
  takes 122-143 against 85-96 ms, and a mapping's page faults 104-114 against 6 ms
  (`benches/page_cache.py`); in a 2 GiB run 29-40% of `native`'s pages were 4 KiB pages against
  3% of the raw write's files, written first, whose read was the roofline until then.

Loads read a checkpoint whose files were read once just before (warm page cache), or with
`--cold` dropped from the page cache just before, for every contender alike. Every
load is checked bit-exact on the first repetition, and counts the bytes it read from storage (all
ranks together, over the checkpoint's bytes: `read x`). `--storage-gbps` models slower shared
storage: each of the M loading ranks may read at most 1/M of that bandwidth (every contender's
reads are paced alike), which is where reading each byte once pays. With an object-store URL
(`--path s3://...`), `native` and `ours-dcp` also save to and load from `URL/bench/` in the same run
(rows marked `@url`), and each of those steps reports the requests it sent, per rank and in total.
`olmo-chunks bench` and `benches/reshard.py` run this module.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import io
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError, StorageError

__all__ = [
    "PAIRS",
    "Layout",
    "TensorSpec",
    "format_table",
    "machine_info",
    "model_spec",
    "run",
    "run_on_rank",
    "state_nbytes",
    "timed",
]

WORLD = 4  # ranks in the benchmark world: the largest layout
NUM_EXPERTS = 8
LAYERS = 4
MIB = 1 << 20


@dataclass(frozen=True)
class Layout:
    """How `ranks` ranks hold the state: dense tensors as `Shard(dense_dim)` over all of them
    (`Replicate()` for `dense_dim=-1`), experts over EP-MP `ep_mp` x EP-DP `ranks // ep_mp` (EP-DP
    sharded)."""

    ranks: int
    dense_dim: int
    ep_mp: int

    @property
    def ep_dp(self) -> int:
        return self.ranks // self.ep_mp

    @property
    def label(self) -> str:
        dense = "R" if self.dense_dim < 0 else f"S({self.dense_dim})"
        return f"{self.ranks}r {dense} EP{self.ep_mp}x{self.ep_dp}"


SAVE_4 = Layout(4, 0, 4)
SAVE_2 = Layout(2, 0, 2)
# (name, saved layout, loaded layout)
PAIRS: tuple[tuple[str, Layout, Layout], ...] = (
    ("DP shrink 4->2", SAVE_4, Layout(2, 0, 2)),
    ("DP grow 2->4", SAVE_2, Layout(4, 0, 4)),
    ("Shard(0)->Shard(1)", SAVE_4, Layout(4, 1, 4)),
    ("Shard(0)->Replicate", SAVE_4, Layout(4, -1, 1)),
    ("EP 4->2 (EP-DP 2)", SAVE_4, Layout(4, 0, 2)),
)


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    expert: bool
    seed: int


def model_spec(size_bytes: int) -> list[TensorSpec]:
    """Tensors of an OLMo-like MoE state of about `size_bytes` (FP32 main weights and both Adam
    moments): an embedding, per layer attention in/out projections and two expert tensors."""
    # 4 layers x (4 d^2 attention + 2 E d^2 experts) + 4 d^2 embedding = 84 d^2 params, 12 B each
    per_d2 = 12 * (LAYERS * (4 + 2 * NUM_EXPERTS) + 4)
    d = max(16, round(math.sqrt(size_bytes / per_d2) / 16) * 16)
    params: list[tuple[str, tuple[int, ...], bool]] = [("embeddings.weight", (4 * d, d), False)]
    for i in range(LAYERS):
        b = f"blocks.{i}"
        params += [
            (f"{b}.attention.w_qkv.weight", (3 * d, d), False),
            (f"{b}.attention.w_out.weight", (d, d), False),
            (f"{b}.feed_forward_moe.experts.w1", (NUM_EXPERTS, d, d), True),
            (f"{b}.feed_forward_moe.experts.w2", (NUM_EXPERTS, d, d), True),
        ]
    out: list[TensorSpec] = []
    for key, shape, expert in params:
        for prefix, suffix in (("model.", ""), ("optim.state.", ".exp_avg"), ("optim.state.", ".exp_avg_sq")):
            out.append(TensorSpec(prefix + key + suffix, shape, expert, len(out)))
    return out


def state_nbytes(specs: Iterable[TensorSpec]) -> int:
    return sum(4 * math.prod(s.shape) for s in specs)


def _values(index: torch.Tensor, seed: int) -> torch.Tensor:
    """FP32 values of global canonical indices: exact integers in [1, 2^24), varied and never 0."""
    return ((index * 40503 + seed * 7919) % 16777213 + 1).to(torch.float32)


def _range_values(start: int, length: int, seed: int) -> torch.Tensor:
    return _values(torch.arange(start, start + length, dtype=torch.int64), seed)


def _box_values(offsets: Iterable[int], sizes: Iterable[int], shape: tuple[int, ...],
                seed: int) -> torch.Tensor:
    offsets, sizes = list(offsets), list(sizes)
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    idx = torch.zeros((), dtype=torch.int64)
    for k, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        view = [1] * len(shape)
        view[k] = s
        idx = idx + (torch.arange(o, o + s, dtype=torch.int64) * strides[k]).view(view)
    return _values(idx, seed)


# --------------------------------------------------------------------------------------------
# Per-rank state in a layout
# --------------------------------------------------------------------------------------------

_meshes: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...]) -> Any:
    """A CPU DeviceMesh over ranks `0 .. prod(shape)` of the world (created collectively, cached)."""
    from torch.distributed.device_mesh import DeviceMesh

    if shape not in _meshes:
        _meshes[shape] = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
    return _meshes[shape]


def _make_meshes() -> None:
    """Every mesh the pairs use, in one order on every rank (mesh creation is collective)."""
    for _, a, b in PAIRS:
        for lo in (a, b):
            _mesh((lo.ranks,))
            _mesh((lo.ep_mp, lo.ep_dp))


@dataclass
class _Held:
    """One rank's state in a layout: DTensors for DCP and the same memory as native values."""

    dcp: dict[str, Any]
    native: dict[str, Any]
    locals: dict[str, torch.Tensor]  # the memory itself, per key (for fills and checks)
    expect: dict[str, Callable[[], torch.Tensor]]


def _hold(specs: list[TensorSpec], lo: Layout, rank: int) -> _Held | None:
    """This rank's (uninitialised) state in layout `lo`, or None when it is outside it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from .experts import ExpertLayout
    from .layout import dtensor_pieces

    dense_mesh, ep_mesh = _mesh((lo.ranks,)), _mesh((lo.ep_mp, lo.ep_dp))
    if rank >= lo.ranks:
        return None
    held = _Held({}, {}, {}, {})
    for s in specs:
        if s.expert:
            el = ExpertLayout(s.shape[0], s.shape[1:], rank // lo.ep_dp, lo.ep_mp, rank % lo.ep_dp, lo.ep_dp)
            storage = torch.empty(el.local_numel, dtype=torch.float32)
            start, length = el.flat_range
            per = el.expert_numel
            if start % per or length % per:
                raise ValueError(f"{lo.label}: experts do not split whole (use a multiple of {lo.ranks})")
            stride = torch.Size([math.prod(s.shape[k + 1 :]) for k in range(len(s.shape))])
            dt = DTensor.from_local(storage.view(length // per, *s.shape[1:]), ep_mesh, [Shard(0), Shard(0)],
                                    run_check=False, shape=torch.Size(s.shape), stride=stride)
            held.native[s.key] = el.view(storage)
            held.dcp[s.key] = dt
            held.locals[s.key] = storage
            held.expect[s.key] = functools.partial(_range_values, start, length, s.seed)
        else:
            place = [Replicate() if lo.dense_dim < 0 else Shard(lo.dense_dim)]
            local_shape, _ = compute_local_shape_and_global_offset(s.shape, dense_mesh, place)
            local = torch.empty(local_shape, dtype=torch.float32)
            dt = DTensor.from_local(local, dense_mesh, place, run_check=False,
                                    shape=torch.Size(s.shape), stride=torch.empty(s.shape, device="meta").stride())
            (piece,) = dtensor_pieces(dt)
            held.native[s.key] = held.dcp[s.key] = dt
            held.locals[s.key] = local
            held.expect[s.key] = functools.partial(_box_values, piece.global_offsets, piece.sizes, s.shape, s.seed)
    return held


def _fill(held: _Held) -> None:
    for key, local in held.locals.items():
        local.view(-1).copy_(held.expect[key]().view(-1))


def _check(held: _Held, what: str) -> None:
    for key, local in held.locals.items():
        if not torch.equal(local.view(-1), held.expect[key]().view(-1)):
            raise AssertionError(f"{what}: {key} differs from the saved data")


# --------------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], group: Any = None, before: Callable[[], Any] | None = None) -> float:
    """Seconds `fn` takes on the slowest rank: (`before()`,) barrier, run, barrier. Python's cyclic
    collector runs before, not inside, as in training loops that manage it (OLMo-core's and
    Megatron's GC settings): a full collection of a bench rank's heap took 90-310 ms, more than most
    loads it landed in, at random. What lived before is frozen out of later collections, until the
    process exits (what stays frozen is never freed: triton's bindings, imported with DTensor through
    torch._dynamo, then print some 200 lines of "nanobind: leaked ..." as a bench rank exits)."""
    if before is not None:
        before()
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        dist.barrier(group)
        return time.perf_counter() - t0
    finally:
        if enabled:
            gc.enable()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


class _PeakRss:
    """Peak RSS growth of this process while the block runs (VmHWM reset via clear_refs)."""

    def __enter__(self) -> _PeakRss:
        self.extra = -1
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = True
        except OSError:
            self.ok = False
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ok:
            self.extra = max(0, _status("VmHWM") - self.start)


def _raw_write(path: str, buf: torch.Tensor) -> None:
    mv = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < len(mv):
            pos += os.write(fd, mv[pos : pos + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _ranges(files: list[tuple[str, int]], start: int, length: int) -> list[tuple[str, int, int]]:
    """`(file, offset, len)` of bytes `start .. start + length` of the concatenation of `files`."""
    out, base = [], 0
    for path, size in files:
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            out.append((path, lo - base, hi - lo))
        base += size
    return out


def _raw_read(files: list[tuple[str, int]], start: int, out: torch.Tensor) -> None:
    """Reads bytes `start .. start + len(out)` of the concatenation of `files` into `out`."""
    mv = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
    pos = 0
    for path, lo, n_bytes in _ranges(files, start, len(mv)):
        fd = os.open(path, os.O_RDONLY)
        try:
            off, hi = lo, lo + n_bytes
            while off < hi:
                n = os.preadv(fd, [mv[pos : pos + min(hi - off, 64 << 20)]], off)
                if n <= 0:
                    raise OSError(f"{path}: short read")
                _account(n)
                off += n
                pos += n
        finally:
            os.close(fd)


_python_reads = 0  # bytes read from storage outside the core (DCP's reader, the raw read)


def _account(n: int) -> None:
    """Counts (and paces, under `--storage-gbps`) `n` bytes read outside the core."""
    global _python_reads
    from . import _core

    _python_reads += n
    _core.pace_read(n)


def _storage_reads() -> int:
    """Bytes this process has read from storage so far: through the core and outside it."""
    from . import _core

    return _core.io_counters()[0] + _python_reads


class _CountedFile(io.FileIO):
    """A data file whose reads are counted and paced like the core's."""

    def readinto(self, b: Any) -> int | None:
        n = super().readinto(b)
        _account(n or 0)
        return n

    def readall(self) -> bytes:
        data = super().readall()
        _account(len(data))
        return data


def _counted_reader(path: str) -> Any:
    """DCP's `FileSystemReader` on `path`, its reads counted and paced."""
    import contextlib

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CountedFS(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if mode != "rb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with io.BufferedReader(_CountedFile(os.fspath(path), "r")) as stream:
                yield stream

    reader = FileSystemReader(path)
    reader.fs = CountedFS()
    return reader


def data_files(path: str) -> list[tuple[str, int]]:
    """`(file, size)` of the data files of the native checkpoint at `path`, in name order."""
    data = os.path.join(path, "data")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs if f.endswith(".bin"))
    return [(f, os.path.getsize(f)) for f in files]


def _files(paths: list[str], rank: int, ranks: int) -> list[str]:
    """This loading rank's share of the files under `paths`."""
    return sorted(os.path.join(d, f) for p in paths for d, _, fs in os.walk(p) for f in fs)[rank::ranks]


def _warm(paths: list[str], rank: int, ranks: int) -> None:
    """Reads every file under `paths` once (files split across the `ranks` loading ranks), so the
    timed load that follows finds all of them in the page cache, whatever ran before."""
    buf = bytearray(16 << 20)
    for f in _files(paths, rank, ranks):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _drop(paths: list[str], rank: int, ranks: int) -> None:
    """Asks the kernel to drop every file under `paths` from the page cache (files split across the
    `ranks` loading ranks): `posix_fadvise(DONTNEED)`, which drops clean pages of files on disk
    (the saves fsynced them) and is a no-op where pages cannot be dropped (tmpfs)."""
    for f in _files(paths, rank, ranks):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _zero(held: _Held) -> None:
    for t in held.locals.values():
        t.zero_()


def _prepare(held: _Held | None, path: str, cold: bool, rank: int, ranks: int) -> None:
    """Before each timed load: zeros in `held` (so that the check after the last load is of it),
    and the files under `path` dropped from the page cache (`cold`) or read into it."""
    if held is not None:
        _zero(held)
        (_drop if cold else _warm)([path], rank, ranks)


def _share(total: int, parts: int, i: int) -> tuple[int, int]:
    a, b = total * i // parts, total * (i + 1) // parts
    return a, b - a


# --------------------------------------------------------------------------------------------
# The run on every rank
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    size_bytes: int
    reps: int = 2
    root: str = "/tmp"
    verify: bool = True
    threads: tuple[int, ...] = ()  # FileSystemWriter thread counts (default: 1 and the core count)
    storage_gbps: float = 0.0  # shared storage bandwidth of loads (0: unbounded)
    url: str | None = None  # an object-store location measured besides the local disk
    cold: bool = False  # drop the checkpoint's pages from the page cache before each load


def _dcp_thread_counts(opts: Options) -> tuple[int, ...]:
    return opts.threads or tuple(sorted({1, os.cpu_count() or 1}))


def _save_step(method: str, held: _Held | None, path: str, raw_file: tuple[str, int],
               raw_buf: torch.Tensor, group: Any) -> float:
    """Seconds of one durable save (every rank calls it; ranks outside the layout only wait)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from . import _core, checkpoint
    from .dcp import ChunkStoreWriter

    if held is None:
        return timed(lambda: None)
    if method == RAW_URL:
        return timed(lambda: _core.object_store_put_raw(path, os.path.basename(raw_file[0]), raw_file[1], 0))
    method = method.removesuffix(URL_SUFFIX)
    if method == "raw":
        return timed(lambda: _raw_write(raw_file[0], raw_buf[: raw_file[1]]))
    if method == "native":
        return timed(lambda: checkpoint.save(held.native, path, process_group=group, overwrite=True))
    if method == "ours-dcp":
        return timed(lambda: dcp.save(held.dcp, storage_writer=ChunkStoreWriter(path, process_group=group),
                                      process_group=group))
    t = int(method.split("=")[1])
    return timed(lambda: dcp.save(held.dcp, storage_writer=FileSystemWriter(path, thread_count=t),
                                  process_group=group))


def _stage_step(method: str, held: _Held | None, nbytes: int, raw_buf: torch.Tensor) -> float:
    """Seconds to stage CPU copies of the state, without I/O."""
    from .shards import describe

    if held is None:
        return timed(lambda: None)
    if method == "native":
        def stage() -> None:
            # what `save` does for accelerator tensors: a host buffer per chunk, filled by a copy
            staged = []
            for key, v in held.native.items():
                for _, data in describe(key, v).regions():
                    staged.append(torch.empty(data.shape, dtype=data.dtype).copy_(data))
        return timed(stage)
    if method == "dcp":
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # torch before 2.8: what its dcp.async_save stages with
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            return timed(lambda: BlockingAsyncStager().stage(held.dcp))
        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            return timed(lambda: stager.stage(held.dcp))
        finally:
            stager.close()
    out = torch.zeros(nbytes, dtype=torch.uint8)
    return timed(lambda: out.copy_(raw_buf[:nbytes]))


def _stall_step(method: str, held: _Held | None, path: str, nbytes: int, raw_buf: torch.Tensor,
                group: Any) -> float:
    """Seconds a save keeps training from going on: the whole save when synchronous, until the
    call returns when asynchronous (the background write is then awaited, untimed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from . import checkpoint
    from .background import async_save

    pending: list[Any] = []
    if held is None:
        seconds = timed(lambda: None)
    elif method == "raw":
        out = torch.zeros(nbytes, dtype=torch.uint8)
        seconds = timed(lambda: out.copy_(raw_buf[:nbytes]))
    elif method == "native":
        seconds = timed(lambda: checkpoint.save(held.native, path, process_group=group, overwrite=True))
    elif method == "native-async":
        seconds = timed(lambda: pending.append(async_save(held.native, path, process_group=group, overwrite=True)))
    else:
        seconds = timed(lambda: pending.append(
            dcp.async_save(held.dcp, storage_writer=FileSystemWriter(path), process_group=group)))
    for f in pending:
        f.result()
    dist.barrier()
    return seconds


def _tries(method: str) -> int:
    """Timings of `method` per repetition (one a round), the best kept, each after its own
    preparation (fresh zeros, the page cache warmed or dropped). The raw-read roofline is a
    limit, and one read of it came out at a third of the others in some runs (3.6-3.9 GB/s
    against 10.8-12.5 on the other pairs at 2 GiB). The default and its two read modes, whose
    times it is measured against (`of best`), differ by a few ms at 0.5 GiB, where one timing
    each varies by more than that (cold, by 20%)."""
    return 3 if method in ("raw", "native", "native-once", "native-direct") else 1


def _load_fn(method: str, held: _Held | None, path: str, raw_files: list[tuple[str, int]],
             share: tuple[int, int], group: Any, peak: _PeakRss) -> Callable[[], Any]:
    """One resharded load into `held` by `method`, to be timed (ranks outside the layout only wait)."""
    import torch.distributed.checkpoint as dcp

    from . import _core, checkpoint
    from .dcp import ChunkStoreReader, FastLoadPlanner

    if held is None:
        return lambda: None
    if method == RAW_URL:
        ranges = [(os.path.basename(p), off, n) for p, off, n in _ranges(raw_files, *share)]
        return lambda: _core.object_store_get_raw(path, ranges, 0)
    name, method = method, method.removesuffix(URL_SUFFIX)
    if method == "raw":
        out = torch.zeros(share[1], dtype=torch.uint8)
        peak.start = _status("VmRSS")  # the destination is not extra
        return lambda: _raw_read(raw_files, share[0], out)
    if method.startswith("native"):
        verify = method != "native-noverify"
        read = {"native-direct": "direct", "native-once": "once"}.get(method, "auto")

        def load() -> None:
            _CHOSEN[name] = checkpoint.load(held.native, path, process_group=group, verify=verify, read=read).read

        return load
    if method == "ours-dcp":
        return lambda: dcp.load(held.dcp, storage_reader=ChunkStoreReader(path, process_group=group),
                                planner=FastLoadPlanner(), process_group=group)
    return lambda: dcp.load(held.dcp, storage_reader=_counted_reader(path), process_group=group)


def _rotated(methods: list[str], rep: int) -> list[str]:
    """`methods` in the order of repetition `rep`: each starts one place earlier than in the last,
    so that whatever a place in the order costs falls on every contender in turn."""
    k = rep % len(methods)
    return methods[k:] + methods[:k]


# What the last native load of each method read with ("once" or "direct").
_CHOSEN: dict[str, str] = {}


def _base(method: str) -> str:
    """The contender whose checkpoint a load method reads."""
    at_url = method.endswith(URL_SUFFIX)
    method = method.removesuffix(URL_SUFFIX).removesuffix("-noverify").removesuffix("-direct").removesuffix("-once")
    return method + URL_SUFFIX if at_url else method


URL_SUFFIX = "@url"
RAW_URL = f"raw{URL_SUFFIX}"  # the same bytes moved with object_store alone: the object store's roofline


def _requests(url: str | None) -> int:
    """Requests this process has sent to the bucket of `url` so far (0 without one)."""
    from . import _core

    return _core.object_store_counters(url)[2] if url else 0


def run_on_rank(opts: Options) -> dict[str, Any] | None:  # noqa: PLR0915
    """The benchmark on this rank of an initialised world of at least `WORLD` ranks; returns the
    figures on rank 0 (None elsewhere). Every rank must call it."""
    from . import _core

    if dist.get_world_size() < WORLD:
        raise ValueError(f"the benchmark needs {WORLD} ranks, this world has {dist.get_world_size()}")
    rank = dist.get_rank()
    specs = model_spec(opts.size_bytes)
    total = state_nbytes(specs)
    _make_meshes()
    root = os.path.join(opts.root, "bench")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.join(root, "raw"))
    dist.barrier()
    # created in one order on every rank (collective); only members use a group
    sizes = sorted({lo.ranks for _, a, b in PAIRS for lo in (a, b)})
    groups = {r: dist.new_group(list(range(r))) for r in sizes}
    dcp_threads = _dcp_thread_counts(opts)
    contenders = ["native", "ours-dcp", *(f"dcp-fs t={t}" for t in dcp_threads)]
    if opts.url:
        contenders += [RAW_URL, f"native{URL_SUFFIX}", f"ours-dcp{URL_SUFFIX}"]
    records: list[dict[str, Any]] = []

    def record(kind: str, where: str, method: str, seconds: float, rss: int, requests: int = 0,
               read: int = 0) -> None:
        records.append({"kind": kind, "where": where, "method": method, "seconds": seconds, "rss": rss,
                        "requests": requests, "read": read, "chose": _CHOSEN.pop(method, None)})

    def path_of(method: str, ranks: int) -> str:
        name = re.sub(r"[^a-z0-9-]", "", method.removesuffix(URL_SUFFIX)) + f"-{ranks}"
        return f"{opts.url}/bench/{name}" if method.endswith(URL_SUFFIX) else os.path.join(root, name)

    saved_layouts = sorted({a for _, a, _ in PAIRS}, key=lambda lo: -lo.ranks)
    raw_buf = torch.full((max(_share(total, lo.ranks, 0)[1] + 1 for lo in saved_layouts),), 0x5A,
                         dtype=torch.uint8)
    for rep in range(opts.reps):
        for a in saved_layouts:
            src = _hold(specs, a, rank)
            if src is not None:
                _fill(src)
            paths = {m: path_of(m, a.ranks) for m in contenders}
            raw_files = [(os.path.join(root, "raw", f"rank-{r}.bin"), _share(total, a.ranks, r)[1])
                         for r in range(a.ranks)]
            mine = raw_files[rank] if rank < a.ranks else ("", 0)
            # Durable saves, interleaved so drifting machine load hits every contender alike.
            for method in ["raw", *_rotated(contenders, rep)]:
                sent = _requests(opts.url)
                with _PeakRss() as peak:
                    seconds = _save_step(method, src, paths.get(method, ""), mine, raw_buf, groups[a.ranks])
                record("save", a.label, method, seconds, peak.extra, _requests(opts.url) - sent)
            for method in ("native", "dcp", "raw"):
                with _PeakRss() as peak:
                    seconds = _stage_step(method, src, mine[1], raw_buf)
                record("stage", a.label, method, seconds, 0 if method == "raw" else peak.extra)
            for method in ("raw", "native", "native-async", "dcp-async"):
                stall_path = os.path.join(root, f"stall-{method}-{a.ranks}")
                with _PeakRss() as peak:
                    seconds = _stall_step(method, src, stall_path, mine[1], raw_buf, groups[a.ranks])
                record("stall", a.label, method, seconds, 0 if method == "raw" else peak.extra)
                # Never loaded from: gone before the loads, with the page cache it holds (three
                # copies of the state, on a machine whose free memory a 2 GiB run holds at the
                # kernel's low watermark).
                if rank == 0:
                    shutil.rmtree(stall_path, ignore_errors=True)
                dist.barrier()
            del src
            if mine[0]:  # the raw write's file is never read: the raw read reads native's files
                os.remove(mine[0])
            read_files = data_files(paths["native"])
            dist.barrier()
            for name, a2, b in PAIRS:
                if a2 != a:
                    continue
                dst = _hold(specs, b, rank)
                if dst is not None:  # touched now, so that no step counts the destination's pages
                    _zero(dst)
                loads = ["native", "native-once", "native-direct", "native-noverify", *contenders[1:]]
                if opts.url:  # auto's choice on the object store, against both of its modes there
                    loads += [f"native-once{URL_SUFFIX}", f"native-direct{URL_SUFFIX}"]
                methods = ["raw", *_rotated(loads, rep)]
                took: dict[str, list[float]] = {m: [] for m in methods}
                rss, reqs, read = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
                fns: dict[str, Callable[[], Any]] = {}
                # Rounds: every method's tries spread over the same minutes (the machine's speed
                # drifts by more than the gaps measured), in reverse order every other round.
                for rnd in range(max(map(_tries, methods))):
                    for method in methods if rnd % 2 == 0 else methods[::-1]:
                        if rnd >= _tries(method):
                            continue
                        src_path = paths["native" if method == "raw" else _base(method)]
                        prepare = functools.partial(_prepare, dst, src_path, opts.cold, rank, b.ranks)
                        _core.set_read_pace(int(opts.storage_gbps * 1e9 / b.ranks) if dst is not None else 0)
                        before, asked = _storage_reads(), _requests(opts.url)
                        try:
                            with _PeakRss() as peak:
                                if method not in fns:
                                    fns[method] = _load_fn(method, dst, paths.get(_base(method), ""),
                                                           raw_files if method == RAW_URL else read_files,
                                                           _share(total, b.ranks, rank), groups[b.ranks], peak)
                                took[method].append(timed(fns[method], before=prepare))
                        finally:
                            _core.set_read_pace(0)
                        rss[method] = max(rss[method], peak.extra)
                        reqs[method] += _requests(opts.url) - asked
                        read[method] += _storage_reads() - before
                        if dst is not None and method not in ("raw", RAW_URL) and rep == 0 and rnd == 0 and opts.verify:
                            _check(dst, f"{name} {method}")
                for method in methods:
                    record("load", name, method, min(took[method]), rss[method], reqs[method],
                           read[method] // _tries(method))
                del dst
            dist.barrier()
            if rank == 0:
                for p in paths.values():
                    shutil.rmtree(p, ignore_errors=True)
            dist.barrier()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        return _summarize(opts, specs, gathered[:WORLD], dcp_threads)
    return None


def _summarize(opts: Options, specs: list[TensorSpec], per_rank: list[list[dict[str, Any]]],
               dcp_threads: tuple[int, ...]) -> dict[str, Any]:
    """Best time per (kind, where, method) (timings agree across ranks: barrier to barrier), the
    largest extra RSS of any rank, GB/s and the ratios."""
    total = state_nbytes(specs)
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    for recs in per_rank:
        for r in recs:
            c = cells.setdefault((r["kind"], r["where"], r["method"]),
                                 {"seconds": [], "rss": 0, "requests": {}, "read": {}, "chose": []})
            if per_rank[0] is recs:
                c["seconds"].append(r["seconds"])
                if r.get("chose"):
                    c["chose"].append(r["chose"])
            c["rss"] = max(c["rss"], r["rss"])
            c["requests"].setdefault(id(recs), r.get("requests", 0))  # the first repetition's
            c["read"].setdefault(id(recs), r.get("read", 0))  # the same every repetition
    rows: dict[str, list[dict[str, Any]]] = {"save": [], "stage": [], "stall": [], "load": []}
    for (kind, where, method), c in cells.items():
        best = min(c["seconds"])
        requests = list(c["requests"].values())
        rows[kind].append({"where": where, "method": method, "seconds": c["seconds"], "best_s": best,
                           "gbps": total / best / 1e9, "peak_extra_rss_mib": c["rss"] / MIB,
                           "read_x": sum(c["read"].values()) / total,
                           "chose": "/".join(sorted(set(c["chose"]))) or None,
                           "requests_per_rank": requests if any(requests) else None})
    for group in rows.values():
        by_where: dict[str, list[dict[str, Any]]] = {}
        for row in group:
            by_where.setdefault(row["where"], []).append(row)
        for where_rows in by_where.values():
            roofs = {r["method"]: r["gbps"] for r in where_rows if r["method"] in ("raw", RAW_URL)}
            dcp_rows = [r for r in where_rows if r["method"].startswith("dcp")]
            dcp_best = max(r["gbps"] for r in dcp_rows) if dcp_rows else None
            modes = {suffix: [r["gbps"] for r in where_rows
                              if r["method"] in (f"native-once{suffix}", f"native-direct{suffix}")]
                     for suffix in ("", URL_SUFFIX)}
            for row in where_rows:
                suffix = URL_SUFFIX if row["method"].endswith(URL_SUFFIX) else ""
                # an object store's rows against the same bytes moved with object_store alone
                row["of_roofline"] = row["gbps"] / roofs[RAW_URL if suffix and RAW_URL in roofs else "raw"]
                row["x_dcp"] = row["gbps"] / dcp_best if dcp_best else None
                if row["method"] == f"native{suffix}" and modes[suffix]:
                    row["of_best_mode"] = row["gbps"] / max(modes[suffix])
    return {
        "machine": machine_info(opts.root),
        "state_bytes": total,
        "tensors": len(specs),
        "hidden": specs[0].shape[1],
        "experts": NUM_EXPERTS,
        "reps": opts.reps,
        "storage_gbps": opts.storage_gbps or None,
        "url": opts.url,
        "dcp_writer_threads": list(dcp_threads),
        "page_cache": ("cold (each load's files dropped from the page cache before it)" if opts.cold
                       else "warm (each load's files read once before it)"),
        "pairs": [{"name": n, "save": asdict(a) | {"label": a.label}, "load": asdict(b) | {"label": b.label}}
                  for n, a, b in PAIRS],
        "save": rows["save"],
        "stage": rows["stage"],
        "stall": rows["stall"],
        "load": rows["load"],
    }


def machine_info(path: str = "/tmp") -> dict[str, Any]:
    """What the figures were measured on."""

    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "nproc": os.cpu_count(),
        "uname": " ".join(platform.uname()),
        "free_g": sh("free", "-g"),
        "disk": sh("df", "-h", path),
        "torch": torch.__version__,
        "loadavg": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------

_NAMES = {
    "raw": "roofline",
    "native": "olmo_chunks native (read=auto)",
    "native-noverify": "olmo_chunks native, verify=False",
    "native-direct": "olmo_chunks native, read=direct",
    "native-once": "olmo_chunks native, read=once",
    "ours-dcp": "olmo_chunks via DCP",
}


def _name(method: str, kind: str) -> str:
    if method == "raw":
        return {"save": "roofline: raw write+fsync", "load": "roofline: raw read",
                "stage": "roofline: memcpy", "stall": "roofline: memcpy"}[kind]
    if method == RAW_URL:
        return {"save": "roofline: object_store PUTs @url", "load": "roofline: object_store GETs @url"}[kind]
    if kind == "stall":
        return {"native": "olmo_chunks save (sync)", "native-async": "olmo_chunks async_save",
                "dcp-async": "DCP async_save (FileSystemWriter)"}[method]
    if method == "dcp" and kind == "stage":
        return "DCP DefaultStager"
    if method == "native" and kind == "stage":
        return "olmo_chunks host copy"
    if method.endswith(URL_SUFFIX):
        return _name(method.removesuffix(URL_SUFFIX), kind) + " @url"
    if method.startswith("dcp-fs"):
        t = method.split("=")[1]
        return f"DCP FileSystemWriter t={t}" if kind == "save" else f"DCP FileSystemReader (t={t} save)"
    return _NAMES[method]


def format_table(res: dict[str, Any]) -> str:
    """The figures as a plain-text table."""
    gib = res["state_bytes"] / 2**30
    lines = [
        f"olmo-chunks bench: {gib:.2f} GiB state ({res['tensors']} FP32 tensors, hidden {res['hidden']}, "
        f"{res['experts']} experts), best of {res['reps']}, {res['machine']['nproc']} cores; "
        f"GB/s = state bytes / wall time (slowest rank)",
        f"loads: {res['page_cache'].split(' ')[0]} page cache (the same for every reader)"
        + (f", storage capped at {res['storage_gbps']:g} GB/s shared by the loading ranks"
           if res.get("storage_gbps") else "")
        + "; read x = bytes read from storage by all ranks / checkpoint bytes; RSS MiB = peak extra RSS "
        "of the worst rank during the step, beyond the state it saves from / loads into",
    ]
    if res.get("url"):
        lines.append(f"@url rows: {res['url']}/bench (requests: total, then per rank, of the first repetition; "
                     "'of roof' against the object_store rows)")
    head = f"  {'':<38} {'GB/s':>7} {'x DCP':>7} {'of roof':>8} {'best s':>8} {'RSS MiB':>8} {'read x':>7}"

    def row(r: dict[str, Any], kind: str) -> str:
        x = f"{r['x_dcp']:.2f}" if r["x_dcp"] is not None else "-"
        read = f"{r['read_x']:.2f}" if kind == "load" else ""
        req = r.get("requests_per_rank")
        req = f"  requests {sum(req)} ({'/'.join(map(str, req))})" if req else ""
        if kind == "load" and r.get("chose") and r["method"] in ("native", f"native{URL_SUFFIX}"):
            best = f", {r['of_best_mode'] * 100:.0f}% of the better mode" if r.get("of_best_mode") else ""
            req += f"  chose {r['chose']}{best}"
        return (f"  {_name(r['method'], kind):<38} {r['gbps']:>7.3f} {x:>7} {r['of_roofline'] * 100:>7.0f}% "
                f"{r['best_s']:>8.3f} {r['peak_extra_rss_mib']:>8.0f} {read:>7}{req}").rstrip()

    for kind, title in (("save", "Durable save (fsync), saved layout"),
                        ("stage", "Staging only (CPU copies, no I/O)"),
                        ("stall", "Training stall of a save (async: until the call returns)"),
                        ("load", "Resharded load, pair")):
        wheres: list[str] = []
        for r in res[kind]:
            if r["where"] not in wheres:
                wheres.append(r["where"])
        for where in wheres:
            lines.append("")
            lines.append(f"{title}: {where}")
            lines.append(head)
            for r in res[kind]:
                if r["where"] == where:
                    lines.append(row(r, kind))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Running a world
# --------------------------------------------------------------------------------------------


def rendezvous_url() -> str:
    """A `tcp://` rendezvous on a free port of 127.0.0.1: a TCPStore hosted by rank 0, as torchrun's
    is. (A `file://` store would cost each coordination step about 10 ms: torch's FileStore polls
    its file, and no notification wakes a waiter.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _spawned(rank: int, size: int, rendezvous: str, opts: Options, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size)
    try:
        res = run_on_rank(opts)
        if res is not None:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def room_needed(opts: Options) -> int:
    """Bytes the benchmark holds at once under its local directory: per saved layout, the raw
    files, each contender's checkpoint, and one stall row's checkpoint (each removed once
    measured), each about the state's size."""
    copies = 1 + 2 + len(_dcp_thread_counts(opts)) + 1
    return int(copies * state_nbytes(model_spec(opts.size_bytes)) * 1.05)


def _check_room(opts: Options) -> None:
    """`StorageError` now, rather than a full disk mid-run (where a rank's error cannot even be
    written down for the others), if the local directory has not the room `room_needed` says
    (`InvalidArgumentError` if it is no directory)."""
    if not os.path.isdir(opts.root):
        raise InvalidArgumentError(f"{opts.root}: no such directory")
    need, free = room_needed(opts), shutil.disk_usage(opts.root).free
    if need > free:
        raise StorageError(
            f"the benchmark of a {opts.size_bytes / 2**30:g} GiB state holds about {need / 1e9:.1f} GB at once "
            f"under {opts.root} and {free / 1e9:.1f} GB is free there: pass --dir on a larger filesystem or a "
            "smaller --size-gb")


def run(opts: Options) -> dict[str, Any]:
    """Spawns a world of `WORLD` processes, runs the benchmark and returns rank 0's figures."""
    import torch.multiprocessing as mp

    _check_room(opts)
    tmp = tempfile.mkdtemp(prefix="olmo-chunks-bench-", dir=opts.root)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        opts = Options(**{**asdict(opts), "root": tmp})
        out = os.path.join(tmp, "result.json")
        mp.spawn(_spawned, args=(WORLD, rendezvous_url(), opts, out), nprocs=WORLD)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
            return result
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
        shutil.rmtree(tmp, ignore_errors=True)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type="amount", default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--reps", type="count", default=2, help="repetitions; the best is reported (default 2)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--path", default=None,
                   help="a directory (as --dir), or an object-store URL (s3://bucket/prefix, gs://...) where the "
                        "native and DCP-door contenders also save and load, besides the local disk")
    p.add_argument("--json", type="output", default=None, help="also write the figures to this file")
    p.add_argument("--dcp-threads", type="count", nargs="*", default=None,
                   help="FileSystemWriter thread counts (default: 1 and the core count)")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check of every load")
    p.add_argument("--cold", action="store_true",
                   help="drop the checkpoint's files from the page cache before each load (default: warm them)")
    p.add_argument("--storage-gbps", type="amount", default=0.0,
                   help="cap loads' storage reads at this many GB/s shared by the loading ranks (default: none)")


def main(args: argparse.Namespace) -> int:
    from .location import checkpoint_location, is_url

    path = checkpoint_location(args.path) if args.path else None
    url = path if path and is_url(path) else None
    opts = Options(
        size_bytes=int(args.size_gb * 2**30),
        reps=args.reps,
        root=args.dir or (path if path and not url else None) or tempfile.gettempdir(),
        url=url,
        verify=not args.no_verify,
        threads=tuple(args.dcp_threads or ()),
        storage_gbps=args.storage_gbps,
        cold=args.cold,
    )
    res = run(opts)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
