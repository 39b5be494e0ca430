"""Export to safetensors / Hugging Face, import from it, and exhaustive conversion validation.

Everything streams in bounded memory on the CPU: a tensor is read from the chunk store (or an HF
directory) one box at a time, never the whole model. `validate_conversion` runs the two passes
of the conversion check: the native pass (saved main weights through the mapping, compared with
the HF export) and the round-trip pass (the HF model built from its config, imported, streamed
back and compared again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _core, values
from ..errors import ConversionError, InvalidArgumentError, OlmoChunksError
from ..location import checkpoint_location, is_url
from ..roles import EXP_AVG, EXP_AVG_SQ, MAIN_WEIGHT
from ..session import SaveSession, zstd_level
from ..shards import dtype_name
from .mapping import (
    BUILTIN_MAPPINGS,
    MappingSpec,
    NativeSource,
    Planned,
    TensorPlan,
    lookup_entry,
    plan_export,
    plan_identity,
    plan_import,
    read_planned,
    scatter_planned,
)
from .ops import TrimVocab
from .safetensors_io import INDEX_NAME, SafetensorsDir, ShardedWriter
from .shapes import contiguous_boxes

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "TensorDictSource",
    "export_checkpoint",
    "import_hf",
    "parse_bytes",
    "validate_conversion",
]

DEFAULT_MEMORY_BUDGET = 1 << 30
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_bytes(text: str | int) -> int:
    """`1073741824`, `512M`, `1G`, `64MiB` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise InvalidArgumentError(f"cannot read {text!r} as a byte count")
    scale = 1024 ** ("KMGT".find(m.group(2).upper()) + 1) if m.group(2) else 1
    return int(float(m.group(1)) * scale)


def _box_elems(budget: int, itemsizes: Sequence[int]) -> int:
    """Elements per box so that every buffer alive at once (a read, a re-layout copy, the cast
    output, and for validation the compared bytes) stays within `budget`."""
    return max(1, budget // max(1, sum(itemsizes)))


def _native_loader(
    manifest: Any, workers: int | None
) -> Callable[[NativeSource, list[int], list[int]], torch.Tensor]:
    def load(src: NativeSource, off: list[int], size: list[int]) -> torch.Tensor:
        buf = torch.empty(size, dtype=src.dtype)
        if buf.numel():
            manifest.load(
                [(src.index, src.pieces(off, size), 0)],
                [(buf.data_ptr(), buf.numel() * buf.element_size())],
                verify=True,
                workers=workers,
            )
        return buf

    return load


def _resolve_dtype(name: str | None) -> torch.dtype | None:
    if name is None or name in ("keep", "saved"):
        return None
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"--dtype must be one of {', '.join(_DTYPES)} or keep") from None


