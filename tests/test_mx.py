"""MXFP8 (OCP MX v1.0): `to_mxfp8` bit-exact against a scalar reference written from the spec,
and the MXFP8 caches `compute_weights(..., mxfp8=True)` rebuilds on real gloo worlds."""

import bisect
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from olmo_chunks.errors import InvalidArgumentError
from olmo_chunks.experts import ExpertLayout
from olmo_chunks.mx import to_mxfp8
from olmo_chunks.weights import compute_weights
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from tests import world

# --- the reference, straight from the spec: Python floats (doubles), one element at a time ---

# Every non-negative finite E4M3 value by code 0x00..0x7E (0x7F is NaN): 3 mantissa bits, bias 7,
# exponent field 0 is subnormal.
E4M3 = [(c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(0x7F)]
assert E4M3[-1] == 448.0


def ref_e4m3(v: float) -> int:
    """The E4M3 code of `v`: saturate to 448, round to nearest, ties to the even code."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(E4M3, a)
    if E4M3[i] != a:
        below, above = a - E4M3[i - 1], E4M3[i] - a
        if below < above or (below == above and (i - 1) % 2 == 0):
            i -= 1
    return sign | i


def ref_block(xs: list[float]) -> tuple[int, list[int]]:
    """(E8M0 scale code, E4M3 codes) of one block."""
    amax = max((abs(x) for x in xs if not math.isnan(x)), default=0.0)
    if amax == 0:
        e = -127
    elif math.isinf(amax):
        e = 127
    else:
        e = min(max(math.floor(math.log2(amax)) - 8, -127), 127)
    return e + 127, [ref_e4m3(x / 2.0**e) for x in xs]


def check(t: torch.Tensor, block_size: int, dim: int) -> None:
    data, scale = to_mxfp8(t, block_size, dim)
    assert data.dtype == torch.float8_e4m3fn and data.shape == t.shape
    want_scale_shape = list(t.shape)
    want_scale_shape[dim] //= block_size
    assert scale.dtype == torch.float8_e8m0fnu and list(scale.shape) == want_scale_shape
    xs = t.float().movedim(dim, -1).reshape(-1, block_size).tolist()
    codes = data.view(torch.uint8).movedim(dim, -1).reshape(-1, block_size).tolist()
    scales = scale.view(torch.uint8).movedim(dim, -1).reshape(-1).tolist()
    for block, got, got_scale in zip(xs, codes, scales, strict=True):
        want_scale, want = ref_block(block)
        assert got_scale == want_scale, block
        assert got == want, block


def test_special_values_bit_exact():
    nan, inf = math.nan, math.inf
    blocks = [
        [0.0] * 8,  # amax 0: scale 2^-127, data zero
        [-0.0, 0.0, -0.0, -0.0, 0.0, 0.0, -0.0, 0.0],  # negative zero keeps its sign
        [1e-40, -3e-41, 1.4e-45, 0.0, 2e-39, -1e-45, 5e-42, 1e-38],  # FP32 subnormals: scale clamps at 2^-127
        [1.0, 1.9, -1.99, 1.75, 1.7, -0.001, 1e-5, 300.0],  # 300 = 2^8 * 1.17: 1.9 etc. saturate at 448
        [256.0, 1.0625, 1.1875, 2**-10, 3 * 2**-10, -(2**-10), 1.0, 0.0],  # X = 1: ties to even
        [nan, 1.0, -2.0, 0.5, nan, 0.25, 0.0, -0.0],  # NaN ignored by amax and stays NaN
        [nan] * 8,
        [inf, 1.0, -inf, 3e38, 0.0, -1.0, 2.0, 0.5],  # Inf: scale 2^127, saturates to 448
        [3.3e38, -1e38, 2e38, 1.0, 0.0, 1e30, -3e38, 5e37],  # top of FP32
    ]
    check(torch.tensor(blocks, dtype=torch.float32), 8, -1)
    check(torch.tensor(blocks, dtype=torch.float32).T.contiguous(), 8, 0)


def test_exact_ties_and_saturation_values():
    # Against hand-worked codes too, so the reference itself is pinned.
    data, scale = to_mxfp8(torch.tensor([256.0, 1.0625, 3 * 2**-10, 2**-10, 500.0, -449.0, 0.0, -0.0]), 8)
    assert scale.view(torch.uint8).tolist() == [127 + 0]  # floor(log2(500)) - 8 = 0
    assert data.view(torch.uint8).tolist() == [0x78, 0x38, 0x02, 0x00, 0x7E, 0xFE, 0x00, 0x80]
    assert data.float().tolist() == [256.0, 1.0, 2**-8, 0.0, 448.0, -448.0, 0.0, -0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block_size, dim", [((64,), 32, 0), ((3, 64), 32, -1), ((64, 5), 32, 0),
                                                     ((2, 3, 48), 16, 2), ((4, 32, 3), 32, 1), ((6, 4), 1, 0)])
def test_random_tensors_bit_exact(dtype, shape, block_size, dim):
    g = torch.Generator().manual_seed(hash((shape, dim)) & 0xFFFF)
    t = torch.randn(shape, generator=g)
    # Spread magnitudes from FP32 subnormals up to large values, varying along every axis.
    t = t * torch.exp2(torch.randint(-140, 100, shape, generator=g).float()) if dtype == torch.float32 else t
    t = t * torch.exp2(torch.randint(-30, 30, shape, generator=g).float()) if dtype == torch.bfloat16 else t
    check(t.to(dtype), block_size, dim)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(width=32), min_size=16, max_size=16), st.sampled_from([4, 8, 16]))
def test_any_fp32_block_bit_exact(values, block_size):
    check(torch.tensor(values, dtype=torch.float32), block_size, -1)


def test_bad_input_is_refused():
    with pytest.raises(InvalidArgumentError, match="not a multiple of the block size 32"):
        to_mxfp8(torch.ones(4, 48))
    with pytest.raises(InvalidArgumentError, match="not a multiple"):
        to_mxfp8(torch.ones(33, 64), dim=0)
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        to_mxfp8(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        to_mxfp8(torch.ones(4, 32), dim=2)
    with pytest.raises(InvalidArgumentError, match="at least one dimension"):
        to_mxfp8(torch.tensor(1.0))
    with pytest.raises(InvalidArgumentError, match="block_size must be positive"):
        to_mxfp8(torch.ones(4, 32), block_size=0)


def test_agrees_with_torchao_on_ordinary_blocks():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(16, 128, generator=g) * torch.exp2(torch.randint(-60, 60, (16, 1), generator=g).float()))
    t = t.bfloat16()
    scale, data = mx.to_mx(t, torch.float8_e4m3fn, 32)
    ours = to_mxfp8(t)
    assert torch.equal(ours.scale.view(torch.uint8), scale.view(torch.uint8).reshape(16, 4))
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))


# --- through compute_weights on real worlds: quantised after the all-gather ---


def _mx_equal(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def values(shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())


def _caches(mesh_shape, placements):
    mesh = world.mesh(mesh_shape)
    rank, size = dist.get_rank(), dist.get_world_size()
    full = values((96, 64))
    if any(isinstance(p, _StridedShard) for p in placements):
        # Cut the local shard by the definition of _StridedShard(0, split_factor=2) then Shard(0).
        c = mesh.get_coordinate()
        mid = torch.cat([torch.tensor_split(part, mesh_shape[0])[c[0]] for part in torch.chunk(full, 2)])
        local = torch.tensor_split(mid, mesh_shape[1])[c[1]]
        dense = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    else:
        dense = distribute_tensor(full, mesh, placements)
    lo = ExpertLayout(4, (32, 64), 0, 1, rank, size, sharded=True)
    experts = values((4, 32, 64))
    start, n = lo.flat_range
    main = {"dense": dense, "experts": lo.view(experts.reshape(-1)[start : start + n].clone()),
            "norm": torch.ones(64)}
    weights, caches = compute_weights(main, ep_dp_group=dist.group.WORLD, mxfp8=True)
    ok = set(caches) == {"dense", "experts"} and torch.equal(weights["dense"], full.bfloat16())
    for key, want in (("dense", full), ("experts", experts)):
        bf16 = want.bfloat16()
        ok &= _mx_equal(caches[key].rowwise, to_mxfp8(bf16, 32, -1))
        ok &= _mx_equal(caches[key].colwise, to_mxfp8(bf16, 32, -2))
        ok &= caches[key].colwise.scale.shape == (*want.shape[:-2], want.shape[-2] // 32, want.shape[-1])
    return ok


@pytest.mark.parametrize("world_size, mesh_shape, placements", [
    (2, (2,), [Shard(1)]),
    (3, (3,), [Shard(0)]),
    (3, (1, 3), [Replicate(), Shard(1)]),  # 64 columns over 3 ranks: uneven shards straddle MX blocks
    (4, (2, 2), [Shard(0), Shard(1)]),
    (4, (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
])
def test_compute_weights_mxfp8_after_reshard(world_size, mesh_shape, placements):
    assert world.run(world_size, _caches, mesh_shape, placements) == [True] * world_size


def test_compute_weights_mxfp8_refuses_unblockable_weight():
    with pytest.raises(InvalidArgumentError, match=r"w: .* not a multiple of the block size 32"):
        compute_weights({"v": torch.ones(64, 32), "w": torch.ones(64, 40)}, mxfp8=True)
