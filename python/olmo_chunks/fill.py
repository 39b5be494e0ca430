"""Filling destination tensors from a checkpoint: the one load path both front doors use.

The core plans and reads (each needed block once, in parallel, checksums verified) straight into
CPU destinations that can take the saved bytes as they are. Everything else (accelerator tensors,
another dtype, elements sharing memory) goes through CPU staging buffers, at most `STAGING_BYTES`
at a time whatever the destinations' dtype or device (pinned for CUDA), and is copied into place by
torch. A destination that is the same memory as another key's (tied weights) is filled once and
checked: the checkpoint must hold the same bytes for both keys.

Across the ranks of a job (`read="once"`, the default), a saved block that several ranks need is
read from storage by one of them and handed to the others with torch collectives (`all_to_all` on
gloo for CPU, on NCCL for CUDA destinations): the core plans which rank reads what (`ReadOnce`,
`plan_read_once`), in rounds in which no rank reads, sends and receives more than `STAGING_BYTES`.
When no block is needed by two ranks, every rank reads its own, as with `read="direct"`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _core
from ._dist import Group
from .errors import InvalidArgumentError, MismatchError, OlmoChunksError
from .shards import is_dense

__all__ = ["READ_MODES", "STAGING_BYTES", "Fill", "ReadOnceStats", "check_read_mode", "fill"]

READ_MODES = ("once", "direct")

# Host memory used at a time to stage destinations the core cannot fill in place.
STAGING_BYTES = int(os.environ.get("OLMO_CHUNKS_STAGING_BYTES", 1 << 30))

@dataclass
class Fill:
    """One destination: `dest` receives the elements of manifest tensor `tensor` that `pieces(buf)`
    names, as core target pieces over a buffer `buf` shaped like `dest` (element offsets from
    `buf`'s first element, `buf`'s strides)."""

    key: str
    tensor: int
    dest: torch.Tensor
    pieces: Callable[[torch.Tensor], list[_core.Piece]]
    saved_dtype: torch.dtype


@dataclass
class ReadOnceStats:
    """A cooperative load's rounds, and the most bytes this rank read, sent and received in one."""

    rounds: int
    peak_bytes: int


def fill(manifest: _core.Manifest, fills: Sequence[Fill], *, verify: bool, workers: int | None,
         group: Group | None = None, read: str = "once") -> ReadOnceStats | None:
    """Fills every `Fill.dest` from `manifest` (see the module docstring). With a `group` of
    several ranks every rank calls this together (collective), with the same `read`. Returns the
    cooperative load's figures, or None when each rank read its own bytes."""
    check_read_mode(read)
    direct, staged, tied = _classify(fills)
    force = os.environ.get("OLMO_CHUNKS_READ_ONCE") == "always"  # benchmarks: the rounds even alone
    if group is not None and read == "once" and (group.size > 1 or force):
        stats = _read_once(manifest, direct, staged, tied, group, verify, workers, force)
        if stats is not None:
            return stats
    if direct:
        _load_direct(manifest, direct, verify, workers)
    for batch in _batches(staged):
        _copy_into_place(batch, _load_staged(manifest, batch, verify, workers))
    first = {id(f): key for f, key in tied}
    for batch in _batches([f for f, _ in tied]):
        _check_tied(batch, _load_staged(manifest, batch, verify, workers), first)
    return None


def check_read_mode(read: str) -> str:
    """`read`, if it names a read mode; else `InvalidArgumentError`."""
    if read not in READ_MODES:
        raise InvalidArgumentError(f"read must be one of {READ_MODES}, got {read!r}")
    return read


def _copy_into_place(batch: list[Fill], stages: list[torch.Tensor]) -> None:
    for f, stage in zip(batch, stages, strict=True):
        f.dest.copy_(stage, non_blocking=stage.is_pinned())
    if any(f.dest.is_cuda for f in batch):
        torch.cuda.synchronize()


