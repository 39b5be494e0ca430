"""`save` and `load`: the native front door."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import reprlib
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _core, values
from ._dist import DEFAULT_PEER_TIMEOUT, INLINE_BYTES, Group
from .errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    MismatchError,
    MissingDataFileError,
    OlmoChunksError,
    RankFailedError,
    StorageError,
    check_bool,
    check_int,
    named_error,
)
from .fill import STAGING_BYTES, Fill, FillStep, ReadOutcome, check_read_mode, check_workers
from .layout import LEFT_TO_RIGHT, ORDERED, Reading, agreed_reading, local_readings
from .location import checkpoint_location
from .roles import check_roles, resolve_role
from .session import SaveSession, staging_bytes, zstd_level
from .shards import ChunkItem, TensorShard, describe, dtype_name, is_dense, region_numel, torch_dtype
from .tree import TRAINER_PREFIX, TRAINER_RNG_PREFIX, Leaf, flatten

__all__ = ["LoadReport", "load", "open_manifest", "save"]

log = logging.getLogger(__name__)



def open_manifest(group: Group, path: str | os.PathLike[str], args: Callable[[], Mapping[str, Any]] | None = None,
                  said: Callable[[], dict[str, tuple[bool, bool]]] | None = None
                  ) -> tuple[_core.Manifest, dict[str, Reading]]:
    """The manifest committed at `path` (collective): rank 0 alone reads it from storage and
    hands its bytes to the others, so metadata reads do not grow with ranks: in the step's own
    outcome where every peer fetching it from the store moves at most `INLINE_BYTES` out of rank 0
    (a small group, a small manifest), else by a broadcast on the group's collectives after it.
    An error opening it is raised on every rank, as the same error. `args()` (checks and returns
    the call's arguments that must agree across ranks) runs in the first step and the arguments
    are compared, the path included: a bad or differing one is an error on every rank, never a
    rank missing from the step. `said()` (`_readings`) rides in the same step: the readings the
    ranks agree (`_agree`) come back with the manifest."""
    where = checkpoint_location(path)
    if group.size == 1:
        if args is not None:
            args()
        return _core.Manifest.open(where), _agree([said() if said is not None else {}])
    raw: list[bytes] = []

    def mine() -> tuple[dict[str, Any], dict[str, tuple[bool, bool]]]:
        return {"path": where, **(args() if args is not None else {})}, said() if said is not None else {}

    def read(gathered: list[tuple[dict[str, Any], dict[str, tuple[bool, bool]]]]
             ) -> tuple[str, Any, str | bytes, dict[str, Reading]]:
        group.check_same([a for a, _ in gathered], f"loading {where}")
        made_by = _agree([r for _, r in gathered])
        try:
            raw.append(_core.Manifest.read_bytes(where))
        except OlmoChunksError as exc:
            return ("error", type(exc).__name__, str(exc), {})
        inline = len(raw[0]) * (group.size - 1) <= INLINE_BYTES
        return ("ok", len(raw[0]), raw[0] if inline else b"", made_by)

    _, (status, got, message, made_by) = group.exchange(mine, read)
    if status == "error":
        raise named_error(got, message)
    data = message if len(message) == got else group.broadcast_bytes(raw[0] if raw else None, got)
    return _core.Manifest.from_bytes(where, bytes(data)), made_by


@dataclass
class LoadReport:
    """What `load` did: keys loaded, and (with `strict=False`) what it skipped and why."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    # How the bytes came: "once" (each block read by one rank, handed to the others) or "direct";
    # with "once", the rounds and the most bytes this rank staged (sent and received) at once; with
    # read="auto", the predicted seconds of both and the rates they came from.
    reading: ReadOutcome = field(default_factory=ReadOutcome)

    @property
    def read(self) -> str:
        return self.reading.read

    @property
    def rounds(self) -> int:
        return self.reading.rounds

    @property
    def round_peak_bytes(self) -> int:
        return self.reading.peak_bytes

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def _describe_all(leaves: dict[str, Leaf], roles: Mapping[str, str] | None,
                  made_by: Mapping[str, Reading] | None = None) -> dict[str, TensorShard]:
    return {key: _describe(key, leaf, roles, (made_by or {}).get(key))
            for key, leaf in leaves.items() if leaf.is_tensor}


def _describe(key: str, leaf: Leaf, roles: Mapping[str, str] | None, made_by: Reading | None) -> TensorShard:
    shard = describe(key, leaf.value, made_by)
    if shard.role is None:
        shard.role = resolve_role(key, shard.local, roles)
    return shard


def _readings(leaves: dict[str, Leaf]) -> dict[str, tuple[bool, bool]]:
    """What this rank's shards say of the DTensors whose `_StridedShard` spec reads two ways at its
    coordinate (`layout.local_readings`): usually nothing."""
    said = {}
    for key, leaf in leaves.items():
        if isinstance(leaf.value, DTensor):
            try:
                fits = local_readings(leaf.value)
            except ValueError as exc:  # a spec that reads neither way
                raise InvalidArgumentError(f"{key!r}: {exc}") from None
            if fits is not None:
                said[key] = fits
    return said


def _agree(said: list[dict[str, tuple[bool, bool]]]) -> dict[str, Reading]:
    """Rank 0: the reading of each DTensor that reads two ways, from what the ranks said of their
    shards (`_readings`; `layout.agreed_reading`): where a rank's own shape fits both readings, the
    others' tell which made it."""
    by_key: dict[str, list[tuple[bool, bool]]] = {}
    for mine in said:
        for key, fits in mine.items():
            by_key.setdefault(key, []).append(fits)
    return {key: agreed_reading(repr(key), fits) for key, fits in by_key.items()}


def _plan(gathered: list[tuple[dict[str, Any], dict[str, Any], dict[str, tuple[bool, bool]]]]
          ) -> tuple[list[list[int]], dict[str, Any], dict[str, Any]]:
    """Rank 0: check that ranks agree on every tensor, merge plain entries, and give every distinct
    chunk one writer, balancing bytes across the ranks that hold it (replicas are written once).
    A rank whose shard of a tensor reads two ways (`_readings`) sent the regions of both, in its
    local chunk order: the agreed one's are written. Returns, per rank, the indices of its local
    chunks it writes."""
    made_by = _agree([said for *_, said in gathered])
    problems: list[str] = []
    schema: dict[str, tuple[Any, ...]] = {}
    entries: dict[str, Any] = {}
    ids: dict[tuple[str, tuple[Any, ...]], int] = {}  # a chunk's replicas share its id
    held: list[list[tuple[int, int]]] = []  # per rank, (id, bytes) of the chunks it may write
    where: list[list[int]] = []  # per rank, the local index of each of those
    for rank, (tensors, plain, _) in enumerate(gathered):
        held.append([])
        where.append([])
        local = 0
        for key, (dtype, shape, role, *readings) in tensors.items():
            seen = schema.setdefault(key, (dtype, shape, role))
            if seen != (dtype, shape, role):
                problems.append(f"{key}: rank {rank} has {(dtype, shape, role)}, another rank {seen}")
            item = torch_dtype(dtype).itemsize
            taken = int(made_by[key] == ORDERED) if len(readings) > 1 else 0
            for i, regions in enumerate(readings):
                if i != taken:
                    local += len(regions)
                    continue
                for region in regions:
                    chunk = ids.setdefault((key, region), len(ids))
                    held[rank].append((chunk, item * region_numel(region)))
                    where[rank].append(local)
                    local += 1
        for key, v in plain.items():
            entries.setdefault(key, v)
    for key in entries.keys() & schema.keys():
        problems.append(f"{key}: a tensor on some ranks and a plain value on others")
    if problems:
        raise MismatchError(problems, header="ranks disagree on the state dict to save")
    return [[at[i] for i in mine] for at, mine in zip(where, _core.assign_writers(held), strict=True)], schema, entries


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    roles: Mapping[str, str] | None = None,
    info: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    block_size: int = _core.DEFAULT_BLOCK_SIZE,
    workers: int | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    compression: str | None = None,
    compression_level: int | None = None,
) -> None:
    """Saves `state_dict` to checkpoint `path` (a directory, or an `s3://bucket/prefix` or
    `gs://bucket/prefix` URL), collectively over `process_group`.

    Tensors may be plain (the whole tensor, the same wherever it appears), DTensors of any
    placement, or `ChunkSource`s; each rank writes its own chunks in parallel from native code and
    every replicated chunk is written once. Other values are stored as data. `roles` overrides the
    inferred role per key or dotted key prefix.

    The checkpoint becomes visible when its manifest is committed, last; until then `path` keeps
    the checkpoint it had, whatever happens to this save. A checkpoint already at `path` is
    replaced only with `overwrite=True`; files olmo-chunks did not write may sit beside it (never
    touched), but a `data/` it did not write is refused; a save
    racing another one to the same path fails with `CheckpointLockedError`. A failure on any rank,
    or a rank silent for `peer_timeout` seconds, raises on every rank.

    `compression="zstd"` compresses each checksum block of every chunk on its own with zstd at
    `compression_level` (default 3), byte-shuffled first where that helps; blocks that do not shrink
    stay raw (`docs/FORMAT.md`, "Compressed chunks"). A rank holds the compressed bytes of each
    data file in memory (at most its raw size) until they are written.

    An `async_save` of this process on the same process group still in flight is waited for first.
    """
    background = sys.modules.get(f"{__package__}.background")  # none in flight if it was never imported
    if background is not None:
        background.settle(process_group)
    t0 = time.perf_counter()
    with Group(process_group, peer_timeout, "save") as group, SaveSteps(
            group, path, roles=roles, info=info, overwrite=overwrite, block_size=block_size, workers=workers,
            compression=(compression, compression_level)) as steps:
        chunks = steps.plan(state_dict)
        steps.commit(lambda: steps.session.write(chunks))
    steps.log(t0)


