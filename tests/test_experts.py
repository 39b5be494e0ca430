"""Expert flat views: layouts against a torch.chunk oracle, and save/load across EP-MP x EP-DP
layouts on real gloo worlds, bit-exact."""

import itertools
import math

import olmo_chunks as oc
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from olmo_chunks import roles
from olmo_chunks.errors import InvalidArgumentError, MismatchError, RankFailedError
from olmo_chunks.experts import ExpertFlatView, ExpertLayout, chunk_range

from tests import world

WORLD = 4


def oracle_slice(global_flat: torch.Tensor, lo: ExpertLayout) -> torch.Tensor:
    """This rank's elements computed with torch.chunk on the real global tensor."""
    experts = global_flat.reshape(lo.num_experts, -1)
    block = torch.chunk(experts, lo.ep_mp_size, dim=0)
    block = block[lo.ep_mp_rank].reshape(-1) if lo.ep_mp_rank < len(block) else experts[:0].reshape(-1)
    if not lo.sharded:
        return block
    parts = torch.chunk(block, lo.ep_dp_size) if block.numel() else ()
    return parts[lo.ep_dp_rank] if lo.ep_dp_rank < len(parts) else block[:0]


def global_values(numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers are exact in every float dtype used here.
    return (torch.arange(numel) % 251).to(dtype)


layouts = st.tuples(st.integers(1, 4), st.integers(1, 4), st.booleans()).filter(
    lambda t: t[0] * t[1] <= WORLD)


@st.composite
def expert_cases(draw):
    mp_a, dp_a, sh_a = draw(layouts)
    mp_b, dp_b, sh_b = draw(layouts)
    num_experts = draw(st.integers(max(mp_a, mp_b), 9))
    expert_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return (mp_a, dp_a, sh_a), (mp_b, dp_b, sh_b), num_experts, expert_shape, dtype


# ---- layouts, no world needed -----------------------------------------------------------------


@given(total=st.integers(0, 50), parts=st.integers(1, 9))
def test_chunk_range_matches_torch_chunk(total, parts):
    got = [chunk_range(total, parts, i) for i in range(parts)]
    want = []
    for c in torch.chunk(torch.arange(total), parts) if total else ():
        want.append((int(c[0]), int(c[-1]) + 1))
    assert [r for r in got if r[0] < r[1]] == want
    assert got[0][0] == 0 and got[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


@given(layout=layouts, num_experts=st.integers(4, 9),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_layout_flat_ranges_match_oracle_and_tile(layout, num_experts, shape):
    mp, dp, sharded = layout
    numel = num_experts * math.prod(shape)
    g = torch.arange(numel)
    covered = torch.zeros(numel, dtype=torch.int64)
    for m, d in itertools.product(range(mp), range(dp)):
        lo = ExpertLayout(num_experts, tuple(shape), m, mp, d, dp, sharded)
        start, length = lo.flat_range
        assert torch.equal(g[start : start + length], oracle_slice(g, lo))
        assert lo.local_numel == length
        covered[start : start + length] += 1
    # Sharded: every element held once; replicated: once per EP-DP replica.
    assert torch.all(covered == (1 if sharded else dp))


def test_uneven_layout_examples():
    # 6 experts over EP-MP 4: torch.chunk gives 2, 2, 2, 0.
    assert [ExpertLayout(6, (3,), m, 4).expert_range for m in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 6)]
    # A block of 2 experts x 5 elements over EP-DP 3: 4, 4, 2.
    assert [ExpertLayout(4, (5,), 1, 2, d, 3).flat_range for d in range(3)] == [(10, 4), (14, 4), (18, 2)]
    assert [ExpertLayout(4, (5,), 1, 2, d, 3, sharded=False).flat_range for d in range(3)] == [(10, 10)] * 3
    assert ExpertLayout(8, (2,), experts=(3, 7)).flat_range == (6, 8)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_experts=0, expert_shape=(2,)),
        dict(num_experts=4, expert_shape=(2, -1)),
        dict(num_experts=4, expert_shape="ab"),
        dict(num_experts=4, expert_shape=(2,), ep_mp_rank=2, ep_mp_size=2),
        dict(num_experts=4, expert_shape=(2,), ep_dp_rank=-1, ep_dp_size=2),
        dict(num_experts=4, expert_shape=(2,), ep_dp_size=0),
        dict(num_experts=2, expert_shape=(2,), ep_mp_size=4),
        dict(num_experts=4, expert_shape=(2,), experts=(3, 5)),
        dict(num_experts=4, expert_shape=(2,), ep_mp_rank=True, ep_mp_size=2),
    ],
)
def test_bad_layout_is_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        ExpertLayout(**kwargs)


