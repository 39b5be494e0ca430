"""One load path for both doors: bounded staging whatever the destination dtype, one place that
builds a manifest (the core), typed records across the boundary."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import _core

RSS_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import psutil, torch
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreReader

    path, n, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sd = {f"t{i}": torch.zeros(numel, dtype=torch.bfloat16) for i in range(n)}
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    base = proc.memory_info().rss
    t = threading.Thread(target=sample)
    t.start()
    dcp.load(sd, storage_reader=ChunkStoreReader(path), no_dist=True)
    done.set()
    t.join()
    ok = all(torch.equal(sd[f"t{i}"], torch.full((numel,), float(i), dtype=torch.bfloat16)) for i in range(n))
    print(int(ok), base, peak[0])
    """
)


def test_dcp_door_load_into_bf16_is_bounded_by_the_staging_budget(tmp_path: Path):
    n, numel, budget = 8, 16 << 20, 64 << 20  # 8 x 64 MiB of FP32 into BF16 destinations
    olmo_chunks.save({f"t{i}": torch.full((numel,), float(i)) for i in range(n)}, tmp_path / "c")
    size = n * numel * 4
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "c"), str(n), str(numel)],
        capture_output=True, text=True, check=True, env={**os.environ, "OLMO_CHUNKS_STAGING_BYTES": str(budget)},
    ).stdout.split()
    ok, base, peak = (int(x) for x in out[-3:])
    extra = peak - base
    print(f"\nDCP load of {size >> 20} MiB FP32 into BF16: +{extra >> 20} MiB peak RSS, budget {budget >> 20} MiB")
    assert ok == 1
    assert extra < budget + (32 << 20), extra  # one staging batch at a time, plus allocator slack


def test_the_core_takes_and_returns_typed_records(tmp_path: Path):
    box, flat = _core.Box([2, 0], [3, 4]), _core.Flat(5, 7)
    assert pickle.loads(pickle.dumps([box, flat])) == [box, flat]
    assert len({box, _core.Box([2, 0], [3, 4]), flat, _core.Flat(5, 7)}) == 2  # hashable by value
    assert box != _core.Box([2, 0], [3, 5]) and flat != _core.Flat(5, 8)
    with pytest.raises(olmo_chunks.InvalidArgumentError, match=r"as many offsets as sizes, got \[0\] and \[1, 2\]"):
        _core.Box([0], [1, 2])
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="as many offsets, sizes and strides"):
        _core.Piece([0, 0], [1, 2], 0, [1])
    with pytest.raises(TypeError):  # the old tuple spelling is refused, not guessed at
        _core.WriteItem("w", ("box", [0], [4]), 0, 0)  # type: ignore[arg-type]
    assert _core.Piece([1], [2], 3, [1]).shifted(4) == _core.Piece([1], [2], 7, [1])
    # A saved 4x6 tensor (one box) and a wanted 2x3 box inside it: one overlap, the same from the
    # manifest and from the plain box function, and one element run per wanted row.
    olmo_chunks.save({"w": torch.arange(24.0).reshape(4, 6)}, tmp_path / "c")
    m = _core.Manifest.open(str(tmp_path / "c"))
    saved = m.saved_boxes(0)
    wanted = _core.Box([1, 2], [2, 3])
    (hits,) = m.overlaps([0], [[wanted]])
    assert hits == _core.box_overlaps(2, saved, [wanted])
    assert [(h.saved_offsets, h.offsets, h.sizes) for h in hits] == [([0, 0], [1, 2], [2, 3])]
    runs = m.plan_runs([_core.Target(0, [_core.Piece([1, 2], [2, 3], 0, [3, 1])])])
    assert [(r.chunk, r.src, r.target, r.dst, r.len) for r in runs] == [(0, 8, 0, 0, 3), (0, 14, 0, 3, 3)]
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="1 tensors, 2 lists of wanted boxes"):
        m.overlaps([0], [[wanted], [wanted]])