class SaveSteps:
    """One collective save in its steps, shared by `save` and `async_save`: `plan` (every rank
    describes its state, rank 0 checks and plans it and takes the path's lease, unless told to
    leave that to `lease`) and `commit` (every rank writes its share through `session`, rank 0
    commits). Leaving the `with` block without a commit abandons the save, leaving the path as it
    was."""

    def __init__(self, group: Group, path: str | os.PathLike[str], *, roles: Mapping[str, str] | None,
                 info: Mapping[str, Any] | None, overwrite: bool, block_size: int, workers: int | None,
                 compression: tuple[str | None, int | None] = (None, None)) -> None:
        self.group = group
        self.session = SaveSession(checkpoint_location(path), rank=group.rank, block_size=block_size, workers=workers)
        self.roles, self.info, self.overwrite = roles, info, overwrite
        # Checked in the first step (`plan`), where a bad value fails every rank.
        self.compression = compression
        self.checks: list[Callable[[], object]] = []  # more such checks (`async_save`'s)
        self.nbytes = 0
        self._plan: dict[str, Any] = {}

    @property
    def target(self) -> str:
        return self.session.target

    def plan(self, state_dict: Mapping[str, Any], *,
             defer_lease_within: int | None = None) -> list[ChunkItem]:
        """The chunks `(key, region, data)` this rank writes (replicated ones are written once).
        With `defer_lease_within`, the lease is left to `lease()` if every rank's tensors fit in that
        many staging bytes (nothing is written before `commit` then)."""
        local: dict[str, Any] = {}

        def describe_local() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool, dict[str, Any]]:
            self._check_args()
            self.session.zstd = zstd_level(*self.compression)
            leaves = flatten(state_dict)
            said = _readings(leaves)
            tensors: dict[str, tuple[Any, ...]] = {}
            chunks: list[ChunkItem] = []
            for key, leaf in leaves.items():
                if not leaf.is_tensor:
                    continue
                # A shard that fits both readings here describes both; rank 0 takes the agreed one's.
                shards = [_describe(key, leaf, self.roles, reading)
                          for reading in ((LEFT_TO_RIGHT, ORDERED) if said.get(key) == (True, True) else (None,))]
                readings = []
                for s in shards:
                    regions = list(s.regions())
                    readings.append([r for r, _ in regions])
                    chunks.extend((key, r, d) for r, d in regions)
                tensors[key] = (dtype_name(s.dtype), list(s.shape), s.role, *readings)
            local["chunks"] = chunks
            plain = {k: values.encode(leaf.value, k) for k, leaf in leaves.items() if not leaf.is_tensor}
            fits = defer_lease_within is not None and staging_bytes(chunks) <= defer_lease_within
            return tensors, plain, said, fits, self.args()

        def begin(gathered: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool, dict[str, Any]]]
                  ) -> list[tuple[str, list[int]]]:
            self.group.check_same([args for *_, args in gathered], f"saving to {self.target}")
            assign, self._plan["schema"], self._plan["entries"] = _plan([(t, p, r) for t, p, r, *_ in gathered])
            save_id = "" if all(fits for *_, fits, _ in gathered) else self._take_lease()
            return [(save_id, mine) for mine in assign]

        _, (self.session.save_id, mine) = self.group.exchange(describe_local, begin, scatter=True)
        return [local["chunks"][i] for i in mine]

    def _check_args(self) -> None:
        check_bool("overwrite", self.overwrite)
        check_roles(self.roles)
        if self.info is not None and not isinstance(self.info, Mapping):
            raise InvalidArgumentError(f"info must be a mapping, got {type(self.info).__name__}")
        check_int("block_size", self.session.block_size, 1, 2**64 - 1)  # the core caps it
        check_workers(self.session.workers)
        for check in self.checks:
            check()

    def args(self) -> dict[str, Any]:
        """The arguments every rank must pass alike."""
        s = self.session
        return {"path": s.target, "overwrite": self.overwrite, "block_size": s.block_size, "compression": s.zstd}

    def lease(self) -> None:
        """Takes the path's lease if `plan` left it (collective)."""
        if not self.session.save_id:
            _, self.session.save_id = self.group.exchange(None, lambda _: self._take_lease())

    def _take_lease(self) -> str:
        return self.session.begin(self.overwrite, self.group.peer_timeout)

    def commit(self, write: Callable[[], list[_core.WrittenChunk]]) -> None:
        """Runs `write` (this rank's share) on every rank; rank 0 then commits the manifest."""

        after: list[BaseException] = []

        def commit(all_written: list[list[_core.WrittenChunk]]) -> None:
            self.nbytes = sum(c.nbytes for written in all_written for c in written)
            info = {"writer": "olmo_chunks", "world_size": self.group.size, **(self.info or {})}
            try:
                self.session.commit(self._plan["schema"], itertools.chain(*all_written), self._plan["entries"], info,
                                    ready=self.group.check_awake)
            except BaseException as exc:
                if not self.session.committed:
                    raise
                # Committed, then interrupted (a KeyboardInterrupt as the commit returned): the
                # others are told the save committed, which it did; this rank raises it after.
                after.append(exc)

        def mine() -> list[_core.WrittenChunk]:
            try:
                return write()
            except (StorageError, CorruptCheckpointError):
                # A save that took this one's lease over removes its data (aborts its uploads):
                # this write failed for that reason, which the lease tells.
                with contextlib.suppress(StorageError):
                    self.session.check_lease()
                raise

        try:
            self.group.exchange(mine, commit, hear_out=True)
            if after:
                raise after[0]
        except RankFailedError as exc:
            if not (exc.dead and exc.rank == 0 and self.session.save_id and self._committed()):
                raise
            # Rank 0 (the store's host) died after committing, before this rank read the outcome:
            # the checkpoint at the path tells it.
            log.warning("olmo-chunks: rank 0 died after committing save %s to %s", self.session.save_id, self.target)

    def _committed(self) -> bool:
        """True if the checkpoint at the path is this save's."""
        try:
            return _core.Manifest.open(self.target).save_id == self.session.save_id
        except OlmoChunksError:
            return False

    def log(self, t0: float) -> None:
        if self.group.rank == 0:
            size = self.group.size
            _log_summary("saved", self.nbytes, "to", self.target, t0, f"{size} rank{'s' * (size > 1)}")

    def __enter__(self) -> SaveSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.abort()  # a no-op after the commit, and off the coordinator


