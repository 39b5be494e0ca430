"""GPU memory around an olmo_chunks save and load, for a lent GPU machine (one process, one GPU).

Holds FP32 main weights and both Adam moments on the GPU, as expert flat views (EP-MP 1) and dense
tensors, and reports `torch.cuda.memory_allocated` / `memory_reserved` (and their peaks):
before the save, during it (peak), during a load into fresh GPU storage (peak), and after the BF16
compute weights are rebuilt. The seed's claim is that saving does not grow GPU memory: staging goes
through pinned host buffers. Without CUDA it says so and exits 0, unless `--cpu` asks for a dry run
of the same steps on the CPU (figures then are process RSS).

    python benches/gpu_memory_check.py --gib 4 --dir /tmp/ck --json $OUT/gpu_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


class Sampler:
    """Samples the device's (or the process's) memory from a thread while a step runs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()

    def now(self) -> tuple[int, int]:
        if self.device == "cuda":
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        import psutil

        rss = psutil.Process().memory_info().rss
        return rss, rss

    def __enter__(self) -> Sampler:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.samples = [self.now()]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.samples.append(self.now())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.samples.append(self.now())

    def report(self) -> dict[str, float]:
        out = {
            "allocated_start_mib": _mib(self.samples[0][0]),
            "reserved_start_mib": _mib(self.samples[0][1]),
            "allocated_sampled_max_mib": _mib(max(a for a, _ in self.samples)),
            "reserved_sampled_max_mib": _mib(max(r for _, r in self.samples)),
            "allocated_end_mib": _mib(self.samples[-1][0]),
            "reserved_end_mib": _mib(self.samples[-1][1]),
            "samples": len(self.samples),
        }
        if self.device == "cuda":
            out["allocated_peak_mib"] = _mib(torch.cuda.max_memory_allocated())
            out["reserved_peak_mib"] = _mib(torch.cuda.max_memory_reserved())
        return out


def pick_device(cpu_dry_run: bool, script: str) -> str | None:
    """"cuda" when there is a GPU, "cpu" for a dry run, else None (after saying the check is skipped)."""
    if torch.cuda.is_available():
        return "cuda"
    if cpu_dry_run:
        return "cpu"
    print(f"{script}: no CUDA device; skipped (use --cpu for a dry run)")
    return None


def _state(device: str, numel: int, num_experts: int, fill: bool) -> tuple[dict, dict]:
    from olmo_chunks.experts import ExpertLayout

    lo = ExpertLayout(num_experts, (numel // num_experts // 2,))
    dense_rows = 1024
    dense_cols = max(1, numel // 2 // dense_rows)

    def make(shape: tuple[int, ...] | int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.normal_() if fill else t.fill_(float("nan"))

    model = {"experts.w": lo.view(make(lo.local_numel)), "dense.w": make((dense_rows, dense_cols))}
    def moment(name: str) -> object:
        return lo.view(make(lo.local_numel)) if name.startswith("experts") else make((dense_rows, dense_cols))

    optim = {name: {"exp_avg": moment(name), "exp_avg_sq": moment(name)} for name in model}
    return model, optim


def _data(v: object) -> torch.Tensor:
    from olmo_chunks.experts import ExpertFlatView

    return v.storage if isinstance(v, ExpertFlatView) else v  # type: ignore[return-value]


def main() -> int:  # noqa: PLR0915
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="FP32 parameters' size in GiB (the state is 3x)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dir", help="checkpoint directory (default: a temp dir, removed after)")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU when there is no CUDA")
    args = ap.parse_args()

    device = pick_device(args.cpu, "gpu_memory_check")
    if device is None:
        return 0

    import olmo_chunks as oc
    from olmo_chunks.weights import compute_weights

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    numel = int(args.gib * 2**30 / 4)
    root = args.dir or tempfile.mkdtemp(prefix="olmo-chunks-gpumem-")
    path = os.path.join(root, "ck")
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run; figures are RSS)",
        "torch": torch.__version__,
        "params_gib": args.gib,
        "state_gib": round(3 * numel * 4 / 2**30, 3),
        "staging_bytes": oc.checkpoint.STAGING_BYTES,
    }
    try:
        model, optim = _state(device, numel, args.experts, fill=True)
        with Sampler(device) as s:
            pass
        report["before_save"] = s.report()
        t0 = time.perf_counter()
        with Sampler(device) as s:
            oc.save({"model": model, "optim": optim}, path, overwrite=True)
        report["save"] = {**s.report(), "seconds": round(time.perf_counter() - t0, 3)}
        want = {k: _data(v).clone() for k, v in model.items()}
        del model, optim
        if device == "cuda":
            torch.cuda.empty_cache()
        model, optim = _state(device, numel, args.experts, fill=False)
        t0 = time.perf_counter()
        with Sampler(device) as s:
            oc.load({"model": model, "optim": optim}, path)
        report["load"] = {**s.report(), "seconds": round(time.perf_counter() - t0, 3)}
        got = {k: _data(v) for k, v in model.items()}
        report["load_exact"] = all(torch.equal(got[k], want[k]) for k in want)
        del want
        with Sampler(device) as s:
            bf16 = compute_weights(model)
        bf16_bytes = sum(t.numel() * t.element_size() for t in bf16.values())
        report["compute_weights"] = {**s.report(), "bf16_mib": _mib(bf16_bytes)}
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    save = report["save"]
    key = "allocated_peak_mib" if device == "cuda" else "allocated_sampled_max_mib"
    report["save_growth_mib"] = round(save[key] - save["allocated_start_mib"], 1)  # type: ignore[index]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if report["load_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
