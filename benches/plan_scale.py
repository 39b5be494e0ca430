"""Load planning at scale, simulated: manifests of thousands of saving ranks, built without data.

    python benches/plan_scale.py --ranks 4096 --tensors 500 [--json out.json]

Two checkpoints are described (never written: file entries and sizes are made up, checksums
zero) and committed through `_core.SaveTransaction`, as a save on `--ranks` ranks would:

- `1-D`: every tensor `Shard(0)` over all ranks (FSDP-like), loaded by one rank of `Shard(0)` over
  3/4 as many ranks (misaligned, so a rank's box straddles saved chunks);
- `2-D`: every tensor on a `g x g` grid (`g*g = --ranks`, 64 x 64 by default), loaded by one rank of
  a `g/2 x 2g` grid, and by one rank of an uneven `(g-3) x (g+5)` grid.

For each it times opening the checkpoint and planning one rank's load (best of `--reps`):
- ours: `_core.Manifest.open`, then `Manifest.plan_runs` (the native `load` planner), and through
  the DCP door `ChunkStoreReader.read_metadata` then `FastLoadPlanner.create_local_plan`;
- DCP: `FileSystemReader.read_metadata` (unpickling the same metadata as DCP's `.metadata`), then
  `DefaultLoadPlanner.create_local_plan`, on the same layouts.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from olmo_chunks import _core
from olmo_chunks.dcp import ChunkStoreReader, FastLoadPlanner
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

warnings.filterwarnings("ignore")

Box = tuple[tuple[int, ...], tuple[int, ...]]


def cut(n: int, parts: int, i: int) -> tuple[int, int]:
    """`(start, size)` of `torch.chunk`-style part `i` of `n` (trailing parts shorter or empty)."""
    step = -(-n // parts)
    a = min(i * step, n)
    return a, min(a + step, n) - a


@functools.lru_cache(maxsize=64)
def cuts(n: int, parts: int) -> list[tuple[int, int]]:
    return [cut(n, parts, i) for i in range(parts)]


def grid_boxes(shape: tuple[int, int], rows: int, cols: int) -> list[Box]:
    """Boxes of a `rows x cols` grid layout (row-major rank order); a 1-D layout has cols = 1."""
    return [((r0, c0), (rs, cs)) for r0, rs in cuts(shape[0], rows) for c0, cs in cuts(shape[1], cols)]


def grid_box(shape: tuple[int, int], rows: int, cols: int, rank: int) -> Box:
    (r0, rs), (c0, cs) = cut(shape[0], rows, rank // cols), cut(shape[1], cols, rank % cols)
    return (r0, c0), (rs, cs)


class LocalShard:
    """What DCP's planners need of a rank's value: the global size and the local chunks (the
    `__create_chunk_list__` protocol DTensor implements), without a mesh of thousands of ranks."""

    def __init__(self, shape: tuple[int, ...], boxes: list[Box]) -> None:
        self._shape = torch.Size(shape)
        self._chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes if 0 not in s]

    def size(self) -> torch.Size:
        return self._shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks


def build(path: str, ranks: int, tensors: list[tuple[str, tuple[int, int]]], rows: int, cols: int) -> int:
    """Commits a manifest of `tensors` saved on a `rows x cols` grid of `ranks` ranks (one data
    file per rank, as `save` writes); returns the number of chunks."""
    block = 64 << 20  # the largest block size: few (zero) checksums per chunk
    txn = _core.SaveTransaction.begin(path)
    fsize = [0] * ranks
    placed = []
    for key, shape in tensors:
        for r, (o, s) in enumerate(grid_boxes(shape, rows, cols)):
            nbytes = 4 * s[0] * s[1]
            if nbytes:
                off = -(-fsize[r] // 64) * 64
                fsize[r] = off + nbytes
                placed.append((key, list(o), list(s), r, off, nbytes))
    chunks = [
        _core.WrittenChunk(key, _core.Box(o, s), f"data/{txn.save_id}/rank-{r:05d}.bin", fsize[r], off, nbytes,
                           [0] * -(-nbytes // block))
        for key, o, s, r, off, nbytes in placed
    ]
    schema = [_core.TensorSchema(key, "float32", list(shape), "main_weight") for key, shape in tensors]
    txn.commit(block, schema, chunks, "{}", json.dumps({"simulated": True}))
    return len(chunks)


def best(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    t, out = math.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def open_costs(path: str, dcp_dir: str, reps: int) -> tuple[dict[str, float], Any, Any]:
    """Seconds to open the checkpoint for each planner (the DCP ones once: they take long), the
    opened manifest and the DCP metadata our reader builds from it."""
    t_open, m = best(lambda: _core.Manifest.open(path), reps)
    t_md, md = best(lambda: ChunkStoreReader(path).read_metadata(), 1)
    with open(os.path.join(dcp_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)  # the same metadata as DCP's own pickle
    t_dopen, _ = best(lambda: FileSystemReader(dcp_dir).read_metadata(), 1)
    return {"native": t_open, "ours-dcp": t_md, "dcp": t_dopen}, m, md


def plan_costs(m: Any, md: Any, tensors: list[tuple[str, tuple[int, int]]], load_grid: tuple[int, int],
               rank: int, reps: int) -> dict[str, Any]:
    """Seconds to plan one rank's load for every planner, and the number of items (DCP read items)
    or runs (the native planner's contiguous element runs) each returns."""
    rows, cols = load_grid
    mine = {key: [grid_box(shape, rows, cols, rank)] for key, shape in tensors}
    index = {t.key: i for i, t in enumerate(m.tensors)}
    targets = []
    for key, _ in tensors:
        for o, s in mine[key]:
            if 0 not in s:
                targets.append(_core.Target(index[key], [_core.Piece(list(o), list(s), 0, [s[1], 1])]))
    t_plan, runs = best(lambda: m.plan_runs(targets), reps)
    out: dict[str, Any] = {"load_grid": f"{rows}x{cols}", "rank": rank,
                           "native": {"plan_s": t_plan, "items": len(runs)}}

    def plan(planner_cls: type) -> Any:
        # what set_up_planner leaves for a flat state dict of real tensors (whose meta-tensor
        # initialisation and flattening would not accept these stand-ins)
        planner = planner_cls()
        sd = {key: LocalShard(shape, mine[key]) for key, shape in tensors}
        planner.original_state_dict, planner.state_dict, planner.mappings = sd, sd, {}
        planner.metadata, planner.is_coordinator = md, False
        return planner.create_local_plan()

    t_fast, fast = best(lambda: plan(FastLoadPlanner), reps)
    t_dcp, slow = best(lambda: plan(DefaultLoadPlanner), reps)
    out["ours-dcp"] = {"plan_s": t_fast, "items": len(fast.items)}
    out["dcp"] = {"plan_s": t_dcp, "items": len(slow.items)}
    if len(slow.items) != len(fast.items):
        raise AssertionError(f"planners disagree: DCP {len(slow.items)} items, ours {len(fast.items)}")
    return out


def run(ranks: int, n_tensors: int, reps: int, root: str) -> dict[str, Any]:
    g = math.isqrt(ranks)
    if g * g != ranks:
        raise SystemExit(f"--ranks must be a square for the 2-D grid, got {ranks}")
    results: dict[str, Any] = {"ranks": ranks, "tensors": n_tensors, "reps": reps, "cases": []}
    cases = [
        ("1-D Shard(0)", (ranks, 1),
         [(f"layers.{i}.w", (ranks * (2 + i % 3), 256)) for i in range(n_tensors)],
         [((ranks * 3 // 4, 1), ranks * 3 // 8)]),
        (f"2-D {g}x{g} grid", (g, g),
         [(f"layers.{i}.w", (g * 8, g * (8 + 4 * (i % 2)))) for i in range(n_tensors)],
         [((g // 2, 2 * g), ranks // 2 + g), ((g - 3, g + 5), (g - 3) * (g + 5) // 2)]),
    ]
    for name, (rows, cols), tensors, loads in cases:
        path = tempfile.mkdtemp(prefix="plan-scale-", dir=root)
        dcp_dir = tempfile.mkdtemp(prefix="plan-scale-dcp-", dir=root)
        try:
            t0 = time.perf_counter()
            n = build(path, ranks, tensors, rows, cols)
            built = time.perf_counter() - t0
            size = os.path.getsize(os.path.join(path, _core.MANIFEST_NAME))
            opens, m, md = open_costs(path, dcp_dir, reps)
            for grid, rank in loads:
                r = plan_costs(m, md, tensors, grid, rank, reps)
                for who, t in opens.items():
                    r[who]["open_s"] = t
                r.update(case=name, saved_grid=f"{rows}x{cols}", chunks=n, manifest_bytes=size, build_s=built,
                         dcp_metadata_bytes=os.path.getsize(os.path.join(dcp_dir, ".metadata")))
                results["cases"].append(r)
                print(format_row(r), flush=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(dcp_dir, ignore_errors=True)
    return results


HEADER = (f"{'case':<16} {'saved':>7} {'loaded':>7} {'chunks':>9} {'planner':<9} {'open ms':>9} "
          f"{'plan ms':>9} {'items/runs':>10}")


def format_row(r: dict[str, Any]) -> str:
    lines = []
    for who in ("native", "ours-dcp", "dcp"):
        x = r[who]
        lines.append(f"{r['case']:<16} {r['saved_grid']:>7} {r['load_grid']:>7} {r['chunks']:>9} {who:<9} "
                     f"{x['open_s'] * 1e3:>9.1f} {x['plan_s'] * 1e3:>9.1f} {x['items']:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096, help="saving ranks (a square; default 4096 = 64x64)")
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the manifests go (default: the temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"planning one rank's load: {args.ranks} saving ranks x {args.tensors} tensors, best of", args.reps)
    print("open = native: Manifest.open; ours-dcp: ChunkStoreReader.read_metadata; "
          "dcp: FileSystemReader.read_metadata")
    print(HEADER)
    res = run(args.ranks, args.tensors, args.reps, args.dir or tempfile.gettempdir())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