def _check_tied(batch: list[Fill], stages: list[torch.Tensor], first: dict[int, str]) -> None:
    for f, stage in zip(batch, stages, strict=True):
        now = f.dest.detach().to("cpu", f.saved_dtype).contiguous()
        if not torch.equal(_bits(now), _bits(stage)):
            raise MismatchError(
                [f"{f.key}: shares memory with {first[id(f)]} in the state dict, but the checkpoint holds "
                 "different values for them"],
                header="cannot load tied tensors",
            )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _direct(dest: torch.Tensor, saved_dtype: torch.dtype) -> bool:
    """True if the core can write `dest`'s elements in place (CPU, saved dtype, aligned, no
    self-overlap)."""
    if dest.device.type != "cpu" or dest.dtype != saved_dtype:
        return False
    if (dest.data_ptr() - dest.untyped_storage().data_ptr()) % dest.element_size():
        return False
    return is_dense(dest)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes `[start, end)` that `t`'s elements can touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _classify(fills: Sequence[Fill]) -> tuple[list[Fill], list[Fill], list[tuple[Fill, str]]]:
    """Splits `fills` into those the core fills in place, those staged and copied into place, and
    tied ones (the very memory of an earlier key's destination, with that key). Destinations of
    different keys in one storage whose bytes may interleave are staged (filled one after the
    other); those of one key never overlap (they are parts of one tensor)."""
    direct: list[Fill] = []
    staged: list[Fill] = []
    tied: list[tuple[Fill, str]] = []
    placed: dict[tuple[str, int], list[tuple[Fill, tuple[int, int]]]] = {}
    for f in fills:
        if f.dest.numel() == 0:
            continue
        if not _direct(f.dest, f.saved_dtype):
            staged.append(f)
            continue
        others = placed.setdefault((str(f.dest.device), f.dest.untyped_storage().data_ptr()), [])
        span = _span(f.dest)
        same = next((g for g, _ in others if g.key != f.key and _same_view(g.dest, f.dest)), None)
        if same is not None:
            tied.append((f, same.key))
        elif any(g.key != f.key and s[0] < span[1] and span[0] < s[1] for g, s in others):
            staged.append(f)
        else:
            others.append((f, span))
            direct.append(f)
    return direct, staged, tied


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _storages(fills: list[Fill]) -> tuple[list[tuple[int, int]], Callable[[], list[_core.Target]]]:
    """The distinct storages of `fills` as core buffers `(address, nbytes)`, and a function making
    the fills' core targets: each destination addressed inside its storage, so destinations
    interleaved in one storage are one buffer."""
    buffers: list[tuple[int, int]] = []
    index: dict[int, int] = {}
    for f in fills:
        storage = f.dest.untyped_storage()
        if storage.data_ptr() not in index:
            index[storage.data_ptr()] = len(buffers)
            buffers.append((storage.data_ptr(), storage.nbytes()))

    def targets() -> list[_core.Target]:
        out = []
        for f in fills:
            sptr = f.dest.untyped_storage().data_ptr()
            shift = (f.dest.data_ptr() - sptr) // f.dest.element_size()
            pieces = [p.shifted(shift) for p in f.pieces(f.dest)]
            if pieces:
                out.append(_core.Target(f.tensor, pieces, index[sptr]))
        return out

    return buffers, targets


def _load_direct(manifest: _core.Manifest, fills: list[Fill], verify: bool, workers: int | None) -> None:
    """One core call: each storage is one buffer, each destination addressed inside it."""
    buffers, targets = _storages(fills)
    manifest.load(targets(), buffers, verify=verify, workers=workers)


def _load_staged(manifest: _core.Manifest, fills: list[Fill], verify: bool, workers: int | None) -> list[torch.Tensor]:
    """Reads `fills` into fresh CPU buffers of the saved dtype (pinned for CUDA destinations)."""
    stages = [torch.empty(tuple(f.dest.shape), dtype=f.saved_dtype, pin_memory=f.dest.is_cuda) for f in fills]
    targets = [_core.Target(f.tensor, f.pieces(s), i) for i, (f, s) in enumerate(zip(fills, stages, strict=True))]
    buffers = [(s.data_ptr(), s.numel() * s.element_size()) for s in stages]
    manifest.load([t for t in targets if t.pieces], buffers, verify=verify, workers=workers)
    return stages


