"""zstd-compressed chunks (format version 2): resharded round trips bit-exact, every door, partial
reads, damaged and crafted blocks refused with clear errors, and plain zstd frames on disk."""

from __future__ import annotations

import struct
from pathlib import Path

import olmo_chunks
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from olmo_chunks import _core
from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter
from olmo_chunks.errors import ChecksumError, CorruptCheckpointError, InvalidArgumentError
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Shard

from tests import world
from tests.manifest_bytes import RawManifest, crc32c

BLOCK = 4096


def tensors() -> dict[str, torch.Tensor]:
    """Compressible (trained-like weights, zeros, small integers) and incompressible data."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * 0.02
    return {
        "w": w,
        "w16": w.bfloat16(),
        "zeros": torch.zeros(48, 40),
        "ids": torch.randint(0, 5, (48, 40), generator=g),
        "noise": torch.randint(-(2**31), 2**31 - 1, (48, 40), generator=g, dtype=torch.int32),
    }


def _save(path: str) -> None:
    mesh = world.mesh((dist.get_world_size(),))
    sd = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in tensors().items()}
    olmo_chunks.save(sd, path, compression="zstd", compression_level=5, block_size=BLOCK)


def _load(path: str) -> list[str]:
    mesh = world.mesh((dist.get_world_size(),))
    want = tensors()
    sd = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(1)]) for k, t in want.items()}
    olmo_chunks.load(sd, path)
    return [k for k, t in want.items() if not torch.equal(sd[k].full_tensor().view(torch.uint8).reshape(-1),
                                                          t.view(torch.uint8).reshape(-1))]


def test_resharded_round_trip_is_bit_exact(tmp_path: Path):
    path = str(tmp_path / "ckpt")
    world.run(4, _save, path)
    m = _core.Manifest.open(path)
    assert m.format_version == 2
    chunks = {t.key: m.chunks(i) for i, t in enumerate(m.tensors)}
    assert all(c.codec == "zstd" for cs in chunks.values() for c in cs)
    stored = {t.key: t.stored_nbytes / t.nbytes for t in m.tensors}
    assert stored["zeros"] < 0.05 and stored["ids"] < 0.2 and stored["w"] < 1
    assert stored["noise"] == 1.0  # did not shrink: stored raw
    assert world.run(3, _load, path) == [[]] * 3
    assert m.verify_data() == sum(t.nbytes for t in m.tensors)


def test_partial_loads_read_only_the_blocks_they_need(tmp_path: Path):
    # One chunk of 16 blocks of 4 rows each (1 KiB rows).
    t = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    path = tmp_path / "c"
    olmo_chunks.save({"t": t}, path, compression="zstd", block_size=BLOCK)
    m = _core.Manifest.open(str(path))
    (c,) = m.chunks(0)
    assert c.nbytes == 64 * 256 * 4 and c.stored_nbytes < c.nbytes
    for rows, cols in [(slice(0, 64), slice(100, 101)), (slice(17, 18), slice(0, 256)), (slice(30, 40), slice(3, 250))]:
        assert torch.equal(_core_fill(path, rows, cols), t[rows, cols])
    # Damage block 5 (rows 20..24): loads that need other blocks never read it.
    lens = struct.unpack("<16I", RawManifest.parse((path / "olmo_chunks.manifest").read_bytes()).block_lens)
    data = path / m.files[0].path
    b = bytearray(data.read_bytes())
    b[c.offset + sum(lens[:5]) + 7] ^= 1
    data.write_bytes(bytes(b))
    assert torch.equal(_core_fill(path, slice(0, 20), slice(0, 256)), t[:20])
    assert torch.equal(_core_fill(path, slice(24, 64), slice(5, 9)), t[24:, 5:9])
    with pytest.raises(ChecksumError, match=f"file bytes {c.offset + sum(lens[:5])}..{c.offset + sum(lens[:6])}"):
        _core_fill(path, slice(23, 24), slice(0, 1))


def _core_fill(path: Path, rows: slice, cols: slice) -> torch.Tensor:
    """A box of the saved tensor through the core's loader."""
    m = _core.Manifest.open(str(path))
    out = torch.empty(rows.stop - rows.start, cols.stop - cols.start)
    piece = _core.Piece([rows.start, cols.start], list(out.shape), 0, list(out.stride()))
    m.load([_core.Target(0, [piece])], [(out.data_ptr(), out.numel() * 4)])
    return out


def test_uncompressed_saves_stay_version_1(tmp_path: Path):
    t = tensors()
    olmo_chunks.save(t, tmp_path / "v1", block_size=BLOCK)
    olmo_chunks.save(t, tmp_path / "v2", block_size=BLOCK, compression="zstd")
    for name, version in (("v1", 1), ("v2", 2)):
        raw = (tmp_path / name / "olmo_chunks.manifest").read_bytes()
        assert struct.unpack_from("<I", raw, 8)[0] == version
        assert _core.Manifest.open(str(tmp_path / name)).format_version == version
        back = {k: torch.zeros_like(v) for k, v in t.items()}
        olmo_chunks.load(back, tmp_path / name)
        assert all(torch.equal(back[k], t[k]) for k in t)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP (no_dist=True)
