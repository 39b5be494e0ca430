"""A warm load's speed against how the page cache holds the checkpoint: 4 KiB pages or large folios.

    python benches/page_cache.py --gib 1 --loads 7

The kernel decides the size of the folios (runs of pages it manages as one) that hold a file's
bytes when it puts them in the page cache: a write of 8 MiB into free memory gets folios of up
to 2 MiB, a write of 4 KiB gets a 4 KiB page, and so does a large write where memory holds no
free 2 MiB block (a busy machine's usual state). The folios stay as they are as long as the pages
stay cached, and a warm read pays for each one: a `pread` takes the kernel's copy loop once per
folio, a mapping takes a page fault (and its undoing) per folio mapped. So two warm loads of the
same bytes differ by how the files were written, and so did this project's bench, whose roofline
read files written first, into free memory, and whose loads read files written later.

One process saves a checkpoint of `--gib` GiB with `olmo_chunks.save`, then holds its data file
in the page cache each way in turn (the file dropped, then rewritten in place with 8 MiB or with
4 KiB writes, the same bytes) and times, alternating, `--loads` times each: `pread` of the file
into memory by one thread and by two (halves), touching each page of a mapping of it (the faults
alone), and `olmo_chunks.load(read="direct")` of the checkpoint with one worker and with two
(and two without checksums). Every destination is torch memory in 4 KiB pages, as the bench's: a
`pread` into memory in 2 MiB pages (numpy's, for arrays of 4 MiB or more) took twice as long here.
Where `/proc/kpageflags` can be read (root), the share of the file's pages in folios of 64 KiB or
more is printed for each state.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from olmo_chunks import bench, checkpoint

KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16


def rewrite(path: str, write: int) -> None:
    """Puts the file at `path` back in the page cache as `write`-byte writes of its own bytes
    leave it: read, dropped from the cache, written back in place, fsynced."""
    with open(path, "r+b", buffering=0) as f:
        data = f.read()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(data)
        for at in range(0, len(data), write):
            os.pwrite(f.fileno(), view[at : at + write], at)
        os.fsync(f.fileno())


def large_folio_share(path: str) -> float | None:
    """The share of the file's cached pages that lie in folios of 64 KiB or more, from the page
    flags of a mapping of it; None where those cannot be read (they need root)."""
    try:
        kf = open("/proc/kpageflags", "rb")  # noqa: SIM115
    except OSError:
        return None
    n = os.path.getsize(path)
    with kf, open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as m:
        at = _touch(m)
        pages = (n + 4095) // 4096
        with open("/proc/self/pagemap", "rb") as pm:
            pm.seek(at // 4096 * 8)
            entries = struct.unpack(f"{pages}Q", pm.read(8 * pages))
        runs, run = [], 0
        for e in entries:
            kf.seek((e & ((1 << 55) - 1)) * 8)
            flags = struct.unpack("Q", kf.read(8))[0]
            if flags >> KPF_COMPOUND_TAIL & 1:
                run += 1
                continue
            runs.append(run)
            run = 1
        runs.append(run)
    return sum(r for r in runs if r >= 16) / max(sum(runs), 1)


def _preads(files: list[tuple[str, int]], out: torch.Tensor, parts: int) -> None:
    """The bench's raw read of `files` into `out`, in `parts` page-aligned parts on as many threads."""
    n = len(out)
    cuts = [n * i // parts // 4096 * 4096 for i in range(parts)] + [n]
    threads = [threading.Thread(target=bench._raw_read, args=(files, cuts[i], out[cuts[i] : cuts[i + 1]]))
               for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _touch(m: mmap.mmap) -> int:
    """Reads a byte of every page of the mapping `m`, which maps each; the mapping's address."""
    a = np.frombuffer(m, dtype=np.uint8)
    int(a[::4096].sum())
    return int(a.ctypes.data)


def _faults(fd: int, n: int) -> None:
    with mmap.mmap(fd, n, prot=mmap.PROT_READ) as m:
        _touch(m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--loads", type=int, default=7)
    p.add_argument("--root", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="olmo-page-cache-", dir=args.root)
    try:
        n = int(args.gib * (1 << 30)) // 16 // 4
        state = {f"w{i}": torch.randn(n) for i in range(16)}
        path = os.path.join(root, "ck")
        checkpoint.save(state, path)
        files = bench.data_files(path)
        (data, size), = files
        out = torch.zeros(size, dtype=torch.uint8)
        fd = os.open(data, os.O_RDONLY)
        ways: dict[str, Callable[[], object]] = {
            "pread, 1 thread": lambda: _preads(files, out, 1),
            "pread, 2 threads": lambda: _preads(files, out, 2),
            "page faults of a mapping": lambda: _faults(fd, size),
            "olmo_chunks load, 1 worker": lambda: checkpoint.load(state, path, read="direct", workers=1),
            "olmo_chunks load, 2 workers": lambda: checkpoint.load(state, path, read="direct", workers=2),
            "the same, verify=False": lambda: checkpoint.load(state, path, read="direct", workers=2, verify=False),
        }
        print(f"{size / 2**30:.2f} GiB data file, medians of {args.loads} (ms), alternating")
        for name, write in (("large folios (8 MiB writes)", 8 << 20), ("4 KiB pages (4 KiB writes)", 4096)):
            rewrite(data, write)
            share = large_folio_share(data)
            times: dict[str, list[float]] = {k: [] for k in ways}
            for i in range(args.loads + 1):
                for k, fn in ways.items():
                    t = time.perf_counter()
                    fn()
                    if i:
                        times[k].append(time.perf_counter() - t)
            held = f", {share:.0%} of pages in folios of 64 KiB or more" if share is not None else ""
            print(f"{name}{held}:")
            for k, ts in times.items():
                med = statistics.median(ts)
                print(f"  {k:28s} {med * 1e3:8.1f}   {size / med / 1e9:6.2f} GB/s")
        os.close(fd)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
