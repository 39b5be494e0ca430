"""Compute weights: full BF16 tensors from FP32 DTensor shards and expert flat views, gathered
with gloo collectives on real worlds, cast before any traffic."""

import pytest
import torch
import torch.distributed as dist
from olmo_chunks.errors import InvalidArgumentError
from olmo_chunks.experts import ExpertLayout
from olmo_chunks.layout import LEFT_TO_RIGHT, ORDERED, readings_differ
from olmo_chunks.weights import compute_weights, dtensor_weight, expert_weight, full_weight
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from tests import world
from tests.test_layout import strided_rows, strided_split

PLACEMENTS = {
    "S0,S0": [Shard(0), Shard(0)],
    "S0,S1": [Shard(0), Shard(1)],
    "R,S0": [Replicate(), Shard(0)],
    "S1,R": [Shard(1), Replicate()],
    "R,R": [Replicate(), Replicate()],
    "SS0,S0": [_StridedShard(0, split_factor=2), Shard(0)],
}


def fp32_values(shape) -> torch.Tensor:
    # Not exactly representable in bf16, so the cast is visible.
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * 1.001 + 0.3).reshape(shape)


def chunk(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    parts = torch.chunk(t, n)
    return parts[i] if i < len(parts) else t[:0]


class GatherLog:
    """Wraps dist.all_gather to record the dtype of every gathered tensor."""

    def __init__(self):
        self.dtypes = []
        self._orig = dist.all_gather

    def __enter__(self):
        def logged(out, t, group=None, async_op=False):
            self.dtypes.append(t.dtype)
            return self._orig(out, t, group=group, async_op=async_op)

        dist.all_gather = logged
        return self

    def __exit__(self, *exc):
        dist.all_gather = self._orig


def _dense_case(name, shape):
    mesh = world.mesh((2, 2))
    full = fp32_values(shape)
    placements = PLACEMENTS[name]
    if any(isinstance(p, _StridedShard) for p in placements):
        # distribute_tensor cannot build _StridedShard: cut the local shard by its definition
        # (chunk i of each of the split_factor chunks, concatenated, then chunked again).
        c = mesh.get_coordinate()
        mid = torch.cat([chunk(part, 2, c[0]) for part in torch.chunk(full, 2)])
        local = chunk(mid, 2, c[1])
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                stride=full.stride())
    else:
        dt = distribute_tensor(full, mesh, placements)
    with GatherLog() as log:
        got = dtensor_weight(dt)
    n_sharded = sum(not isinstance(p, Replicate) for p in placements)
    return (got.dtype, torch.equal(got, full.to(torch.bfloat16)), set(log.dtypes), len(log.dtypes),
            n_sharded, dt.to_local().dtype)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
@pytest.mark.parametrize("shape", [(7, 3), (2, 5), (9, 4)])
def test_dtensor_weight_is_full_bf16(name, shape):
    for got_dtype, equal, dtypes, calls, n_sharded, main_dtype in world.run(4, _dense_case, name, shape):
        assert got_dtype == torch.bfloat16 and equal
        assert main_dtype == torch.float32
        assert dtypes <= {torch.bfloat16}  # cast before gathering
        # At most one gather per sharded mesh dim (none where all peers hold nothing), none for replicas.
        assert calls <= n_sharded and (calls > 0) == (n_sharded > 0)


def _strided_case(mesh_shape, rows, made_by, whole=None):
    """A (rows, 2) weight cut by the `made_by` reading on a dp x tp mesh (`strided_rows`; torch
    2.8/2.9's split where `whole`); its compute weight, or the refusal."""
    full = fp32_values((rows, 2))
    with strided_split(whole):
        dt = strided_rows(full, world.mesh(mesh_shape), made_by)
        try:
            return "ok", torch.equal(dtensor_weight(dt), full.to(torch.bfloat16))
        except InvalidArgumentError as e:
            return "refused", str(e)


