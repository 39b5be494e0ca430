"""Hostile checkpoint directories: symlinked data files and directories, FIFOs and sockets in place
of data files, absurd dimension counts and block sizes. Each is refused with a precise exception,
promptly, and nothing outside the checkpoint is read."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import _core
from olmo_chunks.cli import main as cli_main
from olmo_chunks.errors import (
    CorruptCheckpointError,
    CorruptManifestError,
    InvalidArgumentError,
    LayoutError,
    OlmoChunksError,
    UnsafePathError,
)

from tests.manifest_bytes import RawManifest, crc32c

MAX_NDIM = 64
MAX_BLOCK_SIZE = 64 << 20


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}, "step": 3}


def zeros() -> dict:
    return {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "step": None}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    olmo_chunks.save(state(), path, block_size=4096)
    return path


def data_file(path: Path) -> Path:
    (file,) = _core.Manifest.open(str(path)).files
    return path / file.path


def verify(path: Path) -> int:
    return _core.Manifest.open(str(path)).verify_data()


def refused_everywhere(path: Path, cls: type[Exception], match: str, capsys) -> None:
    """load, `verify_data` and `olmo-chunks verify` all refuse `path` with exactly `cls`."""
    with pytest.raises(cls, match=match) as info:
        olmo_chunks.load(zeros(), path)
    assert type(info.value) is cls
    with pytest.raises(cls, match=match) as info:
        verify(path)
    assert type(info.value) is cls
    capsys.readouterr()
    assert cli_main(["verify", str(path)]) == 1
    assert "error" in capsys.readouterr().err


def test_unsafe_path_error_is_a_corrupt_checkpoint_error():
    assert issubclass(UnsafePathError, CorruptCheckpointError)
    assert issubclass(UnsafePathError, OlmoChunksError)
    assert olmo_chunks.UnsafePathError is UnsafePathError


def test_symlinked_data_file_with_matching_checksums_is_refused(ckpt: Path, tmp_path: Path, capsys):
    f = data_file(ckpt)
    outside = tmp_path / "outside.bin"
    shutil.copyfile(f, outside)  # same bytes: every checksum matches
    f.unlink()
    f.symlink_to(outside)
    refused_everywhere(ckpt, UnsafePathError, "symbolic link", capsys)


def test_symlinked_data_directory_is_refused(ckpt: Path, tmp_path: Path, capsys):
    moved = tmp_path / "elsewhere"
    (ckpt / "data").rename(moved)
    (ckpt / "data").symlink_to(moved)
    refused_everywhere(ckpt, UnsafePathError, r'"data" is a symbolic link', capsys)


def test_checkpoint_path_itself_may_be_a_symlink(ckpt: Path, tmp_path: Path):
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    sd = zeros()
    olmo_chunks.load(sd, link)
    assert torch.equal(sd["model"]["w"], state()["model"]["w"])
    assert verify(link) > 0
    assert cli_main(["verify", str(link)]) == 0


def run_with_deadline(fn, seconds: float = 20.0):
    """Runs `fn` on a daemon thread; returns ("ok", value), ("raised", exc) or ("blocked", None)."""
    out: list = []

    def target():
        try:
            out.append(("ok", fn()))
        except BaseException as e:
            out.append(("raised", e))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else ("blocked", None)


def test_fifo_data_file_is_refused_within_seconds(ckpt: Path):
    f = data_file(ckpt)
    f.unlink()
    os.mkfifo(f)
    try:
        for what, fn in [
            ("verify", lambda: verify(ckpt)),
            ("load", lambda: olmo_chunks.load(zeros(), ckpt)),
            ("cli", lambda: cli_main(["verify", str(ckpt)])),
        ]:
            status, value = run_with_deadline(fn)
            assert status != "blocked", f"{what} blocked on a FIFO"
            if what == "cli":
                assert (status, value) == ("ok", 1)
            else:
                assert status == "raised" and type(value) is UnsafePathError, (what, value)
                assert "not a regular file (a FIFO)" in str(value)
    finally:
        # Release any reader a regression left blocked in open().
        with contextlib.suppress(OSError):
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))


def test_socket_and_directory_data_files_are_refused(ckpt: Path, capsys, monkeypatch):
    f = data_file(ckpt)
    f.unlink()
    monkeypatch.chdir(f.parent)  # socket paths are limited to 108 bytes; bind a relative one
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(f.name)
        refused_everywhere(ckpt, UnsafePathError, "socket", capsys)
    f.unlink()
    f.mkdir()
    refused_everywhere(ckpt, UnsafePathError, "directory", capsys)


def single_tensor_manifest(path: Path, shape: list[int], block_size: int = 4096) -> None:
    """A hand-built checkpoint: one float32 element, one flat chunk, `shape` (all ones) as given."""
    data = struct.pack("<f", 1.5)
    (path / "data" / "x").mkdir(parents=True)
    (path / "data" / "x" / "a.bin").write_bytes(data)
    meta = {
        "format": "olmo-chunks",
        "version": 1,
        "save_id": "x",
        "block_size": block_size,
        "checksum": "crc32c",
        "files": [{"path": "data/x/a.bin", "size": len(data)}],
        "tensors": [
            {"key": "deep", "dtype": "float32", "shape": shape, "role": "tensor", "order": "row-major", "chunks": 1}
        ],
        "entries": {},
        "info": {},
    }
    # kind 1 (flat), file 0, offset 0, nbytes 4, crc_index 0, start 0, len 1
    table = struct.pack("<B3xIQQQQQ", 1, 0, 0, len(data), 0, 0, 1)
    raw = RawManifest(1, meta, table, struct.pack("<I", crc32c(data)))
    (path / olmo_chunks.MANIFEST_NAME).write_bytes(raw.encode())


def cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    # A subprocess, so that a crash (the old stack overflow) fails the test instead of pytest.
    return subprocess.run([sys.executable, "-m", "olmo_chunks", *args], capture_output=True, text=True, timeout=120)


def test_hand_built_manifest_at_the_caps_verifies(tmp_path: Path):
    single_tensor_manifest(tmp_path, [1] * MAX_NDIM, block_size=MAX_BLOCK_SIZE)
    assert verify(tmp_path) == 4
    assert cli_main(["verify", str(tmp_path)]) == 0


@pytest.mark.parametrize("ndim", [MAX_NDIM + 1, 30_000])
def test_too_many_dimensions_are_refused_not_a_crash(tmp_path: Path, ndim: int):
    single_tensor_manifest(tmp_path, [1] * ndim)
    with pytest.raises(CorruptManifestError, match=f"{ndim} dimensions; at most {MAX_NDIM}"):
        _core.Manifest.open(str(tmp_path))
    out = cli_subprocess("verify", str(tmp_path))
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "corrupt manifest" in out.stderr and "dimensions" in out.stderr


def test_huge_block_size_in_a_manifest_is_refused(ckpt: Path):
    path = ckpt / olmo_chunks.MANIFEST_NAME
    raw = RawManifest.parse(path.read_bytes())
    raw.meta["block_size"] = 1 << 30
    path.write_bytes(raw.encode())
    with pytest.raises(CorruptManifestError, match="block size"):
        verify(ckpt)
    with pytest.raises(CorruptManifestError, match="block size"):
        olmo_chunks.load(zeros(), ckpt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_chunks_that_do_not_cover_their_tensor_are_refused_through_every_door(tmp_path: Path):
    """A tensor larger than its chunks (a gap), or with chunks overlapping as much as they leave
    out: refused, never a destination left partly as it was."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreReader, FastLoadPlanner

    def crafted(name: str, overlap: bool) -> Path:
        path = tmp_path / name
        olmo_chunks.save({"w": torch.arange(16.0).reshape(4, 4)}, path)
        manifest = path / olmo_chunks.MANIFEST_NAME
        raw = RawManifest.parse(manifest.read_bytes())
        raw.meta["tensors"][0]["shape"] = [8, 4]
        if overlap:  # its one chunk (rows 0-3) twice
            raw.meta["tensors"][0]["chunks"] = 2
            raw.table += raw.table
        manifest.write_bytes(raw.encode())
        return path

    gap, overlap = crafted("gap", False), crafted("overlap", True)
    with pytest.raises(CorruptManifestError, match='tensor "w": its chunks hold 16 of its 32 elements'):
        olmo_chunks.load({"w": torch.zeros(8, 4)}, gap)
    with pytest.raises(LayoutError, match=r'tensor "w": saved chunks 0 and 1 overlap \(a corrupt manifest\)'):
        olmo_chunks.load({"w": torch.zeros(8, 4)}, overlap)
    for path, why in ((gap, "its chunks hold 16 of its 32 elements"), (overlap, "LayoutError")):
        for planner in (None, FastLoadPlanner()):
            with pytest.raises(BaseException, match=why):  # as DCP wraps it
                dcp.load({"w": torch.zeros(8, 4)}, storage_reader=ChunkStoreReader(path), planner=planner,
                         no_dist=True)


