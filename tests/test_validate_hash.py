"""`validate-conversion` hashes each HF file in bounded memory: streamed through one buffer of at most
the memory budget (and at most 8 MiB), never read whole. Python-heap peaks are measured with
tracemalloc, which sees every bytes/bytearray the hashing allocates."""

import hashlib
import os
import tracemalloc

import pytest
import torch
from olmo_chunks.hf.validate import _hash_file, validate_conversion

from tests.test_export import hf_config, olmoe_hf_oracle, olmoe_native, save_native, write_hf

MiB = 1 << 20


def _peak(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("hash") / "shard.bin"
    with open(p, "wb") as f:
        for _ in range(5):
            f.write(os.urandom(8 * MiB))
        f.write(os.urandom(8 * MiB - 12_345))  # not a multiple of any buffer size
    return p


@pytest.mark.parametrize("budget", [64 << 10, 1 * MiB, 8 * MiB, 1 << 30])
def test_hash_file_streams_in_bounded_memory(big_file, budget):
    size = big_file.stat().st_size
    assert size > 40 * MiB
    got, peak = _peak(lambda: _hash_file(big_file, budget))
    assert got == hashlib.sha256(big_file.read_bytes()).hexdigest()
    # One buffer of min(budget, 8 MiB), plus small change: never the file.
    assert peak < min(budget, 8 * MiB) + 256 * 1024, (budget, peak)
    assert peak < size / 4


def test_hash_file_edge_cases(tmp_path):
    assert _hash_file(tmp_path / "absent") is None
    (tmp_path / "empty").write_bytes(b"")
    assert _hash_file(tmp_path / "empty", 1) == hashlib.sha256(b"").hexdigest()
    (tmp_path / "odd").write_bytes(b"x" * 1001)
    assert _hash_file(tmp_path / "odd", 7) == hashlib.sha256(b"x" * 1001).hexdigest()


def test_validate_conversion_hashes_a_shard_larger_than_the_budget(tmp_path):
    """A 32 MiB shard validated with a 1 MiB budget: its recorded sha256 is the whole file's, and the
    Python heap never held it (before the fix the report built it with `read_bytes`)."""
    t = olmoe_native(seed=5)
    save_native(tmp_path / "native", t, moments=False)
    # The model's tensors plus one unmapped 32 MiB tensor, which gets a shard of its own.
    tensors = {**olmoe_hf_oracle(t), "extra.padding": torch.randn(8 * MiB)}
    write_hf(tmp_path / "hf", tensors, hf_config(), shard=MiB)
    shard = max((tmp_path / "hf").glob("*.safetensors"), key=lambda f: f.stat().st_size)
    assert shard.stat().st_size > 32 * MiB and len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    report, peak = _peak(
        lambda: validate_conversion(
            tmp_path / "native", tmp_path / "hf", mapping="olmoe", round_trip=False, memory_budget=MiB
        )
    )
    assert report["hf_files"][shard.name] == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert any("extra.padding" in f for f in report["failures"])  # an unmapped tensor still fails
    assert peak < 2 * MiB, peak  # the 1 MiB hash buffer and small change; the shard is 32 MiB
