"""The benchmark harness at a tiny size: every row is there, figures are sane and every load it
timed was bit-exact (the harness raises otherwise). No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from olmo_chunks import bench

from tests import world
from tests.s3server import in_env

ROOT = Path(__file__).resolve().parent.parent


def test_model_spec_is_olmo_like_and_sized() -> None:
    specs = bench.model_spec(2 << 30)
    assert abs(bench.state_nbytes(specs) / (2 << 30) - 1) < 0.05
    keys = {s.key for s in specs}
    for s in specs:
        if s.key.startswith("model."):
            name = s.key.removeprefix("model.")
            assert {f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"} <= keys
    assert any(s.expert for s in specs) and any(not s.expert for s in specs)
    assert len(specs) == 3 * len({s.key for s in specs if s.key.startswith("model.")})


def test_the_raw_read_reads_the_checkpoints_own_bytes(tmp_path: Path) -> None:
    """The load roofline reads the native checkpoint's data files: a one-tensor checkpoint's file
    starts with the tensor's bytes, and only its data files are listed."""
    from olmo_chunks import checkpoint

    t = torch.arange(3 << 18, dtype=torch.int32)
    checkpoint.save({"t": t}, str(tmp_path / "ck"))
    files = bench.data_files(str(tmp_path / "ck"))
    assert [(Path(f).parent.parent.name, Path(f).suffix) for f, _ in files] == [("data", ".bin")]
    assert files[0][1] == os.path.getsize(files[0][0]) >= t.nbytes
    out = torch.zeros(t.nbytes, dtype=torch.uint8)
    bench._raw_read(files, 0, out)
    assert torch.equal(out.view(torch.int32), t)
    assert bench.data_files(str(tmp_path / "missing")) == []


def test_reshard_bench_tiny(tmp_path: Path, s3) -> None:
    url = f"s3://{s3.bucket()}/runs"
    opts = bench.Options(size_bytes=3 << 20, reps=1, root=str(tmp_path), threads=(1, 2), url=url,
                         storage_gbps=2.0)
    results = world.run(bench.WORLD, in_env, s3.env(), bench.run_on_rank, opts, timeout=600)
    res = results[0]
    assert results[1:] == [None] * (bench.WORLD - 1)
    assert res["state_bytes"] == bench.state_nbytes(bench.model_spec(3 << 20))
    contenders = {"native", "ours-dcp", "dcp-fs t=1", "dcp-fs t=2", "raw@url", "native@url", "ours-dcp@url"}
    saved = {a.label for _, a, _ in bench.PAIRS}
    got = {(r["where"], r["method"]) for r in res["save"]}
    assert got == {(w, m) for w in saved for m in contenders | {"raw"}}
    assert {(r["where"], r["method"]) for r in res["stage"]} == {
        (w, m) for w in saved for m in ("native", "dcp", "raw")}
    assert {(r["where"], r["method"]) for r in res["load"]} == {
        (name, m) for name, _, _ in bench.PAIRS
        for m in contenders | {"raw", "native-noverify", "native-once", "native-direct", "native-once@url",
                               "native-direct@url"}}
    for name, _, _ in bench.PAIRS:
        read = {r["method"]: r["read_x"] for r in res["load"] if r["where"] == name}
        assert read["raw"] == 1.0  # the loading ranks' shares of the raw files, once
        # an object store's rows against its own roofline, which reads the same bytes once in 8 MiB GETs
        rows = {r["method"]: r for r in res["load"] if r["where"] == name}
        assert math.isclose(rows["native@url"]["of_roofline"], rows["native@url"]["gbps"] / rows["raw@url"]["gbps"])
        assert sum(rows["raw@url"]["requests_per_rank"]) >= math.ceil(res["state_bytes"] / (8 << 20))
        # every contender reads at least the checkpoint's bytes; reading once never reads more than direct
        assert all(x >= 1.0 for x in read.values()), read
        assert read["native-once"] <= read["native-direct"] + 1e-9, read
        for suffix in ("", "@url"):  # auto against its two modes, on local storage and on the object store
            auto = rows[f"native{suffix}"]
            modes = [rows[f"native-{m}{suffix}"]["gbps"] for m in ("once", "direct")]
            assert auto["chose"] in ("once", "direct") and math.isclose(auto["of_best_mode"], auto["gbps"] / max(modes))
            # The default reads what the mode it chose reads.
            assert read[f"native{suffix}"] == pytest.approx(read[f"native-{auto['chose']}{suffix}"], rel=0.05), (
                read, auto["chose"])
    assert {(r["where"], r["method"]) for r in res["stall"]} == {
        (w, m) for w in saved for m in ("raw", "native", "native-async", "dcp-async")}
    for row in res["save"] + res["stage"] + res["stall"] + res["load"]:
        assert len(row["seconds"]) == 1
        assert row["best_s"] > 0 and math.isfinite(row["gbps"]) and row["gbps"] > 0
        assert row["peak_extra_rss_mib"] >= 0
        assert math.isclose(row["gbps"], res["state_bytes"] / row["best_s"] / 1e9)
        if row["method"] in ("raw", "raw@url"):
            assert row["of_roofline"] == 1.0
        if row["method"].endswith("@url") and row in res["save"] + res["load"]:
            assert len(row["requests_per_rank"]) == bench.WORLD and sum(row["requests_per_rank"]) > 0
        else:
            assert row["requests_per_rank"] is None
    for row in res["save"] + res["load"]:
        dcp_best = max(r["gbps"] for r in res[("save" if row in res["save"] else "load")]
                       if r["where"] == row["where"] and r["method"].startswith("dcp"))
        assert math.isclose(row["x_dcp"], row["gbps"] / dcp_best)
    table = bench.format_table(res)
    for name, a, _ in bench.PAIRS:
        assert name in table and a.label in table
    assert "olmo_chunks async_save" in table and "DCP async_save" in table
    for label in ("olmo_chunks native", "olmo_chunks native, verify=False", "olmo_chunks via DCP",
                  "DCP FileSystemWriter t=2", "DCP FileSystemReader", "roofline: raw read", "roofline: raw write+fsync",
                  "DCP DefaultStager", "warm page cache", "storage capped at 2 GB/s",
                  "read=direct", "read=once", "read=auto", "chose ", "of the better mode", "read x",
                  "olmo_chunks native (read=auto) @url", "requests ", "roofline: object_store GETs @url",
                  "roofline: object_store PUTs @url"):
        assert label in table
    assert json.loads(json.dumps(res)) == res
    assert not (tmp_path / "bench").exists()