@pytest.mark.parametrize("made_by", [LEFT_TO_RIGHT, ORDERED])
def test_dtensor_weight_of_a_strided_shard_that_reads_two_ways(made_by):
    """7 rows on 3 x 2: `distribute_tensor`'s reading of the spec and the order its split factors
    encode (`redistribute`, FSDP2 over TP) put other rows on some coordinates, of the same size as
    the other reading's everywhere but one; the ranks agree from their shapes which made the weight,
    and it comes out whole. Before, any coordinate where the readings differed refused it."""
    spec = ((7, 2), (3, 2), (_StridedShard(0, split_factor=2), Shard(0)), None)
    assert readings_differ(*spec)
    assert world.run(6, _strided_case, (3, 2), 7, made_by) == [("ok", True)] * 6


def test_dtensor_weight_refuses_a_strided_shard_whose_ranks_fit_both_readings():
    """5 rows on 2 x 2 split as torch 2.8/2.9 do: the two readings put other rows on some rank with
    the same shape at every rank, so no shape tells which made it."""
    for status, detail in world.run(4, _strided_case, (2, 2), 5, ORDERED, True):
        assert status == "refused", detail
        assert detail.startswith("ambiguous layout of a tensor of shape (5, 2) placed (_StridedShard(dim=0, sf=2), "
                                 "Shard(dim=0)) on mesh (2, 2): every rank's local shard fits both readings"), detail


def _expert_case(mp, dp, sharded, num_experts, expert_shape):
    rank = dist.get_rank()
    m, d = divmod(rank, dp)
    lo = ExpertLayout(num_experts, expert_shape, m, mp, d, dp, sharded)
    full = fp32_values((num_experts, *expert_shape))
    start, n = lo.flat_range
    storage = full.reshape(-1)[start : start + n].clone()
    mesh = world.mesh((mp, dp))
    with GatherLog() as log:
        got = expert_weight(lo.view(storage), mesh.get_group(1))
    e0, e1 = lo.expert_range
    return got.shape, torch.equal(got, full[e0:e1].to(torch.bfloat16)), set(log.dtypes), got.dtype


@pytest.mark.parametrize(
    "mp, dp, sharded, num_experts",
    [(2, 2, True, 4), (2, 2, False, 4), (1, 4, True, 3), (4, 1, True, 4), (2, 2, True, 3)],
)
def test_expert_weight_gathers_over_ep_dp(mp, dp, sharded, num_experts):
    for shape, equal, dtypes, dtype in world.run(4, _expert_case, mp, dp, sharded, num_experts, (3, 5)):
        assert equal and dtype == torch.bfloat16
        assert dtypes <= {torch.bfloat16}
        assert shape[1:] == (3, 5)


def _mixed(_):
    mesh = world.mesh((2, 2))
    rank = dist.get_rank()
    lo = ExpertLayout(4, (2, 3), rank // 2, 2, rank % 2, 2)
    full = fp32_values((4, 2, 3))
    start, n = lo.flat_range
    main = {
        "dense": distribute_tensor(fp32_values((5, 2)), mesh, [Shard(0), Shard(0)]),
        "experts": lo.view(full.reshape(-1)[start : start + n].clone()),
        "norm": torch.ones(3),
    }
    out = compute_weights(main, ep_dp_group=mesh.get_group(1))
    errors = []
    for bad in (lambda: full_weight([1.0]),
                lambda: expert_weight(main["experts"]),
                lambda: expert_weight(main["experts"], dist.group.WORLD),
                lambda: dtensor_weight(DTensor.from_local(torch.ones(4), mesh, [Partial(), Replicate()]))):
        try:
            bad()
        except InvalidArgumentError:
            errors.append("InvalidArgumentError")
    return ({k: (v.dtype, tuple(v.shape)) for k, v in out.items()},
            torch.equal(out["experts"], full[2 * (rank // 2): 2 * (rank // 2) + 2].bfloat16()),
            out["norm"].data_ptr() != main["norm"].data_ptr(), errors)


def test_compute_weights_of_a_state_and_bad_input():
    for shapes, experts_ok, fresh, errors in world.run(4, _mixed, None):
        assert shapes == {"dense": (torch.bfloat16, (5, 2)), "experts": (torch.bfloat16, (2, 2, 3)),
                          "norm": (torch.bfloat16, (3,))}
        assert experts_ok and fresh
        assert errors == ["InvalidArgumentError"] * 4
