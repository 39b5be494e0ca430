"""What export, import and validation share: the memory budget and byte sizes, dtype choices, the
native reader, in-memory HF tensors, and the checks and names of a conversion."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _core
from ..errors import ConversionError, InvalidArgumentError
from ..location import checkpoint_location, is_url
from .mapping import (
    BUILTIN_MAPPINGS,
    MappingSpec,
    NativeSource,
    TensorPlan,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "DTYPES",
    "TensorDictSource",
    "box_elems",
    "config_problems",
    "native_loader",
    "out_dtype",
    "parse_bytes",
    "pick_import_spec",
    "read_config",
    "resolve_dtype",
    "sha256_json",
    "source_name",
]

DEFAULT_MEMORY_BUDGET = 1 << 30


DTYPES = {
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
    n = float(m.group(1)) * scale
    if n >= 2**63:
        raise InvalidArgumentError(f"{text!r} is too many bytes (at most 8 EiB)")
    return int(n)


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in HF config file `path` (`--config`); `InvalidArgumentError` naming the
    file and why when it is missing, unreadable, not JSON or not an object."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidArgumentError(f"HF config {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise InvalidArgumentError(f"HF config {path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"HF config {path}: not a JSON object")
    return config


def box_elems(budget: int, itemsizes: Sequence[int]) -> int:
    """Elements per box so that every buffer alive at once (a read, a re-layout copy, the cast
    output, and for validation the compared bytes) stays within `budget`."""
    return max(1, budget // max(1, sum(itemsizes)))


def native_loader(
    manifest: Any, workers: int | None
) -> Callable[[NativeSource, list[int], list[int]], torch.Tensor]:
    def load(src: NativeSource, off: list[int], size: list[int]) -> torch.Tensor:
        buf = torch.empty(size, dtype=src.dtype)
        if buf.numel():
            manifest.load(
                [_core.Target(src.index, src.pieces(off, size))],
                [(buf.data_ptr(), buf.numel() * buf.element_size())],
                verify=True,
                workers=workers,
            )
        return buf

    return load


def resolve_dtype(name: str | None) -> torch.dtype | None:
    if name is None or name in ("keep", "saved"):
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"--dtype must be one of {', '.join(DTYPES)} or keep") from None


def out_dtype(src: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and src.is_floating_point else src


def config_problems(
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


def sha256_json(v: Any) -> str:
    return hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_name(ckpt: str | os.PathLike[str]) -> str:
    """How a report names checkpoint `ckpt`: its URL, or its absolute path."""
    location = checkpoint_location(ckpt)
    return location if is_url(location) else str(Path(location).resolve())


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


def pick_import_spec(names: Sequence[str], mapping: str | None, model_type: str | None) -> MappingSpec:
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