def load(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    partial: bool = False,
    roles: Mapping[str, str] | None = None,
    verify: bool = True,
    workers: int | None = None,
    peer_timeout: float = DEFAULT_PEER_TIMEOUT,
    read: str = "auto",
) -> LoadReport:
    """Fills `state_dict` in place from checkpoint `path`, whatever layout either side has.

    Every tensor (plain, DTensor or `ChunkSource`) receives exactly the elements of the global
    tensor it holds, read in parallel and checked against block checksums (`verify`). With
    `read="once"` each saved block the job needs is read from storage by one rank and handed to
    the other ranks that need it through the group's collectives (in rounds of at most
    `OLMO_CHUNKS_STAGING_BYTES` per rank); `read="direct"` has every rank read what it needs
    itself; `read="auto"` (the default) predicts both from measured storage and exchange rates
    (`olmo_chunks.rates`) and takes the faster (`LoadReport.reading` says which and why). The
    manifest is read by rank 0 alone and handed to the others (`open_manifest`). Plain values are
    replaced. A model conversion (missing or extra keys, a shape, dtype or role mismatch) raises
    one `MismatchError` listing every mismatch; with `strict=False` what matches is loaded and the
    rest reported in the returned `LoadReport`. Saved trainer state (`trainer.*`, restored by `load_trainer_state`) is
    checked only when `state_dict` holds trainer state too.

    `partial=True` lets `state_dict` hold a subset of the checkpoint (a pipeline stage's layers,
    the trainer state alone): checkpoint keys it lacks are not unexpected, while every key it has
    is still checked as above. A failure on any rank, or a rank silent for `peer_timeout`
    seconds, raises on every rank; no rank returns before every rank has read all it needed.
    """
    t0 = time.perf_counter()
    with Group(process_group, peer_timeout, "load") as group:
        return _load(group, state_dict, path, strict=strict, partial=partial, roles=roles, verify=verify,
                     workers=workers, read=read, t0=t0)


