"""Shape helpers of the HF conversion: element counts, strides, and the contiguous boxes that tile
a tensor in row-major order (how a tensor is streamed one bounded box at a time)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["contiguous_boxes", "numel", "strides"]


def numel(shape: Sequence[int]) -> int:
    """The number of elements of a tensor of `shape`."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def strides(shape: Sequence[int]) -> list[int]:
    """The row-major element strides of `shape`."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return out[::-1]


def contiguous_boxes(shape: Sequence[int], max_elems: int) -> Iterator[tuple[list[int], list[int]]]:
    """Boxes `(offsets, sizes)` that tile `shape` in row-major order, each a contiguous run of at
    most `max_elems` elements (at least one element) of the canonical order."""
    shape = [int(d) for d in shape]
    max_elems = max(1, int(max_elems))
    if not shape:
        yield [], []
        return
    if 0 in shape:
        return

    def rec(prefix: list[int], dim: int) -> Iterator[tuple[list[int], list[int]]]:
        inner = numel(shape[dim + 1 :])
        n = shape[dim]
        if inner <= max_elems:
            step = max(1, max_elems // inner)
            for start in range(0, n, step):
                size = min(step, n - start)
                yield prefix + [start] + [0] * (len(shape) - dim - 1), [1] * dim + [size] + shape[dim + 1 :]
        else:
            for i in range(n):
                yield from rec([*prefix, i], dim + 1)

    yield from rec([], 0)
