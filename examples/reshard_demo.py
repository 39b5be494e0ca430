"""The main job: save an OLMo-like training state on N gloo ranks in one layout, load it on M ranks
in another, verify every element bit-exact, and print throughput.

    python examples/reshard_demo.py --save-ranks 4 --load-ranks 3 --size-mb 512
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
import zlib

import olmo_chunks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def model_spec(size_mb: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of a dense OLMo-like model whose main weights + two Adam moments take ~size_mb."""
    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * (hidden * 2)  # attention + MLP
    layers = max(1, round(size_mb * 2**20 / 12 / per_layer))
    spec = {"embeddings.weight": (4096, hidden)}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            spec[f"blocks.{i}.attention.w_{name}.weight"] = (hidden, hidden)
        spec[f"blocks.{i}.feed_forward.w1.weight"] = (hidden * 2, hidden)
        spec[f"blocks.{i}.feed_forward.w2.weight"] = (hidden, hidden * 2)
        spec[f"blocks.{i}.feed_forward.w3.weight"] = (hidden * 2, hidden)
        spec[f"blocks.{i}.attention_norm.weight"] = (hidden,)
    return spec


def full_tensor(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g)


def layout(mesh, shape: tuple[int, ...], style: str) -> list:
    """Placements: 'rows' (DP Shard(0)), 'grid' (Shard(0) x Shard(1) on a 2-D mesh), 'cols'."""
    if len(shape) == 1:
        return [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    if style == "grid":
        return [Shard(0), Shard(1)]
    return [Shard(1 if style == "cols" else 0)] + [Replicate()] * (mesh.ndim - 1)


def build_state(spec, mesh, style: str, fill: bool) -> dict:
    state: dict = {"model": {}, "optim": {}}
    for key, shape in spec.items():
        for role, target in (("main", state["model"]), ("exp_avg", None), ("exp_avg_sq", None)):
            full = full_tensor(f"{key}.{role}", shape) if fill else torch.zeros(shape)
            dt = distribute_tensor(full, mesh, layout(mesh, shape, style), src_data_rank=None)
            if target is not None:
                target[key] = dt
            else:
                state["optim"].setdefault(key, {})[role] = dt
    state["trainer"] = {"step": 1000, "tokens_seen": 1000 * 4 * 4096}
    return state


def describe_reading(r) -> str:
    """Which read strategy the load took (`read="auto"`, the default, chooses) and why."""
    if r.predicted_direct_s is None or r.predicted_once_s is None:
        return f"read={r.read}: no saved block is needed by two ranks" if r.read == "direct" else f"read={r.read}"
    return (f"read={r.read}: predicted {r.predicted_direct_s:.2f} s direct, {r.predicted_once_s:.2f} s once "
            f"(from {r.why})")


def mesh_for(world: int, style: str):
    if style == "grid":
        a = math.isqrt(world)
        while world % a:
            a -= 1
        return init_device_mesh("cpu", (a, world // a))
    return init_device_mesh("cpu", (world,))


def worker(rank: int, world: int, port: int, action: str, path: str, size_mb: int, style: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = mesh_for(world, style)
        spec = model_spec(size_mb)
        state = build_state(spec, mesh, style, fill=(action == "save"))
        dist.barrier()
        t0 = time.perf_counter()
        how = ""
        if action == "save":
            olmo_chunks.save(state, path, overwrite=True)
        else:
            how = describe_reading(olmo_chunks.load(state, path).reading)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        wrong = 0
        if action == "load":
            expect = build_state(spec, mesh, style, fill=True)
            for part in ("model", "optim"):
                flat_got = olmo_chunks.tree.flatten(state[part])
                flat_want = olmo_chunks.tree.flatten(expect[part])
                for k, leaf in flat_got.items():
                    if not torch.equal(leaf.value.to_local(), flat_want[k].value.to_local()):
                        wrong += 1
            wrong += state["trainer"] != expect["trainer"]
        totals = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(totals)
        if rank == 0:
            out.put((elapsed, int(totals[0]), how))
    finally:
        dist.destroy_process_group()


def run(world: int, action: str, path: str, size_mb: int, style: str) -> tuple[float, int, str]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, action, path, size_mb, style, out), nprocs=world,
                       start_method="spawn")
    return out.get()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-ranks", type=int, default=4)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--save-layout", default="rows", choices=["rows", "grid", "cols"])
    p.add_argument("--load-layout", default="cols", choices=["rows", "grid", "cols"])
    p.add_argument("--size-mb", type=int, default=512,
                   help="checkpoint size (main weights + 2 Adam moments; at least about 180 MB: the embedding "
                        "and one layer)")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = args.dir or tempfile.mkdtemp(prefix="olmo-chunks-demo-")
    path = os.path.join(root, "step1000")
    try:
        t_save, _, _ = run(args.save_ranks, "save", path, args.size_mb, args.save_layout)
        nbytes = sum(t.nbytes for t in olmo_chunks._core.Manifest.open(path).tensors)
        print(f"saved   {nbytes / 1e9:.3f} GB on {args.save_ranks} ranks ({args.save_layout}) in {t_save:.2f} s: "
              f"{nbytes / t_save / 1e9:.2f} GB/s (durable: data and manifest fsynced)")
        t_load, wrong, how = run(args.load_ranks, "load", path, args.size_mb, args.load_layout)
        print(f"loaded  {nbytes / 1e9:.3f} GB on {args.load_ranks} ranks ({args.load_layout}) in {t_load:.2f} s: "
              f"{nbytes / t_load / 1e9:.2f} GB/s (resharded, checksums verified; {how})")
        if wrong:
            raise SystemExit(f"FAILED: {wrong} tensors differ after the resharded load")
        print(f"verified: every tensor bit-exact after resharding {args.save_ranks}x{args.save_layout} -> "
              f"{args.load_ranks}x{args.load_layout}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
