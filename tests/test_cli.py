"""The olmo-chunks CLI: inspect and verify, with clean failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import _core


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "olmo_chunks", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    p = 1000
    sd = {
        "model": {"w": torch.randn(p, dtype=torch.float32)},
        "optim": {"w": {"exp_avg": torch.randn(p), "exp_avg_sq": torch.rand(p), "step": torch.tensor(3.0)}},
        "trainer": {"step": 3},
    }
    olmo_chunks.save(sd, tmp_path / "ckpt", block_size=1024)
    return tmp_path / "ckpt"


def test_inspect_shows_tensors_and_the_12p_breakdown(ckpt: Path):
    out = cli("inspect", str(ckpt))
    assert out.returncode == 0, out.stderr
    assert "model.w" in out.stdout and "optim.w.exp_avg_sq" in out.stdout
    assert "P = 1000 main-weight parameters" in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    assert rows["main_weight"][2] == "4.00P" and rows["exp_avg"][2] == "4.00P" and rows["exp_avg_sq"][2] == "4.00P"
    assert rows["total"][2] == "12.00P"


def test_inspect_json(ckpt: Path):
    out = cli("inspect", "--json", str(ckpt))
    s = json.loads(out.stdout)
    assert s["parameters"] == 1000 and s["total_bytes"] == 12004
    assert {t["key"]: t["role"] for t in s["tensors"]}["optim.w.step"] == "optimizer_state"
    totals = json.loads(cli("inspect", "--json", "--no-tensors", str(ckpt)).stdout)
    assert totals == {**{k: v for k, v in s.items() if k != "tensors"}, "tensor_count": len(s["tensors"])}


def test_verify_ok(ckpt: Path):
    out = cli("verify", str(ckpt))
    assert out.returncode == 0 and out.stdout.startswith("OK ")


def test_verify_names_tensor_and_chunk_of_a_flipped_byte(ckpt: Path):
    m = _core.Manifest.open(str(ckpt))
    keys = [t.key for t in m.tensors]
    t = keys.index("optim.w.exp_avg")
    offset = m.chunks(t)[0].offset
    f = ckpt / m.files[0].path
    data = bytearray(f.read_bytes())
    data[offset + 1500] ^= 0xFF
    f.write_bytes(bytes(data))
    out = cli("verify", str(ckpt))
    assert out.returncode == 1
    assert 'checksum mismatch in tensor "optim.w.exp_avg" chunk 0' in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_bad_path_is_a_clean_error(tmp_path: Path, cmd: str):
    out = cli(cmd, str(tmp_path / "missing"))
    assert out.returncode == 1
    assert "no such directory" in out.stderr and "Traceback" not in out.stderr
