"""One load path for both doors: bounded staging whatever the destination dtype, one place that
builds a manifest (the core), typed records across the boundary."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

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

    import olmo_chunks

    path, n, numel, door = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dtype = torch.bfloat16 if door == "dcp" else torch.float32
    sd = {f"t{i}": torch.zeros(numel, dtype=dtype) for i in range(n)}
    proc, peak, done = psutil.Process(), [0, 0], threading.Event()

    def now():  # (memory of its own, pages of files mapped in) resident
        m = proc.memory_info()
        return m.rss - m.shared, m.shared

    def sample():
        while not done.is_set():
            peak[:] = [max(p, x) for p, x in zip(peak, now())]
            time.sleep(0.002)

    base = now()
    t = threading.Thread(target=sample)
    t.start()
    if door == "dcp":
        dcp.load(sd, storage_reader=ChunkStoreReader(path), no_dist=True)
    else:
        olmo_chunks.load(sd, path)
    done.set()
    t.join()
    ok = all(torch.equal(sd[f"t{i}"], torch.full((numel,), float(i), dtype=dtype)) for i in range(n))
    print(int(ok), *base, *peak)
    """
)


def _peak_rss(path: Path, n: int, numel: int, door: str, env: dict[str, str]) -> tuple[int, int, int]:
    """Loads `n` tensors of `numel` through `door` ("dcp" into BF16, or "native") in a fresh
    process: (loaded right, peak growth of its own RSS, peak growth of its mapped file pages)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(path), str(n), str(numel), door],
        capture_output=True, text=True, check=True, env={**os.environ, **env},
    ).stdout.split()
    ok, base, base_mapped, peak, peak_mapped = (int(x) for x in out[-5:])
    return ok, peak - base, peak_mapped - base_mapped


# Pages copied out of a mapping of a data file are let go of every 64 MiB; copies under way (a unit
# of at most 8 MiB per worker, 4 to 32 workers) fault theirs back in meanwhile.
MAPPED_BOUND = (64 << 20) + min(max(os.cpu_count() or 4, 4), 32) * (10 << 20)


def test_dcp_door_load_into_bf16_is_bounded_by_the_staging_budget(tmp_path: Path):
    n, numel, budget = 8, 16 << 20, 64 << 20  # 8 x 64 MiB of FP32 into BF16 destinations
    olmo_chunks.save({f"t{i}": torch.full((numel,), float(i)) for i in range(n)}, tmp_path / "c")
    ok, extra, mapped = _peak_rss(tmp_path / "c", n, numel, "dcp", {"OLMO_CHUNKS_STAGING_BYTES": str(budget)})
    print(f"\nDCP load of {n * numel * 4 >> 20} MiB FP32 into BF16: +{extra >> 20} MiB peak RSS of its own, "
          f"+{mapped >> 20} MiB of mapped pages, budget {budget >> 20} MiB")
    assert ok == 1
    assert extra < budget + (32 << 20), extra  # one staging batch at a time, plus allocator slack
    assert mapped < MAPPED_BOUND, mapped


def test_a_warm_load_lets_go_of_the_mapped_pages_it_copied_out(tmp_path: Path):
    # 768 MiB read in one go out of the page cache: the pages it maps stay far below that.
    n, numel = 12, 16 << 20
    olmo_chunks.save({f"t{i}": torch.full((numel,), float(i)) for i in range(n)}, tmp_path / "c")
    ok, extra, mapped = _peak_rss(tmp_path / "c", n, numel, "native", {})
    print(f"\nload of {n * numel * 4 >> 20} MiB: +{extra >> 20} MiB peak RSS of its own, "
          f"+{mapped >> 20} MiB of mapped pages")
    assert ok == 1
    assert extra < 32 << 20, extra  # straight into place
    assert mapped < MAPPED_BOUND, mapped


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
    with SaveSession(path, rank=3, budget=500) as s:  # files of at most 250 bytes held
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


def _gated_writes(monkeypatch: pytest.MonkeyPatch, files: int, fail_at: int | None = None) -> dict[str, list[int]]:
    """Makes `SaveSession` record its stagings and writes of a save of `files` data files: the
    write of each file but the last waits (up to 20 s) until the next file has been staged, and
    the write of file `fail_at` fails with StorageError. Returns the record: the files staged, the
    files whose write saw the next one staged while it was in flight, the writing threads."""
    from olmo_chunks import session as session_mod

    seen: dict[str, list[int]] = {"staged": [], "overlapped": [], "threads": []}
    stage, write_chunks = session_mod.SaveSession._stage, _core.write_chunks

    def staging(self: Any, batch: Any) -> Any:
        out = stage(self, batch)
        seen["staged"].append(len(seen["staged"]))
        return out

    def writing(target: str, name: str, *args: Any) -> Any:
        part = re.search(r"rank-\d+(?:-(\d+))?\.bin$", name)
        assert part is not None, name
        k = int(part.group(1) or 0)
        seen["threads"].append(threading.get_ident())
        if k == fail_at:
            raise olmo_chunks.StorageError(5, f"{name}: injected write failure")
        deadline = time.monotonic() + 20
        while len(seen["staged"]) <= k + 1 < files and time.monotonic() < deadline:
            time.sleep(0.005)
        if len(seen["staged"]) > k + 1:
            seen["overlapped"].append(k)
        return write_chunks(target, name, *args)

    monkeypatch.setattr(session_mod.SaveSession, "_stage", staging)
    monkeypatch.setattr(_core, "write_chunks", writing)
    return seen


def test_a_save_session_stages_the_next_file_while_the_last_one_is_written(tmp_path: Path, monkeypatch):
    from olmo_chunks.session import SaveSession

    path = str(tmp_path / "c")
    # Non-contiguous CPU tensors are staged (copied into a host buffer) like accelerator ones:
    # 6 x 400 bytes, a budget of 1600 bytes: files of two chunks, staged while the one before is
    # written.
    parts = [torch.arange(100, dtype=torch.float32).reshape(10, 10).t() + i for i in range(6)]
    seen = _gated_writes(monkeypatch, files=3)
    with SaveSession(path, budget=1600) as s:
        s.begin(overwrite=False)
        written = s.write([(f"t{i}", _core.Box([0, 0], [10, 10]), t) for i, t in enumerate(parts)])
        assert [c.file.rsplit("/", 1)[-1] for c in written] == [
            "rank-00000.bin", "rank-00000.bin", "rank-00000-001.bin", "rank-00000-001.bin",
            "rank-00000-002.bin", "rank-00000-002.bin"]
        s.commit({f"t{i}": ("float32", [10, 10], "main_weight") for i in range(6)}, written, {}, {})
    assert seen["staged"] == [0, 1, 2] and seen["overlapped"] == [0, 1]
    assert threading.get_ident() not in seen["threads"]  # written by the session's thread
    back = {f"t{i}": torch.zeros(10, 10) for i in range(6)}
    olmo_chunks.load(back, path)
    assert all(torch.equal(back[f"t{i}"], parts[i]) for i in range(6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a save from CUDA needs a GPU")
def test_a_save_from_cuda_overlaps_its_device_to_host_copies_with_writes(tmp_path: Path, monkeypatch):
    from olmo_chunks.session import SaveSession

    path = str(tmp_path / "c")
    parts = [torch.randn(256, 256, device="cuda") for _ in range(6)]  # 256 KiB each
    seen = _gated_writes(monkeypatch, files=3)
    with SaveSession(path, budget=1 << 20) as s:
        s.begin(overwrite=False)
        written = s.write([(f"t{i}", _core.Box([0, 0], [256, 256]), t) for i, t in enumerate(parts)])
        assert s._spare is not None and s._spare.is_pinned()
        s.commit({f"t{i}": ("float32", [256, 256], "main_weight") for i in range(6)}, written, {}, {})
    assert seen["staged"] == [0, 1, 2] and seen["overlapped"] == [0, 1]
    back = {f"t{i}": torch.zeros(256, 256) for i in range(6)}
    olmo_chunks.load(back, path)
    assert all(torch.equal(back[f"t{i}"], parts[i].cpu()) for i in range(6))


def test_a_failed_background_write_fails_the_save_and_leaves_the_checkpoint(tmp_path: Path, monkeypatch):
    from olmo_chunks.session import SaveSession

    path = str(tmp_path / "c")
    olmo_chunks.save({"old": torch.ones(3)}, path)
    before = _core.Manifest.open(path).save_id
    seen = _gated_writes(monkeypatch, files=3, fail_at=1)
    parts = [torch.full((10, 10), float(i)).t() for i in range(6)]
    with (pytest.raises(olmo_chunks.StorageError, match=r"rank-00000-001\.bin: injected write failure"),
          SaveSession(path, budget=1600) as s):
        s.begin(overwrite=True)
        s.write([(f"t{i}", _core.Box([0, 0], [10, 10]), t) for i, t in enumerate(parts)])
    # File 2 was staged while file 1's write failed; the failure surfaced before it was written.
    assert seen["staged"] == [0, 1, 2] and len(seen["threads"]) == 2
    assert sorted(os.listdir(tmp_path / "c" / "data")) == [before]  # the failed save's files are gone
    assert not (tmp_path / "c" / ".olmo_chunks.lease").exists()
    out = {"old": torch.zeros(3)}
    olmo_chunks.load(out, path)
    assert torch.equal(out["old"], torch.ones(3))


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
