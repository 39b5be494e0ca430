"""`import_hf`: a native checkpoint (main weights, native names) written from an HF model directory
or in-memory tensors, streaming in bounded memory."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch

from .. import _core, values
from ..errors import ConversionError
from ..location import checkpoint_location
from ..roles import MAIN_WEIGHT
from ..session import SaveSession, zstd_level
from ..shards import Region, dtype_name
from .common import (
    DEFAULT_MEMORY_BUDGET,
    TensorDictSource,
    box_elems,
    cast_finite,
    out_dtype,
    pick_import_spec,
    resolve_dtype,
)
from .mapping import (
    MappingSpec,
    NativeSource,
    Planned,
    TensorPlan,
    plan_import,
    scatter_planned,
)
from .ops import TrimVocab
from .safetensors_io import SafetensorsDir
from .shapes import contiguous_boxes

__all__ = ["import_hf"]

def _native_regions(
    src: NativeSource, off: list[int], size: list[int], data: torch.Tensor
) -> list[tuple[Region, torch.Tensor]]:
    data = data.contiguous()
    if tuple(src.saved_shape) == tuple(src.shape):
        return [(_core.Box(off, size), data)]
    flat = data.reshape(-1)
    return [
        (_core.Flat(start, length), flat[local : local + length])
        for start, length, local in _core.box_runs(list(src.shape), list(off), list(size))
    ]


def import_hf(
    source: str | os.PathLike[str] | SafetensorsDir | TensorDictSource,
    ckpt: str | os.PathLike[str],
    *,
    mapping: str | MappingSpec | None = None,
    dtype: str | None = "fp32",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    pad_multiple: int | None = None,
    config: Mapping[str, Any] | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    compression: str | None = None,
    compression_level: int | None = None,
) -> dict[str, Any]:
    """Writes a native checkpoint at `ckpt` (main weights, native names) from an HF model
    directory (or in-memory tensors), streaming in bounded memory. Vocab rows are padded with
    zeros to `pad_multiple` (default: the mapping's) and the true vocab size, the HF config and
    the mapping are saved with it. A checkpoint already at `ckpt` is replaced only with
    `overwrite=True`; `compression` and `compression_level` are `olmo_chunks.save`'s. Returns a
    summary."""
    zstd = zstd_level(compression, compression_level)
    src = source if isinstance(source, (SafetensorsDir, TensorDictSource)) else SafetensorsDir(source)
    if src.problems:
        raise ConversionError(src.problems, header="the HF tensors are inconsistent")
    if config is None and isinstance(src, SafetensorsDir):
        config = src.config()
    spec = (
        mapping
        if isinstance(mapping, MappingSpec)
        else pick_import_spec(list(src.tensors), mapping, (config or {}).get("model_type"))
    )
    plan = plan_import({n: t.shape for n, t in src.tensors.items()}, spec, pad_multiple=pad_multiple)
    if plan.problems:
        raise ConversionError(plan.problems, header=f"cannot import through mapping {spec.name}")
    want = resolve_dtype(dtype)
    native_dtype: dict[str, torch.dtype] = {}
    for e in plan.entries:
        assert e.source is not None
        d = out_dtype(src.tensors[e.hf_name].dtype, want)
        if native_dtype.setdefault(e.native_name, d) != d:
            raise ConversionError([f"{e.native_name}: built from HF tensors of different dtypes"])
        e.source.dtype = d
    with SaveSession(checkpoint_location(ckpt), workers=workers, zstd=zstd, budget=memory_budget // 2) as session:
        session.begin(overwrite)
        return _import_into(session, src, plan, spec, native_dtype, config, memory_budget)


def _import_into(session: SaveSession, src: SafetensorsDir | TensorDictSource, plan: TensorPlan, spec: MappingSpec,
                 native_dtype: dict[str, torch.dtype], config: Mapping[str, Any] | None,
                 memory_budget: int) -> dict[str, Any]:
    def add(native_src: NativeSource, off: list[int], size: list[int], data: torch.Tensor) -> None:
        for region, d in _native_regions(native_src, off, size, data):
            session.add(spec.import_prefix + native_src.name, region, d, owned=True)

    by_native: dict[str, list[Planned]] = {}
    for e in plan.entries:
        by_native.setdefault(e.native_name, []).append(e)
    for es in by_native.values():
        for e in es:
            assert e.source is not None
            item = src.tensors[e.hf_name].dtype.itemsize
            n = box_elems(memory_budget // 2, [item] * 2 + [e.source.dtype.itemsize] * 2)
            for off, size in contiguous_boxes(e.shape, n):
                x, bad = cast_finite(src.read_box(e.hf_name, off, size), e.source.dtype)
                if bad:
                    raise ConversionError([f"{e.hf_name}: {bad}"], header="refusing to import")
                for o, s, d in scatter_planned(e, off, size, x):
                    assert d is not None
                    add(e.source, o, s, d)
        # Vocab padding rows are zeros.
        e = es[0]
        assert e.source is not None
        for op, shp in zip(e.ops, e.shapes, strict=False):
            if isinstance(op, TrimVocab) and plan.vocab_size is not None and shp[op.dim] > plan.vocab_size:
                pad_shape = list(shp)
                pad_shape[op.dim] -= plan.vocab_size
                n = box_elems(memory_budget // 2, [e.source.dtype.itemsize])
                for off, size in contiguous_boxes(pad_shape, n):
                    off = list(off)
                    off[op.dim] += plan.vocab_size
                    add(e.source, off, list(size), torch.zeros(size, dtype=e.source.dtype))
    session.flush()
    schema = {
        spec.import_prefix + native: (dtype_name(native_dtype[native]), list(saved_shape), MAIN_WEIGHT)
        for native, (saved_shape, _) in plan.natives.items()
    }
    entries: dict[str, Any] = {
        "model_config": values.encode(
            {"vocab_size": plan.vocab_size, "padded_vocab_size": plan.padded_vocab_size}, "model_config"
        ),
    }
    if config is not None:
        entries["hf_config"] = values.encode(dict(config), "hf_config")
    info = {
        "writer": "olmo_chunks.import_hf",
        "source": str(getattr(src, "path", "<tensors>")),
        "mapping": spec.name,
        "mapping_sha256": spec.sha256,
    }
    session.commit(schema, session.written, entries, info)
    return {
        "tensors": len(schema),
        "hf_tensors": len(plan.entries),
        "mapping": spec.name,
        "vocab_size": plan.vocab_size,
        "padded_vocab_size": plan.padded_vocab_size,
        "files": session.parts,
    }


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="Hugging Face model directory (safetensors)")
    p.add_argument("ckpt", help="native checkpoint directory to write")
    p.add_argument(
        "--mapping", default=None, help="built-in or JSON spec file (default: the built-in that fits)"
    )
    p.add_argument("--dtype", default="fp32", help="dtype of the native main weights (fp32, bf16 or keep)")
    p.add_argument(
        "--pad-vocab-multiple",
        type=int,
        default=None,
        help="pad vocab rows to a multiple (default: mapping's)",
    )
    p.add_argument("--memory-budget", type="bytes", default=DEFAULT_MEMORY_BUDGET)
    p.add_argument("--workers", type="count", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at CKPT")
    p.add_argument("--compression", choices=["zstd"], default=None, help="compress every block with zstd")
    p.add_argument("--compression-level", type=int, default=None, help="zstd level (default 3)")


def _import_cmd(args: argparse.Namespace) -> int:
    s = import_hf(
        args.hf_dir,
        args.ckpt,
        mapping=args.mapping,
        dtype=args.dtype,
        memory_budget=args.memory_budget,
        pad_multiple=args.pad_vocab_multiple,
        workers=args.workers,
        overwrite=args.overwrite,
        compression=args.compression,
        compression_level=args.compression_level,
    )
    print(
        f"OK {args.ckpt}: {s['tensors']} native tensors from {s['hf_tensors']} HF tensors "
        f"(mapping {s['mapping']}, vocab {s['vocab_size']} padded to {s['padded_vocab_size']})"
    )
    return 0