def _bench_script(name: str) -> ModuleType:
    """A script of benches/ imported as a module (run in this process: no interpreter start-up)."""
    spec = importlib.util.spec_from_file_location(f"benches_{name}", ROOT / "benches" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _resident(path: Path) -> float:
    """The share of `path`'s pages in the page cache (mincore over a private mapping)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        buf = (ctypes.c_char * size).from_buffer(mm)
        vec = (ctypes.c_ubyte * -(-size // page))()
        try:
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
        finally:
            del buf
    return sum(v & 1 for v in vec) / len(vec)


def test_cold_loads_drop_the_checkpoint_from_the_page_cache(tmp_path: Path) -> None:
    data = tmp_path / "ckpt" / "data"
    data.mkdir(parents=True)
    files = [data / f"rank-{i}.bin" for i in range(2)]
    for f in files:
        f.write_bytes(bytes(range(256)) * (16 << 10))  # 4 MiB
    bench._warm([str(tmp_path / "ckpt")], 0, 1)
    assert all(_resident(f) == 1.0 for f in files)
    if bench.machine_info(str(tmp_path))["disk"].split("\n")[-1].startswith("tmpfs"):
        pytest.skip("tmpfs keeps its pages")
    os.sync()  # dirty pages are not dropped; a save's files are fsynced
    bench._drop([str(tmp_path / "ckpt")], 0, 1)
    assert all(_resident(f) < 0.1 for f in files), [_resident(f) for f in files]


def test_plan_scale_small_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench_script("plan_scale").main(["--ranks", "64", "--tensors", "6", "--reps", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("1-D", "2-D"))]
    # three load cases (1-D, 2-D to 4x16, 2-D to 5x13), each by three planners
    assert len(rows) == 9
    assert {r[-4] for r in rows} == {"native", "ours-dcp", "dcp"}
    for r in rows:
        open_ms, plan_ms, items = float(r[-3]), float(r[-2]), int(r[-1])
        assert open_ms >= 0 and plan_ms >= 0 and items > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_gpu_check_cpu_dry_run(tmp_path: Path) -> None:
    assert _bench_script("gpu_check").main(["--cpu", "--gib", "0.01", "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["load"]["exact"] is True and rep["compute_weights"]["dtype_ok"] is True
    for step in ("save", "load", "compute_weights"):
        assert rep[step]["gbps"] > 0 and rep[step]["samples"] >= 2
        assert rep[step]["allocated_sampled_max_mib"] >= rep[step]["allocated_start_mib"]
    assert rep["copy"]["h2d_gbps"] > 0 and rep["copy"]["d2h_gbps"] > 0
    assert rep["save"]["of_d2h"] > 0 and rep["load"]["of_h2d"] > 0
    assert rep["raw_read_gbps"] > 0 and rep["load"]["of_raw_read"] > 0
    assert not os.path.exists(rep["dir"])  # its temp dir is removed


def test_gpu_check_skips_cleanly_without_cuda(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench_script("gpu_check").main([]) == 0
    assert "skipped" in capsys.readouterr().out


def test_read_pace_caps_storage_reads() -> None:
    import time

    from olmo_chunks import _core

    _core.set_read_pace(10_000_000)
    try:
        t0 = time.perf_counter()
        for _ in range(4):
            _core.pace_read(500_000)
        paced = time.perf_counter() - t0
    finally:
        _core.set_read_pace(0)
    t0 = time.perf_counter()
    _core.pace_read(10**12)  # no cap: no wait
    assert paced >= 0.19 and time.perf_counter() - t0 < paced


def test_compression_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "z.json"
    args = ["--mib", "0.25", "--reps", "1", "--levels", "1", "--dir", str(tmp_path), "--json", str(out)]
    assert _bench_script("compression").main(args) == 0
    rep = json.loads(out.read_text())
    assert set(rep["roles"]) == {"main_weight fp32", "exp_avg fp32", "exp_avg_sq fp32", "bf16 export"}
    for rows in rep["roles"].values():
        assert rows["raw"]["ratio"] == 1.0 and 0 < rows["zstd-1"]["ratio"] < 0.95
        assert set(rows["zstd-1"]["pays_below_gbps"]) == {"save", "load"}
        assert all(r["save_gbps"] > 0 and r["load_gbps"] > 0 for r in rows.values())


def test_save_staging_bench_tiny(tmp_path: Path) -> None:
    # 32 transposed tensors of 128 KiB in files of 512 KiB: staged, double-buffered, verified.
    out = subprocess.run([sys.executable, str(ROOT / "benches" / "save_staging.py"), "--gib", "0.004",
                          "--budget-mib", "1", "--reps", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "files of 0.5 MiB" in out.stdout and "olmo_chunks save (double-buffered)" in out.stdout
    assert os.listdir(tmp_path) == []  # its checkpoints are removed


@pytest.mark.parametrize("protocol", ["now", "before"])
def test_coord_scale_tiny(protocol: str) -> None:
    """The coordination harness runs both protocols to the end: every step, then one failure that
    reaches every simulated rank (the harness exits non-zero otherwise), with the serial CPU of a
    step (the store's server, the root)."""
    if protocol == "before" and subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "eedafe9"],
                                               capture_output=True).returncode != 0:
        pytest.skip("the history holding the old protocol is not in this clone")
    out = subprocess.run([sys.executable, str(ROOT / "benches" / "coord_scale.py"), "--ranks", "16", "--procs", "2",
                          "--ops", "2", "--protocol", protocol, "--straggle", "0.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    if protocol == "now":  # requests counted by the core's client only
        assert lines[-2].startswith("while rank 15 came 0.5 s late, the other 15 ranks sent the store ")
        del lines[-2]
    assert lines[-2].startswith("CPU per step: the store's server ") and "rank 0 (the root)" in lines[-2]
    assert "a failure on rank 15 reached all 16 ranks" in lines[-3]
    assert lines[-1].startswith("coordination: 16 ranks, ") and "ms per step (median)" in lines[-1]