def test_bad_storage_is_refused():
    lo = ExpertLayout(4, (3,), 0, 2)
    with pytest.raises(InvalidArgumentError, match="needs 6"):
        lo.view(torch.zeros(5))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        lo.view(torch.zeros(12)[::2])
    with pytest.raises(InvalidArgumentError, match="needs 6 from offset 2"):
        lo.view(torch.zeros(7), offset=2)
    with pytest.raises(InvalidArgumentError, match="unknown role"):
        lo.view(torch.zeros(6), role="weights")
    with pytest.raises(InvalidArgumentError):
        ExpertFlatView(lo, [0.0] * 6)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ExpertFlatView((4, (3,)), torch.zeros(6))  # type: ignore[arg-type]


def test_view_aliases_storage_and_describes_one_flat_range():
    storage = torch.zeros(20)
    view = ExpertFlatView.build(storage, num_experts=4, expert_shape=(2, 3), ep_mp_rank=1, ep_mp_size=2,
                                ep_dp_rank=1, ep_dp_size=2, role=roles.EXP_AVG, offset=4)
    shard = view.tensor_shard()
    assert isinstance(view, oc.ChunkSource)
    assert shard.shape == (4, 2, 3) and shard.role == roles.EXP_AVG
    assert shard.flat == [(12 + 6, 6, 0)]
    # Exactly the view's elements of the live storage: no copy, and nothing beyond the view.
    assert shard.local.data_ptr() == storage.data_ptr() + 4 * storage.element_size()
    assert shard.local.numel() == 6 and shard.local.untyped_storage().data_ptr() == storage.data_ptr()
    (region, data), = shard.regions()
    assert region == oc._core.Flat(18, 6)
    assert data.data_ptr() == storage.data_ptr() + 4 * storage.element_size()
    assert view.local.data_ptr() == data.data_ptr()


def test_single_process_roundtrip_with_offset(tmp_path):
    g = global_values(4 * 6, torch.float32)
    oc.save({"e": ExpertLayout(4, (2, 3)).view(g.clone())}, tmp_path / "ck")
    lo = ExpertLayout(4, (2, 3), 1, 2, 0, 2)
    buf = torch.full((lo.local_numel + 3,), -1.0)
    oc.load({"e": lo.view(buf, offset=2)}, tmp_path / "ck")
    assert torch.equal(buf[2:-1], oracle_slice(g, lo))
    assert buf[:2].eq(-1).all() and buf[-1] == -1


# ---- save on one layout, load on another, real gloo worlds -------------------------------------


def _rank_layout(spec, num_experts, expert_shape) -> ExpertLayout | None:
    mp, dp, sharded = spec
    rank = torch.distributed.get_rank()
    if rank >= mp * dp:
        return None
    m, d = divmod(rank, dp)
    return ExpertLayout(num_experts, expert_shape, m, mp, d, dp, sharded)


def _expert_state(lo: ExpertLayout | None, storages) -> dict:
    if lo is None:
        return {}
    return {"experts": {
        "w_up": lo.view(storages[0]),
        "w_up_exp_avg": lo.view(storages[1], role=roles.EXP_AVG),
    }}


