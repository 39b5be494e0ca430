"""The benchmark harness at a tiny size: every row is there, figures are sane and every load it
timed was bit-exact (the harness raises otherwise). No timing assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from olmo_chunks import bench

from tests import world

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


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


def test_reshard_bench_tiny(tmp_path: Path) -> None:
    opts = bench.Options(size_bytes=3 << 20, reps=1, root=str(tmp_path), threads=(1, 2))
    results = world.run(bench.WORLD, bench.run_on_rank, opts, timeout=600)
    res = results[0]
    assert results[1:] == [None] * (bench.WORLD - 1)
    assert res["state_bytes"] == bench.state_nbytes(bench.model_spec(3 << 20))
    contenders = {"native", "ours-dcp", "dcp-fs t=1", "dcp-fs t=2"}
    saved = {a.label for _, a, _ in bench.PAIRS}
    got = {(r["where"], r["method"]) for r in res["save"]}
    assert got == {(w, m) for w in saved for m in contenders | {"raw"}}
    assert {(r["where"], r["method"]) for r in res["stage"]} == {
        (w, m) for w in saved for m in ("native", "dcp", "raw")}
    assert {(r["where"], r["method"]) for r in res["load"]} == {
        (name, m) for name, _, _ in bench.PAIRS for m in contenders | {"raw"}}
    for row in res["save"] + res["stage"] + res["load"]:
        assert len(row["seconds"]) == 1
        assert row["best_s"] > 0 and math.isfinite(row["gbps"]) and row["gbps"] > 0
        assert row["peak_extra_rss_mib"] >= 0
        assert math.isclose(row["gbps"], res["state_bytes"] / row["best_s"] / 1e9)
        if row["method"] == "raw":
            assert row["of_roofline"] == 1.0
    for row in res["save"] + res["load"]:
        dcp_best = max(r["gbps"] for r in res[("save" if row in res["save"] else "load")]
                       if r["where"] == row["where"] and r["method"].startswith("dcp"))
        assert math.isclose(row["x_dcp"], row["gbps"] / dcp_best)
    table = bench.format_table(res)
    for name, a, _ in bench.PAIRS:
        assert name in table and a.label in table
    for label in ("olmo_chunks native", "olmo_chunks via DCP", "DCP FileSystemWriter t=2",
                  "DCP FileSystemReader", "roofline: raw read", "roofline: raw write+fsync",
                  "DCP DefaultStager", "warm page cache"):
        assert label in table
    assert json.loads(json.dumps(res)) == res
    assert not (tmp_path / "bench").exists()
