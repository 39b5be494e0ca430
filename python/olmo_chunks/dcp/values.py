"""Plain values through the DCP door: DCP's flattened leaves <-> native entries, and the
restricted unpickling of the values DCP hands over pickled."""


from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .. import values
from ..errors import InvalidArgumentError

_TENSOR = object()  # marks a tensor leaf in a path trie


class _Node(dict[Any, Any]):
    """An inner node of a path trie (leaves are encoded values, which may be dicts too)."""


def group_entries(
    leaves: Mapping[str, Any], paths: Mapping[str, Any] | None, tensor_keys: Iterable[str]
) -> dict[str, Any]:
    """Native entries (key -> encoded value) from DCP's flattened plain leaves (`leaves`, encoded
    values by FQN) and DCP's flatten mapping (`paths`: FQN -> object path): a container whose
    subtree holds no tensor becomes one entry at its dotted key, as `olmo_chunks.save` stores it."""
    if not paths:
        return dict(leaves)
    root = _Node()
    for key, enc in [*((k, _TENSOR) for k in tensor_keys), *leaves.items()]:
        path = paths.get(key, (key,))
        node = root
        for part in path[:-1]:
            nxt = node.setdefault(part, _Node())
            if not isinstance(nxt, _Node):  # a value and a container at one path: DCP forbids it
                raise InvalidArgumentError(f"{key!r}: a value and a container share the path {path}")
            node = nxt
        node[path[-1]] = enc
    out: dict[str, Any] = {}

    def has_tensor(node: Any) -> bool:
        return node is _TENSOR or (isinstance(node, _Node) and any(has_tensor(v) for v in node.values()))

    def rebuild(node: Any) -> Any:
        if not isinstance(node, _Node):
            return node
        keys = list(node)
        if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
            return [rebuild(node[i]) for i in range(len(keys))]
        items = {k: rebuild(v) for k, v in node.items()}
        if all(isinstance(k, str) and not k.startswith("$") for k in items):
            return items
        return {"$dict": [[k, v] for k, v in items.items()]}

    def visit(prefix: str, node: Any) -> None:
        if node is _TENSOR:
            return
        if isinstance(node, _Node) and has_tensor(node):
            for k, v in node.items():
                visit(f"{prefix}.{k}", v)
        else:
            out[prefix] = rebuild(node)

    for k, v in root.items():
        visit(str(k), v)
    return out


def _dcp_terminal(value: Any) -> bool:
    """DCP's rule (torch >= 2.4 traverse_state_dict): mappings are descended; a list is descended
    only if it holds a mapping or a descended list; everything else is a leaf."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return not any(isinstance(e, (Mapping, list)) and not _dcp_terminal(e) for e in value)
    return True


def dcp_leaves(key: str, value: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """The DCP leaves `{fqn: (object path, value)}` of native plain entry `key` = `value`."""
    out: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def walk(path: tuple[Any, ...], v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk((*path, str(k)), x)
        elif _dcp_terminal(v):
            out[".".join(map(str, path))] = (path, v)
        else:
            for i, x in enumerate(v):
                walk((*path, i), x)

    walk((key,), value)
    return out


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`, which is how pickle's protocol 2 (torch.save's) writes `b""` (an empty BytesIO's
    or numpy array's data too); `bytes` with arguments is refused, so no value can ask for memory."""
    if args:
        raise TypeError("bytes() with arguments")
    return b""


def _numpy_globals() -> list[Any]:
    """What numpy arrays, scalars and dtypes of numeric and bool dtypes unpickle through (under
    numpy 1's and numpy 2's module names), io.BytesIO and empty bytes; never object or structured
    dtypes."""
    core = getattr(np, "_core", None) or np.core
    out: list[Any] = [np.ndarray, np.dtype, io.BytesIO, (_empty_bytes, "builtins.bytes")]
    for fn in (core.multiarray._reconstruct, core.multiarray.scalar):
        out += [(fn, f"{mod}.multiarray.{fn.__name__}") for mod in ("numpy.core", "numpy._core")]
    codes = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"
    return out + list({type(np.dtype(c)) for c in codes} - {np.dtype})


SAFE_GLOBALS = _numpy_globals()


def encode_object(fqn: str, raw: bytes) -> Any:
    """The plain value DCP pickled for `fqn`, as tagged JSON data; refuses anything that is not."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise InvalidArgumentError(
            f"{fqn!r}: only plain values (None, bools, ints, floats, strings, bytes, BytesIO, lists, tuples, "
            f"dicts, numpy arrays) can be stored next to tensors; this one cannot be loaded as data ({exc})"
        ) from None
    return values.encode(value, fqn)
