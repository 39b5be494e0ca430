"""Saving experts makes no copy of the expert storage: the writer is handed the live storage's own
memory (checked on a gloo world), and peak RSS does not grow by the storage size (checked in a
fresh process, against a control that does copy)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import olmo_chunks as oc
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import _core
from olmo_chunks.experts import ExpertLayout

from tests import world


def _save_and_record_writer_pointers(path, sharded):
    rank = dist.get_rank()
    lo = ExpertLayout(8, (16, 8), rank // 2, 2, rank % 2, 2, sharded=sharded)
    storages = {name: torch.randn(lo.local_numel) for name in ("main", "exp_avg", "exp_avg_sq")}
    state = {"experts": {name: lo.view(t) for name, t in storages.items()}}
    handed = []
    original = _core.write_chunks

    def recording(dir, rel_path, items, *args, **kwargs):
        handed.extend((item.address, item.nbytes) for item in items)
        return original(dir, rel_path, items, *args, **kwargs)

    _core.write_chunks = recording
    try:
        oc.save(state, path)
    finally:
        _core.write_chunks = original
    spans = {name: (t.data_ptr(), t.numel() * t.element_size()) for name, t in storages.items()}
    inside = [any(p == start and n == size for start, size in spans.values()) for p, n in handed]
    return inside, sum(n for _, n in handed), sum(size for _, size in spans.values())


def test_writer_gets_the_live_storage_sharded(tmp_path):
    out = world.run(4, _save_and_record_writer_pointers, str(tmp_path / "ck"), True)
    for inside, handed, held in out:
        assert inside and all(inside)  # every chunk is exactly one live storage, not a copy
        assert handed == held  # EP-DP shards are disjoint: each rank writes all it holds


def test_writer_gets_the_live_storage_replicated(tmp_path):
    out = world.run(4, _save_and_record_writer_pointers, str(tmp_path / "ck"), False)
    assert all(all(inside) for inside, _, _ in out)
    # Each EP-MP block is written once by one of its two EP-DP replicas.
    assert sum(handed for _, handed, _ in out) == sum(held for _, _, held in out) // 2


RSS_PROBE = textwrap.dedent("""
    import json, sys, threading, psutil, torch, olmo_chunks as oc
    from olmo_chunks.experts import ExpertLayout
    torch.set_num_threads(1)
    path, mib = sys.argv[1], int(sys.argv[2])
    n = mib * 2**20 // 4
    lo = ExpertLayout(64, (n // 64,))
    storage = torch.randn(lo.local_numel)
    proc = psutil.Process()

    def growth(fn):
        # Peak resident memory while fn runs, above what was resident just before (sampled).
        base = proc.memory_info().rss
        peak, done = [base], threading.Event()
        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                done.wait(0.001)
        t = threading.Thread(target=sample)
        t.start()
        try:
            fn()
        finally:
            done.set()
            t.join()
        return max(peak[0], proc.memory_info().rss) - base

    view = growth(lambda: oc.save({"experts": lo.view(storage)}, path + "/view"))
    # Control: a transposed view must be made contiguous, i.e. copied, before writing.
    copy = growth(lambda: oc.save({"experts": storage.reshape(64, -1).t()}, path + "/copy"))
    print(json.dumps({"storage": storage.numel() * 4, "view": view, "copy": copy}))
""")


def test_saving_experts_does_not_grow_peak_rss(tmp_path):
    mib = 128
    proc = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path), str(mib)], capture_output=True,
                          text=True, timeout=300, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["storage"] == mib * 2**20
    assert r["view"] < r["storage"] // 16, r  # no copy of the expert storage
    assert r["copy"] > r["storage"] // 2, r  # the probe does see a copy when there is one


def test_gpu_memory_check_script_runs(tmp_path):
    """The lent-GPU script works end to end; here (no CUDA) as its CPU dry run."""
    out = tmp_path / "report.json"
    script = Path(__file__).resolve().parent.parent / "benches" / "gpu_memory_check.py"
    args = ["--cpu", "--gib", "0.01", "--experts", "8", "--json", str(out)]
    subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                   check=True)
    r = json.loads(out.read_text())
    assert r["load_exact"] is True
    assert {"before_save", "save", "load", "compute_weights", "save_growth_mib"} <= r.keys()
    assert r["compute_weights"]["bf16_mib"] == pytest.approx(0.01 * 1024 / 2, rel=0.01)
