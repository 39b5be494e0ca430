"""zstd-compressed chunks: ratio and save / load GB/s with and without compression, per role.

    python benches/compression.py --mib 64 --dir /tmp --json out.json

For each role (FP32 main weights, Adam `exp_avg` and `exp_avg_sq`, a BF16 export of the weights)
it saves `--mib` MiB of trained-like data in one process (`olmo_chunks.save`, fsynced) raw and with
zstd at each `--levels`, loads it back (`olmo_chunks.load`, checksums verified), checks the bytes,
and reports the stored/raw ratio and GB/s of raw bytes, best of `--reps`. Run it twice: with
`--dir` on the storage you care about, and on tmpfs (`/dev/shm`, the CPU-bound case). From the
tmpfs times it gives, per role, the storage bandwidth below which compression pays:
saving `raw` bytes costs about `raw / B + s` on storage of bandwidth `B` (`s` the tmpfs time), and
compressed `ratio * raw / B + s_zstd`, so compression wins when `B < raw * (1 - ratio) / (s_zstd - s)`.

Data (random-normal floats are nearly incompressible, and trained values are not much better: the
low mantissa bits of trained weights and moments are noise; what compresses is the sign/exponent
byte, which varies little within a row): weights `N(0, s_row)` with per-row `s_row` log-normal
around 0.02 (an OLMo-style init scale that training spreads); `exp_avg` a gradient EMA,
`N(0, 1e-4 * s_row / 0.02)`; `exp_avg_sq` the square of another such draw (positive, so its sign bit
is constant); the BF16 export is the weights cast.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import olmo_chunks
import torch


def role_data(mib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Trained-like tensors of about `mib` MiB each (see the module docstring)."""
    cols = 4096
    rows = max(1, int(mib * 2**20 / 4 / cols))
    g = torch.Generator().manual_seed(seed)
    scale = 0.02 * torch.exp(0.5 * torch.randn(rows, 1, generator=g))
    w = torch.randn(rows, cols, generator=g) * scale
    return {
        "main_weight fp32": w,
        "exp_avg fp32": torch.randn(rows, cols, generator=g) * (scale * 5e-3),
        "exp_avg_sq fp32": (torch.randn(rows, cols, generator=g) * (scale * 5e-3)) ** 2,
        "bf16 export": (torch.randn(2 * rows, cols, generator=g) * scale.repeat(2, 1)).bfloat16(),  # same MiB
    }


def _time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(t: torch.Tensor, root: Path, level: int | None, reps: int) -> dict[str, Any]:
    """Save and load GB/s of raw bytes and the stored/raw ratio of one tensor."""
    path = root / f"ckpt-{level}"
    kw: dict[str, Any] = {"compression": "zstd", "compression_level": level} if level is not None else {}
    save_s = _time(lambda: olmo_chunks.save({"t": t}, path, overwrite=True, **kw), reps)
    back = {"t": torch.empty_like(t)}
    load_s = _time(lambda: olmo_chunks.load(back, path), reps)
    assert torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))
    info = olmo_chunks._core.Manifest.open(str(path)).tensors[0]
    shutil.rmtree(path)
    raw = t.numel() * t.element_size()
    return {"ratio": info.stored_nbytes / info.nbytes, "save_s": save_s, "load_s": load_s,
            "save_gbps": raw / save_s / 1e9, "load_gbps": raw / load_s / 1e9, "raw_bytes": raw}


def break_even(raw: dict[str, Any], z: dict[str, Any], op: str) -> float | None:
    """Storage GB/s below which compression makes `op` faster (None: always, since it is not slower)."""
    extra = z[f"{op}_s"] - raw[f"{op}_s"]
    return None if extra <= 0 else raw["raw_bytes"] * (1 - z["ratio"]) / extra / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64, help="MiB per role")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="olmo-chunks-zbench-", dir=args.dir))
    report: dict[str, Any] = {"dir": str(root.parent), "mib": args.mib, "roles": {}}
    try:
        print(f"{'role':<18} {'codec':<8} {'stored/raw':>10} {'save GB/s':>10} {'load GB/s':>10}"
              f" {'pays below (save, load) GB/s':>30}")
        for role, t in role_data(args.mib).items():
            rows = {"raw": measure(t, root, None, args.reps)}
            for level in args.levels:
                rows[f"zstd-{level}"] = measure(t, root, level, args.reps)
            for name, r in rows.items():
                if name != "raw":
                    r["pays_below_gbps"] = {op: break_even(rows["raw"], r, op) for op in ("save", "load")}
                pays = r.get("pays_below_gbps")
                shown = "" if pays is None else ", ".join("always" if v is None else f"{v:.2f}"
                                                          for v in pays.values())
                print(f"{role:<18} {name:<8} {r['ratio']:>10.3f} {r['save_gbps']:>10.3f} {r['load_gbps']:>10.3f}"
                      f" {shown:>30}")
            report["roles"][role] = rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
