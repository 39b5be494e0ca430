"""One pair of `olmo-chunks bench`, its load modes and the raw-read roofline taken in turn in one
gloo world of 4 ranks: medians, where the bench keeps each cell's best.

    python benches/alternate.py --gib 2 --pair "Shard(0)->Shard(1)" --modes raw,auto,direct --loads 10

On a shared machine whose speed drifts by more than the differences looked for (this project's
2-core VM moved by 60% within an hour), a best of a few timings per cell, taken minutes apart,
compares moments more than modes; here every mode gets its turn in every round (in reverse order
every other round), and the first round is not counted. Modes: `raw` (the `pread` of each loading
rank's share of the checkpoint's own data files, the bench's roofline) and the `read=`
modes of `olmo_chunks.checkpoint.load` (`auto`, `once`, `direct`). As in the bench, each load
starts from fresh zeros and the page cache warmed (or dropped, `--cold`); `--small-pages` holds
the files in 4 KiB pages, as a save leaves them where memory is short of free 2 MiB blocks
(`page_cache.py`). Rank 0 prints, per
mode, the median and best seconds of the slowest rank, the median's fraction of the raw read's,
and what `auto` chose and why.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import warnings

import page_cache
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from olmo_chunks import bench, checkpoint

warnings.filterwarnings("ignore")
RANKS = 4


def _main(rank: int, url: str, root: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=RANKS)
    specs = bench.model_spec(int(args.gib * (1 << 30)))
    bench._make_meshes()
    groups = {n: dist.new_group(list(range(n))) for n in (2, 4)}
    (_, saved, loaded), = [p for p in bench.PAIRS if p[0] == args.pair]
    path = os.path.join(root, "ck")
    src = bench._hold(specs, saved, rank)
    if src is not None:
        bench._fill(src)
        checkpoint.save(src.native, path, process_group=groups[saved.ranks])
    del src
    files = bench.data_files(path)
    if args.small_pages:
        for f, _ in files[rank::RANKS]:
            page_cache.rewrite(f, 4096)
    dist.barrier()
    total = bench.state_nbytes(specs)
    share = bench._share(total, loaded.ranks, rank)
    out = torch.zeros(share[1], dtype=torch.uint8)
    dst = bench._hold(specs, loaded, rank)
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    why = ""
    prepare = functools.partial(bench._prepare, dst, path, args.cold, rank, loaded.ranks)
    for i in range(args.loads + 1):
        for mode in args.modes if i % 2 == 0 else args.modes[::-1]:

            def load(mode: str = mode) -> None:
                nonlocal why
                if dst is not None and mode == "raw":
                    bench._raw_read(files, share[0], out)
                elif dst is not None:
                    r = checkpoint.load(dst.native, path, process_group=groups[loaded.ranks], read=mode)
                    if mode == "auto":
                        why = f"chose {r.read}: {r.reading.why}"

            seconds = bench.timed(load, before=prepare)
            if i:
                times[mode].append(seconds)
    if rank == 0:
        state = "cold" if args.cold else "warm"
        print(f"{args.pair}, {args.gib:g} GiB {state}, {RANKS} gloo ranks, {args.loads} loads per mode")
        raw = statistics.median(times["raw"]) if "raw" in times else None
        for mode, ts in times.items():
            med = statistics.median(ts)
            frac = f"  {raw / med:.2f} of raw" if raw else ""
            print(f"  {mode:7s} median {med * 1e3:8.1f} ms  best {min(ts) * 1e3:8.1f} ms{frac}")
        if why:
            print(f"  auto {why}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--pair", default="Shard(0)->Shard(1)", choices=[name for name, _, _ in bench.PAIRS])
    p.add_argument("--modes", default="raw,auto,direct",
                   type=lambda s: [m for m in s.split(",") if m])
    p.add_argument("--loads", type=int, default=8)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each load")
    p.add_argument("--small-pages", action="store_true",
                   help="hold the checkpoint's files in the page cache in 4 KiB pages (rewritten so after the save)")
    p.add_argument("--root", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    bad = [m for m in args.modes if m not in ("raw", "auto", "once", "direct")]
    if bad or not args.modes or args.loads < 1:
        p.error(f"modes are raw, auto, once and direct (got {args.modes}); --loads at least 1")
    root = tempfile.mkdtemp(prefix="olmo-alternate-", dir=args.root)
    try:
        mp.spawn(_main, args=(bench.rendezvous_url(), root, args), nprocs=RANKS)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