def _out_dtype(src: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and src.is_floating_point else src


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


def _config_problems(
    spec: MappingSpec | None, plan: TensorPlan, config: Mapping[str, Any] | None
) -> list[str]:
    if spec is None or config is None:
        return []
    out = []
    for field, source in spec.config_checks.items():
        want = plan.derived.get(source)
        if want is None or want == -1:
            continue
        if field not in config:
            out.append(f"config.{field}: missing, the checkpoint implies {want}")
        elif config[field] != want:
            out.append(f"config.{field}: {config[field]!r}, the checkpoint implies {want}")
    return out


def _saved_hf_config(manifest: Any) -> dict[str, Any] | None:
    v = lookup_entry(values.entries(manifest), "hf_config")
    return v if isinstance(v, dict) else None


def _sha256_json(v: Any) -> str:
    return hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _source_name(ckpt: str | os.PathLike[str]) -> str:
    """How a report names checkpoint `ckpt`: its URL, or its absolute path."""
    location = checkpoint_location(ckpt)
    return location if is_url(location) else str(Path(location).resolve())


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
) -> dict[str, Any]:
    """Streams the main weights of checkpoint `ckpt` into sharded safetensors files and an index
    in `out`, holding at most about `memory_budget` bytes of tensor data at a time.

    `format="hf"` renames and re-lays them out through a mapping (a built-in picked to fit, or
    `mapping`), trims vocab padding to the saved vocab size and writes `config.json` (from
    `config` or the checkpoint's saved `hf_config`). `format="safetensors"` keeps native names
    (`include_moments` adds the Adam moments). `dtype` casts floating tensors (`bf16`, `fp32`).
    Returns the index written.
    """
    manifest = _core.Manifest.open(checkpoint_location(ckpt))
    want = _resolve_dtype(dtype)
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
        if isinstance(config, Mapping):
            cfg = dict(config)
        elif config is not None:
            cfg = json.loads(Path(config).read_text())
        else:
            cfg = _saved_hf_config(manifest)
        if cfg is None:
            raise InvalidArgumentError(
                f"{ckpt}: no saved hf_config; pass --config CONFIG.json for --format hf"
            )
        problems = _config_problems(spec, plan, cfg)
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
        od = _out_dtype(e.source.dtype, want)
        if od != e.source.dtype:
            k = f"{dtype_name(e.source.dtype)}->{dtype_name(od)}"
            casts[k] = casts.get(k, 0) + 1
        planned.append((e.hf_name, od, e.shape))
    meta = {
        "olmo_chunks": {
            "source": _source_name(ckpt),
            "save_id": manifest.save_id,
            "mapping": spec.name if spec else "identity",
            "mapping_sha256": spec.sha256 if spec else None,
            "dtype": dtype_name(want) if want is not None else "saved",
            "casts": casts,
            "vocab_size": plan.vocab_size,
            "padded_vocab_size": plan.padded_vocab_size,
        }
    }
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (INDEX_NAME, "model.safetensors"):
        (out_dir / stale).unlink(missing_ok=True)
    for old in out_dir.glob("model-*-of-*.safetensors"):
        old.unlink()
    writer = ShardedWriter(out_dir, planned, max_shard_bytes=max_shard_bytes, index_metadata=meta)
    load = _native_loader(manifest, workers)
    try:
        for e, (_, od, _) in zip(plan.entries, planned, strict=True):
            assert e.source is not None
            n = _box_elems(memory_budget, [e.source.dtype.itemsize] * 3 + [od.itemsize])
            for off, size in contiguous_boxes(e.shape, n):
                x = read_planned(e, off, size, load)
                if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                    raise ConversionError(
                        [f"{e.source.key}: nonfinite values (exporting {e.hf_name})"],
                        header="refusing to export nonfinite weights",
                    )
                writer.write(e.hf_name, x.to(od))
                del x
    except BaseException:
        writer.abort()
        raise
    index = writer.close()
    if cfg is not None:
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return index


