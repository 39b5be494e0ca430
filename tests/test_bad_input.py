"""Every bad input gets a clear exception from olmo_chunks.errors, and nothing saved is lost."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import olmo_chunks
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import _core
from olmo_chunks.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    CorruptManifestError,
    InvalidArgumentError,
    MismatchError,
    MissingDataFileError,
    OlmoChunksError,
    RankFailedError,
    StorageError,
    TruncatedDataError,
    UnsupportedFormatError,
)
from olmo_chunks.session import SaveSession

from tests import world
from tests.manifest_bytes import RawManifest, crc32c


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).bfloat16()},
        "optim": {"w": {"exp_avg": torch.randn(64, 33, generator=g), "step": torch.tensor(7.0)}},
        "step": 10 + seed,
    }


def zeros_like_state(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        out[k] = zeros_like_state(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else None
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    olmo_chunks.save(state(), path, block_size=4096)
    return path


def manifest_path(path: Path) -> Path:
    return path / olmo_chunks.MANIFEST_NAME


def data_file(path: Path) -> Path:
    (file,) = _core.Manifest.open(str(path)).files
    return path / file.path


def rewrite_manifest(path: Path, edit) -> None:
    raw = RawManifest.parse(manifest_path(path).read_bytes())
    edit(raw)
    manifest_path(path).write_bytes(raw.encode())


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_round_trip(ckpt: Path):
    sd = zeros_like_state(state())
    olmo_chunks.load(sd, ckpt)
    assert_same(sd, state())


def test_flipped_data_byte_is_a_checksum_error_naming_tensor_and_chunk(ckpt: Path):
    f = data_file(ckpt)
    data = bytearray(f.read_bytes())
    data[100] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r'tensor "[^"]+" chunk 0'):
        olmo_chunks.load(zeros_like_state(state()), ckpt)
    # The unverified path reads the damaged bytes; that is what verify=False means.
    olmo_chunks.load(zeros_like_state(state()), ckpt, verify=False)


def test_truncated_data_file(ckpt: Path):
    f = data_file(ckpt)
    os.truncate(f, f.stat().st_size - 10)
    with pytest.raises(TruncatedDataError, match="truncated"):
        olmo_chunks.load(zeros_like_state(state()), ckpt)


def test_missing_data_file(ckpt: Path):
    data_file(ckpt).unlink()
    with pytest.raises(MissingDataFileError) as info:
        olmo_chunks.load(zeros_like_state(state()), ckpt)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CorruptCheckpointError)


def test_missing_manifest_nonexistent_path_and_file_path(ckpt: Path, tmp_path: Path):
    manifest_path(ckpt).unlink()
    with pytest.raises(CheckpointNotFoundError, match="no committed manifest"):
        olmo_chunks.load(zeros_like_state(state()), ckpt)
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        olmo_chunks.load({}, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        olmo_chunks.load({}, tmp_path / "file")


@pytest.mark.parametrize("where", [0, 20, 50, 70, -3])
def test_corrupt_manifest_bytes(ckpt: Path, where: int):
    data = bytearray(manifest_path(ckpt).read_bytes())
    data[where] ^= 0x40
    manifest_path(ckpt).write_bytes(bytes(data))
    with pytest.raises(CorruptManifestError):
        olmo_chunks.load(zeros_like_state(state()), ckpt)


def test_truncated_and_empty_manifest(ckpt: Path):
    data = manifest_path(ckpt).read_bytes()
    for cut in (0, 10, 64, len(data) - 1):
        manifest_path(ckpt).write_bytes(data[:cut])
        with pytest.raises(CorruptManifestError):
            _core.Manifest.open(str(ckpt))


def test_newer_format_version_is_refused_clearly(ckpt: Path):
    rewrite_manifest(ckpt, lambda raw: setattr(raw, "version", olmo_chunks.FORMAT_VERSION + 1))
    newer = olmo_chunks.FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match=f"format version {newer} is not supported"):
        olmo_chunks.load(zeros_like_state(state()), ckpt)


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/passwd", "data/../../x.bin", ""])
def test_data_file_outside_the_checkpoint_is_refused(ckpt: Path, bad: str):
    def edit(raw: RawManifest) -> None:
        raw.meta["files"][0]["path"] = bad

    rewrite_manifest(ckpt, edit)
    with pytest.raises(CorruptManifestError, match="outside the checkpoint directory"):
        olmo_chunks.load(zeros_like_state(state()), ckpt)


def test_chunk_outside_its_file_is_refused(ckpt: Path):
    def edit(raw: RawManifest) -> None:
        raw.meta["files"][0]["size"] = 100

    rewrite_manifest(ckpt, edit)
    with pytest.raises(CorruptManifestError, match="outside its file"):
        _core.Manifest.open(str(ckpt))


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**62, 8], [2**63, 2**63, 2**63]])
def test_absurd_shapes_are_refused(ckpt: Path, shape: list[int]):
    def edit(raw: RawManifest) -> None:
        t = next(t for t in raw.meta["tensors"] if t["key"] == "model.w")
        t["shape"] = shape

    rewrite_manifest(ckpt, edit)
    with pytest.raises(CorruptManifestError, match="overflow"):
        _core.Manifest.open(str(ckpt))


def test_region_outside_its_tensor_is_refused(ckpt: Path):
    def edit(raw: RawManifest) -> None:
        t = next(t for t in raw.meta["tensors"] if t["key"] == "model.w")
        t["shape"] = [32, 33]

    rewrite_manifest(ckpt, edit)
    with pytest.raises(CorruptManifestError, match="exceeds dim 0"):
        _core.Manifest.open(str(ckpt))


def test_every_error_is_an_olmo_chunks_error():
    for cls in (ChecksumError, CheckpointNotFoundError, CorruptManifestError, InvalidArgumentError,
                MismatchError, MissingDataFileError, RankFailedError, TruncatedDataError, UnsupportedFormatError):
        assert issubclass(cls, OlmoChunksError)


def test_model_conversion_lists_every_mismatch(ckpt: Path):
    sd = zeros_like_state(state())
    sd["model"]["w"] = torch.zeros(65, 33)  # shape
    sd["model"]["b"] = torch.zeros(33)  # dtype
    del sd["optim"]["w"]["step"]  # extra in the checkpoint
    sd["model"]["new"] = torch.zeros(3)  # missing from the checkpoint
    with pytest.raises(MismatchError) as info:
        olmo_chunks.load(sd, ckpt)
    lines = info.value.mismatches
    assert len(lines) == 4, lines
    text = "\n".join(lines)
    for needle in ("model.w: checkpoint has dtype=float32 shape=(64, 33)", "model.b: checkpoint has dtype=bfloat16",
                   "optim.w.step: in the checkpoint but not", "model.new: missing from the checkpoint"):
        assert needle in text
    # strict=False loads what matches and reports the rest.
    report = olmo_chunks.load(sd, ckpt, strict=False)
    assert report.loaded == ["optim.w.exp_avg", "step"]
    assert report.missing == ["model.new"] and report.unexpected == ["optim.w.step"]
    assert len(report.mismatched) == 2
    assert torch.equal(sd["optim"]["w"]["exp_avg"], state()["optim"]["w"]["exp_avg"])
    assert sd["model"]["w"].abs().sum() == 0


def test_role_mismatch_is_a_conversion(ckpt: Path):
    sd = zeros_like_state(state())
    with pytest.raises(MismatchError, match="role=exp_avg"):
        olmo_chunks.load(sd, ckpt, roles={"model.w": "exp_avg"})


def test_unsupported_values_are_refused_with_their_key(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match=r"'cfg\.fn': values of type function"):
        olmo_chunks.save({"w": torch.zeros(2), "cfg": {"fn": lambda: 0}}, tmp_path / "x")
    assert not (tmp_path / "x" / olmo_chunks.MANIFEST_NAME).exists()
    with pytest.raises(InvalidArgumentError, match="object arrays"):
        olmo_chunks.save({"a": np.array([object()])}, tmp_path / "y")


def test_saving_onto_a_file_is_refused(tmp_path: Path):
    (tmp_path / "f").write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        olmo_chunks.save(state(), tmp_path / "f")
    assert (tmp_path / "f").read_text() == "keep me"


def test_keys_sharing_memory_must_hold_the_same_bytes(ckpt: Path):
    sd = zeros_like_state(state())
    sd["optim"]["w"]["exp_avg"] = sd["model"]["w"]  # the same tensor twice, saved with other values
    with pytest.raises(MismatchError, match=r"shares memory with model\.w"):
        olmo_chunks.load(sd, ckpt)


def test_plain_values_round_trip_exactly(tmp_path: Path):
    plain = {"big": 2**80, "neg": -(2**70), "nan": float("nan"), "inf": float("-inf"), "t": (1, "a", None),
             "b": b"\x00\xff", "n": {"$x": 1, 3: [True, 0.1]}, "arr": np.arange(6, dtype=np.uint16).reshape(2, 3)}
    olmo_chunks.save({"w": torch.zeros(1), "plain": plain}, tmp_path / "p")
    sd = {"w": torch.zeros(1), "plain": None}
    olmo_chunks.load(sd, tmp_path / "p")
    got = sd["plain"]
    assert got.keys() == plain.keys()
    assert got["big"] == 2**80 and got["neg"] == -(2**70) and np.isnan(got["nan"]) and got["inf"] == float("-inf")
    assert got["t"] == (1, "a", None) and got["b"] == b"\x00\xff" and got["n"] == {"$x": 1, 3: [True, 0.1]}
    assert got["arr"].dtype == np.uint16 and (got["arr"] == plain["arr"]).all()


def test_failed_commit_keeps_the_previous_checkpoint(ckpt: Path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(SaveSession, "commit", boom)
    with pytest.raises(OSError, match="simulated"):
        olmo_chunks.save(state(seed=1), ckpt, overwrite=True)
    monkeypatch.undo()
    sd = zeros_like_state(state())
    olmo_chunks.load(sd, ckpt)
    assert_same(sd, state())
    # The failed save removed its own data; the next successful save replaces the checkpoint.
    assert len(os.listdir(ckpt / "data")) == 1
    olmo_chunks.save(state(seed=2), ckpt, overwrite=True)
    sd = zeros_like_state(state())
    olmo_chunks.load(sd, ckpt)
    assert_same(sd, state(seed=2))
    assert len(os.listdir(ckpt / "data")) == 1


def test_the_commits_last_word_is_asked_in_the_core_after_the_manifest_is_written(ckpt: Path, monkeypatch):
    # The coordinator's check that it was not frozen while the others gave up on it ran before the
    # core assembled, encoded and wrote the manifest: a freeze in that time went unseen.
    real = SaveSession.commit
    seen: list[list[str]] = []

    class CalledOff(Exception):
        pass

    def refuse() -> None:
        seen.append(sorted(n for n in os.listdir(ckpt) if ".tmp-" in n))
        raise CalledOff("frozen")

    monkeypatch.setattr(SaveSession, "commit", lambda *a, **k: real(*a, **{**k, "ready": refuse}))
    with pytest.raises(CalledOff, match=r"^frozen$"):
        olmo_chunks.save(state(seed=1), ckpt, overwrite=True)
    assert len(seen) == 1 and len(seen[0]) == 1 and olmo_chunks.MANIFEST_NAME in seen[0][0], seen
    monkeypatch.undo()
    sd = zeros_like_state(state())
    olmo_chunks.load(sd, ckpt)
    assert_same(sd, state())
    assert not [n for n in os.listdir(ckpt) if ".tmp-" in n] and len(os.listdir(ckpt / "data")) == 1


def save_failing_on_rank(path: str, bad_rank: int, seed: int) -> str:
    import torch.distributed as dist

    sd = state(seed)
    if dist.get_rank() == bad_rank:
        real = SaveSession.write

        def failing(*args, **kwargs):
            real(*args, **kwargs)
            raise OSError("write failed (simulated)")

        SaveSession.write = failing
    try:
        olmo_chunks.save(sd, path, overwrite=True)
        return "saved"
    except OlmoChunksError as exc:
        return type(exc).__name__
    except OSError as exc:
        return f"OSError: {exc}"
    finally:
        SaveSession.write = real if dist.get_rank() == bad_rank else SaveSession.write


def load_state(path: str, seed: int) -> bool:
    sd = zeros_like_state(state())
    olmo_chunks.load(sd, path)
    want = state(seed)
    return all(torch.equal(sd["model"][k], want["model"][k]) for k in ("w", "b")) and sd["step"] == want["step"]


def test_failure_on_one_rank_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path: Path):
    path = str(tmp_path / "ckpt")
    assert world.run(3, save_failing_on_rank, path, -1, 0) == ["saved"] * 3
    results = world.run(3, save_failing_on_rank, path, 1, 5)
    assert results == ["RankFailedError", "OSError: write failed (simulated)", "RankFailedError"]
    assert world.run(3, load_state, path, 0) == [True] * 3


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental", "ignore:torch.distributed is disabled")
@pytest.mark.parametrize("dtype", [torch.complex32, getattr(torch, "float8_e8m0fnu", torch.complex32)])
def test_dtypes_the_format_lacks_are_refused_before_anything_is_written(ckpt: Path, tmp_path: Path, dtype):
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreWriter
    from torch.distributed.checkpoint.api import CheckpointException

    before = sorted(p.name for p in ckpt.rglob("*"))
    bad = {"w": torch.ones(4), "t": torch.zeros(4, dtype=dtype)}
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(InvalidArgumentError, match=rf"'t': dtype {name} cannot be checkpointed \(the format "
                       r"stores bool, uint8, .*, complex128\)"):
        olmo_chunks.save(bad, ckpt, overwrite=True)
    with pytest.raises(CheckpointException, match=rf"InvalidArgumentError: 't': dtype {name} cannot"):
        dcp.save(bad, storage_writer=ChunkStoreWriter(ckpt, overwrite=True), no_dist=True)
    assert sorted(p.name for p in ckpt.rglob("*")) == before
    with pytest.raises(InvalidArgumentError, match=f"dtype {name} cannot"):
        olmo_chunks.save(bad, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    out = state(1)
    olmo_chunks.load(out, ckpt)
    assert torch.equal(out["model"]["w"], state()["model"]["w"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": -1}, r"block_size=-1: expected a whole number from 1 to 18446744073709551615"),
    ({"block_size": 2**70}, r"block_size=1180591620717411303424: expected a whole number"),
    ({"block_size": 4096.0}, r"block_size=4096\.0: expected a whole number"),
    ({"workers": -1}, r"workers=-1: expected a whole number from 1 to 1024"),
    ({"workers": 0}, r"workers=0: expected"),
    ({"compression": "zstd", "compression_level": -(2**40)}, r"compression_level=-1099511627776: expected"),
    ({"info": 5}, r"info must be a mapping, got int"),
    ({"roles": ["w"]}, r"roles must be a mapping, got list"),
    ({"roles": {"model": "exp_avgsq"}}, r"roles\['model'\]='exp_avgsq': expected one of main_weight, exp_avg, "),
    ({"overwrite": "no"}, r"overwrite='no': expected True or False"),
])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_bad_save_arguments_are_invalid_argument_errors(ckpt: Path, how: str, kwargs: dict, message: str):
    before = (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes()
    with pytest.raises(InvalidArgumentError, match=message):
        kwargs = {"overwrite": True, **kwargs}
        if how == "save":
            olmo_chunks.save(state(1), ckpt, **kwargs)
        else:
            olmo_chunks.async_save(state(1), ckpt, **kwargs).result()
    assert (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes() == before


@pytest.mark.parametrize("pool_bytes", [None, "1G", -1, 2.0**30])
def test_a_bad_async_save_pool_is_an_invalid_argument_error(ckpt: Path, pool_bytes):
    """(`None`, a string or a negative size failed with TypeError or RuntimeError until 2026-12-07,
    and -1 was taken where a pool was already kept.)"""
    olmo_chunks.async_save(state(1), ckpt, overwrite=True, pool_bytes=1 << 20).result()  # a pool is kept now
    before = (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes()
    with pytest.raises(InvalidArgumentError, match=rf"pool_bytes={pool_bytes!r}: expected a whole number from 0 to "):
        olmo_chunks.async_save(state(2), ckpt, overwrite=True, pool_bytes=pool_bytes).result()
    assert (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes() == before


@pytest.mark.parametrize("flag", ["verify", "strict", "partial"])
def test_a_load_flag_that_is_not_a_bool_is_refused_before_anything_is_read(ckpt: Path, flag: str):
    """"no" is truthy: read as a flag it meant yes (strict, partial), or failed in the core's
    conversion as a TypeError (verify), until 2026-12-07."""
    out = state(1)
    with pytest.raises(InvalidArgumentError, match=rf"{flag}='no': expected True or False"):
        olmo_chunks.load(out, ckpt, **{flag: "no"})
    assert torch.equal(out["model"]["w"], state(1)["model"]["w"])


def test_keys_that_cannot_be_filled_or_written_are_refused_before_anything_is_read(ckpt: Path):
    """A plain value in a read-only mapping could not be loaded (its tensors were filled, then a
    TypeError); a tensor key holding a lone surrogate cannot be stored (a UnicodeEncodeError
    from the core, after the save had taken its lease). Both refused at the first step now."""
    import types

    out = state(1)
    with pytest.raises(InvalidArgumentError, match=r"'step': a plain value in a mappingproxy, which cannot be "
                       r"assigned to, so its saved value could not be loaded; pass a dict"):
        olmo_chunks.load(types.MappingProxyType(out), ckpt)
    assert torch.equal(out["model"]["w"], state(1)["model"]["w"])
    before = (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes()
    with pytest.raises(InvalidArgumentError, match=r"'model.w\\udc80': a tensor's key must be valid Unicode text"):
        olmo_chunks.save({"model": {"w\udc80": torch.ones(2)}}, ckpt, overwrite=True)
    with pytest.raises(InvalidArgumentError, match=r"a tensor's key must be valid Unicode text"):
        olmo_chunks.load({"w\udc80": torch.ones(2)}, ckpt)
    assert (ckpt / olmo_chunks.MANIFEST_NAME).read_bytes() == before
    assert sorted(p.name for p in (ckpt / "data").iterdir()) == [_core.Manifest.open(str(ckpt)).save_id]


@pytest.mark.parametrize("workers", [-1, 0, 2**64, 1.5, "4"])
def test_bad_load_and_dcp_door_workers_are_invalid_argument_errors(ckpt: Path, workers):
    from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter

    message = rf"workers={workers!r}: expected a whole number from 1 to 1024"
    with pytest.raises(InvalidArgumentError, match=message):
        olmo_chunks.load(state(1), ckpt, workers=workers)
    with pytest.raises(InvalidArgumentError, match=message):
        ChunkStoreReader(ckpt, workers=workers)
    with pytest.raises(InvalidArgumentError, match=message):
        ChunkStoreWriter(ckpt, workers=workers)


def test_dcp_door_flags_that_are_not_bools_are_refused():
    from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter

    with pytest.raises(InvalidArgumentError, match=r"verify='no': expected True or False"):
        ChunkStoreReader("x", verify="no")
    with pytest.raises(InvalidArgumentError, match=r"overwrite=0: expected True or False"):
        ChunkStoreWriter("x", overwrite=0)


def test_plain_values_inside_tuples_are_compared_not_skipped(tmp_path: Path):
    """A tuple cannot be changed in place: a value in one that holds tensors is loaded when it is
    the saved one, and is a mismatch otherwise (it was skipped, and a strict load said all was
    loaded)."""
    olmo_chunks.save({"opt": (torch.arange(3.0), 7, "saved-name")}, tmp_path / "c")
    same = {"opt": (torch.zeros(3), 7, "saved-name")}
    assert olmo_chunks.load(same, tmp_path / "c").loaded == ["opt.0", "opt.1", "opt.2"]
    assert torch.equal(same["opt"][0], torch.arange(3.0))
    stale = {"opt": (torch.zeros(3), 5, "stale-name")}
    with pytest.raises(MismatchError, match=r"opt\.1: a value inside a tuple, which cannot be replaced in place; "
                       r"the checkpoint holds 7, the state dict 5"):
        olmo_chunks.load(stale, tmp_path / "c")
    assert torch.equal(stale["opt"][0], torch.zeros(3))  # refused before anything was read
    report = olmo_chunks.load(stale, tmp_path / "c", strict=False)
    assert [m.split(":")[0] for m in report.mismatched] == ["opt.1", "opt.2"] and report.loaded == ["opt.0"]
    assert torch.equal(stale["opt"][0], torch.arange(3.0))


def test_a_checkpoint_replaced_during_a_load_says_so(ckpt: Path, monkeypatch):
    from olmo_chunks.fill import FillStep

    run = FillStep.run

    def overwritten_first(self, decided):  # another job's save commits over it meanwhile
        olmo_chunks.save(state(2), ckpt, overwrite=True)
        return run(self, decided)

    monkeypatch.setattr(FillStep, "run", overwritten_first)
    old = _core.Manifest.open(str(ckpt)).save_id
    with pytest.raises(MissingDataFileError, match=rf"\(the checkpoint was replaced during this load: save {old} is "
                       r"now [0-9a-f]{32}; load it again\)"):
        olmo_chunks.load(state(1), ckpt)


def test_errors_cross_to_other_ranks_as_themselves_only_where_their_message_makes_them():
    from olmo_chunks.errors import CheckpointLockedError, ConversionError, named_error, shared_form

    assert shared_form(CheckpointLockedError("held")) == ("CheckpointLockedError", "held", None)
    got = named_error("CheckpointLockedError", "held")
    assert type(got) is CheckpointLockedError and str(got) == "held"
    for exc in (MismatchError(["a: b", "c: d"], header="ranks disagree"), ConversionError(["x"])):
        form = shared_form(exc)
        assert form is not None
        again = named_error(*form)
        assert type(again) is type(exc) and again.mismatches == exc.mismatches and str(again) == str(exc)
    for exc in (RankFailedError("rank 2 died"), ValueError("x")):
        assert shared_form(exc) is None
    for name in ("MismatchError", "RankFailedError", "os", "__builtins__", "Any"):  # what the store may say
        assert type(named_error(name, "m")) is OlmoChunksError
    assert type(named_error("MismatchError", "m", [1])) is OlmoChunksError  # a list of strings only


@pytest.mark.parametrize(("var", "value"), [
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:9 "),  # a trailing blank was a panic of the HTTP client
    ("AWS_ENDPOINT_URL", "not a url"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:99999"),  # a bad port, or no host, was a panic of the HTTP client
    ("AWS_ENDPOINT_URL", "http://[::1"),
    ("AWS_ENDPOINT_URL", "http://"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:9/?x=1"),  # was "ETag Header missing from response"
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:9#f"),
    ("AWS_ENDPOINT_URL_S3", "not a url"),  # the client's endpoint when set, ahead of AWS_ENDPOINT_URL
    ("AWS_ENDPOINT_URL_S3", "http://h ost:1"),
    ("AWS_ENDPOINT_URL_S3", ""),  # `export VAR=`: the client takes it over AWS_ENDPOINT_URL, and panicked
    ("AWS_ENDPOINT_URL", ""),
    ("OLMO_CHUNKS_RETRY_TIMEOUT", "30s"),  # was silently 120 s
    ("OLMO_CHUNKS_RETRY_TIMEOUT", "0"),
])
def test_bad_object_store_settings_are_invalid_arguments(monkeypatch, var: str, value: str):
    import uuid

    monkeypatch.setenv(var, value)
    bucket = f"never-{uuid.uuid4().hex[:12]}"  # a bucket this process has no client for yet
    with pytest.raises(InvalidArgumentError, match=re.escape(f'{var}="{value}"')):
        olmo_chunks.load({"w": torch.zeros(1)}, f"s3://{bucket}/x")


def test_an_endpoints_password_stays_out_of_error_messages(monkeypatch):
    """An endpoint with credentials (`http://user:password@host`, a proxy's) was quoted whole in
    the errors of its requests and of its settings (until 2026-12-07)."""
    import socket
    import uuid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once it is closed
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
                 "OLMO_CHUNKS_RETRY_TIMEOUT": "1", "AWS_ENDPOINT_URL": f"http://user:Pa55word@127.0.0.1:{port}"}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://b-{uuid.uuid4().hex[:12]}/x"
    with pytest.raises(InvalidArgumentError) as plain:  # AWS_ALLOW_HTTP not set
        olmo_chunks.load({"w": torch.zeros(1)}, url)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    with pytest.raises(StorageError) as unanswered:
        olmo_chunks.load({"w": torch.zeros(1)}, url)
    for err in (plain, unanswered):
        assert "Pa55word" not in str(err.value) and "user:***@127.0.0.1" in str(err.value), str(err.value)


@pytest.mark.parametrize("allow", [None, "false", "maybe"])
@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_plain_http_endpoint_without_allow_http_names_the_variable(monkeypatch, allow: str | None, var: str):
    import uuid

    monkeypatch.setenv(var, "http://127.0.0.1:9")
    if allow is None:
        monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    else:
        monkeypatch.setenv("AWS_ALLOW_HTTP", allow)
    said = "is not set" if allow is None else f'is "{allow}"'
    want = rf"\({var}\) is plain HTTP; set AWS_ALLOW_HTTP=true to use it \(AWS_ALLOW_HTTP {said}\)"
    with pytest.raises(InvalidArgumentError, match=want):
        olmo_chunks.load({"w": torch.zeros(1)}, f"s3://never-{uuid.uuid4().hex[:12]}/x")  # was "builder error"


@pytest.mark.parametrize(("var", "value"), [
    ("AWS_REGION", "us east-1"),  # each was a PanicException of the HTTP library, building a request
    ("AWS_REGION", "us\x01"),
    ("AWS_SESSION_TOKEN", "a\x01b"),
    ("AWS_ACCESS_KEY_ID", "a\x01b"),
    ("AWS_ENDPOINT_URL", "http://ex\u00e4mple.invalid:1"),
])
def test_settings_the_object_store_client_panics_on_are_invalid_arguments(monkeypatch, capfd, var: str,
                                                                         value: str):
    import uuid

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("OLMO_CHUNKS_RETRY_TIMEOUT", "1")
    if var == "AWS_REGION" and value == "us east-1":
        monkeypatch.delenv("AWS_ENDPOINT_URL")
    good = os.environ.get(var, "us-east-1" if var == "AWS_REGION" else "")
    monkeypatch.setenv(var, value)
    url = f"s3://never-{uuid.uuid4().hex[:12]}/x"
    with pytest.raises(InvalidArgumentError, match="the object store's client refused its settings"):
        olmo_chunks.load({"w": torch.zeros(1)}, url)
    assert "panicked" not in capfd.readouterr().err  # the caught panic printed its own lines before the error
    monkeypatch.setenv(var, good)  # mended: the bucket's client is made again (it was kept, and refused for good)
    with pytest.raises(OlmoChunksError) as again:
        olmo_chunks.load({"w": torch.zeros(1)}, url)
    assert "refused its settings" not in str(again.value)


@pytest.mark.parametrize("bucket", ["a b", "a\x01b", "bkt#zz", "bkt?zz"])
def test_a_bucket_name_with_a_character_no_bucket_has_is_refused(bucket: str):
    # A blank or control character was a panic; '#' and '?' sent requests to the bucket's root.
    with pytest.raises(InvalidArgumentError, match="a bucket name holds only letters, digits"):
        olmo_chunks.load({"w": torch.zeros(1)}, f"s3://{bucket}/x")


def test_an_unknown_role_is_refused_by_every_door(ckpt: Path, tmp_path: Path):
    # It was saved as written (a checkpoint that then loaded only with the same misspelling).
    from olmo_chunks.dcp import ChunkStoreWriter, import_dcp

    message = r"roles\['model.w'\]='weights': expected one of main_weight, exp_avg, exp_avg_sq, optimizer_state, "
    with pytest.raises(InvalidArgumentError, match=message):
        olmo_chunks.load(state(1), ckpt, roles={"model.w": "weights"})
    with pytest.raises(InvalidArgumentError, match=message):
        ChunkStoreWriter(tmp_path / "dcp", roles={"model.w": "weights"})
    with pytest.raises(InvalidArgumentError, match=message):
        import_dcp(tmp_path / "nowhere", tmp_path / "out", roles={"model.w": "weights"})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "value"), [
    ("OLMO_CHUNKS_STAGING_BYTES", "512Mb?"), ("OLMO_CHUNKS_STAGING_BYTES", "0"), ("OLMO_CHUNKS_POOL_BYTES", "-5"),
    ("OLMO_CHUNKS_POOL_BYTES", "lots"), ("OLMO_CHUNKS_ARRIVAL_TIMEOUT", "nan"), ("OLMO_CHUNKS_STORAGE_GBPS", "inf"),
    ("OLMO_CHUNKS_THREADS", "abc"), ("OLMO_CHUNKS_THREADS", "0"), ("OLMO_CHUNKS_THREADS", "5000"),
])
def test_environment_settings_are_checked(name: str, value: str, monkeypatch, tmp_path: Path):
    # They were read with int() or float() (a raw ValueError for 512M, and 0 or -5 taken as they were).
    from olmo_chunks import _dist, rates

    monkeypatch.setenv(name, value)
    message = f"{name}='{value}': expected a " if value != "5000" else f"{name}=5000: expected a whole number from 1 to"
    if name.endswith("_BYTES"):  # read as fill and background are imported: at the first save or load
        module, constant = ("fill", "STAGING_BYTES") if "STAGING" in name else ("background", "DEFAULT_POOL_BYTES")
        # One interpreter (each imports torch): the import refused, then made again with "512M".
        script = (f"import os\ntry:\n    import olmo_chunks.{module}\nexcept Exception as e:\n"
                  f"    print(f'{{type(e).__name__}}: {{e}}')\nos.environ[{name!r}] = '512M'\n"
                  f"from olmo_chunks import {module} as m\nprint(m.{constant})")
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        refused, accepted = run.stdout.strip().rsplit("\n", 1)
        assert refused.startswith(f"InvalidArgumentError: {message}") and accepted == str(512 << 20), (run.stdout,
                                                                                                     run.stderr)
        return
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        if name == "OLMO_CHUNKS_ARRIVAL_TIMEOUT":
            _dist._arrival_timeout(None)
        elif name == "OLMO_CHUNKS_THREADS":  # (the core skipped what it could not read, and took any count)
            olmo_chunks.save({"w": torch.zeros(1)}, tmp_path / "c")
        else:
            rates.storage_rate("/tmp")
    assert not (tmp_path / "c").exists()


def save_short_local_shard(path: str) -> str:
    """A DTensor built by hand whose local shard holds one row where Shard(0) of 4 rows on 2 ranks
    places two; rank 1's is right."""
    from torch.distributed.tensor import DTensor, Shard

    rows = 1 if dist.get_rank() == 0 else 2
    dt = DTensor.from_local(torch.ones(rows, 3), world.mesh((2,)), [Shard(0)], run_check=False,
                            shape=torch.Size((4, 3)), stride=(3, 1))
    try:
        olmo_chunks.save({"w": dt}, path, overwrite=True)
    except OlmoChunksError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_local_shard_smaller_than_its_placements_say_is_refused_by_name(tmp_path: Path):
    """Was a CorruptManifestError from the commit ("byte length 12 does not match its region"), the
    save's bytes written first; now rank 0 names the tensor before anything is written, and a
    checkpoint already at the path stays."""
    path = str(tmp_path / "c")
    olmo_chunks.save({"w": torch.zeros(4, 3)}, path)
    results = world.run(2, save_short_local_shard, path)
    assert results[0].startswith("InvalidArgumentError: 'w': the local shard of shape (1, 3) is smaller than "
                                 "what (Shard(dim=0),) of a (4, 3) tensor place on this rank"), results
    assert results[1].startswith("RankFailedError: rank 0 failed: InvalidArgumentError"), results
    back = {"w": torch.ones(4, 3)}
    olmo_chunks.load(back, path)
    assert torch.equal(back["w"], torch.zeros(4, 3))