def test_async_save_and_dcp_writer_compress(tmp_path: Path):
    t = tensors()
    olmo_chunks.async_save(t, tmp_path / "a", compression="zstd", block_size=BLOCK).result()
    # DCP needs a process group for its own collectives; one gloo rank here.
    dcp.save(t, storage_writer=ChunkStoreWriter(tmp_path / "d", compression="zstd", compression_level=1),
             no_dist=True)
    for name in ("a", "d"):
        m = _core.Manifest.open(str(tmp_path / name))
        assert m.format_version == 2, name
        back = {k: torch.zeros_like(v) for k, v in t.items()}
        if name == "a":
            olmo_chunks.load(back, tmp_path / name)
        else:
            dcp.load(back, storage_reader=ChunkStoreReader(tmp_path / name), no_dist=True)
        assert all(torch.equal(back[k], t[k]) for k in t), name


def test_bad_compression_arguments_are_refused(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="only 'zstd'"):
        olmo_chunks.save({"w": torch.ones(4)}, tmp_path / "x", compression="lz4")
    with pytest.raises(InvalidArgumentError, match="needs compression='zstd'"):
        olmo_chunks.save({"w": torch.ones(4)}, tmp_path / "x", compression_level=3)
    with pytest.raises(InvalidArgumentError, match="zstd level 99 is not in"):
        olmo_chunks.save({"w": torch.ones(4)}, tmp_path / "x", compression="zstd", compression_level=99)


def one_block_checkpoint(path: Path) -> tuple[torch.Tensor, Path, int, int]:
    """A checkpoint of one tensor in one compressed block: (tensor, data file, offset, stored len)."""
    t = torch.randn(32, 32, generator=torch.Generator().manual_seed(1)) * 0.02
    olmo_chunks.save({"w": t}, path, compression="zstd", block_size=1 << 20)
    m = _core.Manifest.open(str(path))
    (c,) = m.chunks(0)
    assert c.codec == "zstd" and c.stored_nbytes < c.nbytes
    return t, path / m.files[0].path, c.offset, c.stored_nbytes


def test_a_block_is_a_plain_zstd_frame(tmp_path: Path):
    zstandard = pytest.importorskip("zstandard")
    t, data, offset, n = one_block_checkpoint(tmp_path / "c")
    frame = data.read_bytes()[offset : offset + n]
    raw = zstandard.ZstdDecompressor().decompress(frame)
    # Byte-shuffled by 4 (float32): byte j of every element together.
    want = t.contiguous().view(torch.uint8).reshape(-1, 4).T.contiguous().reshape(-1)
    assert raw == bytes(want.numpy())


def _load_error(path: Path) -> Exception:
    back = {"w": torch.zeros(32, 32)}
    with pytest.raises(CorruptCheckpointError) as e:
        olmo_chunks.load(back, path)
    return e.value


def test_a_flipped_byte_in_a_compressed_block_is_a_checksum_error(tmp_path: Path):
    _, data, offset, n = one_block_checkpoint(tmp_path / "c")
    b = bytearray(data.read_bytes())
    b[offset + n // 2] ^= 0x10
    data.write_bytes(bytes(b))
    err = _load_error(tmp_path / "c")
    assert isinstance(err, ChecksumError) and 'tensor "w" chunk 0' in str(err)
    with pytest.raises(ChecksumError):
        _core.Manifest.open(str(tmp_path / "c")).verify_data()


def _plant(path: Path, data: Path, offset: int, stored: bytes) -> None:
    """Puts `stored` as the chunk's only block, with its length and checksum fixed up."""
    b = bytearray(data.read_bytes())
    b[offset:] = stored
    data.write_bytes(bytes(b))
    mpath = path / "olmo_chunks.manifest"
    raw = RawManifest.parse(mpath.read_bytes())
    assert raw.version == 2 and len(raw.checksums) == 4
    raw.checksums = struct.pack("<I", crc32c(stored))
    raw.block_lens = struct.pack("<I", len(stored))
    raw.meta["files"][0]["size"] = len(b)
    mpath.write_bytes(raw.encode())


@pytest.mark.parametrize("case, message", [
    ("garbage", "not a valid zstd frame"),
    ("short", "decompresses to 2048 bytes, expected 4096"),
    ("long", "decompresses to 8192 bytes, expected 4096"),
    ("trailing", "bytes follow the zstd frame"),
])
def test_a_crafted_block_with_a_valid_checksum_is_a_clear_error(tmp_path: Path, case: str, message: str):
    zstandard = pytest.importorskip("zstandard")
    t, data, offset, _ = one_block_checkpoint(tmp_path / "c")
    raw = bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())
    z = zstandard.ZstdCompressor(write_content_size=True)
    stored = {"garbage": bytes(range(200)) * 5, "short": z.compress(raw[:2048]), "long": z.compress(raw * 2),
              "trailing": z.compress(raw) + b"\0\0"}[case]
    _plant(tmp_path / "c", data, offset, stored)
    for verify in (True, False):
        back = {"w": torch.zeros(32, 32)}
        with pytest.raises(CorruptCheckpointError, match=message) as e:
            olmo_chunks.load(back, tmp_path / "c", verify=verify)
        assert not isinstance(e.value, ChecksumError) and 'tensor "w" chunk 0' in str(e.value)
    with pytest.raises(CorruptCheckpointError, match=message):
        _core.Manifest.open(str(tmp_path / "c")).verify_data()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP (no_dist=True)
def test_import_dcp_with_compression(tmp_path: Path):
    from olmo_chunks.cli import main
    from torch.distributed.checkpoint import FileSystemWriter

    t = tensors()
    dcp.save(t, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    assert main(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "z"), "--compression", "zstd"]) == 0
    assert _core.Manifest.open(str(tmp_path / "z")).format_version == 2
    back = {k: torch.zeros_like(v) for k, v in t.items()}
    olmo_chunks.load(back, tmp_path / "z")
    assert all(torch.equal(back[k], t[k]) for k in t)