def _save_then_load(path, spec_a, spec_b, num_experts, expert_shape, dtype_name):
    dtype = getattr(torch, dtype_name)
    numel = num_experts * math.prod(expert_shape)
    g = [global_values(numel, dtype), global_values(numel, dtype).neg()]
    lo = _rank_layout(spec_a, num_experts, expert_shape)
    saved = [oracle_slice(x, lo).clone() for x in g] if lo else []
    oc.save(_expert_state(lo, saved), path)
    lo = _rank_layout(spec_b, num_experts, expert_shape)
    fresh = [torch.full((lo.local_numel,), float("nan"), dtype=dtype) for _ in g] if lo else []
    ptrs = [t.data_ptr() for t in fresh]
    oc.load(_expert_state(lo, fresh), path, partial=lo is None)
    assert [t.data_ptr() for t in fresh] == ptrs  # filled in place
    return [torch.equal(t, oracle_slice(x, lo)) for t, x in zip(fresh, g, strict=True)] if lo else []


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=expert_cases())
def test_reshard_experts_across_layouts(tmp_path_factory, case):
    path = str(tmp_path_factory.mktemp("ck") / "ck")
    results = world.run(WORLD, _save_then_load, path, *case)
    assert all(all(r) for r in results)


@pytest.mark.parametrize(
    "spec_a, spec_b, num_experts",
    [
        ((4, 1, True), (2, 1, True), 8),  # EP4 -> EP2
        ((2, 2, True), (1, 2, False), 4),  # EP2 x EP-DP shard -> EP1 x EP-DP replicate
        ((1, 4, False), (4, 1, True), 4),  # replicated everywhere -> one expert per rank
        ((2, 2, True), (3, 1, True), 7),  # uneven EP-MP and uneven EP-DP
        ((1, 3, True), (2, 2, True), 5),  # EP-DP 3 over 5 x 3 x 2 elements: uneven flat shards
    ],
)
def test_reshard_named_cases(tmp_path, spec_a, spec_b, num_experts):
    results = world.run(WORLD, _save_then_load, str(tmp_path / "ck"), spec_a, spec_b, num_experts, (3, 2),
                        "float32")
    assert all(all(r) for r in results)
    assert sum(len(r) for r in results) == 2 * spec_b[0] * spec_b[1]


def _manifest_roles(path):
    return {t.key: (t.shape, t.role) for t in oc._core.Manifest.open(path).tensors}


def test_saved_shape_and_roles(tmp_path):
    path = str(tmp_path / "ck")
    world.run(WORLD, _save_then_load, path, (2, 2, True), (2, 2, True), 4, (3, 2), "float32")
    assert _manifest_roles(path) == {
        "experts.w_up": ([4, 3, 2], roles.MAIN_WEIGHT),
        "experts.w_up_exp_avg": ([4, 3, 2], roles.EXP_AVG),
    }
    # Two EP-MP blocks, each in two EP-DP shards.
    m = oc._core.Manifest.open(path)
    assert [type(c.region) for c in m.chunks(0)] == [oc._core.Flat] * 4


def _load_other_model(path, num_experts, role):
    m, d = divmod(torch.distributed.get_rank(), 2)
    lo = ExpertLayout(num_experts, (3, 2), m, 2, d, 2)
    state = {"experts": {"w_up": lo.view(lo.empty()), "w_up_exp_avg": lo.view(lo.empty(), role=role)}}
    try:
        oc.load(state, path)
    except MismatchError as exc:
        return "MismatchError", exc.mismatches
    except RankFailedError:
        return "RankFailedError", []
    return "loaded", []


def test_expert_count_or_role_change_is_a_conversion(tmp_path):
    path = str(tmp_path / "ck")
    world.run(WORLD, _save_then_load, path, (2, 2, True), (2, 2, True), 4, (3, 2), "float32")
    results = world.run(WORLD, _load_other_model, path, 6, roles.EXP_AVG)
    assert {r[0] for r in results} == {"MismatchError"}
    assert all(len(r[1]) == 2 and all("shape=(4, 3, 2)" in m for m in r[1]) for r in results)
    results = world.run(WORLD, _load_other_model, path, 4, roles.EXP_AVG_SQ)
    assert {r[0] for r in results} == {"MismatchError"}
    assert all(r[1] == [r[1][0]] and "role=exp_avg" in r[1][0] for r in results)