# --- import -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MemTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class TensorDictSource:
    """In-memory tensors (e.g. a model's state dict) with the reading interface of
    `SafetensorsDir`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._data = {k: v.detach() for k, v in tensors.items()}
        self.tensors = {k: _MemTensor(k, v.dtype, tuple(v.shape)) for k, v in self._data.items()}
        self.problems: list[str] = []
        self.duplicates: dict[str, list[str]] = {}

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        t = self._data[name]
        idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        return t[idx].contiguous()


def _native_regions(
    src: NativeSource, off: list[int], size: list[int], data: torch.Tensor
) -> list[tuple[tuple[str, list[int], list[int]], torch.Tensor]]:
    data = data.contiguous()
    if tuple(src.saved_shape) == tuple(src.shape):
        return [(("box", off, size), data)]
    flat = data.reshape(-1)
    return [
        (("flat", [start], [length]), flat[local : local + length])
        for start, length, local in _core.box_runs(list(src.shape), list(off), list(size))
    ]


def _pick_import_spec(names: Sequence[str], mapping: str | None, model_type: str | None) -> MappingSpec:
    if mapping is not None:
        return MappingSpec.load(mapping)
    specs = [MappingSpec.load(n) for n in BUILTIN_MAPPINGS]
    specs.sort(key=lambda s: s.hf_model_type != model_type)
    for spec in specs:
        if spec.covers_hf(names):
            return spec
    raise ConversionError(
        [f"{n}" for n in names if not any(s.hf_rule(n) for s in specs)][:20],
        header="no built-in mapping covers these HF tensors; pass --mapping SPEC",
    )


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
        else _pick_import_spec(list(src.tensors), mapping, (config or {}).get("model_type"))
    )
    plan = plan_import({n: t.shape for n, t in src.tensors.items()}, spec, pad_multiple=pad_multiple)
    if plan.problems:
        raise ConversionError(plan.problems, header=f"cannot import through mapping {spec.name}")
    want = _resolve_dtype(dtype)
    native_dtype: dict[str, torch.dtype] = {}
    for e in plan.entries:
        assert e.source is not None
        d = _out_dtype(src.tensors[e.hf_name].dtype, want)
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
            n = _box_elems(memory_budget // 2, [item] * 2 + [e.source.dtype.itemsize] * 2)
            for off, size in contiguous_boxes(e.shape, n):
                x = src.read_box(e.hf_name, off, size)
                if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                    raise ConversionError([f"{e.hf_name}: nonfinite values"], header="refusing to import")
                x = x.to(e.source.dtype)
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
                n = _box_elems(memory_budget // 2, [e.source.dtype.itemsize])
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


# --- validation -------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(ints[t.element_size()])


def _compare(
    plan: TensorPlan,
    hf: SafetensorsDir | TensorDictSource,
    load: Callable[..., Any],
    budget: int,
    recorded_dtype: str | None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per-tensor records and failure lines (`name: why`) for every planned and every stored
    HF tensor."""
    records: list[dict[str, Any]] = []
    failures: list[str] = [p if ":" in p else f"{p}: mapping problem" for p in plan.problems]
    failures += list(hf.problems)
    expected = {e.hf_name for e in plan.entries}
    for e in plan.entries:
        src = e.source
        assert src is not None
        rec: dict[str, Any] = {
            "name": e.hf_name,
            "status": "ok",
            "shape": list(e.shape),
            "source": src.key,
            "source_dtype": dtype_name(src.dtype),
            "source_shape": list(src.shape),
            "source_saved_shape": list(src.saved_shape),
            "source_chunks": dict(src.chunk_kinds),
            "packing": e.packing(),
        }
        if src.also_saved:
            rec["also_saved"] = list(src.also_saved)
        why: list[str] = []
        act = hf.tensors.get(e.hf_name)
        if e.hf_name in hf.duplicates:
            why.append(f"duplicate: stored in {', '.join(hf.duplicates[e.hf_name])}")
        if act is None:
            why.append("missing from the HF side")
        elif tuple(act.shape) != tuple(e.shape):
            trims = [(op, shp) for op, shp in zip(e.ops, e.shapes, strict=False) if isinstance(op, TrimVocab)]
            if trims and len(act.shape) == len(e.shape):
                op, shp = trims[0]
                rows, want = act.shape[op.dim], e.shape[op.dim]
                if rows < want:
                    why.append(
                        f"shape {list(act.shape)}, expected {list(e.shape)}: vocab trimmed beyond the "
                        f"padding ({rows} rows, saved vocab size {want} of {shp[op.dim]} padded)"
                    )
                else:
                    why.append(
                        f"shape {list(act.shape)}, expected {list(e.shape)}: vocab not trimmed to the saved "
                        f"size {want}"
                    )
            else:
                why.append(f"wrong shape {list(act.shape)}, expected {list(e.shape)}")
        elif src.dtype.is_floating_point and not act.dtype.is_floating_point:
            why.append(f"dtype {dtype_name(act.dtype)} for a {dtype_name(src.dtype)} weight")
        elif (
            recorded_dtype not in (None, "saved")
            and src.dtype.is_floating_point
            and dtype_name(act.dtype) != recorded_dtype
        ):
            why.append(f"dtype {dtype_name(act.dtype)}, the export recorded {recorded_dtype}")
        if not why and act is not None:
            rec["dtype"] = dtype_name(act.dtype)
            rec["cast"] = (
                f"{dtype_name(src.dtype)}->{dtype_name(act.dtype)}" if act.dtype != src.dtype else None
            )
            why += _stream_compare(e, act.dtype, hf, load, budget, rec)
        if why:
            rec["status"] = "fail"
            rec["reasons"] = why
            failures += [f"{e.hf_name}: {w}" for w in why]
        records.append(rec)
    for name in sorted(set(hf.tensors) - expected):
        extra = "extra: the mapping produces no such tensor from the native checkpoint"
        records.append(
            {"name": name, "status": "fail", "reasons": [extra], "shape": list(hf.tensors[name].shape)}
        )
        failures.append(f"{name}: {extra}")
    for name in sorted(set(hf.duplicates) - expected):
        failures.append(f"{name}: duplicate: stored in {', '.join(hf.duplicates[name])}")
    return records, failures


