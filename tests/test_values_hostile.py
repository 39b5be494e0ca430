"""Plain values and tensors that are odd, crafted or unsupported: exact round trips for what is
supported, an `OlmoChunksError` (never a bare ValueError, RecursionError, ...) for the rest, and
one-line CLI errors."""

from __future__ import annotations

import io
import json
import struct
import warnings
from pathlib import Path

import numpy as np
import olmo_chunks
import pytest
import torch
from olmo_chunks import _core, cli, values
from olmo_chunks.dcp import ChunkStoreReader
from olmo_chunks.errors import CorruptManifestError, InvalidArgumentError
from olmo_chunks.tree import flatten

from tests.manifest_bytes import MAGIC, RawManifest, crc32c

# ------------------------------------------------------------------------------------------------
# Exact round trips (issue 15, bug 12)
# ------------------------------------------------------------------------------------------------

ODD_VALUES = {
    "zero_d": np.array(2.5),
    "zero_d_int": np.array(7, dtype=np.int16),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "big_endian": np.arange(4, dtype=">u4"),
    "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "f32": np.float32(1.5),
    "i64": np.int64(3),
    "u8": np.uint8(255),
    "b": np.bool_(True),
    "c": np.complex64(1 - 2j),
    "f64": np.float64(0.25),  # a subclass of float: must not come back as a Python float
    "nan32": np.float32("nan"),
    "s": np.str_("ab"),
    "buf": io.BytesIO(b"\x00losses\xff"),
}


def _same(a, b) -> bool:
    if isinstance(a, io.BytesIO):
        return type(b) is io.BytesIO and a.getvalue() == b.getvalue()
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        nan = a.dtype.kind in "fc"
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b, equal_nan=nan)
    return a == b


@pytest.mark.parametrize("key", ODD_VALUES)
def test_numpy_and_bytesio_values_keep_type_dtype_and_shape(key):
    v = ODD_VALUES[key]
    enc = values.encode(v, key)
    back = values.decode(json.loads(json.dumps(enc)), key)
    assert _same(v, back), (v, back)


def test_numpy_values_round_trip_through_the_native_door(tmp_path: Path):
    olmo_chunks.save({"w": torch.zeros(1), "odd": ODD_VALUES}, tmp_path / "c")
    sd = {"w": torch.zeros(1), "odd": None}
    olmo_chunks.load(sd, tmp_path / "c")
    assert sd["odd"].keys() == ODD_VALUES.keys()
    assert [k for k in ODD_VALUES if not _same(ODD_VALUES[k], sd["odd"][k])] == []


def test_unsupported_numpy_dtypes_are_refused_with_the_key():
    structured = np.zeros(2, dtype=[("a", "<f4"), ("b", "<i8")])
    for bad in (structured, np.array([object()]), np.array([1], dtype=object)):
        with pytest.raises(InvalidArgumentError, match="'k'"):
            values.encode(bad, "k")


# ------------------------------------------------------------------------------------------------
# Crafted entries (issue 15, bug 13)
# ------------------------------------------------------------------------------------------------


def _nd(**kw):
    base = {"dtype": "<f4", "shape": [2], "data": "AAAAAAAAAAA="}
    return {"$ndarray": {**base, **kw}}


CRAFTED = {
    "bad_base64": {"$bytes": "not base64!"},
    "bytes_not_str": {"$bytes": 12},
    "bad_bytesio": {"$bytesio": "%%%"},
    "unknown_dtype": _nd(dtype="<q9"),
    "object_dtype": _nd(dtype="|O"),
    "structured_dtype": _nd(dtype="V8,(1000,)f4"),
    "dtype_not_str": _nd(dtype=["<f4"]),
    "short_data": _nd(shape=[3]),
    "huge_shape": _nd(shape=[2**40, 2**40]),
    "negative_shape": _nd(shape=[-2]),
    "scalar_with_shape": _nd(scalar=True),
    "ndarray_missing_data": {"$ndarray": {"dtype": "<f4", "shape": [0]}},
    "ndarray_extra_key": _nd(evil=1),
    "int_garbage": {"$int": "12x"},
    "int_not_str": {"$int": [1]},
    "float_garbage": {"$float": "lots"},
    "dict_not_pairs": {"$dict": [[1, 2, 3]]},
    "dict_not_list": {"$dict": {"a": 1}},
    "dict_unhashable_key": {"$dict": [[[1], 2]]},
    "tuple_not_list": {"$tuple": 5},
    "unknown_tag": {"$pickle": "gASVAAAAAAAAAAA="},
    "tag_with_sibling": {"$int": "1", "x": 2},
    "too_deep": json.loads("[" * (values.MAX_DEPTH + 5) + "]" * (values.MAX_DEPTH + 5)),
}


@pytest.mark.parametrize("name", CRAFTED)
def test_crafted_plain_values_are_corrupt_manifest_errors_naming_the_key(name):
    with pytest.raises(CorruptManifestError, match=f"'cfg.{name}'"):
        values.decode(CRAFTED[name], f"cfg.{name}")


def test_deeply_nested_json_is_a_corrupt_manifest_error():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(CorruptManifestError, match="manifest entries"):
        values.entries(type("M", (), {"entries_json": '{"x": ' + deep + "}"})())


