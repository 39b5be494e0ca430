"""GPU check for a lent GPU machine (one process, one GPU, well under 5 minutes).

On the GPU it measures, in one run:
1. host<->device copy bandwidth (pinned host memory, best of 3): the ceiling for staging; the
   checkpoint lives in /dev/shm where it has room, and the host's raw read of its files (page cache
   into one host buffer, best of 3) is the ceiling the load's reads are measured against;
2. `olmo_chunks.save` of FP32 main weights + both Adam moments held on the GPU (dense tensors and
   expert flat views), staged through pinned host buffers: GB/s, and GPU memory allocated /
   reserved before, at peak during, and after (saving must not grow GPU memory);
3. a resharded load back to GPU memory: the saved whole tensors loaded as the shards of `--shards`
   ranks of another layout (dense `Shard(1)` column blocks, experts over EP-MP `--shards`), one
   shard after another in this process, through pinned staging; checked bit-exact; GB/s and GPU
   memory; then the same load through the read-once rounds (forced, as one process shares no
   block: what each rank of a job does besides the exchange), with its rounds;
4. the BF16 compute weights rebuilt from the loaded FP32 shards (`compute_weights`: cast, then
   all-gather over the shards' group, a one-GPU NCCL group here): GB/s of BF16 bytes and GPU memory;
   then the same rebuild with the MXFP8 caches (`mxfp8=True`: BF16 plus both MXFP8 forms of every
   matrix), timed next to it.

Save and load GB/s are also given as fractions of the device->host and host->device bandwidth.
Without CUDA it prints that it skipped and exits 0; `--cpu` runs the same steps on the CPU (a dry
run for CI: gloo instead of NCCL, pageable instead of pinned memory, "GPU memory" is process RSS).

    python benches/gpu_check.py --gib 4 --json $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_memory_check import Sampler, pick_device  # shared with that check

NUM_EXPERTS = 8


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, reps: int = 3) -> dict[str, float]:
    """GB/s of host->device and device->host copies of `nbytes` (pinned host memory on CUDA)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda").fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        best = math.inf
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    del host, dev
    return out


def _memory_dir(nbytes: int) -> str | None:
    """/dev/shm where it has room for the run's two checkpoints (the save is then measured against
    the device->host copy, not a disk), else the default temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 3 * nbytes:
        return shm
    return None


def raw_read_gbps(path: str, reps: int = 3) -> float:
    """GB/s of reading every file under `path` into one preallocated host buffer (best of `reps`,
    the page cache warm): the host's own limit for the load's reads."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    sizes = [os.path.getsize(f) for f in files]
    buf = memoryview(bytearray(max(sizes)))

    def read_all() -> float:
        t0 = time.perf_counter()
        for f, n in zip(files, sizes, strict=True):
            fd = os.open(f, os.O_RDONLY)
            try:
                got = 0
                while got < n:
                    k = os.preadv(fd, [buf[got:n]], got)
                    if k <= 0:
                        raise OSError(f"{f}: short read")
                    got += k
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    read_all()  # warms the page cache
    best = min(read_all() for _ in range(reps))
    return sum(sizes) / best / 1e9


def spec(state_bytes: int) -> tuple[int, list[tuple[str, tuple[int, ...], bool]]]:
    """(hidden size, [(key, shape, is_expert)]) of an OLMo-like MoE state of about `state_bytes`:
    2 layers of attention + `NUM_EXPERTS` experts, main weights and both Adam moments."""
    per_d2 = 12 * (2 * (4 + 2 * NUM_EXPERTS))
    d = max(32, round(math.sqrt(state_bytes / per_d2) / 32) * 32)  # MX blocks are 32 wide
    params = []
    for i in range(2):
        params += [(f"blocks.{i}.attention.w_qkv.weight", (3 * d, d), False),
                   (f"blocks.{i}.attention.w_out.weight", (d, d), False),
                   (f"blocks.{i}.feed_forward_moe.experts.w1", (NUM_EXPERTS, d, d), True),
                   (f"blocks.{i}.feed_forward_moe.experts.w2", (NUM_EXPERTS, d, d), True)]
    out = []
    for key, shape, expert in params:
        out += [(f"model.{key}", shape, expert), (f"optim.state.{key}.exp_avg", shape, expert),
                (f"optim.state.{key}.exp_avg_sq", shape, expert)]
    return d, out


class Block:
    """A `ChunkSource`: `local` holds the box `offsets + local.shape` of a global tensor."""

    def __init__(self, shape: tuple[int, ...], offsets: tuple[int, ...], local: torch.Tensor) -> None:
        from olmo_chunks.layout import Piece
        from olmo_chunks.shards import TensorShard

        self.shard = TensorShard(local.dtype, shape, local,
                                 [Piece(offsets, tuple(local.shape), (0,) * len(shape))])

    def tensor_shard(self) -> Any:
        return self.shard


