"""The streaming safetensors writer (read back by the reference `safetensors` package), the
range reader (against the reference writer) and its refusal of hostile headers."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from olmo_chunks.errors import CorruptCheckpointError, InvalidArgumentError
from olmo_chunks.hf.safetensors_io import INDEX_NAME, SafetensorsDir, ShardedWriter
from olmo_chunks.hf.shapes import contiguous_boxes

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    return x > 0 if dtype == torch.bool else x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.integers(1, 40))
def test_contiguous_boxes_tile_in_order(shape, max_elems):
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    seen = []
    for off, size in contiguous_boxes(shape, max_elems):
        n = torch.Size(size).numel()
        assert 1 <= n <= max(max_elems, 1) or (not shape and n == 1)
        seen.append(x[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1))
    got = torch.cat(seen) if seen else torch.empty(0, dtype=torch.int64)
    assert torch.equal(got, x.reshape(-1))


def test_writer_streams_pieces_and_reference_reader_agrees(tmp_path):
    tensors = {
        f"t{i}": _tensor(shape, dt, i)
        for i, (shape, dt) in enumerate(
            [
                ((7, 5), torch.float32),
                ((3,), torch.bfloat16),
                ((2, 3, 4), torch.float16),
                ((0, 3), torch.float32),
                ((), torch.int64),
                ((9,), torch.bool),
                ((4, 4), torch.int8),
            ]
        )
    }
    w = ShardedWriter(
        tmp_path,
        [(k, v.dtype, v.shape) for k, v in tensors.items()],
        max_shard_bytes=64,
        index_metadata={"note": "x"},
    )
    for k, v in tensors.items():
        for off, size in contiguous_boxes(v.shape, 3):
            w.write(k, v[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))])
    index = w.close()
    assert index["metadata"]["note"] == "x"
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    got = {}
    for f in files:
        with safe_open(str(tmp_path / f), "pt") as s:
            assert s.metadata() == {"format": "pt"}
            for k in s.keys():  # noqa: SIM118
                got[k] = s.get_tensor(k)
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"] == index["weight_map"]


def test_writer_refuses_incomplete_and_oversized(tmp_path):
    w = ShardedWriter(tmp_path / "a", [("x", torch.float32, (4,))])
    with pytest.raises(InvalidArgumentError, match="more bytes"):
        w.write("x", torch.zeros(5))
    w.write("x", torch.zeros(2))
    with pytest.raises(InvalidArgumentError, match="not fully written"):
        w.close()
    assert not (tmp_path / "a" / INDEX_NAME).exists()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_reader_boxes_match_reference_writer(tmp_path_factory, dtype, shape, data):
    d = tmp_path_factory.mktemp("st")
    x = _tensor(shape, dtype, 1)
    save_file({"x": x, "y": torch.ones(3)}, str(d / "model.safetensors"))
    off = [data.draw(st.integers(0, n - 1)) for n in shape]
    size = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True)]
    got = SafetensorsDir(d).read_box("x", off, size)
    assert torch.equal(got, x[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))])


def _raw(path, header: bytes | dict, data: bytes = b"", length: int | None = None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.mkdir(exist_ok=True)
    (path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(h) if length is None else length) + h + data
    )


@pytest.mark.parametrize(
    "header,data,length,match",
    [
        (b"", b"", 10**9, "header length"),
        (b"{not json", b"", None, "not JSON"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        ({"x": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "needs 8"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "gap or overlap"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9, None, "data section"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "bad shape"),
        (
            {
                "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "y": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            b"\0" * 4,
            None,
            "gap or overlap",
        ),
    ],
)
def test_hostile_headers_are_refused(tmp_path, header, data, length, match):
    _raw(tmp_path / "d", header, data, length)
    with pytest.raises(CorruptCheckpointError, match=match):
        SafetensorsDir(tmp_path / "d")


def test_duplicate_and_index_problems_are_named(tmp_path):
    entry = '"x":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}'
    h = ("{" + entry.format(0, 4) + "," + entry.format(4, 8) + "}").encode()
    _raw(tmp_path / "d", h, b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match="x: stored more than once"):
        SafetensorsDir(tmp_path / "d")
    d = SafetensorsDir(tmp_path / "d", strict=False)
    assert d.duplicates == {"x": ["model.safetensors", "model.safetensors"]}
    save_file({"a": torch.ones(2)}, str(tmp_path / "e.safetensors"))
    (tmp_path / "i").mkdir()
    (tmp_path / "e.safetensors").rename(tmp_path / "i" / "part.safetensors")
    (tmp_path / "i" / INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a": "part.safetensors", "b": "part.safetensors"}})
    )
    d = SafetensorsDir(tmp_path / "i", strict=False)
    assert d.problems == ["b: listed in model.safetensors.index.json (part.safetensors) but in no file"]
