"""The installed wheel's smoke test (scripts/wheel_smoke.sh drives it; not collected by pytest).

`link-runtime WHEEL SITE`: run in the project venv; links into the fresh venv's SITE the
distributions in the dependency closure of WHEEL's `Requires-Dist` (without extras), and nothing
else. `run OLMO_CHUNKS CKPT`: run in the fresh venv, outside the tree; checks the package it imports
is the installed wheel, the CLI works with torch unimportable, a 2-rank gloo save and a resharded
load are bit-exact, and the installed console script inspects and verifies the result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path


def _requires(metadata: str) -> list[str]:
    """The names of the unconditional `Requires-Dist` lines of a METADATA text."""
    names = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            names.append(re.split(r"[\s<>=!~;\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0])
    return names


def link_runtime(wheel: str, site: str) -> None:
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        todo = _requires(z.read(meta).decode())
    env = {"extra": ""}
    seen: set[str] = set()
    tops: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for f in dist.files or []:
            top = f.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                tops.add(top)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    src = Path(metadata.distribution("torch").locate_file(""))
    for top in sorted(tops):
        if (src / top).exists() and not (Path(site) / top).exists():  # the venv's own pip, setuptools
            os.symlink(src / top, Path(site) / top)
    print(f"[wheel] linked {len(seen)} runtime distributions ({', '.join(sorted(seen)[:6])}, ...)", file=sys.stderr)


def _rank(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import olmo_chunks
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
        saved = DTensor.from_local(full.chunk(world, 0)[rank].clone(), mesh, [Shard(0)])
        olmo_chunks.save({"w": saved, "step": 7}, ckpt)
        dest = {"w": DTensor.from_local(torch.zeros(64, 48 // world), mesh, [Shard(1)]), "step": 0}
        report = olmo_chunks.load(dest, ckpt)
        ok = torch.equal(dest["w"].to_local(), full.chunk(world, 1)[rank]) and dest["step"] == 7 and report.ok
        Path(f"{out}.{rank}").write_text(json.dumps(ok))
    finally:
        dist.destroy_process_group()


def run(cli: str, ckpt: str) -> None:
    import socket

    import olmo_chunks
    import torch.multiprocessing as mp

    where = Path(olmo_chunks.__file__).resolve()
    assert "site-packages" in where.parts, f"imported {where}, not the installed wheel"
    import importlib.util

    dev_only = ("pytest", "maturin", "hypothesis", "transformers", "torchtitan")
    extra = [m for m in dev_only if importlib.util.find_spec(m)]
    assert not extra, f"the fresh venv holds more than the runtime dependencies: {extra}"
    # The CLI never needs torch: it runs with torch unimportable.
    no_torch = ("import sys; sys.modules['torch'] = None; from olmo_chunks.cli import main; "
                "sys.exit(main(['--help']))")
    r = subprocess.run([sys.executable, "-c", no_torch], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"{ckpt}.ok"
    mp.start_processes(_rank, args=(2, port, ckpt, out), nprocs=2, start_method="spawn")
    assert [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)] == [True, True]
    r = subprocess.run([cli, "inspect", "--json", ckpt], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert [(t["key"], t["shape"]) for t in summary["tensors"]] == [("w", [64, 48])], summary
    assert (summary["total_bytes"], summary["files"], summary["info"]["world_size"]) == (64 * 48 * 4, 2, 2), summary
    r = subprocess.run([cli, "verify", ckpt], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith(f"OK {ckpt}"), (r.stdout, r.stderr)
    r = subprocess.run([cli, "verify", f"{ckpt}.missing"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    print(f"[wheel] OK: {where.parent} (CLI without torch, 2-rank gloo save + resharded load, inspect, verify)")


if __name__ == "__main__":
    {"link-runtime": link_runtime, "run": run}[sys.argv[1]](*sys.argv[2:])