def _shard_cols(n: int, parts: int, j: int) -> tuple[int, int]:
    step = -(-n // parts)
    a = min(j * step, n)
    return a, min(a + step, n) - a


def run(args: argparse.Namespace, device: str) -> dict[str, Any]:  # noqa: PLR0915
    import olmo_chunks as oc
    from olmo_chunks.experts import ExpertLayout
    from olmo_chunks.weights import compute_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    state_bytes = int(args.gib * 2**30)
    d, tensors = spec(state_bytes)
    total = sum(4 * math.prod(s) for _, s, _ in tensors)
    root = args.dir or tempfile.mkdtemp(prefix="olmo-chunks-gpucheck-", dir=_memory_dir(total))
    path = os.path.join(root, "ck")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run; memory is RSS)",
        "torch": torch.__version__,
        "state_gib": round(total / 2**30, 3),
        "hidden": d,
        "shards": args.shards,
        "staging_bytes": oc.checkpoint.STAGING_BYTES,
        "dir": root,
    }
    report["copy"] = copy_bandwidth(device, min(total, (1 << 30) if device == "cuda" else (256 << 20)))

    # Source state on the device: plain dense tensors and EP1 expert flat views.
    gen = torch.Generator(device=device).manual_seed(0)
    state: dict[str, Any] = {}
    data: dict[str, torch.Tensor] = {}
    for key, shape, expert in tensors:
        t = torch.empty(math.prod(shape) if expert else shape, dtype=torch.float32, device=device)
        t.normal_(generator=gen)
        data[key] = t
        state[key] = ExpertLayout(shape[0], shape[1:]).view(t) if expert else t
    _sync(device)
    with Sampler(device) as s:
        t0 = time.perf_counter()
        oc.save(state, path, overwrite=True)
        seconds = time.perf_counter() - t0
    report["save"] = {**s.report(), "seconds": round(seconds, 3), "gbps": total / seconds / 1e9,
                      "of_d2h": total / seconds / 1e9 / report["copy"]["d2h_gbps"]}
    report["raw_read_gbps"] = raw_read_gbps(path)

    # Async save: the stall is the device-to-host copy into the reused pinned pool; the source is
    # overwritten right after the call, the checkpoint must hold the values at the call.
    # The pool is sized to hold the whole state (the configuration async saves are made for; a
    # smaller pool makes the call write what overflows it, and the stall then includes those writes).
    pool = oc.session.staging_bytes([("", (), t) for t in data.values()])
    for _ in range(2):  # the first call allocates the pool; the second shows the steady state
        with Sampler(device) as s:
            t0 = time.perf_counter()
            fut = oc.async_save(state, path + "-async", overwrite=True, pool_bytes=pool)
            stall = time.perf_counter() - t0
            for t in data.values():
                t.neg_()  # the next step (undone exactly below)
            fut.result()
        for t in data.values():
            t.neg_()
    memory = s.report()  # before the check below allocates
    back = {key: (ExpertLayout(shape[0], shape[1:]).view(torch.empty_like(data[key])) if expert
                  else torch.empty_like(data[key])) for key, shape, expert in tensors}
    oc.load(back, path + "-async")
    async_exact = all(torch.equal(back[key].local if expert else back[key], data[key])
                      for key, _, expert in tensors)
    del back
    report["async_save"] = {**memory, "pool_mib": round(pool / 2**20, 1), "stall_seconds": round(stall, 4),
                            "sync_seconds": round(seconds, 3),
                            "stall_of_sync": stall / seconds,
                            "stall_x_d2h_copy": stall / (total / 1e9 / report["copy"]["d2h_gbps"]),
                            "exact": async_exact}
    del state

    # Resharded load back to the device: `shards` ranks of another layout, one after another.
    j_state: list[dict[str, Any]] = []
    locals_: list[dict[str, torch.Tensor]] = []
    for j in range(args.shards):
        sd: dict[str, Any] = {}
        held: dict[str, torch.Tensor] = {}
        for key, shape, expert in tensors:
            if expert:
                lo = ExpertLayout(shape[0], shape[1:], ep_mp_rank=j, ep_mp_size=args.shards)
                t = torch.full((lo.local_numel,), float("nan"), device=device)
                sd[key] = lo.view(t)
            else:
                c0, cs = _shard_cols(shape[1], args.shards, j)
                t = torch.full((shape[0], cs), float("nan"), device=device)
                sd[key] = Block(shape, (0, c0), t)
            held[key] = t
        j_state.append(sd)
        locals_.append(held)
    _sync(device)
    with Sampler(device) as s:
        t0 = time.perf_counter()
        for sd in j_state:
            oc.load(sd, path)
        _sync(device)
        seconds = time.perf_counter() - t0
    exact = True
    expected: list[dict[str, torch.Tensor]] = []
    for j, held in enumerate(locals_):
        expected.append({})
        for key, shape, expert in tensors:
            if expert:
                lo = ExpertLayout(shape[0], shape[1:], ep_mp_rank=j, ep_mp_size=args.shards)
                start, length = lo.flat_range
                want = data[key][start : start + length]
            else:
                c0, cs = _shard_cols(shape[1], args.shards, j)
                want = data[key][:, c0 : c0 + cs]
            exact &= bool(torch.equal(held[key], want))
            expected[j][key] = want
    report["load"] = {**s.report(), "seconds": round(seconds, 3), "gbps": total / seconds / 1e9,
                      "of_h2d": total / seconds / 1e9 / report["copy"]["h2d_gbps"],
                      "of_raw_read": total / seconds / 1e9 / report["raw_read_gbps"], "exact": exact}

    # The same load through the read-once rounds (forced: one process shares nothing): blocks read
    # into pinned host buffers, assembled into pinned stages, copied to the GPU round by round.
    for held in locals_:
        for t in held.values():
            t.fill_(float("nan"))
    os.environ["OLMO_CHUNKS_READ_ONCE"] = "always"
    try:
        with Sampler(device) as s:
            t0 = time.perf_counter()
            reports = [oc.load(sd, path) for sd in j_state]
            _sync(device)
            seconds = time.perf_counter() - t0
    finally:
        del os.environ["OLMO_CHUNKS_READ_ONCE"]
    exact_once = all(torch.equal(held[key], back_held[key]) for held, back_held in zip(locals_, expected, strict=True)
                     for key in held)
    report["load_read_once"] = {**s.report(), "seconds": round(seconds, 3), "gbps": total / seconds / 1e9,
                                "of_h2d": total / seconds / 1e9 / report["copy"]["h2d_gbps"],
                                "rounds": [r.rounds for r in reports], "mode": sorted({r.read for r in reports}),
                                "round_peak_mib": round(max(r.round_peak_bytes for r in reports) / 2**20, 1),
                                "exact": exact_once}
    del expected
    del data

    # BF16 compute weights from the FP32 main weights of shard 0's layout: dense as Shard(0)
    # DTensors of the one-device mesh, experts as their flat views.
    mesh = init_device_mesh(device, (1,))
    main: dict[str, Any] = {}
    for key, _, expert in tensors:
        if key.startswith("model."):
            if expert:
                main[key] = j_state[0][key]
            else:
                whole = torch.cat([held[key] for held in locals_], dim=1)
                main[key] = DTensor.from_local(whole, mesh, [Shard(0)], run_check=False)
    del j_state, locals_
    if device == "cuda":
        torch.cuda.empty_cache()
    _sync(device)
    with Sampler(device) as s:
        t0 = time.perf_counter()
        bf16 = compute_weights(main)
        _sync(device)
        seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in bf16.values())
    dtype_ok = all(t.dtype == torch.bfloat16 for t in bf16.values())
    del bf16
    _sync(device)
    t0 = time.perf_counter()
    _, caches = compute_weights(main, mxfp8=True)
    _sync(device)
    mx_seconds = time.perf_counter() - t0
    dtype_ok &= all(c.rowwise.data.dtype == torch.float8_e4m3fn for c in caches.values())
    report["compute_weights"] = {**s.report(), "seconds": round(seconds, 4),
                                 "bf16_mib": round(nbytes / 2**20, 1), "gbps": nbytes / seconds / 1e9,
                                 "mxfp8_seconds": round(mx_seconds, 4), "dtype_ok": dtype_ok}
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    save = report["save"]
    key = "allocated_peak_mib" if device == "cuda" else "allocated_sampled_max_mib"
    report["save_growth_mib"] = round(save[key] - save["allocated_start_mib"], 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="state size in GiB (weights + both moments)")
    ap.add_argument("--shards", type=int, default=2, help="ranks of the layout loaded back (one by one)")
    ap.add_argument("--dir", help="checkpoint directory (default: a temp dir, removed after)")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU when there is no CUDA")
    args = ap.parse_args(argv)
    device = pick_device(args.cpu, "gpu_check")
    if device is None:
        return 0
    rdzv = tempfile.mkdtemp(prefix="olmo-chunks-gpucheck-rdzv-")
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        # gloo for the few object collectives of save/load, NCCL for the BF16 all-gather
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                                init_method=f"file://{os.path.join(rdzv, 'f')}", rank=0, world_size=1)
        try:
            report = run(args, device)
        finally:
            dist.destroy_process_group()
    finally:
        shutil.rmtree(rdzv, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = report["load"]["exact"] and report["load_read_once"]["exact"] and report["compute_weights"]["dtype_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
