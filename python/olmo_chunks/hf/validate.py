"""Exhaustive conversion validation (`validate_conversion`): the native pass (saved main weights
through the mapping, compared with the HF export) and the round-trip pass (the HF model built
from its config, imported, streamed back and compared again)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import _core, values
from ..errors import ConversionError, OlmoChunksError
from ..location import checkpoint_location, local_dir
from ..shards import dtype_name
from .common import (
    DEFAULT_MEMORY_BUDGET,
    TensorDictSource,
    box_elems,
    config_problems,
    native_loader,
    open_regular,
    pick_import_spec,
    read_config,
    sha256_json,
    source_name,
)
from .importer import import_hf
from .mapping import (
    BUILTIN_MAPPINGS,
    MappingSpec,
    Planned,
    TensorPlan,
    plan_export,
    read_planned,
)
from .ops import TrimVocab
from .safetensors_io import SafetensorsDir
from .shapes import contiguous_boxes

__all__ = ["validate_conversion"]

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
    n = box_elems(budget, [e.source.dtype.itemsize] * 3 + [out_dtype.itemsize] * 3)
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
    archs = (config or {}).get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
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
    with open_regular(p) as f:
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
    hf_dir = local_dir(hf, "a Hugging Face model")
    cfg_path = Path(config) if config is not None else hf_dir / "config.json"
    cfg = read_config(cfg_path) if config is not None else None
    files = SafetensorsDir(hf_dir, strict=False)
    if config is None:
        cfg = files.config()
    manifest = _core.Manifest.open(checkpoint_location(native))
    entries = values.entries(manifest)
    index_meta = (files.index or {}).get("metadata")
    index_meta = index_meta.get("olmo_chunks") if isinstance(index_meta, dict) else None
    index_meta = index_meta if isinstance(index_meta, dict) else {}
    recorded = index_meta.get("dtype")
    report: dict[str, Any] = {
        "ok": False,
        "native": source_name(native),
        "hf": str(hf_dir.resolve()),
        "native_checkpoint": {"save_id": manifest.save_id, "entries_sha256": sha256_json(entries)},
        "config": {
            "path": str(cfg_path),
            "file_sha256": _hash_file(cfg_path),
            "sha256": sha256_json(cfg) if cfg is not None else None,
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
            pick_import_spec(list(files.tensors), None, (cfg or {}).get("model_type"))
            if files.tensors
            else MappingSpec.load(BUILTIN_MAPPINGS[0])
        )
    report["mapping"] = {"name": spec.name, "source": spec.source, "sha256": spec.sha256}
    load = native_loader(manifest, workers)
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
    cfg_fail = config_problems(spec, plan, cfg)
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
            else pick_import_spec(list(state.tensors), None, (cfg or {}).get("model_type"))
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
        records, fails = _compare(plan, files, native_loader(manifest, workers), budget, recorded)
        out["tensors"] = records
        out["failures"] += fails
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["ok"] = not out["failures"]
    return out


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--native", required=True, help="native checkpoint directory")
    p.add_argument("--hf", required=True, help="HF export directory")
    p.add_argument("--config", default=None, help="HF config.json (default: the one in --hf)")
    p.add_argument(
        "--mapping", default=None, help="built-in or JSON spec file (default: the built-in that fits)"
    )
    p.add_argument("--report", type="output", required=True, help="where to write the JSON report")
    p.add_argument("--no-round-trip", action="store_true", help="run the native pass only")
    p.add_argument("--memory-budget", type="bytes", default=DEFAULT_MEMORY_BUDGET)
    p.add_argument("--workers", type="count", default=None)


def _validate_cmd(args: argparse.Namespace) -> int:
    try:
        report = validate_conversion(
            args.native,
            args.hf,
            config=args.config,
            mapping=args.mapping,
            memory_budget=args.memory_budget,
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
