"""Native save/load behaviour on one process: staging batches, odd destination layouts."""

from __future__ import annotations

from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import fill

from tests import world


def test_staged_loads_in_bounded_batches_are_bit_exact(tmp_path: Path, monkeypatch):
    sd = {f"t{i}": torch.randn(40, 30) for i in range(7)}
    olmo_chunks.save(sd, tmp_path / "c")
    calls = []
    real_load = olmo_chunks._core.Manifest.load

    def counting_load(self, targets, buffers, **kwargs):
        calls.append(sum(n for _, n in buffers))
        return real_load(self, targets, buffers, **kwargs)

    # Stage every tensor (as CUDA ones are) through batches of at most 3 tensors' bytes.
    monkeypatch.setattr(fill, "_direct", lambda dest, saved_dtype: False)
    monkeypatch.setattr(fill, "STAGING_BYTES", 3 * 40 * 30 * 4)
    monkeypatch.setattr(olmo_chunks._core.Manifest, "load", counting_load)
    out = {k: torch.zeros(40, 30) for k in sd}
    olmo_chunks.load(out, tmp_path / "c")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert calls == [3 * 4800, 3 * 4800, 4800]


def test_strided_and_transposed_destinations_are_filled_in_place(tmp_path: Path):
    w = torch.arange(24 * 18, dtype=torch.float32).reshape(24, 18)
    olmo_chunks.save({"w": w, "v": w[:, 0].clone()}, tmp_path / "c")
    backing = torch.zeros(18, 24)
    column_storage = torch.zeros(24, 5)
    out = {"w": backing.t(), "v": column_storage[:, 2]}  # transposed view, strided column
    olmo_chunks.load(out, tmp_path / "c")
    assert torch.equal(backing.t(), w) and torch.equal(column_storage[:, 2], w[:, 0])
    assert column_storage[:, [0, 1, 3, 4]].abs().sum() == 0


def test_read_once_loads_its_planned_copies_directly_and_checks_the_buffers(tmp_path: Path):
    # The direct fallback of a cooperative load reuses the copies `ReadOnce` planned: the first
    # buffers are filled, later ones (staged destinations) are left alone; buffers of other lengths
    # than planned are refused before anything is written.
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    olmo_chunks.save({"w": w}, tmp_path / "c")
    m = olmo_chunks._core.Manifest.open(str(tmp_path / "c"))
    col = torch.zeros(8, 2)  # columns 2:4, row-major: one copy per row
    top = torch.zeros(3, 6)  # rows 0:3
    targets = [olmo_chunks._core.Target(0, [olmo_chunks._core.Piece([0, 2], [8, 2], 0, [2, 1])], 0),
               olmo_chunks._core.Target(0, [olmo_chunks._core.Piece([0, 0], [3, 6], 0, [6, 1])], 1)]
    lens = [col.numel() * 4, top.numel() * 4]
    ro = olmo_chunks._core.ReadOnce(m, targets, lens)
    short = torch.zeros(8, 1)
    planned = r"buffers of \[32\] bytes given for buffers planned as \[64, 72\]"
    with pytest.raises(olmo_chunks.InvalidArgumentError, match=planned):
        ro.load([(short.data_ptr(), 32)])
    assert short.abs().sum() == 0
    ro.load([(col.data_ptr(), lens[0])])
    assert torch.equal(col, w[:, 2:4]) and top.abs().sum() == 0
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="loaded already"):
        ro.load([(col.data_ptr(), lens[0])])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("door", ["save", "async_save", "dcp"])
def test_lazily_conjugated_and_negated_views_keep_their_values(tmp_path: Path, door: str):
    """A conjugate or negative view's memory holds other values than the view has (torch resolves
    the bit lazily): their values are saved, and loaded into such views they read as saved."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter

    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    big = torch.randn(64, 64, dtype=torch.complex64)
    sd = {"c": x.conj(), "imag": x.conj().imag, "big": big.conj()}  # `.imag` of a conj view is a neg view
    assert sd["c"].is_conj() and sd["imag"].is_neg()
    path = tmp_path / "c"
    if door == "save":
        olmo_chunks.save(sd, path)
    elif door == "async_save":  # "big" is larger than the pool: written from itself
        olmo_chunks.async_save(sd, path, pool_bytes=1024).result()
    else:
        dcp.save(sd, storage_writer=ChunkStoreWriter(path), **world.NO_DIST)
    backing = {"c": torch.zeros(3, dtype=torch.complex64), "imag": torch.zeros(3),
               "big": torch.zeros(64, 64, dtype=torch.complex64)}
    out = {"c": backing["c"].conj(), "imag": backing["imag"]._neg_view(),
           "big": torch.zeros(64, 64, dtype=torch.complex64)}
    if door == "dcp":
        dcp.load(out, storage_reader=ChunkStoreReader(path), **world.NO_DIST)
    else:
        olmo_chunks.load(out, path)
    assert torch.equal(out["c"], x.conj()) and torch.equal(backing["c"], x)  # the view reads as saved
    assert torch.equal(out["imag"], -x.imag) and torch.equal(backing["imag"], x.imag)
    assert torch.equal(out["big"], big.conj())
