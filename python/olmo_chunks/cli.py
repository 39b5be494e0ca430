"""The `olmo-chunks` command line: inspect and verify checkpoints without a GPU job.

Errors are reported as one line, `olmo-chunks <command>: error: ...`, with exit status 1 (2, after
the usage, for an option value refused as it is parsed); set OLMO_CHUNKS_DEBUG=1 to get the
traceback of an unexpected one."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import _core, values
from .errors import InvalidArgumentError, OlmoChunksError, start_thread
from .roles import MAIN_WEIGHT, ROLES

__all__ = ["COMMANDS", "OPTION_TYPES", "Command", "main", "summarize"]


@dataclass(frozen=True)
class Command:
    """A subcommand: `module` (imported only when the subcommand is chosen) defines `configure`,
    which adds its arguments (an option's `type` may name one of `OPTION_TYPES`), and `run`, which
    runs it and returns the exit status. `watch` names the argument holding the output directory
    whose growth a progress bar shows while it runs."""

    name: str
    help: str
    module: str
    configure: str
    run: str
    watch: str | None = None


COMMANDS = [
    Command("inspect", "list tensors, roles, chunks and the bytes-per-parameter breakdown", __name__,
            "_inspect_args", "_inspect"),
    Command("verify", "check every checksum and that chunks cover every tensor exactly once", __name__,
            "_verify_args", "_verify"),
    Command("import-dcp", "convert a DCP FileSystemWriter checkpoint into the chunk store, then verify it",
            "olmo_chunks.dcp.importer", "_import_args", "_import_cmd", watch="dst"),
    Command("export", "stream main weights into sharded safetensors / a Hugging Face model directory",
            "olmo_chunks.hf.export", "_export_args", "_export_cmd", watch="out"),
    Command("import-hf", "write a native checkpoint from a Hugging Face safetensors model directory",
            "olmo_chunks.hf.importer", "_import_args", "_import_cmd", watch="ckpt"),
    Command("validate-conversion", "exhaustively compare a native checkpoint with its HF export (two passes)",
            "olmo_chunks.hf.validate", "_validate_args", "_validate_cmd"),
    Command("bench", "save and resharded-load throughput against torch DCP and the raw I/O roofline",
            "olmo_chunks.bench", "configure", "main"),
]


def _number(convert: Callable[[str], Any], lo: float, hi: float, what: str) -> Callable[[str], Any]:
    """An option type: the text `convert`ed, from `lo` to `hi` (NaN is refused)."""
    def parse(text: str) -> Any:
        with contextlib.suppress(ValueError, OverflowError):
            if lo <= (value := convert(text)) <= hi:
                return value
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return parse


def _bytes(text: str) -> int:
    """An option type: a byte count such as `512M` (only the HF commands, which import torch anyway,
    have such options)."""
    from .hf.common import parse_bytes

    try:
        return parse_bytes(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _output(text: str) -> str:
    """An option type: a file to write at the end, whose directory is checked writable before the
    work starts."""
    parent = os.path.dirname(text) or "."
    if os.path.isdir(text):
        why = "it is a directory"
    elif not os.path.isdir(parent):
        why = f"no directory {parent}"
    elif not os.access(parent, os.W_OK):
        why = f"directory {parent} is not writable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")


# The types options name (`add_argument("--workers", type="count")`) so that the modules defining
# them need not import the CLI: a bad value is argparse's usage error naming the option (exit 2).
OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "count": _number(int, 1, 1024, "a whole number from 1 to 1024"),
    "mib": _number(int, 0, 1 << 30, "a whole number of MiB from 0 to 2**30"),
    "amount": _number(float, 0, sys.float_info.max, "a finite number >= 0"),
    "bytes": _bytes,
    "output": _output,
}


class _Parser(argparse.ArgumentParser):
    """An argument parser that knows `OPTION_TYPES` by name (its subcommands' parsers too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, parse in OPTION_TYPES.items():
            self.register("type", name, parse)


@contextlib.contextmanager
def _progress(desc: str, total: int | None = None) -> Iterator[Callable[[int], None] | None]:
    """A bytes progress bar on stderr, fed with the bytes done so far; None (no bar) when stderr is
    not a terminal or tqdm is not installed."""
    if not sys.stderr.isatty() or importlib.util.find_spec("tqdm") is None:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
              file=sys.stderr) as bar:
        yield lambda done: bar.update(done - bar.n)


def _bytes_under(path: str) -> int:
    """The size of the files under `path` (those gone meanwhile count 0)."""
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(root, f)).st_size
    return n


