"""The layout ops of a mapping spec (`mapping.py`), one class each, the way DTensor placements own
their split logic: each parses its JSON, maps a shape forward (native -> HF) and back, reads a box
of its output from boxes of its input and scatters a box of its output onto its input, and
describes itself. A spec's ops may name variables (a `take` index enumerated over experts) or be
spelled for convenience (`transpose`); `bind` turns them into the concrete ops a plan applies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import InvalidArgumentError
from .shapes import numel

__all__ = ["Blocks", "Op", "Permute", "Take", "Transpose", "TrimVocab", "Unflatten", "parse_op"]

Box = tuple[list[int], list[int]]
# How an op reads a box of its input: `read(offsets, sizes)`.
ReadInput = Callable[[list[int], list[int]], torch.Tensor]
# How an op scatters onto its input: `scatter(offsets, sizes, data)` -> the boxes it lands in.
ScatterInput = Callable[[list[int], list[int], torch.Tensor | None], list[Any]]


def _bad(where: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"mapping spec {where}: {why}")


def _dim(arg: Any, key: str, where: str) -> int:
    d = (arg or {}).get("dim", 0) if isinstance(arg, dict) or arg is None else None
    if not isinstance(d, int) or isinstance(d, bool):
        raise _bad(where, f"{key} dim must be an int")
    return d


class Op(ABC):
    """One layout op, native -> HF. Subclasses are frozen dataclasses."""

    KEY: ClassVar[str]

    @classmethod
    @abstractmethod
    def parse(cls, arg: Any, where: str) -> Op: ...

    @abstractmethod
    def describe(self) -> dict[str, Any]: ...

    def bind(self, vars: Mapping[str, int], ndim: int) -> Op:
        """The concrete op for the values `vars` of the spec's variables, on a tensor of `ndim`."""
        del vars, ndim
        return self

    @abstractmethod
    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        """The shape of the output for an input of `shape` (the saved true vocab size `vocab`)."""

    @abstractmethod
    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        """The input shape for an output of `shape` (`counts`: values of the take variables; vocab
        dims padded to `pad_multiple`)."""

    @abstractmethod
    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        """Box `off`/`size` of the output, from boxes of the input."""

    @abstractmethod
    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        """Where box `off`/`size` of the output (holding `x`, or None for boxes only) lands in the
        input."""

    def _check_dim(self, dim: int, shape: tuple[int, ...], where: str) -> None:
        if not 0 <= dim < len(shape):
            raise InvalidArgumentError(f"{where}: op {self.describe()} dim out of range for shape {shape}")


@dataclass(frozen=True)
class Take(Op):
    """One index of a dim (per-expert unpacking); the index may be a variable of the spec."""

    KEY: ClassVar[str] = "take"
    dim: int
    index: int | str

    @classmethod
    def parse(cls, arg: Any, where: str) -> Take:
        idx = arg.get("index") if isinstance(arg, dict) else None
        if not isinstance(idx, (int, str)) or isinstance(idx, bool):
            raise _bad(where, "take needs an int index or a variable name")
        return cls(_dim(arg, cls.KEY, where), idx)

    @property
    def variable(self) -> str | None:
        return self.index if isinstance(self.index, str) else None

    def describe(self) -> dict[str, Any]:
        return {"take": {"dim": self.dim, "index": self.index}}

    def bind(self, vars: Mapping[str, int], ndim: int) -> Take:
        return Take(self.dim, int(vars[self.index]) if isinstance(self.index, str) else self.index)

    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        self._check_dim(self.dim, shape, where)
        assert isinstance(self.index, int)
        if not 0 <= self.index < shape[self.dim]:
            raise InvalidArgumentError(f"{where}: take index {self.index} outside dim of size {shape[self.dim]}")
        return shape[: self.dim] + shape[self.dim + 1 :]

    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        n = counts[self.index] if isinstance(self.index, str) else self.index + 1
        return (*shape[: self.dim], n, *shape[self.dim :])

    def _unsqueezed(self, off: list[int], size: list[int]) -> Box:
        assert isinstance(self.index, int)
        d = self.dim
        return [*off[:d], self.index, *off[d:]], [*size[:d], 1, *size[d:]]

    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        return read_input(*self._unsqueezed(off, size)).select(self.dim, 0)

    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        return scatter_input(*self._unsqueezed(off, size), None if x is None else x.unsqueeze(self.dim))