def _stream_compare(
    e: Planned, out_dtype: torch.dtype, hf: Any, load: Callable[..., Any], budget: int, rec: dict[str, Any]
) -> list[str]:
    assert e.source is not None
    n = _box_elems(budget, [e.source.dtype.itemsize] * 3 + [out_dtype.itemsize] * 3)
    h_act, h_exp = hashlib.sha256(), hashlib.sha256()
    mismatched, first, nonfinite_native, nonfinite_hf = 0, None, False, False
    base = 0
    for off, size in contiguous_boxes(e.shape, n):
        x = read_planned(e, off, size, load)
        y = hf.read_box(e.hf_name, off, size)
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            nonfinite_native = True
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            nonfinite_hf = True
        xc = x.to(out_dtype)
        bx, by = _bits(xc).reshape(-1), _bits(y).reshape(-1)
        h_exp.update(bx.numpy().tobytes())
        h_act.update(by.numpy().tobytes())
        diff = bx != by
        if bool(diff.any()):
            k = int(diff.nonzero()[0, 0])
            if first is None:
                first = (base + k, float(xc.reshape(-1)[k]), float(y.reshape(-1)[k]))
            mismatched += int(diff.sum())
        base += bx.numel()
    rec["sha256"] = h_act.hexdigest()
    rec["expected_sha256"] = h_exp.hexdigest()
    why = []
    if nonfinite_hf:
        why.append("nonfinite values in the HF tensor")
    if nonfinite_native:
        why.append(f"nonfinite values in the native tensor {e.source.key}")
    if mismatched:
        i, a, b = first  # type: ignore[misc]
        why.append(
            f"{mismatched} element(s) differ after the {rec.get('cast') or 'identity'} conversion "
            f"(first at flat index {i}: expected {a!r}, found {b!r})"
        )
    return why


def _hf_model_state(
    hf_dir: Path, files: SafetensorsDir, config: Mapping[str, Any] | None
) -> tuple[Any, str, list[str]]:
    """The HF-side tensors for the round trip: the transformers model built from the config and
    loaded from the directory when transformers knows the architecture, else the files."""
    try:
        import transformers
    except ImportError:
        return files, "safetensors files (transformers not installed)", []
    arch = ((config or {}).get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None:
        return files, f"safetensors files (transformers has no {arch!r})", []
    dtypes = [t.dtype for t in files.tensors.values() if t.dtype.is_floating_point]
    dt = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    kw: dict[str, Any] = (
        {"dtype": dt} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dt}
    )
    problems: list[str] = []
    try:
        model, info = cls.from_pretrained(
            str(hf_dir), output_loading_info=True, ignore_mismatched_sizes=True, local_files_only=True, **kw
        )
    except Exception as exc:  # transformers raises many types; the failure is the finding
        # Still compare every tensor, from the files, so the report names them.
        return (
            files,
            f"safetensors files (transformers {transformers.__version__} {arch} failed to load them)",
            [f"{arch}: from_pretrained failed: {type(exc).__name__}: {exc}".splitlines()[0]],
        )
    for k in info.get("missing_keys", []):
        problems.append(f"{k}: missing when building {arch} (left at its initial value)")
    for k in info.get("unexpected_keys", []):
        problems.append(f"{k}: not used by {arch}")
    for m in info.get("mismatched_keys", []):
        k = m[0] if isinstance(m, (tuple, list)) else m
        problems.append(f"{k}: shape does not fit {arch}")
    state = model.state_dict()
    seen: dict[int, str] = {}
    for k in list(state):
        ptr = state[k].untyped_storage().data_ptr()
        if ptr in seen and k not in files.tensors:
            del state[k]  # tied alias of a tensor already exported
        else:
            seen.setdefault(ptr, k)
    return TensorDictSource(state), f"transformers {transformers.__version__} {arch}", problems


_HASH_BLOCK = 8 << 20


