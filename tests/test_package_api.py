"""The package's public surface: names resolved lazily from their submodules, the documented
`olmo_chunks.compute_weights(...)` call, the INFO summary of a save and a load, and byte progress
from the core's verification."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import _core


def test_every_public_name_resolves() -> None:
    from olmo_chunks import ChecksumError, load, save  # noqa: F401  (from-imports go through __getattr__)

    for name in olmo_chunks.__all__:
        assert getattr(olmo_chunks, name) is not None, name
    assert set(olmo_chunks.__all__) <= set(dir(olmo_chunks))
    assert olmo_chunks.save is olmo_chunks.checkpoint.save and olmo_chunks.errors.ChecksumError is ChecksumError
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = olmo_chunks.no_such_name


def test_compute_weights_is_the_function_even_after_its_module_was_imported() -> None:
    code = ("import olmo_chunks.weights, olmo_chunks, torch; "
            "out = olmo_chunks.compute_weights({'w': torch.ones(3)}); "
            "assert olmo_chunks.compute_weights is olmo_chunks.weights.compute_weights; "
            "assert out['w'].dtype == torch.bfloat16 and out['w'].tolist() == [1.0, 1.0, 1.0]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert callable(olmo_chunks.compute_weights)


def test_save_and_load_log_one_info_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="olmo_chunks")
    sd = {"w": torch.randn(1000), "b": torch.zeros(24, dtype=torch.bfloat16), "step": 3}
    olmo_chunks.save(sd, tmp_path / "c")
    olmo_chunks.load(sd, tmp_path / "c")
    lines = [r.getMessage() for r in caplog.records if r.name == "olmo_chunks.checkpoint"]
    assert [line.split(" in ")[0] for line in lines] == [
        f"saved 0.00 GB (4048 bytes) to {tmp_path / 'c'}",
        f"loaded 0.00 GB (4048 bytes) from {tmp_path / 'c'}",
    ]
    assert lines[0].endswith(" GB/s, 1 rank)") and lines[1].endswith(" GB/s, rank 0 of 1)")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "olmo_chunks.checkpoint")


def test_verify_progress_counts_up_to_the_total(tmp_path: Path) -> None:
    olmo_chunks.save({f"t{i}": torch.randn(1 << 20) for i in range(8)}, tmp_path / "c", block_size=1 << 16)
    m = _core.Manifest.open(str(tmp_path / "c"))
    seen: list[int] = []
    total = m.verify_data(1, progress=seen.append)
    assert total == 8 * 4 << 20
    assert seen and seen[-1] == total
    assert seen == sorted(set(seen))  # strictly increasing
    assert m.verify_data(2, progress=None) == total

    def fail(done: int) -> None:
        raise KeyError("stop")

    with pytest.raises(KeyError, match="stop"):
        m.verify_data(1, progress=fail)
