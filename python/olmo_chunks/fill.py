"""Filling destination tensors from a checkpoint: the one load path both front doors use.

The core plans and reads (each needed block once, in parallel, checksums verified) straight into
CPU destinations that can take the saved bytes as they are. Everything else (accelerator tensors,
another dtype, elements sharing memory) goes through CPU staging buffers, at most `STAGING_BYTES`
at a time whatever the destinations' dtype or device (pinned for CUDA), and is copied into place by
torch. A destination that is the same memory as another key's (tied weights) is filled once and
checked: the checkpoint must hold the same bytes for both keys.

Across the ranks of a job (`read="once"`), a saved block that several ranks need is read from
storage by one of them and handed to the others with torch collectives (`all_to_all` on gloo for
CPU, on NCCL for CUDA destinations): the core plans which rank reads what (`ReadOnce`,
`plan_read_once`), in rounds in which no rank sends and receives more than half of
`STAGING_BYTES` (what a reader needs itself goes straight into place); the next round is read
while one is exchanged.
When no block is needed by two ranks, every rank reads its own, as with `read="direct"`. With
`read="auto"` (the default) the core predicts both strategies' time from measured rates
(`olmo_chunks.rates`) and the load takes the faster.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _core, rates
from ._dist import INLINE_BYTES, Group
from .errors import (
    ChecksumError,
    InvalidArgumentError,
    MismatchError,
    OlmoChunksError,
    check_int,
    env_setting,
    no_thread,
    parse_bytes,
)
from .location import is_url
from .shards import is_dense

__all__ = ["MAX_WORKERS", "READ_MODES", "STAGING_BYTES", "Fill", "FillStep", "ReadOutcome", "check_read_mode",
           "check_workers", "fill"]

READ_MODES = ("auto", "once", "direct")
# The most I/O workers a save or load may be given.
MAX_WORKERS = 1024

# Host memory used at a time to stage destinations the core cannot fill in place.
STAGING_BYTES = env_setting("OLMO_CHUNKS_STAGING_BYTES", 1 << 30, parse_bytes)

T = TypeVar("T")

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
class ReadOutcome:
    """How a load's bytes came: `read` "once" (with its rounds, and the most bytes this rank held
    for them at once: sent and received, two rounds overlapping) or "direct"; with
    `read="auto"`, the predicted seconds of both strategies and the rates they came from (`why`);
    and the seconds the reads took."""

    read: str = "direct"
    rounds: int = 0
    peak_bytes: int = 0
    predicted_direct_s: float | None = None
    predicted_once_s: float | None = None
    why: str = ""
    seconds: float = 0.0
    # Read directly: this rank's blocks another rank of its host checks, or that its ranks check in
    # part (`_core.ReadChoice.trusted`), and its shares of the latter (`_core.ReadOnce.load`).
    trusted: bytes | None = None
    shares: tuple[int, bytes] | None = None


def fill(manifest: _core.Manifest, fills: Sequence[Fill], *, verify: bool, workers: int | None,
         group: Group | None = None, read: str = "auto", source: str = "",
         then: Callable[[], Any] = lambda: None) -> ReadOutcome:
    """Fills every `Fill.dest` from `manifest`, the checkpoint at `source` (see the module
    docstring), then runs `then()`. With a `group` of several ranks every rank calls this together
    (collective), with the same `read`, and `then()` runs in the fill's last step
    (`FillStep.last`)."""
    step = FillStep(manifest, fills, verify=verify, workers=workers, group=group, read=read, source=source)
    decided = None
    if group is not None and step.once is not None:
        decided = group.exchange(step.local, step.root, scatter=True)[1]
    outcome = step.run(decided)
    if group is None:
        then()
    else:
        step.last(group, outcome, then)
    return outcome


def _forced() -> bool:
    """Benchmarks: the read-once rounds even on one rank, and when no block is shared."""
    return os.environ.get("OLMO_CHUNKS_READ_ONCE") == "always"


class FillStep:
    """A load's fill in three parts, so that the decision of how to read can ride in a step the
    load makes anyway (`checkpoint.load` decides in the step that agrees on what to load): `local()`
    on every rank inside a group step, `root(results)` on its rank 0, whose items the ranks get
    back (`scatter`), then `run(item)` on every rank. `fill` is the three in a step of their own.
    Where the fill is not `collective` (`read="direct"`, one rank) it needs no step: `run(None)`."""

    def __init__(self, manifest: _core.Manifest, fills: Sequence[Fill], *, verify: bool, workers: int | None,
                 group: Group | None, read: str, source: str) -> None:
        check_read_mode(read)
        check_workers(workers)
        self.t0 = time.perf_counter()
        self.manifest, self.verify, self.workers, self.source = manifest, verify, workers, source
        self.direct, self.staged, self.tied = _classify(fills)
        self.once: _ReadOnce | None = None
        if group is not None and FillStep.collective(group, read):
            load = _CooperativeLoad(manifest, self.direct, self.staged, self.tied, group, verify, workers, source)
            self.once = _ReadOnce(load, group, _forced(), read == "auto", source)

    @staticmethod
    def collective(group: Group, read: str) -> bool:
        """Whether the fill of a load with `read` over `group` needs its step."""
        return read != "direct" and (group.size > 1 or _forced())

    def local(self) -> Any:
        return self.once.describe() if self.once is not None else None

    def root(self, got: list[Any]) -> list[Any]:
        assert self.once is not None, "root of a fill that is not collective"
        return self.once.first(got)

    def last(self, group: Group, outcome: ReadOutcome, fn: Callable[[], T]) -> T:
        """The load's last step, after `run`: `fn()` on every rank, returning once every rank has
        read all it needed. Where ranks checked blocks in part (`ReadOutcome.shares`,
        `_core.ReadChoice.trusted`), rank 0 checks here that their shares add up, from one word
        per rank; only where they do not does a second step find the block
        (`_core.check_shares`), failing the load on every rank."""
        once = self.once
        if once is None:
            return group.agree(fn)
        word = outcome.shares[0] if outcome.shares is not None else None

        def root(got: list[tuple[Any, int | None]]) -> bool:
            words = [g[1] for g in got if g[1] is not None]
            return bool(words) and functools.reduce(operator.xor, words) != once.split_sum

        mine, bad = group.exchange(lambda: (fn(), word), root)
        result: T = mine[0]
        if bad:
            def find(got: list[bytes]) -> None:
                _core.check_shares(self.manifest, got)
                raise ChecksumError(f"the checksums of blocks that ranks checked in part do not add up in "
                                    f"{self.source}, though each block's shares do")

            group.exchange(lambda: outcome.shares[1] if outcome.shares is not None else b"", find)
        return result

    def run(self, decided: Any) -> ReadOutcome:
        outcome = ReadOutcome()
        if self.once is not None:
            outcome = self.once.finish(decided)
            if outcome.read == "once":
                outcome.seconds = time.perf_counter() - self.t0
                return outcome
        manifest, verify, workers = self.manifest, self.verify, self.workers
        before, resident = _core.io_counters()[0], rates.resident_bytes()
        t_read = time.perf_counter()
        planned = self.once.load.ro if self.once is not None else None
        if planned is not None and self.direct:  # its copies are planned already (`needs`)
            outcome.shares = planned.load(self.once.load.storages, verify=verify,  # type: ignore[union-attr]
                                          workers=workers, trusted=outcome.trusted)
        elif self.direct:
            _load_direct(manifest, self.direct, verify, workers)
        for batch in _batches(self.staged):
            _copy_into_place(batch, _load_staged(manifest, batch, verify, workers))
        first = {id(f): key for f, key in self.tied}
        for batch in _batches([f for f, _ in self.tied]):
            _check_tied(batch, _load_staged(manifest, batch, verify, workers), first)
        rates.learn_storage(self.source, _core.io_counters()[0] - before, time.perf_counter() - t_read,
                            rates.resident_bytes() - resident)
        outcome.seconds = time.perf_counter() - self.t0
        return outcome


def check_workers(workers: int | None) -> int | None:
    """`workers`, if None or a whole number from 1 to `MAX_WORKERS`; else `InvalidArgumentError`.
    None leaves the count to the core: `OLMO_CHUNKS_THREADS` where set, checked here (the core
    skipped a value it could not read, and took any count)."""
    if workers is None:
        check_int("OLMO_CHUNKS_THREADS", env_setting("OLMO_CHUNKS_THREADS", 1, int), 1, MAX_WORKERS)
        return None
    return check_int("workers", workers, 1, MAX_WORKERS)


def check_read_mode(read: str) -> str:
    """`read`, if it names a read mode; else `InvalidArgumentError`."""
    if read not in READ_MODES:
        raise InvalidArgumentError(f"read must be one of {READ_MODES}, got {read!r}")
    return read


def _copy_into_place(batch: list[Fill], stages: list[torch.Tensor]) -> None:
    for f, stage in zip(batch, stages, strict=True):
        # Detached: a parameter (or a view of one) that requires grad takes the bytes as the core's
        # in-place reads do, and its version counter still moves.
        f.dest.detach().copy_(stage, non_blocking=stage.is_pinned())
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
    self-overlap, not a lazily conjugated or negated view, whose memory holds other values than it
    has)."""
    if dest.device.type != "cpu" or dest.dtype != saved_dtype or dest.is_conj() or dest.is_neg():
        return False
    if (dest.data_ptr() - dest.untyped_storage().data_ptr()) % dest.element_size():
        return False
    return is_dense(dest)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes `[start, end)` that `t`'s elements can touch."""
    if t.numel() == 0 or t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
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