@contextlib.contextmanager
def _watching(desc: str, path: str) -> Iterator[None]:
    """A progress bar of the bytes under directory `path` while the body runs, for work that
    reports no progress of its own."""
    with _progress(desc) as update:
        if update is None:
            yield
            return
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.5):
                update(_bytes_under(path))

        t = threading.Thread(target=poll, daemon=True)
        start_thread(t)
        try:
            yield
        finally:
            stop.set()
            t.join()


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def summarize(path: str) -> dict[str, Any]:
    """Per-tensor and per-role totals of a checkpoint, with bytes per main-weight parameter; `bytes`
    are raw (the tensors' own), `stored_bytes` what they take on disk (less when compressed)."""
    m = _core.Manifest.open(path)
    tensors = []
    by_role: dict[str, int] = {}
    stored: dict[str, int] = {}
    params = 0
    for t in m.tensors:
        numel = 1
        for d in t.shape:
            numel *= d
        tensors.append({"key": t.key, "role": t.role, "dtype": t.dtype, "shape": list(t.shape),
                        "chunks": t.chunks, "bytes": t.nbytes, "stored_bytes": t.stored_nbytes})
        by_role[t.role] = by_role.get(t.role, 0) + t.nbytes
        stored[t.role] = stored.get(t.role, 0) + t.stored_nbytes
        if t.role == MAIN_WEIGHT:
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
        "total_stored_bytes": sum(stored.values()),
        "parameters": params,
        "roles": [{"role": r, "bytes": by_role[r], "stored_bytes": stored[r],
                   "bytes_per_parameter": by_role[r] / params if params else None} for r in order],
        "info": values.parse_json(m.info_json, f"{path}: manifest info"),
    }


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-tensors", action="store_true",
                   help="totals only (with --json: tensor_count in place of the tensors list)")


def _inspect(args: argparse.Namespace) -> int:
    s = summarize(args.path)
    if args.json:
        if args.no_tensors:
            s["tensor_count"] = len(s.pop("tensors"))
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
    print(f"{'role':<16} {'GiB':>10} {'bytes/P':>8} {'stored GiB':>11} {'stored/raw':>10}")

    def row(name: str, raw: int, on_disk: int, per: str) -> None:
        ratio = f"{on_disk / raw:.3f}" if raw else "-"
        print(f"{name:<16} {_gib(raw):>10} {per:>8} {_gib(on_disk):>11} {ratio:>10}")

    for r in s["roles"]:
        per = f"{r['bytes_per_parameter']:.2f}P" if r["bytes_per_parameter"] is not None else "-"
        row(r["role"], r["bytes"], r["stored_bytes"], per)
    row("total", s["total_bytes"], s["total_stored_bytes"], f"{s['total_bytes'] / p:.2f}P" if p else "-")
    return 0


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--workers", type="count", default=None)


def _verify(args: argparse.Namespace) -> int:
    m = _core.Manifest.open(args.path)
    m.check_coverage()
    with _progress("verify", sum(t.nbytes for t in m.tensors)) as update:
        t0 = time.perf_counter()
        n = m.verify_data(args.workers, progress=update)
        dt = time.perf_counter() - t0
    print(f"OK {args.path}: {len(m.tensors)} tensors, {m.num_chunks} chunks, {n} bytes verified "
          f"({n / max(dt, 1e-9) / 1e9:.2f} GB/s), exact coverage")
    return 0


def _fail(command: str, exc: Exception) -> int:
    """Prints `exc` as one error line (re-raises an unexpected one under OLMO_CHUNKS_DEBUG=1)."""
    if not isinstance(exc, OlmoChunksError) and os.environ.get("OLMO_CHUNKS_DEBUG") == "1":
        raise exc
    what = str(exc) if isinstance(exc, OlmoChunksError) else f"{type(exc).__name__}: {exc}"
    print(f"olmo-chunks {command}: error: {what}".replace("\n", " "), file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(prog="olmo-chunks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {c.name: sub.add_parser(c.name, help=c.help, description=c.help) for c in COMMANDS}
    # The command is the first word (the top-level parser has no options taking values); only its
    # module is imported, so `--help`, `inspect` and `verify` stay torch-free.
    cmd = next((c for c in COMMANDS if c.name == next((a for a in argv if not a.startswith("-")), None)), None)
    if cmd is None:
        parser.parse_args(argv)  # --help, or a usage error; exits
        return 2
    try:
        module = importlib.import_module(cmd.module)
        configure, run = getattr(module, cmd.configure), getattr(module, cmd.run)
    except Exception as exc:
        return _fail(cmd.name, exc)
    configure(parsers[cmd.name])
    args = parser.parse_args(argv)
    try:
        with _watching(cmd.name, getattr(args, cmd.watch)) if cmd.watch else contextlib.nullcontext():
            rc: int = run(args)
            return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`| head`), having what it wanted: no error
        with contextlib.suppress(OSError, ValueError):  # nor another at exit, flushing stdout
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports SIGPIPE
    except Exception as exc:
        return _fail(cmd.name, exc)


if __name__ == "__main__":
    sys.exit(main())
