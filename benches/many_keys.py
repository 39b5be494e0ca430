"""What a load costs per key: the same bytes as a few large tensors and as many small ones, loaded
by olmo-chunks and by torch DCP's FileSystemReader, against a raw read of the same bytes.

    python benches/many_keys.py --ranks 4 --mb 64 --keys 16,1000 --reps 8

Each rank holds DTensors `Shard(0)` (rows x 64 FP32) and loads them back in the same layout, from
the page cache, so what differs between the key counts is the work per key (describing each
tensor, planning its reads, the fills) and not the bytes. Per key count it prints the median and
best load in ms (slowest rank), DCP over ours, and, against the fewest keys, the cost of one more
key in microseconds.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time
import warnings

import olmo_chunks
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from olmo_chunks.bench import rendezvous_url
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

warnings.filterwarnings("ignore")


def _state(mesh, keys: int, total_mb: int, fill: bool) -> dict:
    rows = max(mesh.size(), (total_mb << 20) // 4 // 64 // keys)
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": distribute_tensor(torch.randn(rows, 64, generator=g) if fill else torch.zeros(rows, 64),
                                               mesh, [Shard(0)], src_data_rank=None) for i in range(keys)}


def _raw_read(root: str, rank: int, size: int) -> float:
    """Seconds for this rank to read its share of the checkpoint's data files with pread."""
    files = sorted(glob.glob(os.path.join(root, "data", "*", "*.bin")))
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // size, total * (rank + 1) // size
    buf = bytearray(hi - lo)
    t0 = time.perf_counter()
    pos = 0
    for f, n in zip(files, sizes, strict=True):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            fd = os.open(f, os.O_RDONLY)
            try:
                view = memoryview(buf)[a - lo:b - lo]
                done = 0
                while done < len(view):
                    done += os.preadv(fd, [view[done:]], a - pos + done)
            finally:
                os.close(fd)
        pos += n
    return time.perf_counter() - t0


def _worker(rank: int, size: int, url: str, root: str, counts: list[int], total_mb: int, reps: int,
            out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    for keys in counts:
        ours, theirs = os.path.join(root, f"ours-{keys}"), os.path.join(root, f"dcp-{keys}")
        src = _state(mesh, keys, total_mb, True)
        olmo_chunks.save(src, ours)
        dcp.save(src, storage_writer=dcp.FileSystemWriter(theirs))
        dst = _state(mesh, keys, total_mb, False)
        times: dict[str, list[float]] = {"ours": [], "dcp": [], "raw": []}
        runs = {"ours": lambda dst=dst, path=ours: olmo_chunks.load(dst, path),
                "dcp": lambda dst=dst, path=theirs: dcp.load(dst, storage_reader=dcp.FileSystemReader(path)),
                "raw": lambda path=ours: _raw_read(path, rank, size)}
        for _ in range(reps):  # interleaved, so drifting machine load hits them alike
            for name, run in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                run()
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
                times[name].append(float(elapsed))
        assert all(torch.equal(dst[k].to_local(), src[k].to_local()) for k in src)
        if rank == 0:
            out[keys] = {name: (statistics.median(v), min(v)) for name, v in times.items()}
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=int, default=64, help="state dict size in MiB (all ranks together)")
    ap.add_argument("--keys", default="16,1000", help="key counts, comma-separated")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    counts = sorted(int(k) for k in args.keys.split(","))
    root = tempfile.mkdtemp(prefix="many-keys-")
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(args.ranks, rendezvous_url(), root, counts, args.mb, args.reps, out),
                     nprocs=args.ranks)
            res = dict(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.ranks} ranks, {args.mb} MiB state dict, Shard(0) -> Shard(0), warm page cache; "
          f"ms per load (median / best of {args.reps}, slowest rank)")
    print(f"{'keys':>6} {'ours':>14} {'dcp':>14} {'raw read':>14} {'dcp/ours':>9} {'us per key (ours, dcp)':>24}")
    base = res[counts[0]]
    for keys in counts:
        r = res[keys]
        per_key = "" if keys == counts[0] else "  ".join(
            f"{(r[n][0] - base[n][0]) / (keys - counts[0]) * 1e6:.0f}" for n in ("ours", "dcp"))
        cells = [f"{r[n][0] * 1e3:6.1f} / {r[n][1] * 1e3:5.1f}" for n in ("ours", "dcp", "raw")]
        ratio = r["dcp"][0] / r["ours"][0]
        print(f"{keys:>6} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {ratio:>8.1f}x {per_key:>24}")


if __name__ == "__main__":
    main()