class _TwoBlocks:
    """One process standing in for two EP-MP ranks: both flat ranges over one storage, so the
    checkpoint has exactly the chunks an EP-MP-8 save writes."""

    def __init__(self, a: ExpertLayout, b: ExpertLayout, storage: torch.Tensor) -> None:
        self.a, self.b, self.storage = a, b, storage

    def tensor_shard(self):
        from olmo_chunks.shards import TensorShard

        (sa, na), (sb, nb) = self.a.flat_range, self.b.flat_range
        return TensorShard(self.storage.dtype, self.a.shape, self.storage, flat=[(sa, na, 0), (sb, nb, na)])


def _ep8_to_ep4(path):
    rank = dist.get_rank()
    g = global_values(8 * 6, torch.float32)
    a, b = (ExpertLayout(8, (2, 3), 2 * rank + k, 8) for k in (0, 1))
    storage = torch.cat([oracle_slice(g, a), oracle_slice(g, b)])
    oc.save({"w": _TwoBlocks(a, b, storage)}, path)
    lo = ExpertLayout(8, (2, 3), rank, 4)
    got = torch.full((lo.local_numel,), float("nan"))
    oc.load({"w": lo.view(got)}, path)
    return torch.equal(got, oracle_slice(g, lo)), len(oc._core.Manifest.open(path).chunks(0))


def test_ep8_to_ep4(tmp_path):
    out = world.run(WORLD, _ep8_to_ep4, str(tmp_path / "ck"))
    assert out == [(True, 8)] * WORLD


def _inconsistent_save(path, case):
    rank = dist.get_rank()
    if case == "overlap":  # rank 1 thinks the block is replicated, rank 0 that it is sharded
        lo = ExpertLayout(2, (3,), 0, 1, rank % 2, 2, sharded=rank % 2 == 0)
    elif case == "gap":  # nobody holds EP-MP block 1
        lo = ExpertLayout(4, (3,), 0, 2, rank % 2, 2)
    else:  # ranks disagree on the expert count
        lo = ExpertLayout(4 + rank, (3,), 0, 4, 0, 1)
    try:
        oc.save({"w": lo.view(lo.empty())}, path)
    except oc.OlmoChunksError as exc:
        return type(exc).__name__, getattr(exc, "mismatches", None)
    return "saved", None


@pytest.mark.parametrize("case, error", [("overlap", "LayoutError"), ("gap", "LayoutError"),
                                         ("count", "MismatchError")])
def test_inconsistent_layouts_across_ranks_are_refused(tmp_path, case, error):
    out = world.run(2, _inconsistent_save, str(tmp_path / "ck"), case)
    # Every rank raises the root's error as itself, a MismatchError with its list (was RankFailedError on rank 1)
    assert [name for name, _ in out] == [error] * 2 and out[0][1] == out[1][1]
    if error == "MismatchError":
        assert out[0][1] == ["w: rank 1 has ('float32', [5, 3], 'main_weight'), "
                             "another rank ('float32', [4, 3], 'main_weight')"]
    assert not (tmp_path / "ck" / oc.MANIFEST_NAME).exists()


def _from_mesh(_):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_mp", "ep_dp"))
    lo = ExpertLayout.from_mesh(mesh, 8, (3, 2), sharded=False)
    only_mp = ExpertLayout.from_mesh(mesh, 8, (3, 2), ep_dp_dim=None)
    try:
        ExpertLayout.from_mesh(mesh, 8, (3,), ep_mp_dim="ep")
    except InvalidArgumentError:
        bad = "InvalidArgumentError"
    return lo, only_mp, bad


def test_layout_from_named_mesh():
    for rank, (lo, only_mp, bad) in enumerate(world.run(WORLD, _from_mesh, None)):
        assert lo == ExpertLayout(8, (3, 2), rank // 2, 2, rank % 2, 2, sharded=False)
        assert only_mp == ExpertLayout(8, (3, 2), rank // 2, 2)
        assert bad == "InvalidArgumentError"