def test_writer_refuses_block_sizes_above_the_cap(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="block size"):
        olmo_chunks.save(state(), tmp_path / "big", block_size=MAX_BLOCK_SIZE + 1)
    olmo_chunks.save(state(), tmp_path / "ok", block_size=MAX_BLOCK_SIZE)
    assert verify(tmp_path / "ok") > 0


_FOREIGN_SIGBUS = """
import faulthandler, mmap, os, signal, sys, tempfile
import olmo_chunks, torch
from olmo_chunks import _core

if sys.argv[1] == "faulthandler":
    faulthandler.enable()
d = tempfile.mkdtemp()
full = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
olmo_chunks.save({"w": full}, d + "/ck")
m = _core.Manifest.open(d + "/ck")
out = torch.zeros(256, 16)
# A column of the tensor, unchecked: its pieces are copied out of a mapping (the guard installed).
m.load([_core.Target(0, [_core.Piece([0, 16], [256, 16], 0, [16, 1])], 0)],
       [(out.data_ptr(), out.numel() * 4)], verify=False)
assert torch.equal(out, full[:, 16:32]), "wrong bytes"
print("loaded", flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGBUS)
    print("survived", flush=True)
    sys.exit(0)
with open(d + "/other", "wb") as f:
    f.write(b"x" * 65536)
with open(d + "/other", "r+b") as f:
    view = mmap.mmap(f.fileno(), 65536)
    f.truncate(10)
    view[40000]  # SIGBUS in a mapping that is not ours
print("survived", flush=True)
"""


@pytest.mark.parametrize(("before", "how"), [("faulthandler", "fault"), ("default", "fault"), ("default", "kill")])
def test_a_bus_error_outside_the_guarded_mappings_goes_where_it_went_before(before, how):
    # Mapped reads install a SIGBUS handler for their own mappings; any other bus error (a fault in
    # another mapping, or the signal sent) must go where it went before: to Python's faulthandler,
    # or the default action; death by the signal, not swallowed, not a loop.
    res = subprocess.run([sys.executable, "-c", _FOREIGN_SIGBUS, before, how], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert res.stdout.splitlines() == ["loaded"], (res.stdout, res.stderr)
    assert res.returncode == -7, (res.returncode, res.stderr)
    assert ("Bus error" in res.stderr) == (before == "faulthandler"), res.stderr
