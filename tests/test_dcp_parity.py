"""The DCP door behaves like DCP's FileSystemWriter / FileSystemReader where a user can tell:
numpy values and BytesIO round trip, `overwrite=False` refuses, constructor arguments mean the
same; and import-dcp reads nothing outside the source checkpoint."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
from pathlib import Path

import numpy as np
import olmo_chunks
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from olmo_chunks import _core
from olmo_chunks.cli import main as cli_main
from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter, import_dcp
from olmo_chunks.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingDataFileError,
    TruncatedDataError,
    UnsafePathError,
)
from olmo_chunks.trainer_state import RESTORED, TrainerState, load_trainer_state
from torch.distributed.checkpoint.api import CheckpointException

from tests import world

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _failures(info) -> list[type]:
    return [type(exc) for exc, _ in info.value.failures.values()]


# ------------------------------------------------------------------------------------------------
# numpy values and TrainerState through dcp.save / dcp.load (issue 15, bug 10)
# ------------------------------------------------------------------------------------------------


def _draws() -> tuple:
    return random.random(), np.random.rand(3).tolist(), torch.rand(2).tolist()


def trainer_state_worker(path: str) -> dict:
    rank = dist.get_rank()
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    # (DCP drops empty dicts, with its own writer too, so config and extra are not left empty)
    ts = TrainerState(step=9, tokens=900, seed=5, data_position={"batches": 9}, config={"lr": 0.1}, extra={"x": 1})
    sd = {"w": torch.arange(4.0), **ts.state_dict()}
    saved_numpy = sd["trainer"]["rng"][f"rank{rank:05d}"]["numpy"]
    dcp.save(sd, storage_writer=ChunkStoreWriter(path))
    want = _draws()
    # back through the DCP door: the numpy state comes back as the same tuple of typed values
    template = {"w": torch.zeros(4), **TrainerState().state_dict()}
    dcp.load(template, storage_reader=ChunkStoreReader(path))
    got_numpy = template["trainer"]["rng"][f"rank{rank:05d}"]["numpy"]
    same_numpy = (
        type(got_numpy) is tuple
        and [type(x) for x in got_numpy] == [type(x) for x in saved_numpy]
        and got_numpy[1].dtype == saved_numpy[1].dtype
        and got_numpy[1].shape == saved_numpy[1].shape
        and all(np.array_equal(a, b) for a, b in zip(got_numpy, saved_numpy, strict=True))
    )
    # and through the native door: the generators are restored exactly
    _draws()
    resumed = load_trainer_state(path)
    return {
        "numpy": same_numpy,
        "step": template["trainer"]["step"],
        "rng": resumed.rng,
        "draws": _draws() == want,
        "state": (resumed.state.step, resumed.state.data_position),
    }


def test_trainer_state_saves_through_dcp_and_resumes_through_both_doors(tmp_path: Path):
    results = world.run(2, trainer_state_worker, str(tmp_path / "ckpt"))
    assert results == [
        {"numpy": True, "step": 9, "rng": RESTORED, "draws": True, "state": (9, {"batches": 9})}
    ] * 2


NUMPY = {
    "zero_d": np.array(1.25),
    "matrix": np.arange(6, dtype=np.int32).reshape(2, 3),
    "f32": np.float32(1.5),
    "i64": np.int64(3),
    "flag": np.bool_(False),
}


def _same(a, b) -> bool:
    return type(a) is type(b) and a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b)


def test_numpy_values_round_trip_through_the_dcp_door(tmp_path: Path):
    dcp.save({"w": torch.ones(2), "np": dict(NUMPY)}, storage_writer=ChunkStoreWriter(tmp_path / "c"), no_dist=True)
    back = {"w": torch.zeros(2), "np": dict.fromkeys(NUMPY)}
    dcp.load(back, storage_reader=ChunkStoreReader(tmp_path / "c"), no_dist=True)
    native = {"w": torch.zeros(2), "np": None}
    olmo_chunks.load(native, tmp_path / "c")
    for got in (back["np"], native["np"]):
        assert [k for k in NUMPY if not _same(NUMPY[k], got[k])] == []


def test_import_dcp_accepts_numpy_values_and_refuses_object_arrays(tmp_path: Path):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "np": dict(NUMPY)}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    import_dcp(src, tmp_path / "out")
    back = {"w": torch.zeros(2), "np": None}
    olmo_chunks.load(back, tmp_path / "out")
    assert [k for k in NUMPY if not _same(NUMPY[k], back["np"][k])] == []
    src2 = tmp_path / "dcp2"
    dcp.save({"w": torch.ones(2), "o": np.array([1, "x"], dtype=object)},
             storage_writer=dcp.FileSystemWriter(src2), no_dist=True)
    with pytest.raises(InvalidArgumentError, match="'o'"):
        import_dcp(src2, tmp_path / "out2")


# ------------------------------------------------------------------------------------------------
# BytesIO values (issue 15, bug 15a)
# ------------------------------------------------------------------------------------------------


def test_bytesio_values_round_trip_as_dcp_does(tmp_path: Path):
    losses = io.BytesIO(b"\x00\x01 not a pickle \xff")
    dcp.save({"w": torch.ones(2), "losses": losses}, storage_writer=ChunkStoreWriter(tmp_path / "c"),
             no_dist=True)
    # what DCP's own writer and reader give, as the reference
    dcp.save({"w": torch.ones(2), "losses": losses}, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"),
             no_dist=True)
    ref = {"w": torch.zeros(2), "losses": io.BytesIO()}
    dcp.load(ref, storage_reader=dcp.FileSystemReader(tmp_path / "fs"), no_dist=True)
    back = {"w": torch.zeros(2), "losses": io.BytesIO()}
    dcp.load(back, storage_reader=ChunkStoreReader(tmp_path / "c"), no_dist=True)
    for got in (ref["losses"], back["losses"]):
        assert type(got) is io.BytesIO and got.getvalue() == losses.getvalue()
    native = {"w": torch.zeros(2), "losses": None}
    olmo_chunks.load(native, tmp_path / "c")
    assert type(native["losses"]) is io.BytesIO and native["losses"].getvalue() == losses.getvalue()
    # stored as data, not as a pickle
    assert '"$bytesio"' in _core.Manifest.open(str(tmp_path / "c")).entries_json


# ------------------------------------------------------------------------------------------------
# Writer and reader arguments (issue 15, bug 15b, 15c)
# ------------------------------------------------------------------------------------------------


def overwrite_worker(path: str) -> tuple[list[str], bool, list[str]]:
    sd = {"w": torch.arange(4.0) + dist.get_rank()}
    dcp.save({"w": torch.arange(4.0)}, storage_writer=ChunkStoreWriter(path, overwrite=False))
    before = sorted(os.listdir(f"{path}/data"))
    try:
        dcp.save(sd | {"w": torch.ones(4)}, storage_writer=ChunkStoreWriter(path, overwrite=False))
        failures = []
    except CheckpointException as exc:
        # DCP's own phrase, which its tests and users' scripts match on
        failures = sorted({f"{type(e).__name__}: {'Checkpoint already exists' in str(e)}"
                           for e, _ in exc.failures.values()})
    dist.barrier()
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=ChunkStoreReader(path))
    intact = torch.equal(back["w"], torch.arange(4.0)) and sorted(os.listdir(f"{path}/data")) == before
    dist.barrier()
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=ChunkStoreWriter(path))  # overwrite=True default
    dcp.load(back, storage_reader=ChunkStoreReader(path))
    return failures, intact, back["w"].tolist()


def test_overwrite_false_refuses_an_existing_checkpoint_before_writing(tmp_path: Path):
    results = world.run(2, overwrite_worker, str(tmp_path / "ckpt"))
    assert results == [(["CheckpointExistsError: True"], True, [2.0] * 4)] * 2
    assert issubclass(CheckpointExistsError, InvalidArgumentError)
    assert issubclass(UnsafePathError, CorruptCheckpointError)


def test_filesystem_writer_arguments_are_accepted_or_refused_clearly(tmp_path: Path):
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard

    class Rot13(StreamTransformExtension):  # a stream transform we have no per-block equivalent of
        @staticmethod
        def registry_name() -> str:
            return "rot13"

        @staticmethod
        def from_descriptor(version: str) -> Rot13:
            return Rot13()

        def get_descriptor(self) -> str:
            return "rot13/1"

        def transform_to(self, output):
            return output

        def transform_from(self, input):
            return input

    zstd = object.__new__(ZStandard)  # uninitialised: the zstandard package need not be installed
    with pytest.raises(InvalidArgumentError, match=r"_extensions=\['Rot13'\] are not supported"):
        ChunkStoreWriter(tmp_path, _extensions=[zstd, Rot13()])
    with pytest.raises(InvalidArgumentError, match="disagree"):
        ChunkStoreWriter(tmp_path, _extensions=[zstd], compression="lz4")
    assert ChunkStoreWriter(tmp_path, _extensions=[zstd]).zstd == ChunkStoreWriter(tmp_path, compression="zstd").zstd
    assert ChunkStoreWriter(tmp_path, _extensions=[zstd], compression_level=7).zstd == 7
    with pytest.raises(InvalidArgumentError, match="thread_count"):
        ChunkStoreWriter(tmp_path, thread_count=2, workers=3)
    with pytest.raises(InvalidArgumentError, match="serialization_format"):
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        ChunkStoreWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    w = ChunkStoreWriter(
        tmp_path / "c", single_file_per_rank=False, sync_files=False, thread_count=3, per_thread_copy_ahead=1,
        cache_staged_state_dict=True, overwrite=True, _extensions=[],
    )
    assert w.workers == 3
    dcp.save({"w": torch.arange(3.0)}, storage_writer=w, no_dist=True)
    assert _core.Manifest.open(str(tmp_path / "c")).format_version == 1  # no extension: raw blocks
    dcp.save({"w": torch.arange(3.0)}, storage_writer=ChunkStoreWriter(tmp_path / "z", _extensions=[zstd]),
             no_dist=True)
    assert _core.Manifest.open(str(tmp_path / "z")).format_version == 2  # ZStandard: zstd blocks
    with pytest.raises(InvalidArgumentError, match="_extension_registry must be an ExtensionRegistry, not object"):
        ChunkStoreReader(tmp_path / "c", _extension_registry=object())
    for name, registry in (("c", None), ("c", ExtensionRegistry()), ("z", ExtensionRegistry())):
        back = {"w": torch.zeros(3)}
        dcp.load(back, storage_reader=ChunkStoreReader(tmp_path / name, _extension_registry=registry), no_dist=True)
        assert torch.equal(back["w"], torch.arange(3.0)), (name, registry)


# ------------------------------------------------------------------------------------------------
# import-dcp: reads stay inside the source (issue 15, bugs 5 and 13)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def dcp_src(tmp_path: Path) -> Path:
    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(8.0), "cfg": {"lr": 0.5}}, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    return src


def _edit_storage(src: Path, fqn: str, **changes) -> None:
    """Rewrites DCP's .metadata so that `fqn`'s storage entry has `changes` (e.g. relative_path)."""
    md = pickle.loads((src / ".metadata").read_bytes())  # our own, trusted file
    for index, info in list(md.storage_data.items()):
        if index.fqn == fqn:
            md.storage_data[index] = dataclasses.replace(info, **changes)
    (src / ".metadata").write_bytes(pickle.dumps(md))


def _secret(tmp_path: Path) -> Path:
    """A file outside the source checkpoint holding what a valid item would."""
    buf = io.BytesIO()
    torch.save(torch.full((8,), 666.0), buf)
    (tmp_path / "secret.bin").write_bytes(buf.getvalue() * 2)
    return tmp_path / "secret.bin"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "inner_dotdot", "empty"])
def test_import_dcp_refuses_paths_outside_the_source(dcp_src: Path, tmp_path: Path, how: str):
    secret = _secret(tmp_path)
    rel = {"dotdot": "../secret.bin", "absolute": str(secret), "inner_dotdot": "x/../../secret.bin", "empty": ""}
    _edit_storage(dcp_src, "w", relative_path=rel[how], offset=0)
    with pytest.raises(UnsafePathError, match=r"item w .*not a relative path inside the checkpoint directory"):
        import_dcp(dcp_src, tmp_path / "out")
    assert not (tmp_path / "out" / olmo_chunks.MANIFEST_NAME).exists()


@pytest.mark.parametrize("where", ["file", "dir"])
def test_import_dcp_does_not_follow_symlinks_out_of_the_source(dcp_src: Path, tmp_path: Path, where: str):
    secret = _secret(tmp_path)
    if where == "file":
        os.symlink(secret, dcp_src / "link.bin")
        _edit_storage(dcp_src, "w", relative_path="link.bin", offset=0)
    else:
        os.symlink(tmp_path, dcp_src / "up")
        _edit_storage(dcp_src, "w", relative_path="up/secret.bin", offset=0)
    with pytest.raises(UnsafePathError, match=r"item w .*is a symbolic link"):
        import_dcp(dcp_src, tmp_path / "out")
    assert not (tmp_path / "out" / olmo_chunks.MANIFEST_NAME).exists()


def test_import_dcp_refuses_fifos_and_directories_without_blocking(dcp_src: Path, tmp_path: Path):
    os.mkfifo(dcp_src / "fifo")
    _edit_storage(dcp_src, "w", relative_path="fifo")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        import_dcp(dcp_src, tmp_path / "out")
    (dcp_src / "sub").mkdir()
    _edit_storage(dcp_src, "w", relative_path="sub")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        import_dcp(dcp_src, tmp_path / "out")


def test_import_dcp_refuses_huge_lengths_and_missing_files_cleanly(dcp_src: Path, tmp_path: Path, capsys):
    _edit_storage(dcp_src, "w", length=2**62)
    with pytest.raises(TruncatedDataError, match="past the end"):
        import_dcp(dcp_src, tmp_path / "out")
    _edit_storage(dcp_src, "w", length=-1)
    with pytest.raises(CorruptCheckpointError, match="bad storage entry"):
        import_dcp(dcp_src, tmp_path / "out")
    _edit_storage(dcp_src, "w", relative_path="gone.distcp", length=8)
    with pytest.raises(MissingDataFileError, match=r"gone\.distcp"):
        import_dcp(dcp_src, tmp_path / "out")
    # the CLI says so in one line
    assert cli_main(["import-dcp", str(dcp_src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("olmo-chunks import-dcp: error: ") and "gone.distcp" in err


def test_import_dcp_still_imports_an_honest_checkpoint_and_honours_overwrite(dcp_src: Path, tmp_path: Path):
    assert import_dcp(dcp_src, tmp_path / "out")["tensors"] == 1
    with pytest.raises(CheckpointExistsError):
        import_dcp(dcp_src, tmp_path / "out")
    assert import_dcp(dcp_src, tmp_path / "out", overwrite=True)["values"] == 1
    back = {"w": torch.zeros(8), "cfg": None}
    olmo_chunks.load(back, tmp_path / "out")
    assert torch.equal(back["w"], torch.arange(8.0)) and back["cfg"] == {"lr": 0.5}