class _ReadOnce:
    """The cooperative load's decision and rounds (collective). Reads nothing and finishes with a
    "direct" outcome when no saved block is needed by two ranks (and not `force`), or with `auto`
    when reading directly is predicted faster: each rank then reads its own.

    One store step decides (`describe` on every rank, `first` on rank 0, `finish` with its item):
    each rank sends what it needs (where that is small), rank 0 plans, predicts and sends each rank
    its plan. Where the needs or plans are too large for the store, or the group's exchange must be
    measured first, they travel by bounded collectives instead, and a second step decides. The
    exchange is measured (once per group) only where reading once would win were the exchange free:
    where no block is shared, or the ranks read directly no more than reading once would have the
    slowest of them read (blocks checked in part), no exchange can make reading once pay, and the
    probe's all-to-alls would only delay the load (needs too large for the store are gathered
    first, and one more step then says whether to measure)."""

    def __init__(self, load: _CooperativeLoad, group: Group, force: bool, auto: bool, source: str) -> None:
        self.load, self.group, self.force, self.auto, self.source = load, group, force, auto, source
        self.pg = id(group.pg)
        self.inline = max(256, INLINE_BYTES // group.size)
        self.needs: list[bytes] = []
        self.plans: list[bytes] | None = None  # rank 0's: each rank's plan, or what it trusts (`decide`)
        self.split_sum: int | None = None  # rank 0's: what the ranks' shares XOR to (`decide`)
        self.hosts: list[int] | None = None

    def describe(self) -> tuple[bool, list[str], bytes | None, int, bool]:
        n, cuda = self.load.needs()
        self.needs.append(n)
        known = [d for d in ("cpu", "cuda") if (self.pg, d) in _EXCHANGE]
        return cuda, known, n if len(n) <= self.inline else None, page_cache(self.source), self.load.verify

    def shared(self, needs: list[bytes]) -> bool:
        """Whether reading once may pay: some block is needed by two ranks (or it is forced)."""
        return self.force or _core.blocks_shared(needs)

    def decide(self, gathered: list[bytes], device: str,
               free: bool = False) -> tuple[str, float | None, float | None, str, bool] | None:
        """Rank 0's decision, and (in `plans`) each rank's plan, or, read directly, the blocks it
        trusts another rank of its host to check: where the checkpoint is on a filesystem (a
        page cache the ranks of a host share) and checksums are on. With `free`, where this
        group's exchange is not measured, decided as if it cost nothing: `None` where reading
        once would then win (the exchange must be measured first)."""
        if not self.shared(gathered):
            return "direct", None, None, NOT_SHARED, False
        model, why = None, ""
        measured = _EXCHANGE.get((self.pg, device))
        unmeasured = self.auto and free and measured is None
        if self.auto and (measured is not None or unmeasured):
            storage, origin = rates.storage_rate(self.source)
            why = f"storage {storage / 1e9:.2f} GB/s ({origin}), "
            if measured is None:
                model = _core.Rates(storage, math.inf, 0.0, math.inf)
                why += UNMEASURED
            else:
                f = rates.once_factor((self.pg, device))
                model = _core.Rates(storage, measured.bps / f, measured.round_s * f, measured.copy_bps / f)
                why += (f"exchange {measured.bps / 1e9:.2f} GB/s on {device}, {measured.round_s * 1e3:.1f} ms per "
                        f"round, copies {measured.copy_bps / 1e9:.2f} GB/s"
                        + (f", once x{f:.2f} its model (measured)" if f != 1 else ""))
        hosts = self.hosts if self.load.verify and not is_url(self.source) else None
        # Rounds of half the budget: two of them overlap (`_CooperativeLoad.run`).
        choice = _core.plan_read_once(self.load.manifest, gathered, STAGING_BYTES // 2, self.force, model, hosts)
        if choice.plans is not None:
            if unmeasured:
                return None
            self.plans = choice.plans
            return "once", choice.direct_s, choice.once_s, why, True
        self.plans, self.split_sum = choice.trusted, choice.split_sum
        if choice.trusted is not None:
            why += ("; " if why else "") + DELEGATED
        return "direct", choice.direct_s, choice.once_s, why, self.plans is not None

    def first(self, got: list[tuple[bool, list[str], bytes | None, int, bool]]) -> list[Any]:
        group = self.group
        # A rank that does not verify would hand (or, as a block's checker, vouch for) unchecked
        # bytes to one that does (`checkpoint.load` compares it sooner; the DCP door here).
        group.check_same([{"verify": g[4]} for g in got], "reading a checkpoint")
        self.hosts = [g[3] for g in got]
        device = _exchange_device(group, any(g[0] for g in got), all(g[0] for g in got))
        probe = self.auto and group.size > 1 and not all(device in g[1] for g in got)
        inline = all(g[2] is not None for g in got)
        needs = [g[2] for g in got if g[2] is not None]
        decision = self.decide(needs, device, free=True) if probe and inline else None
        probe = probe and decision is None  # else reading once cannot pay: nothing to measure
        if probe or not inline:
            # Measure now, or once the gathered needs show that reading once may pay (`finish`).
            when = ("now" if inline else "if it may pay") if probe else None
            return [(None, device, when, None)] * group.size
        decision = decision or self.decide(needs, device)
        plans = self.plans
        small = plans is not None and sum(map(len, plans)) <= INLINE_BYTES
        return [(decision, device, None, plans[r] if plans is not None and small else None)
                for r in range(group.size)]

    def finish(self, decided: tuple[Any, str, str | None, bytes | None]) -> ReadOutcome:
        group = self.group
        decision, device, probe, mine = decided
        if decision is None:
            if probe == "now":
                _EXCHANGE[(self.pg, device)] = _measure_exchange(group, device)
            gathered = group.gather_bytes(self.needs[0]) if group.size > 1 else self.needs
            if probe == "if it may pay":
                decision = group.exchange(None, lambda _: self.decide(gathered or [], device, free=True))[1]
                if decision is None:
                    _EXCHANGE[(self.pg, device)] = _measure_exchange(group, device)
            if decision is None:
                decision = group.exchange(None, lambda _: self.decide(gathered or [], device))[1]
        mode, direct_s, once_s, why, per_rank = decision
        outcome = ReadOutcome(mode, predicted_direct_s=direct_s, predicted_once_s=once_s, why=why)
        if mine is None and per_rank:
            mine = group.scatter_bytes(self.plans) if group.size > 1 else self.plans[0]  # type: ignore[index]
        if outcome.read == "direct":
            outcome.trusted = mine
            return outcome
        assert mine is not None, "a read-once decision comes with plans"
        t0 = time.perf_counter()
        outcome.rounds, outcome.peak_bytes = self.load.run(mine, device)
        if once_s is not None:  # every rank learns its own; rank 0's is the one that decides
            rates.learn_once((self.pg, device), time.perf_counter() - t0, once_s)
        return outcome


def page_cache(source: str) -> int:
    """A 63-bit name of the page cache through which this rank reads the checkpoint at `source`:
    its kernel (the boot id, which containers on one machine share; else the host name;
    `OLMO_CHUNKS_HOST` names it instead) and the checkpoint's directory as this rank's filesystem
    sees it (device and inode). Ranks of one machine that see different copies at one path
    (containers, each with its own) do not share one; ranks that see one directory through
    different mounts do."""
    kernel = os.environ.get("OLMO_CHUNKS_HOST")
    if kernel is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                kernel = "boot:" + f.read().strip()
        except OSError:
            kernel = "host:" + socket.gethostname()
    try:
        st = os.stat(source)
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        where = "path:" + source
    name = f"{kernel}/{where}".encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 1


NOT_SHARED = "no saved block is needed by two ranks: each reads its own"
UNMEASURED = "exchange not measured: reading once would not be faster were it free"
DELEGATED = ("a block that ranks need in part is checked once: by the shares of its bytes each folds, where they "
             "hold all of it between them, else whole by one rank per host")

# Each group's measured exchange, by process group and device (`_measure_exchange`), each
# all-to-all of the probe timed `PROBE_TRIES` times.
PROBE_TRIES = 3
_EXCHANGE: dict[tuple[int, str], rates.ExchangeRates] = {}


def _measure_exchange(group: Group, device: str) -> rates.ExchangeRates:
    """Times a tiny all-to-all and one of `rates.PROBE_BYTES` per rank on `device` (collective; the
    fastest of `PROBE_TRIES` each), and a copy of as many bytes into a fresh buffer on every rank
    at once. A round costs, besides its bytes, about two tiny collectives: its all-to-all's latency
    and the one-flag all-reduce before it."""
    per_peer = max(1, rates.PROBE_BYTES // group.size)

    def all_to_all(n: int) -> float:
        send = torch.zeros(n * group.size, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        t0 = time.perf_counter()
        work = dist.all_to_all_single(recv, send, group=group.pg, async_op=True)
        group.wait_work(work, "the exchange probe", cuda=device != "cpu")
        return time.perf_counter() - t0

    def copy() -> float:
        src = torch.empty(rates.PROBE_BYTES, dtype=torch.uint8).fill_(1)
        t0 = time.perf_counter()
        torch.empty(rates.PROBE_BYTES, dtype=torch.uint8).copy_(src)  # fresh pages, as a round's
        return time.perf_counter() - t0

    def probe() -> tuple[float, float, float]:
        all_to_all(1)  # connections set up
        # The fastest of a few: on shared cores single timings vary 5x. An optimistic exchange
        # gets read once tried, and a read once slower than predicted corrects the model
        # (`rates.learn_once`); a pessimistic one would never be tried, so never corrected.
        return (min(all_to_all(1) for _ in range(PROBE_TRIES)), min(all_to_all(per_peer) for _ in range(PROBE_TRIES)),
                copy())

    small, big, copied = group.agree(probe)
    return rates.ExchangeRates.probed(per_peer * (group.size - 1), small, big, copied)


class _CooperativeLoad:
    """One rank's side of a cooperative load. Its buffers: the storages of the destinations filled
    in place (as `_load_direct` has them), then one staging buffer per other destination, alive
    from the first round that writes into it to the last (then copied into place, or checked
    against the tensor it is tied to)."""

    def __init__(self, manifest: _core.Manifest, direct: list[Fill], staged: list[Fill],
                 tied: list[tuple[Fill, str]], group: Group, verify: bool, workers: int | None,
                 source: str) -> None:
        self.manifest, self.group, self.verify, self.workers = manifest, group, verify, workers
        self.source = source
        self.read_s, self.read_bytes, self.faulted = 0.0, 0, 0
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

    def run(self, plan: bytes, device: str) -> tuple[int, int]:
        """Every round of `plan`. Round k+1's blocks are read (on a helper thread) while round k is
        exchanged and copied into place, whenever both rounds' buffers fit in `STAGING_BYTES`
        together (the plan's rounds take at most half of it each). The ranks stay in lockstep
        whatever fails on one of them: before each exchange, and after the last, they all-reduce
        whether any has failed and stop together; one agreement then says what failed (none when
        nothing did). Returns the rounds and the most bytes this rank held for them at once."""
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
        self.failure: BaseException | None = None
        held, stopped = 0, False
        with ThreadPoolExecutor(1, thread_name_prefix="olmo-chunks-read") as pool:
            nxt = self._attempt(self._read, 0) if ro.rounds else None
            for k in range(ro.rounds):
                cur, nxt = nxt, None
                exchange = self._attempt(lambda c: _Exchange(self.group, device, c.send, c.sizes), cur)
                if self._any_failed():
                    stopped = True
                    break
                assert cur is not None and exchange is not None
                exchange.start()
                following = _outgoing(ro.round_bytes(k + 1)) if k + 1 < ro.rounds else 0
                ahead = k + 1 < ro.rounds and cur.sizes.total + following <= STAGING_BYTES
                pending = self._attempt(_submit, pool, self._attempt, self._read, k + 1) if ahead else None
                try:
                    recv = exchange.finish()
                finally:
                    if pending is not None:
                        nxt = pending.result()
                self._attempt(self._fill, k, cur, recv)
                held = max(held, cur.sizes.total + (following if ahead else 0))
                if k + 1 < ro.rounds and not ahead:
                    nxt = self._attempt(self._read, k + 1)
        if not stopped:
            if self.failure is None and self.copied != ro.total:
                self.failure = OlmoChunksError(
                    f"internal error: a cooperative load copied {self.copied} of {ro.total} bytes")
            stopped = self._any_failed()
        if stopped:
            self.group.agree(self._raise_failure)
        rates.learn_storage(self.source, self.read_bytes, self.read_s, self.faulted)
        return ro.rounds, held

    def _attempt(self, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`, unless an earlier step failed; a failure is kept for the end of the load
        (the ranks must stay in lockstep until they stop together)."""
        if self.failure is not None:
            return None
        try:
            return fn(*args)
        except BaseException as exc:  # also KeyboardInterrupt: the others learn of it at the next step
            self.failure = exc
            return None

    def _any_failed(self) -> bool:
        """Whether this rank or another has failed (collective: a MAX all-reduce of one flag)."""
        if self.group.size == 1:
            return self.failure is not None
        flag = torch.tensor([int(self.failure is not None)], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group.pg, async_op=True)
        self.group.wait_work(work, "a read-once round", cuda=flag.is_cuda)
        return bool(flag.item())

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _read(self, k: int) -> _Round:
        """Round `k`'s blocks read (with the stages it starts): this rank's own bytes of them
        straight into place, what peers need packed. On the helper thread when read ahead: no
        other step touches the buffers until it is done."""
        for i in self.first.get(k, []):
            if i in self.fill_of:
                f = self.fill_of[i]
                self.stages[i] = torch.empty(tuple(f.dest.shape), dtype=f.saved_dtype, pin_memory=self.pin)
                self.buffers[i] = (self.stages[i].data_ptr(), self.lens[i])
        sizes = self.ro.round_bytes(k)
        send = torch.empty(sum(sizes.sends.values()), dtype=torch.uint8, pin_memory=self.pin)
        resident = rates.resident_bytes()
        seconds, copied = self.ro.read(k, _addr(send), self.buffers, self.verify, self.workers)
        # The send buffer is fresh by design (the model's copy rate has its page faults).
        self.faulted += max(0, rates.resident_bytes() - resident - send.numel())
        self.read_s += seconds
        self.read_bytes += sizes.read
        self.copied += copied
        return _Round(sizes, send)

    def _fill(self, k: int, cur: _Round, recv: torch.Tensor) -> None:
        """Round `k`'s copies into place from what it received; the stages it ends are copied into
        their destinations (or checked against the tensor they are tied to)."""
        self.copied += self.ro.fill(k, _addr(recv), self.buffers, self.workers)
        done = [i for i in self.last.get(k, []) if i in self.stages]
        into = [i for i in done if id(self.fill_of[i]) not in self.tied_to]
        _copy_into_place([self.fill_of[i] for i in into], [self.stages[i] for i in into])
        checks = [i for i in done if id(self.fill_of[i]) in self.tied_to]
        _check_tied([self.fill_of[i] for i in checks], [self.stages[i] for i in checks], self.tied_to)
        for i in done:
            del self.stages[i]
            self.buffers[i] = (0, 0)


@dataclass
class _Round:
    """One round's bytes on this rank: its sizes, and what it sends (packed for its peers)."""

    sizes: _core.RoundBytes
    send: torch.Tensor


def _outgoing(sizes: _core.RoundBytes) -> int:
    """Bytes a round holds before its exchange: what it sends."""
    return sum(sizes.sends.values())


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

    def start(self) -> None:
        """Starts the all-to-all (asynchronous)."""
        self.work = None
        if self.group.size > 1:
            self.work = dist.all_to_all_single(self.recv, self.send, self.outs, self.ins, group=self.group.pg,
                                               async_op=True)

    def finish(self) -> torch.Tensor:
        """Waits for the all-to-all; the received bytes, in CPU memory."""
        if self.work is not None:
            self.group.wait_work(self.work, "a read-once exchange", cuda=self.recv.is_cuda)
        if self.host is None:
            return self.recv
        self.host.copy_(self.recv)
        return self.host


def _submit(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """`pool.submit(fn, *args)`; where its thread cannot be started, `errors.no_thread`'s error."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError as exc:
        raise no_thread(exc) from exc
