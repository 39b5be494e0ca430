"""A save whose tensors must be staged in host memory first: double-buffered against serial.

    python benches/save_staging.py --gib 1 --budget-mib 256 --dir /dev/shm [--device cuda]

`olmo_chunks.save` stages accelerator tensors (and non-contiguous CPU ones) into a host buffer
before writing them, in data files of half `OLMO_CHUNKS_STAGING_BYTES`; the file before is written
by a thread while the next is staged (`SaveSession`). The state here is `--gib` of FP32 in 32
square tensors: on `--device cuda` plain device tensors, on the CPU transposed views (so they are
staged the same way, by a CPU copy instead of a DMA). Rows, best of `--reps`, contenders
interleaved: the save as shipped; the same with each file's write waited for before the next is
staged (serial, the behaviour before double buffering); torch DCP's FileSystemWriter; and the
machine's parts alone: the staging copy of every byte, and a raw write of the same bytes from
contiguous memory. Double buffering can at best take max(copy, write) for copy + write. The
checkpoint saved last is loaded back and compared with the state (exit 1 if it differs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _contenders(state: dict[str, torch.Tensor], root: Path, device: str) -> dict[str, Callable[[], None]]:
    """The rows: each a callable that makes its save (or its part of one) once."""
    import olmo_chunks
    import torch.distributed.checkpoint as dcp
    from olmo_chunks import session

    start = session.SaveSession._start

    def serial(self: session.SaveSession) -> None:
        start(self)
        self._wait()

    def ours(pipelined: bool) -> None:
        session.SaveSession._start = start if pipelined else serial  # type: ignore[method-assign]
        try:
            olmo_chunks.save(state, root / "ours", overwrite=True)
        finally:
            session.SaveSession._start = start  # type: ignore[method-assign]

    def dcp_save() -> None:
        shutil.rmtree(root / "dcp", ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / "dcp")))

    host = [torch.empty(t.shape, dtype=t.dtype) for t in state.values()]

    def copy() -> None:
        for h, t in zip(host, state.values(), strict=True):
            h.copy_(t)
        _sync(device)

    def raw_write() -> None:
        with open(root / "raw", "wb") as f:
            for h in host:
                f.write(h.numpy().data)
            f.flush()
            os.fsync(f.fileno())

    return {
        "olmo_chunks save (double-buffered)": lambda: ours(True),
        "olmo_chunks save, serial staging": lambda: ours(False),
        "DCP FileSystemWriter": dcp_save,
        "staging copy alone": copy,
        "raw write alone (contiguous)": raw_write,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--budget-mib", type=int, default=256, help="OLMO_CHUNKS_STAGING_BYTES in MiB")
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoints go (removed after)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    os.environ["OLMO_CHUNKS_STAGING_BYTES"] = str(args.budget_mib << 20)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    n = 32
    side = int((args.gib * 2**30 / 4 / n) ** 0.5)
    if args.device == "cuda":
        state = {f"t{i}": torch.randn(side, side, device="cuda") for i in range(n)}
    else:
        state = {f"t{i}": torch.randn(side, side).t() for i in range(n)}
    total = sum(t.numel() * 4 for t in state.values())
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="save-staging-"))
    rows = _contenders(state, root, args.device)
    best = dict.fromkeys(rows, float("inf"))
    try:
        names = list(rows)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotated order
                _sync(args.device)
                t0 = time.perf_counter()
                rows[name]()
                best[name] = min(best[name], time.perf_counter() - t0)
        import olmo_chunks

        back = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in state.items()}
        olmo_chunks.load(back, root / "ours")
        if not all(torch.equal(back[k], t.cpu()) for k, t in state.items()):
            print("the saved bytes differ from the state", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ideal = max(best["staging copy alone"], best["raw write alone (contiguous)"])
    print(f"{total / 2**30:.2f} GiB on {args.device}, files of {args.budget_mib / 2:g} MiB, best of {args.reps}")
    print(f"  {'':36s} {'best s':>8s} {'GB/s':>7s} {'of ideal':>9s}")
    for name, s in best.items():
        print(f"  {name:36s} {s:8.3f} {total / s / 1e9:7.2f} {ideal / s:8.0%}")
    serial_sum = best["staging copy alone"] + best["raw write alone (contiguous)"]
    print(f"  ideal: max(copy, write) {ideal:.3f} s; copy + write {serial_sum:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