@dataclass(frozen=True)
class Blocks(Op):
    """A dim cut into `parts` equal blocks, of which the ones in `order` are kept in that order
    (gate/up halves and their order)."""

    KEY: ClassVar[str] = "blocks"
    dim: int
    parts: int
    order: tuple[int, ...]

    @classmethod
    def parse(cls, arg: Any, where: str) -> Blocks:
        parts = arg.get("parts") if isinstance(arg, dict) else None
        order = arg.get("order") if isinstance(arg, dict) else None
        if not (
            isinstance(parts, int)
            and parts > 0
            and isinstance(order, list)
            and all(isinstance(o, int) and 0 <= o < parts for o in order)
        ):
            raise _bad(where, "blocks needs parts > 0 and an order of block indices")
        return cls(_dim(arg, cls.KEY, where), parts, tuple(order))

    def describe(self) -> dict[str, Any]:
        return {"blocks": {"dim": self.dim, "parts": self.parts, "order": list(self.order)}}

    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        self._check_dim(self.dim, shape, where)
        s = list(shape)
        if s[self.dim] % self.parts:
            raise InvalidArgumentError(f"{where}: dim {self.dim} of size {s[self.dim]} is not {self.parts} blocks")
        s[self.dim] = s[self.dim] // self.parts * len(self.order)
        return tuple(s)

    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        s, n = list(shape), len(self.order)
        if not n or s[self.dim] % n:
            raise InvalidArgumentError(f"{where}: dim {self.dim} of size {s[self.dim]} is not {n} blocks")
        s[self.dim] = s[self.dim] // n * self.parts
        return tuple(s)

    def segments(self, in_shape: Sequence[int], a: int, n: int) -> list[tuple[int, int, int]]:
        """For output range [a, a+n) of the dim: `(input_offset, output_offset, size)` pieces."""
        b = in_shape[self.dim] // self.parts
        out = []
        for j, src in enumerate(self.order):
            lo, hi = max(a, j * b), min(a + n, (j + 1) * b)
            if lo < hi:
                out.append((src * b + lo - j * b, lo - a, hi - lo))
        return out

    def _pieces(self, off: list[int], size: list[int], in_shape: Sequence[int]) -> list[tuple[Box, int, int]]:
        out = []
        for src_off, seg_off, seg_size in self.segments(in_shape, off[self.dim], size[self.dim]):
            o, s = list(off), list(size)
            o[self.dim], s[self.dim] = src_off, seg_size
            out.append(((o, s), seg_off, seg_size))
        return out

    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        parts = [read_input(*box) for box, _, _ in self._pieces(off, size, in_shape)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        out = []
        for box, seg_off, seg_size in self._pieces(off, size, in_shape):
            out.extend(scatter_input(*box, None if x is None else x.narrow(self.dim, seg_off, seg_size)))
        return out


@dataclass(frozen=True)
class Permute(Op):
    """The dims reordered: output dim `i` is input dim `perm[i]`."""

    KEY: ClassVar[str] = "permute"
    perm: tuple[int, ...]

    @classmethod
    def parse(cls, arg: Any, where: str) -> Permute:
        if not (isinstance(arg, list) and all(isinstance(x, int) for x in arg)):
            raise _bad(where, f"{cls.KEY} needs a list of dims")
        return cls(tuple(arg))

    def describe(self) -> dict[str, Any]:
        return {"permute": list(self.perm)}

    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        if sorted(self.perm) != list(range(len(shape))):
            raise InvalidArgumentError(f"{where}: permute {list(self.perm)} does not fit shape {shape}")
        return tuple(shape[p] for p in self.perm)

    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        out = [0] * len(shape)
        for i, p in enumerate(self.perm):
            out[p] = shape[i]
        return tuple(out)

    def _input_box(self, off: list[int], size: list[int]) -> Box:
        o, s = [0] * len(off), [0] * len(off)
        for i, p in enumerate(self.perm):
            o[p], s[p] = off[i], size[i]
        return o, s

    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        return read_input(*self._input_box(off, size)).permute(self.perm)

    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        inv = [0] * len(off)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return scatter_input(*self._input_box(off, size), None if x is None else x.permute(inv))


@dataclass(frozen=True)
class Transpose(Op):
    """Two dims swapped: a [`Permute`] once the tensor's rank is known."""

    KEY: ClassVar[str] = "transpose"
    a: int
    b: int

    @classmethod
    def parse(cls, arg: Any, where: str) -> Transpose:
        if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(x, int) for x in arg)):
            raise _bad(where, f"{cls.KEY} needs a list of dims")
        return cls(arg[0], arg[1])

    def describe(self) -> dict[str, Any]:
        return {"transpose": [self.a, self.b]}

    def bind(self, vars: Mapping[str, int], ndim: int) -> Permute:
        perm = list(range(ndim))
        perm[self.a], perm[self.b] = perm[self.b], perm[self.a]
        return Permute(tuple(perm))

    # A swap is its own inverse: every direction is the `Permute` it binds to.
    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        return self.bind({}, len(shape)).forward(shape, vocab, where)

    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        return self.bind({}, len(shape)).inverse(shape, counts, pad_multiple, where)

    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        return self.bind({}, len(off)).read(read_input, off, size, in_shape)

    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        return self.bind({}, len(off)).scatter(scatter_input, off, size, x, in_shape)


