"""Plain (non-tensor) checkpoint values as tagged JSON: data, never pickle.

Supported: None, bool, int (any size), float (NaN and infinities too), str, bytes, list, tuple,
dict (any str or int keys) and numpy arrays/scalars. Anything else is refused with the key named.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["decode", "encode"]

_I64 = 1 << 63


def encode(value: Any, key: str) -> Any:
    """The JSON-ready form of `value`; `key` names it in errors."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -_I64 <= value < _I64 else {"$int": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, list):
        return [encode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise InvalidArgumentError(f"{key!r}: dict keys must be str or int to be checkpointed")
        return {"$dict": [[k, encode(v, f"{key}.{k}")] for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise InvalidArgumentError(f"{key!r}: numpy object arrays cannot be checkpointed")
        arr = np.ascontiguousarray(value)
        return {
            "$ndarray": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "data": base64.b64encode(arr.tobytes()).decode(),
            }
        }
    if isinstance(value, np.generic):
        return encode(value.item(), key)
    raise InvalidArgumentError(
        f"{key!r}: values of type {type(value).__name__} cannot be checkpointed as data "
        "(use tensors, numbers, strings, bytes, lists, tuples, dicts or numpy arrays)"
    )


def decode(value: Any) -> Any:
    """Inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "$int":
            return int(inner)
        if tag == "$float":
            return float(inner)
        if tag == "$bytes":
            return base64.b64decode(inner)
        if tag == "$tuple":
            return tuple(decode(v) for v in inner)
        if tag == "$dict":
            return {k: decode(v) for k, v in inner}
        if tag == "$ndarray":
            arr = np.frombuffer(base64.b64decode(inner["data"]), dtype=np.dtype(inner["dtype"]))
            return arr.reshape(inner["shape"]).copy()
    return {k: decode(v) for k, v in value.items()}