_Checked = tuple[LoadReport, list[Fill], dict[str, Leaf], dict[str, Any]]


def _check_load(manifest: _core.Manifest, leaves: dict[str, Leaf], path: str | os.PathLike[str], *,
                strict: bool, partial: bool, roles: Mapping[str, str] | None,
                made_by: Mapping[str, Reading]) -> _Checked:
    """One rank's side of what a load fills: its report (what is missing, unexpected or
    mismatched; `MismatchError` if `strict`), its fills, leaves and the checkpoint's plain
    values."""
    shards = _describe_all(leaves, check_roles(roles), made_by)
    saved = {t.key: (i, t) for i, t in enumerate(manifest.tensors)}
    entries = values.entries(manifest)
    report = LoadReport()
    for key, leaf in leaves.items():
        if leaf.is_tensor:
            if key not in saved:
                where = "a plain value" if key in entries else "missing"
                report.missing.append(key) if where == "missing" else report.mismatched.append(
                    f"{key}: a tensor here, {where} in the checkpoint")
                continue
            s = shards[key]
            info = saved[key][1]
            dtype, shape, role = info.dtype, info.shape, info.role
            want = (dtype_name(s.dtype), list(s.shape), s.role)
            if want != (dtype, list(shape), role):
                report.mismatched.append(
                    f"{key}: checkpoint has dtype={dtype} shape={tuple(shape)} role={role}, "
                    f"state dict has dtype={want[0]} shape={tuple(want[1])} role={want[2]}")
        elif key not in entries:
            report.missing.append(key) if key not in saved else report.mismatched.append(
                f"{key}: a plain value here, a tensor in the checkpoint")
        elif isinstance(leaf.container, tuple):  # cannot be replaced: loaded only if it is the saved one
            if _encoded(leaf.value, key) == entries[key]:
                report.loaded.append(key)
            else:
                report.mismatched.append(
                    f"{key}: a value inside a tuple, which cannot be replaced in place; the checkpoint holds "
                    f"{reprlib.repr(values.decode(entries[key], key))}, the state dict {reprlib.repr(leaf.value)}")
    if not partial:
        # Trainer entries are `load_trainer_state`'s: unexpected only when the state dict holds
        # trainer state itself, and never another rank's RNG states.
        trainer = any(k.startswith(f"{TRAINER_PREFIX}.") for k in leaves)
        report.unexpected = sorted(
            k for k in (saved.keys() | entries.keys()) if k not in leaves and not k.startswith(TRAINER_RNG_PREFIX)
            and (trainer or not k.startswith(f"{TRAINER_PREFIX}."))
        )
    if strict and not report.ok:
        raise MismatchError(
            [f"{k}: missing from the checkpoint" for k in report.missing]
            + [f"{k}: in the checkpoint but not in the state dict" for k in report.unexpected]
            + report.mismatched,
            header=f"{path}: checkpoint does not match the state dict (a model conversion, not a reshard)",
        )
    bad = set(report.missing) | {m.split(":", 1)[0] for m in report.mismatched}
    wanted = [(key, s) for key, s in shards.items() if key not in bad]
    for key, s in wanted:
        if s.local.numel() and not is_dense(s.local):
            raise InvalidArgumentError(f"{key}: the destination's elements share memory (an expanded or "
                                       "self-overlapping view); load into a tensor with memory of its own")
    report.loaded.extend(key for key, _ in wanted)
    fills = [Fill(key, saved[key][0], s.local, s.core_pieces, s.dtype) for key, s in wanted]
    return report, fills, leaves, entries