@dataclass(frozen=True)
class TrimVocab(Op):
    """A padded vocab dim cut to the saved true vocab size (first op, after `unflatten`)."""

    KEY: ClassVar[str] = "trim_vocab"
    dim: int

    @classmethod
    def parse(cls, arg: Any, where: str) -> TrimVocab:
        return cls(_dim(arg, cls.KEY, where))

    def describe(self) -> dict[str, Any]:
        return {"trim_vocab": {"dim": self.dim}}

    def forward(self, shape: tuple[int, ...], vocab: int | None, where: str) -> tuple[int, ...]:
        self._check_dim(self.dim, shape, where)
        if vocab is None:
            return shape
        if vocab > shape[self.dim]:
            raise InvalidArgumentError(f"{where}: saved vocab size {vocab} exceeds the tensor's {shape[self.dim]} rows")
        return (*shape[: self.dim], vocab, *shape[self.dim + 1 :])

    def inverse(self, shape: tuple[int, ...], counts: Mapping[str, int], pad_multiple: int,
                where: str) -> tuple[int, ...]:
        padded = -(-shape[self.dim] // pad_multiple) * pad_multiple
        return (*shape[: self.dim], padded, *shape[self.dim + 1 :])

    def read(self, read_input: ReadInput, off: list[int], size: list[int],
             in_shape: Sequence[int]) -> torch.Tensor:
        return read_input(off, size)  # the kept rows are the first ones

    def scatter(self, scatter_input: ScatterInput, off: list[int], size: list[int], x: torch.Tensor | None,
                in_shape: Sequence[int]) -> list[Any]:
        return scatter_input(off, size, x)


@dataclass(frozen=True)
class Unflatten:
    """A dim viewed as several (first op only): not a box map like the [`Op`]s, but the logical
    shape the saved tensor is read with. Sizes are ints, one -1, or names of the spec's `dims`."""

    KEY: ClassVar[str] = "unflatten"
    dim: int
    sizes: tuple[int | str, ...]

    @classmethod
    def parse(cls, arg: Any, where: str) -> Unflatten:
        sizes = arg.get("sizes") if isinstance(arg, dict) else None
        if not (isinstance(sizes, list) and all(isinstance(x, (int, str)) for x in sizes)):
            raise _bad(where, "unflatten needs a list of sizes (ints, -1 or dim names)")
        return cls(_dim(arg, cls.KEY, where), tuple(sizes))

    def describe(self) -> dict[str, Any]:
        return {"unflatten": {"dim": self.dim, "sizes": list(self.sizes)}}

    def logical_shape(self, shape: tuple[int, ...], dims: Mapping[str, int], where: str) -> tuple[int, ...]:
        """The logical shape of a saved tensor of `shape` (`dims`: the spec's named sizes)."""
        d = self.dim
        sizes = []
        for x in self.sizes:
            if isinstance(x, str):
                if x not in dims:
                    raise InvalidArgumentError(f"{where}: unflatten size {x!r} is not a known dim")
                x = dims[x]
            sizes.append(int(x))
        if sizes.count(-1) > 1 or not 0 <= d < len(shape):
            raise InvalidArgumentError(f"{where}: bad unflatten {self.describe()['unflatten']}")
        known = numel([x for x in sizes if x != -1])
        if known == 0 or shape[d] % known:
            raise InvalidArgumentError(f"{where}: cannot unflatten size {shape[d]} into {sizes}")
        sizes = [shape[d] // known if x == -1 else x for x in sizes]
        if numel(sizes) != shape[d]:
            raise InvalidArgumentError(f"{where}: cannot unflatten size {shape[d]} into {sizes}")
        return tuple(shape[:d]) + tuple(sizes) + tuple(shape[d + 1 :])

    def saved_shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        """The saved shape of a tensor of `logical` shape (the dims folded back)."""
        d, k = self.dim, len(self.sizes)
        return (*logical[:d], numel(logical[d : d + k]), *logical[d + k :])


_OPS: dict[str, type[Op] | type[Unflatten]] = {
    c.KEY: c for c in (Take, Blocks, Permute, Transpose, TrimVocab, Unflatten)
}


def parse_op(raw: Any, where: str) -> Op | Unflatten:
    """One op of a spec rule: a JSON object with one key naming the op."""
    if not isinstance(raw, dict) or len(raw) != 1:
        raise _bad(where, "must be an object with one key")
    ((key, arg),) = raw.items()
    cls = _OPS.get(key)
    if cls is None:
        raise _bad(where, f"unknown op {key!r}")
    return cls.parse(arg, where)
