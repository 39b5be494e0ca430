"""Export to safetensors / Hugging Face, streaming in bounded memory on the CPU: a tensor is read
from the chunk store one box at a time, never the whole model."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _core, values
from ..errors import CheckpointExistsError, CheckpointLockedError, ConversionError, InvalidArgumentError, StorageError
from ..location import checkpoint_location, local_dir
from ..roles import EXP_AVG, EXP_AVG_SQ, MAIN_WEIGHT
from ..shards import dtype_name
from .common import (
    DEFAULT_MEMORY_BUDGET,
    box_elems,
    cast_finite,
    config_problems,
    native_loader,
    out_dtype,
    read_config,
    resolve_dtype,
    source_name,
)
from .mapping import (
    BUILTIN_MAPPINGS,
    MappingSpec,
    TensorPlan,
    lookup_entry,
    plan_export,
    plan_identity,
    read_planned,
)
from .safetensors_io import INDEX_NAME, ShardedWriter
from .shapes import contiguous_boxes

__all__ = ["export_checkpoint"]

def _pick_export_spec(manifest: Any, mapping: str | None) -> tuple[MappingSpec, TensorPlan]:
    if mapping is not None:
        spec = MappingSpec.load(mapping)
        return spec, plan_export(manifest, spec)
    tried = []
    for name in BUILTIN_MAPPINGS:
        spec = MappingSpec.load(name)
        plan = plan_export(manifest, spec)
        if plan.entries and not plan.problems:
            return spec, plan
        tried.append(f"{name}: {len(plan.problems)} problem(s), first: {plan.problems[:1]}")
    raise ConversionError(tried, header="no built-in mapping fits this checkpoint; pass --mapping SPEC")


def _saved_hf_config(manifest: Any) -> dict[str, Any] | None:
    v = lookup_entry(values.entries(manifest), "hf_config")
    return v if isinstance(v, dict) else None


def export_checkpoint(  # noqa: PLR0915
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str = "hf",
    mapping: str | None = None,
    dtype: str | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    include_moments: bool = False,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    max_shard_bytes: int = 5 << 30,
    workers: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Streams the main weights of checkpoint `ckpt` into sharded safetensors files and an index
    in `out`, holding at most about `memory_budget` bytes of tensor data at a time.

    `format="hf"` renames and re-lays them out through a mapping (a built-in picked to fit, or
    `mapping`), trims vocab padding to the saved vocab size and writes `config.json` (from
    `config` or the checkpoint's saved `hf_config`). `format="safetensors"` keeps native names
    (`include_moments` adds the Adam moments). `dtype` casts floating tensors (`bf16`, `fp32`).
    A model already exported in `out` is replaced only with `overwrite=True`, and only once the
    new one is complete: it is written in a hidden directory in `out` and moved into place at the
    end, so a failed or killed export leaves the old model as it was (or nothing), never a shard
    with a tensor left unwritten. Returns the index written.
    """
    out_dir = local_dir(out, "an export's output")
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidArgumentError(f"{out}: exists and is not a directory")
    existing = [n for n in (INDEX_NAME, "model.safetensors") if (out_dir / n).exists()]
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{out}: a model is already exported there ({existing[0]}); pass overwrite=True (--overwrite) "
            "to replace it (nothing was changed)"
        )
    if isinstance(config, (str, os.PathLike)):
        config = read_config(config)
    manifest = _core.Manifest.open(checkpoint_location(ckpt))
    want = resolve_dtype(dtype)
    spec: MappingSpec | None = None
    if format == "safetensors" and mapping is None:
        plan = plan_identity(
            manifest, (MAIN_WEIGHT, EXP_AVG, EXP_AVG_SQ) if include_moments else (MAIN_WEIGHT,)
        )
    elif format in ("hf", "safetensors"):
        if include_moments:
            raise InvalidArgumentError(
                "optimizer moments can only be exported with native names (--format safetensors)"
            )
        spec, plan = _pick_export_spec(manifest, mapping)
    else:
        raise InvalidArgumentError(f"--format must be hf or safetensors, not {format!r}")
    if plan.problems:
        raise ConversionError(
            plan.problems, header=f"{ckpt}: cannot export through mapping {spec and spec.name}"
        )
    cfg: dict[str, Any] | None = None
    if format == "hf":
        cfg = dict(config) if config is not None else _saved_hf_config(manifest)
        if cfg is None:
            raise InvalidArgumentError(
                f"{ckpt}: no saved hf_config; pass --config CONFIG.json for --format hf"
            )
        problems = config_problems(spec, plan, cfg)
        if problems:
            raise ConversionError(problems, header="the HF config does not match the checkpoint")
    if plan.vocab_size is None and plan.padded_vocab_size is not None:
        print(
            f"olmo-chunks export: warning: {ckpt} saves no vocab size; vocab rows exported untrimmed",
            file=sys.stderr,
        )
    casts: dict[str, int] = {}
    planned = []
    for e in plan.entries:
        assert e.source is not None
        od = out_dtype(e.source.dtype, want)
        if od != e.source.dtype:
            k = f"{dtype_name(e.source.dtype)}->{dtype_name(od)}"
            casts[k] = casts.get(k, 0) + 1
        planned.append((e.hf_name, od, e.shape))
    meta = {
        "olmo_chunks": {
            "source": source_name(ckpt),
            "save_id": manifest.save_id,
            "mapping": spec.name if spec else "identity",
            "mapping_sha256": spec.sha256 if spec else None,
            "dtype": dtype_name(want) if want is not None else "saved",
            "casts": casts,
            "vocab_size": plan.vocab_size,
            "padded_vocab_size": plan.padded_vocab_size,
        }
    }
    with _staged(out_dir) as stage:
        writer = ShardedWriter(stage, planned, max_shard_bytes=max_shard_bytes, index_metadata=meta)
        load = native_loader(manifest, workers)
        try:
            for e, (_, od, _) in zip(plan.entries, planned, strict=True):
                assert e.source is not None
                n = box_elems(memory_budget, [e.source.dtype.itemsize] * 3 + [od.itemsize])
                for off, size in contiguous_boxes(e.shape, n):
                    # Checked after the cast: a finite weight can overflow a narrower dtype.
                    x, bad = cast_finite(read_planned(e, off, size, load), od)
                    if bad:
                        raise ConversionError(
                            [f"{e.source.key}: {bad} (exporting {e.hf_name})"],
                            header="refusing to export nonfinite weights",
                        )
                    writer.write(e.hf_name, x)
                    del x
        except BaseException:
            writer.abort()
            raise
        index = writer.close()
        if cfg is not None:
            (stage / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        _publish(stage, out_dir, writer.files, with_config=cfg is not None)
    return index


_STAGE_PREFIX = ".olmo-chunks-export-"
_LOCK_NAME = ".olmo-chunks-export.lock"


@contextlib.contextmanager
def _staged(out_dir: Path) -> Iterator[Path]:
    """A new directory in `out_dir` where an export writes until it is complete (removed after),
    with `out_dir`'s export lock held throughout: a second export there meanwhile is
    `CheckpointLockedError`. The directories that killed exports left are removed first (only
    this module makes directories of that name, and the lock says none is in use)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(out_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StorageError(f"{out_dir}: cannot write the export there ({type(exc).__name__}: {exc})") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointLockedError(f"{out_dir}: another export is writing there") from None
        try:
            for left in out_dir.glob(f"{_STAGE_PREFIX}*"):
                if left.is_dir() and not left.is_symlink():
                    shutil.rmtree(left, ignore_errors=True)
            stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=out_dir))
        except OSError as exc:
            raise StorageError(f"{out_dir}: cannot write the export there ({type(exc).__name__}: {exc})") from None
        try:
            yield stage
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    finally:
        os.close(lock)  # (the lock goes with it, and with a killed process)


def _publish(stage: Path, out_dir: Path, files: list[str], *, with_config: bool) -> None:
    """Moves a complete export from `stage` into `out_dir`, replacing the model there: its index
    goes first (from then on `out_dir` holds no complete model), the new index comes last."""
    try:
        for stale in (INDEX_NAME, "model.safetensors"):
            (out_dir / stale).unlink(missing_ok=True)
        for old in out_dir.glob("model-*-of-*.safetensors"):
            if old.name not in files:
                old.unlink()
        for name in [*files, *(["config.json"] if with_config else [])]:
            os.replace(stage / name, out_dir / name)
        os.replace(stage / INDEX_NAME, out_dir / INDEX_NAME)
        fd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"{out_dir}: cannot put the export in place ({type(exc).__name__}: {exc})") from None


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="native checkpoint directory")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--format",
        choices=["hf", "safetensors"],
        default="hf",
        help="hf: mapped names + config.json; safetensors: native names (default hf)",
    )
    p.add_argument(
        "--mapping",
        default=None,
        help=f"built-in ({', '.join(BUILTIN_MAPPINGS)}) or a JSON spec file (default: the one that fits)",
    )
    p.add_argument(
        "--dtype", default=None, help="bf16, fp32 or fp16 for floating tensors (default: as saved)"
    )
    p.add_argument(
        "--memory-budget",
        type="bytes",
        default=DEFAULT_MEMORY_BUDGET,
        help="bytes of tensor data held at once (e.g. 256M)",
    )
    p.add_argument(
        "--max-shard-size", type="bytes", default="5G", help="bytes per safetensors file (default 5G)"
    )
    p.add_argument(
        "--config", default=None, help="HF config.json to write (default: the checkpoint's saved hf_config)"
    )
    p.add_argument(
        "--include-moments", action="store_true", help="also export Adam moments (--format safetensors)"
    )
    p.add_argument("--workers", type="count", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a model already exported in OUT")


def _export_cmd(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    index = export_checkpoint(
        args.ckpt,
        args.out,
        format=args.format,
        mapping=args.mapping,
        dtype=args.dtype,
        memory_budget=args.memory_budget,
        include_moments=args.include_moments,
        config=args.config,
        max_shard_bytes=args.max_shard_size,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    n = len(index["weight_map"])
    files = len(set(index["weight_map"].values()))
    print(
        f"OK {args.out}: {n} tensors, {files} file(s), {index['metadata']['total_size']} bytes "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0