def _hash_file(p: Path, budget: int = _HASH_BLOCK) -> str | None:
    """sha256 of file `p` (None if absent), streamed through one buffer of at most `budget` bytes
    (and at most `_HASH_BLOCK`), so a shard of any size is hashed in bounded memory."""
    if not p.exists():
        return None
    h = hashlib.sha256()
    with open(p, "rb", buffering=0) as f:
        buf = memoryview(bytearray(max(1, min(budget, _HASH_BLOCK, os.fstat(f.fileno()).st_size))))
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def validate_conversion(
    native: str | os.PathLike[str],
    hf: str | os.PathLike[str],
    *,
    config: str | os.PathLike[str] | None = None,
    mapping: str | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    round_trip: bool = True,
    workers: int | None = None,
) -> dict[str, Any]:
    """The two exhaustive conversion passes of native checkpoint `native` against HF export
    `hf`. Returns the report; `report["ok"]` is the verdict and `report["failures"]` names every
    failing tensor. Optimizer moments are never loaded."""
    hf_dir = Path(hf)
    files = SafetensorsDir(hf_dir, strict=False)
    cfg_path = Path(config) if config is not None else hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else None
    manifest = _core.Manifest.open(checkpoint_location(native))
    entries = values.entries(manifest)
    index_meta: dict[str, Any] = {}
    if (hf_dir / INDEX_NAME).exists():
        index_meta = (json.loads((hf_dir / INDEX_NAME).read_text()).get("metadata") or {}).get(
            "olmo_chunks"
        ) or {}
    recorded = index_meta.get("dtype")
    report: dict[str, Any] = {
        "ok": False,
        "native": _source_name(native),
        "hf": str(hf_dir.resolve()),
        "native_checkpoint": {"save_id": manifest.save_id, "entries_sha256": _sha256_json(entries)},
        "config": {
            "path": str(cfg_path),
            "file_sha256": _hash_file(cfg_path),
            "sha256": _sha256_json(cfg) if cfg is not None else None,
        },
        "hf_files": {f: _hash_file(hf_dir / f, memory_budget) for f in sorted(files.metadata)},
        "recorded_export": index_meta or None,
        "passes": {},
        "failures": [],
    }
    failures: list[str] = []
    if mapping is not None:
        spec = MappingSpec.load(mapping)
    else:
        spec = (
            _pick_import_spec(list(files.tensors), None, (cfg or {}).get("model_type"))
            if files.tensors
            else MappingSpec.load(BUILTIN_MAPPINGS[0])
        )
    report["mapping"] = {"name": spec.name, "source": spec.source, "sha256": spec.sha256}
    load = _native_loader(manifest, workers)
    # Native pass.
    plan = plan_export(manifest, spec)
    report["native_checkpoint"].update(
        vocab_size=plan.vocab_size,
        padded_vocab_size=plan.padded_vocab_size,
        skipped_roles=plan.ignored,
        derived=plan.derived,
    )
    if cfg is None:
        failures.append(f"config.json: no HF config at {cfg_path}")
    cfg_fail = _config_problems(spec, plan, cfg)
    records, fails = _compare(plan, files, load, memory_budget, recorded)
    fails = cfg_fail + fails
    report["passes"]["native"] = {"ok": not fails and not failures, "failures": fails, "tensors": records}
    failures += [f"native pass: {f}" for f in fails]
    # Round-trip pass.
    if round_trip:
        report["passes"]["round_trip"] = rt = _round_trip(
            hf_dir, files, cfg, spec, memory_budget, workers, recorded
        )
        failures += [f"round-trip pass: {f}" for f in rt["failures"]]
    report["failures"] = failures
    report["ok"] = not failures
    return report