def test_written_chunks_and_schemas_are_typed_and_picklable(tmp_path: Path):
    txn = _core.SaveTransaction.begin(str(tmp_path / "c"))
    data = torch.arange(12, dtype=torch.float32)
    (chunk,) = _core.write_chunks(str(tmp_path / "c"), f"data/{txn.save_id}/rank-00000.bin",
                                  [_core.WriteItem("w", _core.Flat(0, 12), data.data_ptr(), 48)], 1 << 20)
    assert (chunk.key, chunk.region, chunk.offset, chunk.nbytes) == ("w", _core.Flat(0, 12), 0, 48)
    assert chunk.file == f"data/{txn.save_id}/rank-00000.bin" and chunk.file_size == 48
    again = pickle.loads(pickle.dumps(chunk))  # ranks send these to the committing rank
    assert (again.key, again.region, again.file, again.checksums) == (
        chunk.key, chunk.region, chunk.file, chunk.checksums)
    schema = _core.TensorSchema("w", "float32", [12], "main_weight")
    assert pickle.loads(pickle.dumps(schema)) == schema
    m = txn.commit(1 << 20, [schema], [again], "{}", "{}")
    assert m.tensors == [_core.TensorInfo("w", "float32", [12], "main_weight", 1, 48)]
    assert m.tensors[0].nbytes == 48 and m.tensors[0].chunks == 1
    (c,) = m.chunks(0)
    assert (c.region, c.file, c.offset, c.nbytes) == (_core.Flat(0, 12), 0, 0, 48)
    assert m.files[0].path == chunk.file and m.files[0].size == chunk.file_size
    out = {"w": torch.zeros(12)}
    olmo_chunks.load(out, tmp_path / "c")
    assert torch.equal(out["w"], data)


def test_the_core_refuses_inconsistent_parts(tmp_path: Path):
    txn = _core.SaveTransaction.begin(str(tmp_path / "c"))
    name = f"data/{txn.save_id}/rank-00000.bin"
    data = torch.arange(4, dtype=torch.float32)
    item = _core.WriteItem("w", _core.Box([0], [4]), data.data_ptr(), 16)
    (chunk,) = _core.write_chunks(str(tmp_path / "c"), name, [item], 1 << 20)
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="does not describe"):
        txn.commit(1 << 20, [_core.TensorSchema("v", "float32", [4], "tensor")], [chunk], "{}", "{}")
    with pytest.raises(olmo_chunks.LayoutError):  # half of the tensor is not covered
        txn.commit(1 << 20, [_core.TensorSchema("w", "float32", [8], "tensor")], [chunk], "{}", "{}")
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="described twice"):
        txn.commit(1 << 20, [_core.TensorSchema("w", "float32", [4], "tensor")] * 2, [chunk], "{}", "{}")
    assert not (tmp_path / "c" / olmo_chunks.MANIFEST_NAME).exists()


def test_a_save_session_rolls_data_files_at_its_budget_and_commits_through_the_core(tmp_path: Path):
    from olmo_chunks.session import SaveSession

    path = str(tmp_path / "c")
    olmo_chunks.save({"old": torch.ones(3)}, path)
    parts = [torch.full((25,), float(i)) for i in range(5)]  # 100 bytes each
    with SaveSession(path, rank=3, budget=250) as s:
        s.begin(overwrite=True)
        for i, t in enumerate(parts):
            s.add(f"t{i}", _core.Box([0], [25]), t, owned=True)  # made for the save: counts
        s.flush()
        # Borrowed CPU tensors cost nothing: one more file whatever their size.
        s.write([(f"b{i}", _core.Box([0], [25]), t) for i, t in enumerate(parts)])
        names = [f"data/{s.save_id}/rank-00003{p}.bin" for p in ("", "-001", "-002", "-003")]
        assert {c.file for c in s.written} == set(names)
        assert [c.file for c in s.written[:5]] == names[:1] * 2 + names[1:2] * 2 + names[2:3]
        schema = {k: ("float32", [25], "main_weight") for i in range(5) for k in (f"t{i}", f"b{i}")}
        s.commit(schema, s.written, {}, {"writer": "test"})
    back = {k: torch.zeros(25) for k in schema}
    olmo_chunks.load(back, path)
    assert all(torch.equal(back[f"{p}{i}"], parts[i]) for i in range(5) for p in "tb")
    assert os.listdir(tmp_path / "c" / "data") == [s.save_id]  # the old save's data is gone


def test_an_abandoned_save_session_leaves_the_checkpoint_as_it_was(tmp_path: Path):
    from olmo_chunks.session import SaveSession

    path = str(tmp_path / "c")
    olmo_chunks.save({"w": torch.ones(3)}, path)
    before = _core.Manifest.open(path).save_id
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="needs the save id"):
        SaveSession(path).write_file([("w", _core.Box([0], [3]), torch.zeros(3))])
    with pytest.raises(olmo_chunks.InvalidArgumentError, match="only the coordinator commits"):
        SaveSession(path, save_id="0" * 32).commit({}, [], {}, {})
    with SaveSession(path) as s:
        s.begin(overwrite=True)
        s.write([("w", _core.Box([0], [3]), torch.zeros(3))])
        assert (tmp_path / "c" / "data" / s.save_id).is_dir()
    assert sorted(os.listdir(tmp_path / "c" / "data")) == [before]
    assert not (tmp_path / "c" / ".olmo_chunks.lease").exists()
    out = {"w": torch.zeros(3)}
    olmo_chunks.load(out, path)
    assert torch.equal(out["w"], torch.ones(3))