def _batches(fills: list[Fill]) -> Iterator[list[Fill]]:
    """`fills` in runs whose staging buffers take at most STAGING_BYTES (a larger one alone)."""
    batch: list[Fill] = []
    size = 0
    for f in fills:
        nbytes = f.dest.numel() * f.saved_dtype.itemsize
        if batch and size + nbytes > STAGING_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(f)
        size += nbytes
    if batch:
        yield batch


def _read_once(manifest: _core.Manifest, direct: list[Fill], staged: list[Fill], tied: list[tuple[Fill, str]],
               group: Group, verify: bool, workers: int | None, force: bool) -> ReadOnceStats | None:
    """The cooperative load (collective). Returns None, having read nothing, when no saved block
    is needed by two ranks (and not `force`): each rank then reads its own."""
    load = _CooperativeLoad(manifest, direct, staged, tied, group, verify, workers)
    # Which device the bytes travel on (one store step, where a failure describing the needs
    # reaches every rank), then the needs to rank 0 and the plans back by bounded collectives.
    needs: list[bytes] = []

    def describe() -> bool:
        n, cuda = load.needs()
        needs.append(n)
        return cuda

    device = group.exchange(describe, lambda cudas: _exchange_device(group, any(cudas), all(cudas)))[1]
    gathered = group.gather_bytes(needs[0]) if group.size > 1 else needs
    plans: list[bytes] | None = None

    def plan(_: list[None]) -> bool:
        nonlocal plans
        assert gathered is not None
        plans = _core.plan_read_once(manifest, gathered, STAGING_BYTES, force)
        return plans is not None

    if not group.exchange(None, plan)[1]:
        return None
    mine = group.scatter_bytes(plans) if group.size > 1 else plans[0]  # type: ignore[index]
    return load.run(mine, device)


