"""Plain (non-tensor) checkpoint values as tagged JSON: data, never pickle.

Supported: None, bool, int (any size), float (NaN and infinities too), str, bytes, io.BytesIO,
list, tuple, dict (any str or int keys), numpy arrays (any shape, 0-d too) and numpy scalars, each
returned with its type, dtype and shape. Anything else is refused with the key named. Containers
nest at most `MAX_DEPTH` deep, so neither direction recurses without bound, and a value holds at
most `MAX_ITEMS` items in all, counted each time they appear (a list holding one list twice, 40
levels deep, is 2**40 items, not 40).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from typing import Any

import numpy as np

from .errors import CorruptManifestError, InvalidArgumentError

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "decode", "encode", "entries", "parse_json"]

MAX_DEPTH = 100
MAX_ITEMS = 1 << 22
_I64 = 1 << 63


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _ndarray(arr: np.ndarray | np.generic, key: str) -> dict[str, Any]:
    dtype = arr.dtype
    if dtype.hasobject:
        raise InvalidArgumentError(f"{key!r}: numpy object arrays cannot be checkpointed")
    if dtype.itemsize == 0 or np.dtype(dtype.str) != dtype:
        raise InvalidArgumentError(f"{key!r}: numpy dtype {dtype} cannot be checkpointed (structured or empty)")
    out = {"dtype": dtype.str, "shape": list(np.shape(arr)), "data": _b64(arr.tobytes())}
    return {"$ndarray": {**out, "scalar": True} if isinstance(arr, np.generic) else out}


def encode(value: Any, key: str, depth: int = 0, left: list[int] | None = None) -> Any:
    """The JSON-ready form of `value`; `key` names it in errors. `left` holds how many more items
    the whole value may have (`MAX_ITEMS` from the top)."""
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"{key!r}: nested more than {MAX_DEPTH} containers deep")
    left = [MAX_ITEMS] if left is None else left
    left[0] -= 1
    if left[0] < 0:
        raise InvalidArgumentError(f"{key!r}: more than {MAX_ITEMS} items in all (a container held in several "
                                   "places counts each time)")
    if isinstance(value, (np.ndarray, np.generic)):  # before float/str/bytes: np.float64 is a float
        return _ndarray(value, key)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if -_I64 <= value < _I64:
            return value
        try:
            return {"$int": str(value)}
        except ValueError:  # beyond Python's int/str conversion limit
            raise InvalidArgumentError(f"{key!r}: integer too large to checkpoint") from None
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(value))}
    if isinstance(value, io.BytesIO):
        return {"$bytesio": _b64(value.getvalue())}
    d = depth + 1
    if isinstance(value, list):
        return [encode(v, f"{key}[{i}]", d, left) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{key}[{i}]", d, left) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{key}.{k}", d, left) for k, v in value.items()}
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise InvalidArgumentError(f"{key!r}: dict keys must be str or int to be checkpointed")
        return {"$dict": [[k, encode(v, f"{key}.{k}", d, left)] for k, v in value.items()]}
    raise InvalidArgumentError(
        f"{key!r}: values of type {type(value).__name__} cannot be checkpointed as data "
        "(use tensors, None, bools, ints, floats, strings, bytes, lists, tuples, dicts or numpy arrays)"
    )


def decode(value: Any, key: str | None = None) -> Any:
    """Inverse of `encode`. A value `encode` cannot have made (bad base64, an unknown tag or dtype,
    data that does not fit its shape, nesting beyond `MAX_DEPTH`) raises CorruptManifestError
    naming `key`."""
    try:
        return _decode(value, 0)
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError, binascii.Error) as exc:
        where = f"entry {key!r}" if key is not None else "a plain value"
        raise CorruptManifestError(f"{where} cannot be decoded: {exc}") from None


_TAGS = {"$int", "$float", "$bytes", "$bytesio", "$tuple", "$dict", "$ndarray"}


def _unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise TypeError(f"base64 data must be a string, not {type(s).__name__}")
    return base64.b64decode(s, validate=True)


def _decode(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} containers deep")
    d = depth + 1
    if isinstance(value, list):
        return [_decode(v, d) for v in value]
    if not isinstance(value, dict):
        return value
    tags = [k for k in value if isinstance(k, str) and k.startswith("$")]
    if not tags:
        return {k: _decode(v, d) for k, v in value.items()}
    if len(value) != 1 or tags[0] not in _TAGS:
        raise ValueError(f"unknown tag {tags[0]!r} (written by a newer olmo-chunks?)")
    (tag, inner), = value.items()
    if tag in ("$int", "$float"):
        if not isinstance(inner, str):
            raise TypeError(f"{tag} needs a string")
        return int(inner) if tag == "$int" else float(inner)
    if tag == "$bytes":
        return _unb64(inner)
    if tag == "$bytesio":
        return io.BytesIO(_unb64(inner))
    if tag == "$ndarray":
        return _decode_ndarray(inner)
    if not isinstance(inner, list):
        raise TypeError(f"{tag} needs a list")
    if tag == "$tuple":
        return tuple(_decode(v, d) for v in inner)
    out = {}
    for pair in inner:  # $dict
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
            raise TypeError("$dict needs [key, value] pairs with str or int keys")
        out[pair[0]] = _decode(pair[1], d)
    return out


def _decode_ndarray(inner: Any) -> np.ndarray | np.generic:
    if not isinstance(inner, dict) or not {"dtype", "shape", "data"} <= inner.keys() <= {
        "dtype", "shape", "data", "scalar"
    }:
        raise TypeError("$ndarray needs dtype, shape and data")
    name, shape, scalar = inner["dtype"], inner["shape"], inner.get("scalar", False)
    if not isinstance(name, str) or not isinstance(shape, list) or not isinstance(scalar, bool):
        raise TypeError("$ndarray: dtype must be a string, shape a list, scalar a bool")
    if not all(type(n) is int and n >= 0 for n in shape) or (scalar and shape):
        raise ValueError(f"$ndarray: bad shape {shape}")
    dtype = np.dtype(name)
    if dtype.hasobject or dtype.str != name or dtype.itemsize == 0:
        raise ValueError(f"$ndarray: unsupported dtype {name!r}")
    data = _unb64(inner["data"])
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"$ndarray: {len(data)} bytes of data for shape {shape} of {name}")
    arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return arr[()] if scalar else arr


def parse_json(text: str, what: str) -> Any:
    """JSON text from a manifest, or CorruptManifestError naming `what` (nesting too deep for
    Python's parser included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptManifestError(f"{what}: cannot parse JSON ({type(exc).__name__}: {exc})") from None


def entries(manifest: Any) -> dict[str, Any]:
    """The encoded plain entries of a `_core.Manifest`, by key (decode each with `decode`)."""
    out = parse_json(manifest.entries_json, "manifest entries") or {}
    if not isinstance(out, dict):
        raise CorruptManifestError("manifest entries must be a JSON object")
    return out