def _replaced(exc: MissingDataFileError, manifest: _core.Manifest, path: str | os.PathLike[str]
              ) -> MissingDataFileError:
    """`exc`, saying so where the checkpoint at `path` was replaced since `manifest` was read (an
    overwriting save committed during the load and removed the files it read)."""
    try:
        now = _core.Manifest.open(checkpoint_location(path)).save_id
    except OlmoChunksError:
        return exc
    if now == manifest.save_id:
        return exc
    return MissingDataFileError(f"{exc} (the checkpoint was replaced during this load: save {manifest.save_id} "
                                f"is now {now}; load it again)")


def _encoded(value: Any, key: str) -> Any:
    """`value` as the checkpoint stores it (None if it cannot be stored)."""
    try:
        return values.encode(value, key)
    except OlmoChunksError:
        return None


def _load(group: Group, state_dict: Mapping[str, Any], path: str | os.PathLike[str], *, strict: bool, partial: bool,
          roles: Mapping[str, str] | None, verify: bool, workers: int | None, read: str, t0: float) -> LoadReport:
    leaves: dict[str, Leaf] = {}

    def readings() -> dict[str, tuple[bool, bool]]:
        leaves.update(flatten(state_dict))
        for key, leaf in leaves.items():  # before any tensor is filled (a tuple's values stay as they are)
            kind = type(leaf.container)
            if not (leaf.is_tensor or issubclass(kind, tuple) or hasattr(kind, "__setitem__")):
                raise InvalidArgumentError(
                    f"{key!r}: a plain value in a {type(leaf.container).__name__}, which cannot be assigned to, so "
                    "its saved value could not be loaded; pass a dict")
        return _readings(leaves)

    def args() -> dict[str, Any]:
        check_bool("strict", strict)
        check_bool("partial", partial)
        # `verify` too: read once, a rank that does not verify would hand unchecked bytes to one that does.
        return {"read": check_read_mode(read), "staging_bytes": STAGING_BYTES, "verify": check_bool("verify", verify)}

    manifest, made_by = open_manifest(group, path, args, readings)

    # One step agrees on what to load and decides how to read it (`FillStep`).
    checked: list[_Checked] = []
    steps: list[FillStep] = []

    def check_and_describe() -> Any:
        checked.append(_check_load(manifest, leaves, path, strict=strict, partial=partial, roles=roles,
                                   made_by=made_by))
        steps.append(FillStep(manifest, checked[0][1], verify=verify, workers=workers, group=group, read=read,
                              source=checkpoint_location(path)))
        return steps[0].local()

    if FillStep.collective(group, read):
        decided = group.exchange(check_and_describe, lambda got: steps[0].root(got), scatter=True)[1]
    else:
        decided = group.agree(check_and_describe)
    report, fills, leaves, entries = checked[0]
    try:
        report.reading = steps[0].run(decided)  # a failure here fails the others in the next step
    except MissingDataFileError as exc:
        raise _replaced(exc, manifest, path) from exc
    nbytes = sum(f.dest.numel() * f.dest.element_size() for f in fills)

    def plain_values() -> None:
        for key, leaf in leaves.items():
            if not leaf.is_tensor and key in entries and not isinstance(leaf.container, tuple):
                leaf.container[leaf.slot] = values.decode(entries[key], key)
                report.loaded.append(key)

    # The last step: every rank returns only once every rank has read all it needed.
    steps[0].last(group, report.reading, plain_values)
    report.loaded.sort()
    if group.rank == 0:
        _log_summary("loaded", nbytes, "from", path, t0, f"rank 0 of {group.size}")
    return report


def _log_summary(verb: str, nbytes: int, prep: str, path: str | os.PathLike[str], t0: float, who: str) -> None:
    """The one INFO line of a save or load that began at `t0`: bytes, seconds and GB/s."""
    dt = time.perf_counter() - t0
    log.info("%s %.2f GB (%d bytes) %s %s in %.2f s (%.2f GB/s, %s)", verb, nbytes / 1e9, nbytes, prep, path, dt,
             nbytes / max(dt, 1e-9) / 1e9, who)