class _CooperativeLoad:
    """One rank's side of a cooperative load. Its buffers: the storages of the destinations filled
    in place (as `_load_direct` has them), then one staging buffer per other destination, alive
    from the first round that writes into it to the last (then copied into place, or checked
    against the tensor it is tied to)."""

    def __init__(self, manifest: _core.Manifest, direct: list[Fill], staged: list[Fill],
                 tied: list[tuple[Fill, str]], group: Group, verify: bool, workers: int | None) -> None:
        self.manifest, self.group, self.verify, self.workers = manifest, group, verify, workers
        self.storages, self.direct_targets = _storages(direct)
        others = staged + [f for f, _ in tied]
        self.fill_of = {len(self.storages) + j: f for j, f in enumerate(others)}
        self.tied_to = {id(f): key for f, key in tied}
        self.lens = [n for _, n in self.storages] + [f.dest.numel() * f.saved_dtype.itemsize for f in others]
        self.cuda = any(f.dest.is_cuda for f in direct + others)
        self.pin = self.cuda and torch.cuda.is_available()
        self.ro: Any = None

    def needs(self) -> tuple[bytes, bool]:
        """What this rank needs of each saved block, and whether it can exchange on CUDA."""
        targets = self.direct_targets()
        for i, f in self.fill_of.items():
            pieces = f.pieces(torch.empty(f.dest.shape, dtype=f.saved_dtype, device="meta"))
            if pieces:
                targets.append(_core.Target(f.tensor, pieces, i))
        self.ro = _core.ReadOnce(self.manifest, targets, self.lens)
        return self.ro.needs(), self.pin

    def run(self, plan: bytes, device: str) -> ReadOnceStats:
        """Every round of `plan`, each one agreed by every rank: exchange, copies into place, then
        the next round's reads (so a failure reaches every rank before the next collective)."""
        ro = self.ro
        ro.start(plan)
        self.device = device
        self.first: dict[int, list[int]] = {}
        self.last: dict[int, list[int]] = {}
        for i, span in enumerate(ro.buffer_rounds()):
            if span is not None:
                self.first.setdefault(span[0], []).append(i)
                self.last.setdefault(span[1], []).append(i)
        self.buffers = self.storages + [(0, 0)] * len(self.fill_of)
        self.stages: dict[int, torch.Tensor] = {}
        self.copied = 0
        if ro.rounds:
            self.group.agree(functools.partial(self._read, 0))
        for k in range(ro.rounds):
            self.group.agree(functools.partial(self._step, k))
        return ReadOnceStats(ro.rounds, max((ro.round_bytes(k).total for k in range(ro.rounds)), default=0))

    def _read(self, k: int) -> None:
        """Allocates the stages round `k` starts, reads its blocks and packs what peers need."""
        for i in self.first.get(k, []):
            if i in self.fill_of:
                f = self.fill_of[i]
                self.stages[i] = torch.empty(tuple(f.dest.shape), dtype=f.saved_dtype, pin_memory=self.pin)
                self.buffers[i] = (self.stages[i].data_ptr(), self.lens[i])
        sizes = self.ro.round_bytes(k)
        self.read_buf = torch.empty(sizes.read, dtype=torch.uint8, pin_memory=self.pin)
        send = torch.empty(sum(sizes.sends.values()), dtype=torch.uint8, pin_memory=self.pin)
        self.ro.read(k, _addr(self.read_buf), _addr(send), self.verify, self.workers)
        # Everything the exchange needs is allocated here, where a failure still reaches every
        # rank before any of them enters the collective.
        self.exchange = _Exchange(self.group, self.device, send, sizes)

    def _step(self, k: int) -> None:
        """Round `k`'s exchange and copies into place, then round `k + 1`'s reads."""
        recv = self.exchange.run()
        self.copied += self.ro.fill(k, _addr(self.read_buf), _addr(recv), self.buffers, self.workers)
        done = [i for i in self.last.get(k, []) if i in self.stages]
        into = [i for i in done if id(self.fill_of[i]) not in self.tied_to]
        _copy_into_place([self.fill_of[i] for i in into], [self.stages[i] for i in into])
        checks = [i for i in done if id(self.fill_of[i]) in self.tied_to]
        _check_tied([self.fill_of[i] for i in checks], [self.stages[i] for i in checks], self.tied_to)
        for i in done:
            del self.stages[i]
            self.buffers[i] = (0, 0)
        if k + 1 < self.ro.rounds:
            self._read(k + 1)
        elif self.copied != self.ro.total:
            raise OlmoChunksError(f"internal error: a cooperative load copied {self.copied} of {self.ro.total} bytes")


def _addr(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def _exchange_device(group: Group, any_cuda: bool, all_cuda: bool) -> str:
    """Where the ranks exchange bytes: on CUDA (NCCL) when the destinations are there and the group
    can, else on the CPU (gloo); on CUDA also when the group has no CPU backend."""
    if group.size == 1:
        return "cpu"
    devices = group.devices()
    if "cpu" not in devices:
        return "cuda"
    return "cuda" if any_cuda and all_cuda and "cuda" in devices else "cpu"


class _Exchange:
    """One all-to-all of bytes: this rank's `send` (packed for peers in rank order, as many bytes for
    each as `sizes.sends` says) for the bytes of `sizes.recvs`; on CUDA through device buffers."""

    def __init__(self, group: Group, device: str, send: torch.Tensor, sizes: _core.RoundBytes) -> None:
        self.group = group
        self.ins = [sizes.sends.get(p, 0) for p in range(group.size)]
        self.outs = [sizes.recvs.get(p, 0) for p in range(group.size)]
        self.send = send if device == "cpu" else send.to(device, non_blocking=True)
        self.recv = torch.empty(sum(self.outs), dtype=torch.uint8, device=device)
        self.host = None if device == "cpu" else torch.empty(self.recv.numel(), dtype=torch.uint8, pin_memory=True)

    def run(self) -> torch.Tensor:
        """The received bytes, in CPU memory."""
        if self.group.size > 1:
            work = dist.all_to_all_single(self.recv, self.send, self.outs, self.ins, group=self.group.pg,
                                          async_op=True)
            self.group.wait_work(work, "a read-once exchange", cuda=self.recv.is_cuda)
        if self.host is None:
            return self.recv
        self.host.copy_(self.recv)
        return self.host
