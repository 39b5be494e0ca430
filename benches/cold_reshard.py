"""A cold resharded load against torch DCP: FP32 DTensors saved on 4 ranks `Shard(0)`, loaded on 2
ranks `Shard(1)` (every loading rank needs part of every saved chunk), the page cache dropped
before each load.

    python benches/cold_reshard.py --gib 1 --reps 3

Rows: olmo-chunks' default (`read="auto"`, its choice and why), `read="direct"`, and DCP's
FileSystemReader on a checkpoint of the same state written by DCP's FileSystemWriter; in turn
within each repetition, so drifting machine load hits them alike. Best and median seconds (slowest
rank), GB/s of the state, and DCP's best over each row's best.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import warnings

import olmo_chunks
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from olmo_chunks.bench import rendezvous_url, timed
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

warnings.filterwarnings("ignore")

KEYS, COLS = 8, 4096


def _state(mesh: DeviceMesh, gib: float, dim: int, fill: bool) -> dict:
    rows = int(gib * (1 << 30) / 4 / KEYS / COLS)
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": distribute_tensor(torch.randn(rows, COLS, generator=g) if fill else torch.zeros(rows, COLS),
                                       mesh, [Shard(dim)], src_data_rank=None) for i in range(KEYS)}


def _drop(path: str) -> None:
    """Drops `path`'s files from the page cache."""
    for f in glob.glob(os.path.join(path, "**", "*"), recursive=True):
        if os.path.isfile(f):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _worker(rank: int, size: int, url: str, root: str, gib: float, reps: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=size)
    two = dist.new_group([0, 1])
    src = _state(DeviceMesh("cpu", torch.arange(4)), gib, 0, True)
    ours, theirs = os.path.join(root, "ours"), os.path.join(root, "dcp")
    olmo_chunks.save(src, ours)
    dcp.save(src, storage_writer=dcp.FileSystemWriter(theirs))
    del src
    mesh = DeviceMesh("cpu", torch.arange(2))
    dst = _state(mesh, gib, 1, False) if rank < 2 else None
    times: dict[str, list[float]] = {"auto": [], "direct": [], "dcp": []}
    for rep in range(reps):
        for name in times:
            if rank == 0:
                _drop(ours)
                _drop(theirs)
            dist.barrier()

            def load(name: str = name, rep: int = rep) -> None:
                if dst is None:
                    return
                if name == "dcp":
                    dcp.load(dst, storage_reader=dcp.FileSystemReader(theirs), process_group=two)
                    return
                r = olmo_chunks.load(dst, ours, read=name, process_group=two).reading
                if rank == 0 and rep == 0 and name == "auto":
                    out["why"] = f"{r.read}: {r.why}"

            times[name].append(timed(load))
    if dst is not None:
        want = _state(mesh, gib, 1, True)
        assert all(torch.equal(dst[k].to_local(), want[k].to_local()) for k in dst)
    if rank == 0:
        out.update({k: (min(v), statistics.median(v)) for k, v in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="cold-reshard-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(4, rendezvous_url(), root, args.gib, args.reps, out), nprocs=4)
            res = dict(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = args.gib * (1 << 30)
    print(f"{args.gib:g} GiB FP32, Shard(0) on 4 ranks -> Shard(1) on 2, cold page cache, best of {args.reps}")
    print(f"auto chose {res['why']}")
    for name in ("auto", "direct", "dcp"):
        best, median = res[name]
        print(f"  {name:7s} best {best:.3f} s  median {median:.3f} s  {nbytes / best / 1e9:5.2f} GB/s  "
              f"x DCP {res['dcp'][0] / best:.2f}")


if __name__ == "__main__":
    main()