def test_too_deep_values_and_cycles_are_refused_on_save(tmp_path: Path):
    deep: list = []
    for _ in range(values.MAX_DEPTH + 5):
        deep = [deep]
    cycle: list = []
    cycle.append(cycle)
    shared: list = [0]
    for _ in range(40):  # 40 levels, each holding the level below twice: 2**40 items as data
        shared = [shared, shared]
    for bad in (deep, cycle, shared):
        with pytest.raises(InvalidArgumentError, match="'v"):
            olmo_chunks.save({"w": torch.zeros(1), "v": bad}, tmp_path / "x")
    with pytest.raises(InvalidArgumentError, match=rf"more than {values.MAX_ITEMS} items in all"):
        values.encode(shared, "v")
    deep_with_tensor: dict = {"t": torch.zeros(1)}
    for _ in range(values.MAX_DEPTH + 5):
        deep_with_tensor = {"a": deep_with_tensor}
    with pytest.raises(InvalidArgumentError, match="nested more than"):
        flatten({"m": deep_with_tensor})


def _write_meta(path: Path, edit) -> None:
    """Rewrites the manifest at `path` with its metadata JSON text passed through `edit`."""
    mpath = path / olmo_chunks.MANIFEST_NAME
    raw = RawManifest.parse(mpath.read_bytes())
    meta = edit(json.dumps(raw.meta)).encode()
    body = meta + raw.table + raw.checksums
    head = struct.pack("<8sIIQQQI", MAGIC, raw.version, 0, len(meta), len(raw.table), len(raw.checksums),
                       crc32c(body))
    mpath.write_bytes(head + struct.pack("<I", crc32c(head)) + bytes(16) + body)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    olmo_chunks.save({"w": torch.arange(3.0), "cfg": {"lr": 0.5}}, tmp_path / "c")
    return tmp_path / "c"


@pytest.mark.parametrize("name", ["bad_base64", "object_dtype", "short_data", "huge_shape", "unknown_tag"])
def test_crafted_entries_in_a_manifest_fail_cleanly_through_both_doors(small: Path, name: str):
    _write_meta(small, lambda text: text.replace('{"lr": 0.5}', json.dumps(CRAFTED[name])))
    with pytest.raises(CorruptManifestError):
        olmo_chunks.load({"w": torch.zeros(3), "cfg": None}, small)
    with pytest.raises(CorruptManifestError, match="'cfg'"):
        ChunkStoreReader(small).read_metadata()


def test_deeply_nested_entries_fail_cleanly_through_the_dcp_door(small: Path):
    deep = "[" * 100_000 + "]" * 100_000
    _write_meta(small, lambda text: text.replace('{"lr": 0.5}', deep))
    assert len(_core.Manifest.open(str(small)).entries_json) > 200_000  # the core passes it on
    with pytest.raises(CorruptManifestError, match="manifest entries"):
        ChunkStoreReader(small).read_metadata()


# ------------------------------------------------------------------------------------------------
# CLI: one line, no traceback (issue 15, bug 13)
# ------------------------------------------------------------------------------------------------


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    assert cli.main(argv) == 1
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and out.err.startswith(f"olmo-chunks {argv[0]}: error: "), out.err
    assert needle in out.err and "Traceback" not in out.err


def test_cli_errors_are_one_line(small: Path, tmp_path: Path, capsys, monkeypatch):
    _one_line_error(capsys, ["inspect", str(tmp_path / "nowhere")], "nowhere")
    _one_line_error(capsys, ["verify", str(tmp_path / "nowhere")], "nowhere")
    (small / olmo_chunks.MANIFEST_NAME).write_bytes(b"OCHUNKS\ngarbage")
    _one_line_error(capsys, ["inspect", str(small)], str(small))
    # an unexpected exception is one line too, with its type; the traceback only on request
    monkeypatch.setattr(cli, "summarize", lambda path: {}["boom"])
    _one_line_error(capsys, ["inspect", str(small)], "KeyError: 'boom'")
    monkeypatch.setenv("OLMO_CHUNKS_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["inspect", str(small)])


def test_cli_inspect_with_undecodable_info_is_one_line(small: Path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    _write_meta(small, lambda text: text.replace('"info": {', '"info": {"deep": ' + deep + ", "))
    _one_line_error(capsys, ["inspect", str(small)], "manifest info")


# ------------------------------------------------------------------------------------------------
# Tensor kinds (issue 15, bug 13)
# ------------------------------------------------------------------------------------------------


def _odd_tensors() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "sparse": torch.eye(3).to_sparse(),
            "csr": torch.eye(3).to_sparse_csr(),
            "meta": torch.empty(3, device="meta"),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        }


@pytest.mark.parametrize("kind", list(_odd_tensors()))
def test_unsupported_tensor_kinds_are_refused_naming_the_key(tmp_path: Path, kind: str):
    with pytest.raises(InvalidArgumentError, match=r"'model\.w'"):
        olmo_chunks.save({"model": {"w": _odd_tensors()[kind]}}, tmp_path / "x")
    assert not (tmp_path / "x" / olmo_chunks.MANIFEST_NAME).exists()


def test_expanded_tensors_are_saved_as_their_logical_values(tmp_path: Path):
    row = torch.arange(4.0)
    olmo_chunks.save({"w": row.expand(3, 4), "s": torch.tensor(2.0).expand(5)}, tmp_path / "c")
    sd = {"w": torch.zeros(3, 4), "s": torch.zeros(5)}
    olmo_chunks.load(sd, tmp_path / "c")
    assert torch.equal(sd["w"], row.expand(3, 4)) and torch.equal(sd["s"], torch.full((5,), 2.0))


def test_containers_held_in_many_places_are_looked_into_once_and_bounded(tmp_path: Path):
    shared: list = [torch.zeros(1)]
    for _ in range(40):  # 2**40 paths to one tensor
        shared = [shared, shared]
    with pytest.raises(InvalidArgumentError, match=rf"more than {values.MAX_ITEMS} items in the state dict"):
        olmo_chunks.save({"v": shared}, tmp_path / "x")
