"""The `olmo-chunks` command line: inspect and verify checkpoints without a GPU job.

Errors are reported as one line, `olmo-chunks <command>: error: ...`, with exit status 1; set
OLMO_CHUNKS_DEBUG=1 to get the traceback of an unexpected one."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from . import _core, values
from .errors import OlmoChunksError
from .roles import MAIN_WEIGHT, ROLES

__all__ = ["main", "register"]

_COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = []


def register(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]):
    """Decorator adding a subcommand: `configure` adds its arguments, the function runs it and
    returns the exit status."""

    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS.append((name, help, configure, fn))
        return fn

    return wrap


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def summarize(path: str) -> dict:
    """Per-tensor and per-role totals of a checkpoint, with bytes per main-weight parameter."""
    m = _core.Manifest.open(path)
    tensors = []
    by_role: dict[str, int] = {}
    params = 0
    for key, dtype, shape, role, nchunks, nbytes in m.tensors:
        numel = 1
        for d in shape:
            numel *= d
        tensors.append({"key": key, "role": role, "dtype": dtype, "shape": list(shape), "chunks": nchunks,
                        "bytes": nbytes})
        by_role[role] = by_role.get(role, 0) + nbytes
        if role == MAIN_WEIGHT:
            params += numel
    total = sum(by_role.values())
    order = [r for r in ROLES if r in by_role] + sorted(set(by_role) - set(ROLES))
    return {
        "path": path,
        "format_version": m.format_version,
        "save_id": m.save_id,
        "tensors": tensors,
        "files": len(m.files),
        "chunks": m.num_chunks,
        "total_bytes": total,
        "parameters": params,
        "roles": [{"role": r, "bytes": by_role[r], "bytes_per_parameter": by_role[r] / params if params else None}
                  for r in order],
        "info": values.parse_json(m.info_json, f"{path}: manifest info"),
    }


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-tensors", action="store_true", help="totals only")


@register("inspect", "list tensors, roles, chunks and the bytes-per-parameter breakdown", _inspect_args)
def _inspect(args: argparse.Namespace) -> int:
    s = summarize(args.path)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"{s['path']}: format v{s['format_version']}, {len(s['tensors'])} tensors, {s['chunks']} chunks, "
          f"{s['files']} data files, {_gib(s['total_bytes'])} GiB")
    if not args.no_tensors:
        w = max([len(t["key"]) for t in s["tensors"]] + [3])
        print(f"{'key':<{w}}  {'role':<15} {'dtype':<9} {'shape':<22} {'chunks':>6} {'bytes':>14}")
        for t in s["tensors"]:
            shape = "x".join(map(str, t["shape"])) or "scalar"
            print(f"{t['key']:<{w}}  {t['role']:<15} {t['dtype']:<9} {shape:<22} {t['chunks']:>6} {t['bytes']:>14}")
    p = s["parameters"]
    print(f"\nP = {p} main-weight parameters")
    print(f"{'role':<16} {'GiB':>10} {'bytes/P':>8}")
    for r in s["roles"]:
        per = f"{r['bytes_per_parameter']:.2f}P" if r["bytes_per_parameter"] is not None else "-"
        print(f"{r['role']:<16} {_gib(r['bytes']):>10} {per:>8}")
    tot = f"{s['total_bytes'] / p:.2f}P" if p else "-"
    print(f"{'total':<16} {_gib(s['total_bytes']):>10} {tot:>8}")
    return 0


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--workers", type=int, default=None)


@register("verify", "check every checksum and that chunks cover every tensor exactly once", _verify_args)
def _verify(args: argparse.Namespace) -> int:
    m = _core.Manifest.open(args.path)
    m.check_coverage()
    t0 = time.perf_counter()
    n = m.verify_data(args.workers)
    dt = time.perf_counter() - t0
    print(f"OK {args.path}: {len(m.tensors)} tensors, {m.num_chunks} chunks, {n} bytes verified "
          f"({n / max(dt, 1e-9) / 1e9:.2f} GB/s), exact coverage")
    return 0


def _load_plugins() -> None:
    """Imports modules that register further subcommands (they may need optional packages)."""
    import importlib

    for mod in ("olmo_chunks.dcp", "olmo_chunks.export", "olmo_chunks.bench"):
        with contextlib.suppress(ImportError):
            importlib.import_module(mod)


def main(argv: Sequence[str] | None = None) -> int:
    _load_plugins()
    parser = argparse.ArgumentParser(prog="olmo-chunks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help, configure, fn in _COMMANDS:
        p = sub.add_parser(name, help=help, description=help)
        configure(p)
        p.set_defaults(run=fn)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not isinstance(exc, OlmoChunksError) and os.environ.get("OLMO_CHUNKS_DEBUG") == "1":
            raise
        what = str(exc) if isinstance(exc, OlmoChunksError) else f"{type(exc).__name__}: {exc}"
        print(f"olmo-chunks {args.command}: error: {what}".replace("\n", " "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
