"""What export, import and validation share: the memory budget and byte sizes, dtype choices, the
native reader, in-memory HF tensors, and the checks and names of a conversion."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _core
from ..errors import ConversionError, CorruptCheckpointError, InvalidArgumentError, OlmoChunksError, parse_bytes
from ..location import checkpoint_location, is_url
from ..shards import dtype_name
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
    "cast_finite",
    "config_problems",
    "json_object",
    "native_loader",
    "open_regular",
    "out_dtype",
    "parse_bytes",
    "pick_import_spec",
    "read_config",
    "read_json",
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


# Bounds on the JSON of an HF directory (index, config, safetensors headers), far beyond any real
# one: bytes in a file, containers nested, digits in an integer (2**64 has 20).
MAX_JSON_BYTES = 100_000_000
MAX_JSON_DEPTH = 64
MAX_JSON_INT_DIGITS = 64

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def open_regular(
    path: str | os.PathLike[str], where: str | None = None, error: type[OlmoChunksError] = CorruptCheckpointError
) -> io.BufferedReader:
    """`path` opened for reading, following symbolic links (the HF cache links every file) but never
    blocking on a FIFO. A FIFO, socket or device is refused with `error` naming `where` (default
    `path`); a directory or a missing file raises the OSError `open` does."""
    f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))  # noqa: SIM115
    mode = os.fstat(f.fileno()).st_mode
    if not stat.S_ISREG(mode):
        f.close()
        kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
        raise error(f"{where or path}: not a regular file ({kind})")
    return f


def _parse_int(text: str) -> int:
    if len(text) > MAX_JSON_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits, more than {MAX_JSON_INT_DIGITS}")
    return int(text)


def _too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [c for v in level if isinstance(v, (dict, list)) for c in (v.values() if isinstance(v, dict) else v)]
    return any(isinstance(v, (dict, list)) for v in level)


def json_object(
    raw: bytes, where: str, error: type[OlmoChunksError] = CorruptCheckpointError, **hooks: Any
) -> dict[str, Any]:
    """The JSON object in UTF-8 `raw` (`hooks` go to `json.loads`), or `error` naming `where` and why:
    not UTF-8, not JSON, not an object, nested more than `MAX_JSON_DEPTH` deep or holding an integer
    of more than `MAX_JSON_INT_DIGITS` digits."""
    try:
        value = json.loads(raw.decode("utf-8"), parse_int=_parse_int, **hooks)
    except RecursionError:
        raise error(f"{where}: nested more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer too long
        raise error(f"{where}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: not a JSON object")
    if _too_deep(value):
        raise error(f"{where}: nested more than {MAX_JSON_DEPTH} deep")
    return value


def read_json(
    path: str | os.PathLike[str], where: str | None = None, error: type[OlmoChunksError] = CorruptCheckpointError
) -> dict[str, Any]:
    """The JSON object in file `path` (`json_object`); `error` naming `where` (default `path`) and
    why when it cannot be read, is not a regular file or holds more than `MAX_JSON_BYTES`."""
    where = where or str(path)
    try:
        with open_regular(path, where, error) as f:
            if os.fstat(f.fileno()).st_size > MAX_JSON_BYTES:
                raise error(f"{where}: more than {MAX_JSON_BYTES} bytes, too large for JSON metadata")
            raw = f.read()
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror or exc})") from None
    return json_object(raw, where, error)


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in HF config file `path` (`--config`); `InvalidArgumentError` naming the
    file and why when it is missing, unreadable, not JSON or not an object."""
    return read_json(path, f"HF config {path}", InvalidArgumentError)


def cast_finite(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """`x` cast to `dtype`, and why the result is refused when a floating value in it is not
    finite: nonfinite in `x`, or finite in `x` and beyond the range of `dtype`."""
    y = x.to(dtype)
    if not y.is_floating_point() or bool(torch.isfinite(y).all()):
        return y, None
    if not bool(torch.isfinite(x).all()):
        return y, "nonfinite values"
    v = x.reshape(-1)[~torch.isfinite(y.reshape(-1))][0]
    return y, f"value {float(v)!r} overflows {dtype_name(dtype)}"


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
