"""Filling destination tensors from a checkpoint: the one load path both front doors use.

The core plans and reads (each needed block once, in parallel, checksums verified) straight into
CPU destinations that can take the saved bytes as they are. Everything else (accelerator tensors,
another dtype, elements sharing memory) goes through CPU staging buffers, at most `STAGING_BYTES`
at a time whatever the destinations' dtype or device (pinned for CUDA), and is copied into place by
torch. A destination that is the same memory as another key's (tied weights) is filled once and
checked: the checkpoint must hold the same bytes for both keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import _core
from .errors import MismatchError
from .shards import is_dense

__all__ = ["STAGING_BYTES", "Fill", "fill"]

# Host memory used at a time to stage destinations the core cannot fill in place.
STAGING_BYTES = int(os.environ.get("OLMO_CHUNKS_STAGING_BYTES", 1 << 30))

Pieces = list[tuple[list[int], list[int], int, list[int]]]


@dataclass
class Fill:
    """One destination: `dest` receives the elements of manifest tensor `tensor` that `pieces(buf)`
    names, as core target pieces `(offsets, sizes, local_start, strides)` over a buffer `buf` shaped
    like `dest` (element offsets from `buf`'s first element, `buf`'s strides)."""

    key: str
    tensor: int
    dest: torch.Tensor
    pieces: Callable[[torch.Tensor], Pieces]
    saved_dtype: torch.dtype


def fill(manifest: _core.Manifest, fills: Sequence[Fill], *, verify: bool, workers: int | None) -> None:
    """Fills every `Fill.dest` from `manifest` (see the module docstring)."""
    direct, staged, tied = _classify(fills)
    if direct:
        _load_direct(manifest, direct, verify, workers)
    for batch in _batches(staged):
        _copy_into_place(batch, _load_staged(manifest, batch, verify, workers))
    first = {id(f): key for f, key in tied}
    for batch in _batches([f for f, _ in tied]):
        _check_tied(batch, _load_staged(manifest, batch, verify, workers), first)


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


def _load_direct(manifest: _core.Manifest, fills: list[Fill], verify: bool, workers: int | None) -> None:
    """One core call: each storage is one buffer, each destination addressed inside it."""
    targets: list[tuple[int, Pieces, int]] = []
    buffers: list[tuple[int, int]] = []
    index: dict[int, int] = {}
    for f in fills:
        storage = f.dest.untyped_storage()
        sptr = storage.data_ptr()
        if sptr not in index:
            index[sptr] = len(buffers)
            buffers.append((sptr, storage.nbytes()))
        shift = (f.dest.data_ptr() - sptr) // f.dest.element_size()
        pieces = [(o, s, start + shift, st) for o, s, start, st in f.pieces(f.dest)]
        if pieces:
            targets.append((f.tensor, pieces, index[sptr]))
    manifest.load(targets, buffers, verify=verify, workers=workers)


def _load_staged(manifest: _core.Manifest, fills: list[Fill], verify: bool, workers: int | None) -> list[torch.Tensor]:
    """Reads `fills` into fresh CPU buffers of the saved dtype (pinned for CUDA destinations)."""
    stages = [torch.empty(tuple(f.dest.shape), dtype=f.saved_dtype, pin_memory=f.dest.is_cuda) for f in fills]
    targets = [(f.tensor, f.pieces(stage), i) for i, (f, stage) in enumerate(zip(fills, stages, strict=True))]
    buffers = [(s.data_ptr(), s.numel() * s.element_size()) for s in stages]
    manifest.load([t for t in targets if t[1]], buffers, verify=verify, workers=workers)
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
