"""MXFP8: OCP Microscaling (MX v1.0) FP8 E4M3 elements with one E8M0 scale per block.

The rule (`docs/MXFP8.md` has a worked block), per block of `block_size` consecutive elements
along `dim`, computed in FP32: with `amax` the largest absolute value of the block (NaN elements
ignored), the shared scale is `X = 2^(floor(log2(amax)) - 8)` (8 = E4M3's largest exponent),
clamped to E8M0's `2^-127 .. 2^127`; an all-zero block gets `2^-127`. Each element is `x / X`
saturated to +-448 and rounded to nearest-even into E4M3; NaN stays NaN (0x7F), +-Inf
saturates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import InvalidArgumentError

__all__ = ["MXFP8", "MXFP8Cache", "to_mxfp8"]

E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
E8M0_BIAS = 127


class MXFP8(NamedTuple):
    """A tensor in MXFP8: `data` (float8_e4m3fn, the source's shape) times `scale` (float8_e8m0fnu,
    the source's shape with `dim`'s size divided by the block size), broadcast along `dim`."""

    data: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class MXFP8Cache:
    """The two MXFP8 forms of one compute weight an MX training step multiplies with: `rowwise`
    has its blocks along the last dim (forward), `colwise` along the second-to-last (backward;
    dim 0 of a matrix, each expert's own columns for stacked expert weights)."""

    rowwise: MXFP8
    colwise: MXFP8


def to_mxfp8(t: torch.Tensor, block_size: int = 32, dim: int = -1) -> MXFP8:
    """`t` quantised to MXFP8 with blocks of `block_size` elements along `dim` (see the module
    docstring for the rule). Works on any device; `t` must be floating point with `dim`'s size a
    multiple of `block_size`."""
    if not t.is_floating_point():
        raise InvalidArgumentError(f"to_mxfp8 needs a floating-point tensor, got {t.dtype}")
    if t.ndim == 0:
        raise InvalidArgumentError("to_mxfp8 needs a tensor with at least one dimension")
    if not -t.ndim <= dim < t.ndim:
        raise InvalidArgumentError(f"dim {dim} is out of range for a {t.ndim}-d tensor")
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
    n = t.shape[dim]
    if n % block_size:
        raise InvalidArgumentError(
            f"dim {dim} of shape {tuple(t.shape)} has {n} elements, not a multiple of the block size {block_size}")
    x = t.float().movedim(dim, -1)
    blocks = x.reshape(*x.shape[:-1], n // block_size, block_size)
    mag = blocks.abs()
    amax = torch.where(mag.isnan(), 0.0, mag).amax(-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, 0.5 <= m < 1, so floor(log2(amax)) = exp - 1
    shared = torch.where(amax == 0, -E8M0_BIAS, exp - 1 - E4M3_EMAX)
    shared = torch.where(amax == math.inf, E8M0_BIAS, shared).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = (shared + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    # Dividing by the stored power of two is exact; clamping first is the saturation (a plain cast
    # to float8_e4m3fn turns out-of-range values into NaN). NaN is written as 0x7F on every device
    # (GPU arithmetic drops a NaN's sign, CPU arithmetic keeps it).
    v = (blocks / scale.float().unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(v.isnan(), math.nan, v).to(torch.float8_e4m3fn)
    data = q.reshape(x.shape).movedim(-1, dim).contiguous()
    return MXFP8(data, scale.movedim(-1, dim).contiguous())