def _round_trip(
    hf_dir: Path,
    files: SafetensorsDir,
    cfg: Mapping[str, Any] | None,
    spec: MappingSpec,
    budget: int,
    workers: int | None,
    recorded: str | None,
) -> dict[str, Any]:
    state, how, problems = _hf_model_state(hf_dir, files, cfg)
    out: dict[str, Any] = {"ok": False, "hf_model": how, "failures": list(problems), "tensors": []}
    if state is None:
        return out
    try:
        model_spec = (
            spec
            if spec.covers_hf(state.tensors)
            else _pick_import_spec(list(state.tensors), None, (cfg or {}).get("model_type"))
        )
    except ConversionError as exc:
        out["failures"] += [f"{m}: no mapping covers this HF model tensor" for m in exc.mismatches]
        return out
    out["model_mapping"] = {"name": model_spec.name, "sha256": model_spec.sha256}
    tmp = Path(tempfile.mkdtemp(prefix="olmo-chunks-roundtrip-"))
    try:
        try:
            import_hf(
                state,
                tmp / "native",
                mapping=model_spec,
                dtype=None,
                memory_budget=budget,
                config=cfg,
                workers=workers,
            )
        except ConversionError as exc:
            out["failures"] += list(exc.mismatches)
            return out
        manifest = _core.Manifest.open(str(tmp / "native"))
        plan = plan_export(manifest, spec)
        records, fails = _compare(plan, files, _native_loader(manifest, workers), budget, recorded)
        out["tensors"] = records
        out["failures"] += fails
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["ok"] = not out["failures"]
    return out


# --- CLI --------------------------------------------------------------------------------------


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
        default=str(DEFAULT_MEMORY_BUDGET),
        help="bytes of tensor data held at once (e.g. 256M)",
    )
    p.add_argument("--max-shard-size", default="5G", help="bytes per safetensors file (default 5G)")
    p.add_argument(
        "--config", default=None, help="HF config.json to write (default: the checkpoint's saved hf_config)"
    )
    p.add_argument(
        "--include-moments", action="store_true", help="also export Adam moments (--format safetensors)"
    )
    p.add_argument("--workers", type=int, default=None)


def _export_cmd(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    index = export_checkpoint(
        args.ckpt,
        args.out,
        format=args.format,
        mapping=args.mapping,
        dtype=args.dtype,
        memory_budget=parse_bytes(args.memory_budget),
        include_moments=args.include_moments,
        config=args.config,
        max_shard_bytes=parse_bytes(args.max_shard_size),
        workers=args.workers,
    )
    n = len(index["weight_map"])
    files = len(set(index["weight_map"].values()))
    print(
        f"OK {args.out}: {n} tensors, {files} file(s), {index['metadata']['total_size']} bytes "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0


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
    p.add_argument("--memory-budget", default=str(DEFAULT_MEMORY_BUDGET))
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at CKPT")
    p.add_argument("--compression", choices=["zstd"], default=None, help="compress every block with zstd")
    p.add_argument("--compression-level", type=int, default=None, help="zstd level (default 3)")


def _import_cmd(args: argparse.Namespace) -> int:
    s = import_hf(
        args.hf_dir,
        args.ckpt,
        mapping=args.mapping,
        dtype=args.dtype,
        memory_budget=parse_bytes(args.memory_budget),
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


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--native", required=True, help="native checkpoint directory")
    p.add_argument("--hf", required=True, help="HF export directory")
    p.add_argument("--config", default=None, help="HF config.json (default: the one in --hf)")
    p.add_argument(
        "--mapping", default=None, help="built-in or JSON spec file (default: the built-in that fits)"
    )
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--no-round-trip", action="store_true", help="run the native pass only")
    p.add_argument("--memory-budget", default=str(DEFAULT_MEMORY_BUDGET))
    p.add_argument("--workers", type=int, default=None)


def _validate_cmd(args: argparse.Namespace) -> int:
    try:
        report = validate_conversion(
            args.native,
            args.hf,
            config=args.config,
            mapping=args.mapping,
            memory_budget=parse_bytes(args.memory_budget),
            round_trip=not args.no_round_trip,
            workers=args.workers,
        )
    except OlmoChunksError as exc:
        # A checkpoint or directory that cannot be read at all still gets a (failing) report.
        Path(args.report).write_text(
            json.dumps({"ok": False, "error": str(exc), "failures": [str(exc)]}) + "\n"
        )
        raise
    Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    for f in report["failures"]:
        print(f"FAIL {f}", file=sys.stderr)
    passes = ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in report["passes"].items())
    n = len(report["passes"]["native"]["tensors"])
    print(f"{'OK' if report['ok'] else 'FAILED'}: {n} tensors; {passes}; report {args.report}")
    return 0 if report["ok"] else 1
