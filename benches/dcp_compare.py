"""Save and resharded-load throughput of the olmo-chunks DCP backend against DCP's FileSystemWriter /
FileSystemReader on the same data, plus load-planning time of FastLoadPlanner's index against DCP's
sweep line.

    python benches/dcp_compare.py --ranks 2 --mb 384 --dir /tmp/dcp-bench

Each rank holds DTensors sharded on dim 0 for the save and loads them sharded on dim 1, so every
rank reads part of every saved chunk. Loads run right after the saves, from the page cache (this
script does not drop caches on a shared machine); GB/s counts the bytes of the state dict.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from olmo_chunks.bench import rendezvous_url, timed  # the timer and rendezvous olmo-chunks bench uses
from olmo_chunks.dcp import ChunkStoreReader, ChunkStoreWriter, FastLoadPlanner, read_items_for_chunk_lists
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

warnings.filterwarnings("ignore")


def _state(mesh, total_mb: int, dim: int, fill: bool) -> dict:
    n_tensors = 12
    rows = max(1, (total_mb << 20) // 4 // n_tensors // 2048)
    sd = {}
    for i in range(n_tensors):
        full = (
            torch.randn(rows, 2048, generator=torch.Generator().manual_seed(i))
            if fill
            else torch.empty(rows, 2048)
        )
        sd[f"layers.{i}.w"] = distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=None)
    return sd


def _nbytes(sd: dict) -> int:
    """Bytes of the global tensors (a DTensor's numel is the global one)."""
    return sum(v.numel() * v.element_size() for v in sd.values())


def _worker(rank: int, size: int, rendezvous: str, root: str, total_mb: int, reps: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    src = _state(mesh, total_mb, 0, True)
    gb = _nbytes(src) / 1e9
    cases = {
        "olmo_chunks": (lambda p: ChunkStoreWriter(p), lambda p: ChunkStoreReader(p), FastLoadPlanner),
        "dcp_fs(threads=1)": (lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p), None),
        "dcp_fs(threads=4)": (
            lambda p: FileSystemWriter(p, thread_count=4),
            lambda p: FileSystemReader(p),
            None,
        ),
    }
    saves: dict[str, list[float]] = {name: [] for name in cases}
    loads: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):  # backends interleaved, so drifting machine load hits them alike
        for name, (writer, reader, planner) in cases.items():
            path = os.path.join(root, name.replace("(", "_").replace(")", "").replace("=", ""))
            w = writer(path)
            saves[name].append(timed(lambda w=w: dcp.save(src, storage_writer=w)))
            dst, r, p = _state(mesh, total_mb, 1, False), reader(path), planner() if planner else None
            loads[name].append(timed(lambda dst=dst, r=r, p=p: dcp.load(dst, storage_reader=r, planner=p)))
            want = _state(mesh, total_mb, 1, True)
            assert all(torch.equal(dst[k].to_local(), want[k].to_local()) for k in want), name
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    results = {name: (gb / min(saves[name]), gb / min(loads[name])) for name in cases}
    if rank == 0:
        out.update(results)
        out["bytes"] = gb * 1e9
    dist.barrier()
    dist.destroy_process_group()


def _planning(grid: int, rows: int, cols: int, pick: int | None) -> tuple[float, float, int, int]:
    """Seconds to plan one rank's reads of one `64 grid` square tensor saved on a `grid` x `grid`
    layout, the rank holding block `pick` of a `rows` x `cols` layout (all blocks if None): DCP's
    sweep line vs the Rust index. Returns (dcp s, fast s, local chunks, read items)."""
    n = grid * 64

    def cut(r: int, c: int) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(
                torch.Size([i * n // r, j * n // c]),
                torch.Size([(i + 1) * n // r - i * n // r, (j + 1) * n // c - j * n // c]),
            )
            for i in range(r)
            for j in range(c)
        ]

    saved = cut(grid, grid)
    local = cut(rows, cols)
    if pick is not None:
        local = [local[pick]]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n, n]), saved)
    best_dcp = best_fast = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a = create_read_items_for_chunk_list("w", md, local)
        t1 = time.perf_counter()
        (b,) = read_items_for_chunk_lists([("w", torch.Size([n, n]), saved, local)])
        t2 = time.perf_counter()
        best_dcp, best_fast = min(best_dcp, t1 - t0), min(best_fast, t2 - t1)
    assert len(a) == len(b)
    return best_dcp, best_fast, len(local), len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=int, default=384, help="state dict size in MiB (all ranks together)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dcp-compare-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(
                _worker,
                args=(args.ranks, rendezvous_url(), root, args.mb, args.reps, out),
                nprocs=args.ranks,
            )
            res = dict(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.ranks} ranks, {res.pop('bytes') / 1e6:.0f} MB state dict, best of {args.reps}; "
        "load = resharded (Shard(0) -> Shard(1)), warm page cache"
    )
    print(f"{'backend':<20} {'save GB/s':>10} {'load GB/s':>10}")
    for name, (s, ld) in res.items():
        print(f"{name:<20} {s:>10.2f} {ld:>10.2f}")
    print("\nload planning of one tensor on one rank, best of 3 (DCP sweep line vs FastLoadPlanner's index):")
    print(f"{'saved':<9} {'loaded as':<22} {'local':>6} {'items':>6} {'dcp ms':>9} {'fast ms':>9}")
    for grid, rows, cols, pick, what in (
        (128, 1024, 1, 512, "row block of 1024"),
        (128, 1, 128, 64, "column block of 128"),
        (64, 16, 16, None, "16x16 blocks, all"),
        (32, 64, 64, None, "64x64 blocks, all"),
    ):
        d, f, n, items = _planning(grid, rows, cols, pick)
        print(f"{grid}x{grid:<6} {what:<22} {n:>6} {items:>6} {d * 1e3:>9.1f} {f * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
