"""DTensor placements -> pieces of the global tensor, by hand and against torch on real gloo worlds."""

import contextlib
import importlib
import itertools
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from olmo_chunks import layout, weights
from olmo_chunks.errors import InvalidArgumentError
from olmo_chunks.layout import (
    Piece,
    _pieces,
    _strided_order,
    _strided_shard,
    dtensor_pieces,
    ordered_reading,
    shard_pieces,
    spec_pieces,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from tests import world

# A placement as plain data, so hypothesis can print and shrink it: ("R",), ("S", dim) or
# ("SS", dim, split_factor).
PlacementSpec = tuple


def piece(global_offsets, sizes, local_offsets):
    return Piece(tuple(global_offsets), tuple(sizes), tuple(local_offsets))


def pieces_1d(shape, mesh_shape, placements):
    """Pieces of a 1-d tensor at every mesh coordinate, as (global start, size, local start) lists."""
    return {
        coordinate: [
            (p.global_offsets[0], p.sizes[0], p.local_offsets[0])
            for p in shard_pieces(shape, mesh_shape, coordinate, placements)
        ]
        for coordinate in itertools.product(*map(range, mesh_shape))
    }


def test_uneven_shard_gives_torch_chunk_sizes():
    assert pieces_1d((5,), (4,), [Shard(0)]) == {
        (0,): [(0, 2, 0)],
        (1,): [(2, 2, 0)],
        (2,): [(4, 1, 0)],
        (3,): [],
    }


def test_empty_shards_have_no_pieces():
    assert pieces_1d((2,), (4,), [Shard(0)]) == {(0,): [(0, 1, 0)], (1,): [(1, 1, 0)], (2,): [], (3,): []}
    assert shard_pieces((0, 3), (2,), (0,), [Shard(1)]) == []
    assert shard_pieces((4, 0), (2,), (1,), [Replicate()]) == []


def test_zero_dim_tensor_is_one_piece():
    assert shard_pieces((), (2,), (1,), [Replicate()]) == [piece((), (), ())]
    assert shard_pieces((), (), (), []) == [piece((), (), ())]


def test_two_shards_on_one_dim_apply_left_to_right():
    # 7 -> chunks of 4 and 3 on mesh dim 0, each chunked again on mesh dim 1.
    assert pieces_1d((7,), (2, 2), [Shard(0), Shard(0)]) == {
        (0, 0): [(0, 2, 0)],
        (0, 1): [(2, 2, 0)],
        (1, 0): [(4, 2, 0)],
        (1, 1): [(6, 1, 0)],
    }


def test_strided_shard_matches_torch_docstring_example():
    # torch's _StridedShard docstring: rows of an 8-row tensor on a (dp=2, tp=2) mesh.
    got = pieces_1d((8,), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)])
    assert got == {
        (0, 0): [(0, 2, 0)],
        (0, 1): [(4, 2, 0)],
        (1, 0): [(2, 2, 0)],
        (1, 1): [(6, 2, 0)],
    }


@pytest.fixture(params=[False, True], ids=["torch>=2.10", "torch<2.10"])
def chunks_stride_whole(request, monkeypatch):
    """Either torch's split of an uneven _StridedShard, whatever torch runs the test."""
    monkeypatch.setattr(layout, "_CHUNKS_STRIDE_WHOLE", request.param)
    return request.param


def test_uneven_strided_shard_splits_by_split_factor_first(chunks_stride_whole):
    # From torch 2.10: 5 -> split_factor chunks [0, 3) and [3, 5), each then chunked in two.
    # Before: 5 -> 4 chunks [0, 2), [2, 4), [4, 5), [5, 5); coordinate c takes chunks c and c + 2.
    assert pieces_1d((5,), (2,), [_StridedShard(0, split_factor=2)]) == (
        {(0,): [(0, 2, 0), (4, 1, 2)], (1,): [(2, 2, 0)]} if chunks_stride_whole else
        {(0,): [(0, 2, 0), (3, 1, 2)], (1,): [(2, 1, 0), (4, 1, 1)]})


def test_strided_shard_with_split_factor_one_is_shard():
    for c in range(3):
        strided = shard_pieces((4, 7), (3,), (c,), [_StridedShard(1, split_factor=1)])
        assert strided == shard_pieces((4, 7), (3,), (c,), [Shard(1)])


def test_pieces_are_the_product_of_per_dim_intervals(chunks_stride_whole):
    placements = [_StridedShard(1, split_factor=2), Shard(0)]
    # Dim 0 holds rows [2, 4). Dim 1 holds, from torch 2.10, [2, 3) and [5, 6) of columns [0, 3) and
    # [3, 6); before, [2, 4), the second and fourth of the chunks [0, 2), [2, 4), [4, 6), [6, 6).
    assert shard_pieces((4, 6), (2, 3), (1, 1), placements) == (
        [piece((2, 2), (2, 2), (0, 0))] if chunks_stride_whole else
        [piece((2, 2), (2, 1), (0, 0)), piece((2, 5), (2, 1), (0, 1))])
    # 4 rows in chunks of 2 leave nothing for coordinate 2 on dim 0.
    assert shard_pieces((4, 6), (2, 3), (1, 2), placements) == []


def test_negative_shard_dim_counts_from_the_end():
    assert shard_pieces((3, 4), (2,), (1,), [Shard(-1)]) == [piece((0, 2), (3, 2), (0, 0))]


def test_partial_is_refused():
    with pytest.raises(ValueError, match="pending reduction"):
        shard_pieces((4,), (2,), (0,), [Partial()])


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "coordinate", "placements"),
    [
        ((4,), (2,), (0,), [Shard(1)]),
        ((4,), (2,), (2,), [Shard(0)]),
        ((4,), (2, 2), (0,), [Shard(0), Shard(0)]),
        ((4,), (2,), (0,), [Shard(0), Shard(0)]),
    ],
)
def test_inconsistent_arguments_are_refused(shape, mesh_shape, coordinate, placements):
    with pytest.raises(ValueError):
        shard_pieces(shape, mesh_shape, coordinate, placements)


# --- against torch on real gloo worlds ---

WORLD_SIZES = (2, 4, 8)


def mesh_shapes(world_size: int) -> list[tuple[int, ...]]:
    """Every 1-, 2- and 3-d mesh shape with `world_size` devices."""
    return [
        shape
        for ndim in (1, 2, 3)
        for shape in itertools.product(range(1, world_size + 1), repeat=ndim)
        if math.prod(shape) == world_size
    ]


@contextlib.contextmanager
def strided_split(whole: bool | None) -> Iterator[None]:
    """The layout code splitting a `_StridedShard` as torch 2.8/2.9 do where `whole`, as 2.10 and
    later do where not (None: as this torch does), its caches (keyed by spec, not split) emptied on
    the way in and out: a check of one release's layouts on another's torch, the shards cut by hand."""
    caches = (layout._spec_pieces_cached, layout._local_readings_cached, layout._readings_differ_cached,
              weights._pieces_by_coordinate)
    before = layout._CHUNKS_STRIDE_WHOLE
    layout._CHUNKS_STRIDE_WHOLE = before if whole is None else whole
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        layout._CHUNKS_STRIDE_WHOLE = before
        for cache in caches:
            cache.cache_clear()


def strided_rows(full: torch.Tensor, mesh: DeviceMesh, made_by: str) -> DTensor:
    """`full` as (_StridedShard(0, sf=tp), Shard(0)) on a dp x tp `mesh`, each local shard cut by
    hand to the rows the `made_by` reading (`layout.LEFT_TO_RIGHT` or `ORDERED`) puts at its rank."""
    mesh_shape, c = tuple(mesh.shape), tuple(mesh.get_coordinate())
    placements = (_StridedShard(0, split_factor=mesh_shape[1]), Shard(0))
    pieces = (shard_pieces(full.shape, mesh_shape, c, placements) if made_by == layout.LEFT_TO_RIGHT
              else ordered_reading(full.shape, mesh_shape, c, placements, None))
    local = torch.cat([full[p.global_offsets[0] : p.global_offsets[0] + p.sizes[0]] for p in pieces] + [full[:0]])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def build_placement(spec: PlacementSpec):
    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


@st.composite
def layouts(draw, world_size: int):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = draw(st.sampled_from(mesh_shapes(world_size)))
    choices = [("R",)]
    choices += [("S", d) for d in range(ndim)]
    choices += [("SS", d, sf) for d in range(ndim) for sf in (1, 2, 3)]
    placements = draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape), max_size=len(mesh_shape)))
    return shape, mesh_shape, tuple(placements)


def box(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def distribute_and_check(shape, mesh_shape, placement_specs):
    """On one rank: shard a known tensor with torch, check our pieces against the local shard."""
    mesh = world.mesh(mesh_shape)
    placements = [build_placement(p) for p in placement_specs]
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    try:
        dt = world.distribute(full, mesh, placements)
    except Exception as e:  # torch 2.6 refuses uneven _StridedShard, for one
        return "refused", f"{type(e).__name__}: {e}"
    local = dt.to_local()
    try:
        pieces = dtensor_pieces(dt)
    except InvalidArgumentError as e:
        # Torch's own reading of a _StridedShard spec can contradict the shard order it encodes on
        # uneven shapes: refused where the two give other rows, and torch's data is one of them.
        assert str(e).startswith("ambiguous layout: _StridedShard in"), e
        coordinate = mesh.get_coordinate()
        readings = [shard_pieces(shape, mesh_shape, coordinate, dt.placements),
                    ordered_reading(shape, mesh_shape, coordinate, dt.placements,
                                    getattr(dt._spec, "shard_order", None))]
        assert readings[0] != readings[1]
        held = [sorted(v for p in r for v in full[box(p.global_offsets, p.sizes)].flatten().tolist()) for r in readings]
        assert sorted(local.flatten().tolist()) in held, (held, local)  # the elements are unique
        return "ambiguous", str(e)
    assert pieces == shard_pieces(shape, mesh_shape, mesh.get_coordinate(), placements)

    covered_locally = torch.zeros(local.shape, dtype=torch.int64)
    covered_globally = torch.zeros(shape, dtype=torch.int64)
    for p in pieces:
        assert all(p.sizes), f"empty piece {p}"
        assert torch.equal(full[box(p.global_offsets, p.sizes)], local[box(p.local_offsets, p.sizes)]), p
        covered_locally[box(p.local_offsets, p.sizes)] += 1
        covered_globally[box(p.global_offsets, p.sizes)] += 1
    assert bool((covered_locally == 1).all()), "pieces do not tile the local shard exactly once"
    assert bool((covered_globally <= 1).all()), "pieces overlap in the global tensor"
    return "ok", pieces


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pieces_match_torch_shards(world_size, data):
    shape, mesh_shape, placement_specs = data.draw(layouts(world_size))
    results = world.run(world_size, distribute_and_check, shape, mesh_shape, placement_specs)
    # Torch 2.6 and 2.7 refuse an uneven _StridedShard, on the ranks whose part is uneven.
    assume(all(status != "refused" for status, _ in results))
    assume(all(status == "ok" for status, _ in results))  # an ambiguous spec is refused where it is

    # Every element is held once per coordinate of the replicated mesh dims.
    replicas = math.prod(n for n, p in zip(mesh_shape, placement_specs, strict=True) if p[0] == "R")
    covered = torch.zeros(shape, dtype=torch.int64)
    for _, pieces in results:
        for p in pieces:
            covered[box(p.global_offsets, p.sizes)] += 1
    assert bool((covered == replicas).all())


def shard_order_full_tensor():
    """Shard dim 0 on mesh dim 1 before mesh dim 0 via shard_order; torch must gather it back."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry

    mesh = world.mesh((2, 2))
    full = torch.arange(14).reshape(7, 2)
    placements = (Shard(0), Shard(0))
    ref = distribute_tensor(full, mesh, placements)
    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    spec = DTensorSpec(mesh, placements, tensor_meta=ref._spec.tensor_meta, shard_order=order)
    # 7 rows: mesh dim 1 takes [0, 4) or [4, 7), mesh dim 0 then halves that.
    row_starts = {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 2), (1, 1): (6, 1)}
    start, rows = row_starts[tuple(mesh.get_coordinate())]
    dt = DTensor(full[start : start + rows].clone(), spec, requires_grad=False)
    assert dtensor_pieces(dt) == [piece((start, 0), (rows, 2), (0, 0))]
    assert torch.equal(dt.full_tensor(), full)


def test_dtensor_pieces_follow_shard_order():
    if not hasattr(importlib.import_module("torch.distributed.tensor._dtensor_spec"), "ShardOrderEntry"):
        pytest.skip("this torch has no DTensor shard_order")
    world.run(4, shard_order_full_tensor)


def test_strided_shard_with_the_shard_order_torch_derives_from_it():
    """Torch 2.10 keeps (_StridedShard(0, sf=2), Shard(0)) and records beside it shard_order
    (1, 0): the same layout told twice. Both readings agree, so the pieces are torch's."""
    for rows in (7, 8, 11):
        results = world.run(4, distribute_and_check, (rows, 3), (2, 2), (("SS", 0, 2), ("S", 0)))
        if rows % 4 and "refused" in [status for status, _ in results]:
            continue  # torch 2.6 and 2.7 refuse an uneven _StridedShard themselves
        assert [status for status, _ in results] == ["ok"] * 4, results


STRIDED_9 = ((9, 1, 1), (4, 2), (_StridedShard(0, split_factor=2), Shard(0)))


def _status_by_local_shape(coordinate, made_by) -> str:
    """"ok" where the readings of STRIDED_9 agree at `coordinate` or the local shape of the one that
    `made_by` ("left" or "ordered") says fits it alone, else "ambiguous"."""
    shape, mesh_shape, placements = STRIDED_9
    left = shard_pieces(shape, mesh_shape, coordinate, placements)
    ordered = ordered_reading(shape, mesh_shape, coordinate, placements, None)
    if left == ordered:
        return "ok"
    made = left if made_by == "left" else ordered
    held = layout.local_extent(made, 3) if made else (0, 1, 1)
    return "ok" if layout._fits(left, held) != layout._fits(ordered, held) else "ambiguous"


def test_uneven_strided_shard_where_torch_contradicts_its_shard_order():
    """(_StridedShard(0, sf=2), Shard(0)) of 9 rows on a 4 x 2 mesh encodes the shard order (1, 0),
    which puts row 8 on another coordinate than torch's own `distribute_tensor` does (torch 2.10
    records that order beside the spec, 2.15 derives it when asked). Where the readings differ, the
    local shard's shape says `distribute_tensor` made it (checked against torch's data in
    `distribute_and_check`)."""
    results = world.run(8, distribute_and_check, (9, 1, 1), (4, 2), (("SS", 0, 2), ("S", 0)))
    statuses = [status for status, _ in results]
    if "refused" in statuses:
        pytest.skip(f"this torch refuses the layout itself: {results}")
    shape, mesh_shape, placements = STRIDED_9
    coordinates = list(itertools.product(range(4), range(2)))
    differ = [r for r, c in enumerate(coordinates) if shard_pieces(shape, mesh_shape, c, placements)
              != ordered_reading(shape, mesh_shape, c, placements, None)]
    assert differ == ([1, 2, 3, 5, 6, 7] if layout._CHUNKS_STRIDE_WHOLE else [6, 7])
    assert statuses == [_status_by_local_shape(c, "left") for c in coordinates], results
    assert statuses == ["ok"] * 8 or layout._CHUNKS_STRIDE_WHOLE, results


def redistributed_pieces(rows: int):
    """The pieces of the 9-row spec above made by `redistribute`, which follows the encoded order."""
    from torch.distributed.tensor import Replicate as R

    mesh = world.mesh((4, 2))
    full = distribute_tensor(torch.arange(rows), mesh, [R(), R()])
    dt = full.redistribute(mesh, (_StridedShard(0, split_factor=2), Shard(0)))
    try:
        return "ok", dtensor_pieces(dt), dt.to_local().tolist()
    except InvalidArgumentError as e:
        return "ambiguous", str(e), dt.to_local().tolist()


def test_a_redistributed_uneven_strided_shard_is_read_by_its_local_shape():
    """The same spec made by `redistribute`: rank 7 holds row 8, which the left-to-right reading puts
    on rank 6. Before, torch 2.15 (no shard_order beside a _StridedShard) read it left to right only,
    so rank 7's pieces said it held nothing; now its one-row local shard says which reading made it."""
    if not hasattr(importlib.import_module("torch.distributed.tensor._dtensor_spec"), "ShardOrderEntry"):
        pytest.skip("this torch has no DTensor shard order")
    results = world.run(8, redistributed_pieces, 9)
    assert [s for s, _, _ in results] == ["ok"] * 8, results
    assert results[6][2] == [] and results[7][2] == [8]
    for _, pieces, held in results:
        assert [v for p in pieces for v in range(p.global_offsets[0], p.global_offsets[0] + p.sizes[0])] == held


def strided_9(made_by: str, rows: int, cols: int) -> DTensor:
    """A `rows` x `cols` tensor as STRIDED_9's spec, made by `distribute_tensor` ("left") or by
    `redistribute` ("ordered")."""
    from torch.distributed.tensor import Replicate as R

    mesh = world.mesh((4, 2))
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    placements = STRIDED_9[2]
    if made_by == "left":
        return world.distribute(full, mesh, placements)
    return world.distribute(full, mesh, [R(), R()]).redistribute(mesh, placements)


def save_strided_9(path: str, made_by: str, rows: int, cols: int) -> None:
    import olmo_chunks

    olmo_chunks.save({"w": strided_9(made_by, rows, cols)}, path)


def load_strided_9(path: str, made_by: str, rows: int, cols: int) -> bool:
    """Loads into zeros laid out as `strided_9` makes them; True where bit-exact."""
    import olmo_chunks

    want = strided_9(made_by, rows, cols)
    got = want.to_local().clone().zero_()
    dst = DTensor.from_local(got, want.device_mesh, want.placements, run_check=False, shape=want.shape,
                             stride=want.stride())
    olmo_chunks.load({"w": dst}, path)
    return torch.equal(got, want.to_local())


@pytest.mark.parametrize(("saved_by", "loaded_by"), [("ordered", "left"), ("left", "ordered"), ("ordered", "ordered")])
def test_uneven_strided_shards_save_and_load_by_their_local_shapes(tmp_path, saved_by, loaded_by):
    """FSDP2 over tensor parallelism keeps each TP shard's rows together (as `redistribute` does);
    `distribute_tensor` strides them. Both, of one uneven spec, save and load bit-exact into each
    other, and a single process reads the whole tensor back."""
    import olmo_chunks

    if not hasattr(importlib.import_module("torch.distributed.tensor._dtensor_spec"), "ShardOrderEntry"):
        pytest.skip("this torch has no DTensor shard order (nor a redistribute into this spec)")
    path = str(tmp_path / "ckpt")
    world.run(8, save_strided_9, path, saved_by, 9, 3)
    assert world.run(8, load_strided_9, path, loaded_by, 9, 3) == [True] * 8
    back = {"w": torch.zeros(9, 3)}
    olmo_chunks.load(back, path)
    assert torch.equal(back["w"], torch.arange(27, dtype=torch.float32).reshape(9, 3))


def test_same_sized_readings_of_other_rows_are_refused():
    """On a 3-D mesh the two readings of a _StridedShard spec can hold as many elements as each other,
    and other ones: 5 rows, (_StridedShard(0, sf=4), Shard(0), Shard(0)) on 2 x 2 x 2, coordinate
    (0, 1, 0) holds row 4 left to right and row 3 in the encoded order (1, 2, 0). No size check can
    tell them apart, so the spec is refused."""
    placements = (_StridedShard(0, split_factor=4), Shard(0), Shard(0))
    assert _strided_order(placements, (2, 2, 2), 1) == {0: [1, 2, 0]}
    assert shard_pieces((5,), (2, 2, 2), (0, 1, 0), placements) == [piece((4,), (1,), (0,))]
    assert ordered_reading((5,), (2, 2, 2), (0, 1, 0), placements, None) == [piece((3,), (1,), (0,))]
    with pytest.raises(InvalidArgumentError, match=r"ambiguous layout: _StridedShard in .* \(from its split factors\)"):
        spec_pieces((5,), (2, 2, 2), (0, 1, 0), placements, None)
    with pytest.raises(InvalidArgumentError, match=r"its local shard of shape \(1,\) fits both"):
        spec_pieces((5,), (2, 2, 2), (0, 1, 0), placements, None, (1,))
    with pytest.raises(InvalidArgumentError, match=r"its local shard of shape \(2,\) fits neither"):
        spec_pieces((5,), (2, 2, 2), (0, 1, 0), placements, None, (2,))
    # Even shapes: both readings agree everywhere.
    for coordinate in itertools.product(range(2), repeat=3):
        assert spec_pieces((8,), (2, 2, 2), coordinate, placements, None) == shard_pieces(
            (8,), (2, 2, 2), coordinate, placements)


def _torch_chunks(values: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`torch.chunk` into exactly `n` parts, empty ones last, as DTensor pads a short split."""
    parts = list(torch.chunk(values, n)) if len(values) else []
    return parts + [values[:0]] * (n - len(parts))


@settings(deadline=None, max_examples=400)
@given(data=st.data(), whole=st.booleans())
def test_strided_shard_splits_as_each_torch_does(data, whole):
    """`_strided_shard` of any held index sequence against torch's split, written with torch.chunk:
    from 2.10, chunk c of each n-way chunking of the sf chunks; before (`whole`), chunks c, c + n, ...
    of the n * sf-way chunking."""
    cuts = sorted(data.draw(st.lists(st.integers(0, 60), max_size=8, unique=True)))
    intervals = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b]
    n, sf = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    c = data.draw(st.integers(0, n - 1))
    held = torch.cat([torch.arange(a, b) for a, b in intervals]) if intervals else torch.arange(0)
    if whole:
        parts = _torch_chunks(held, n * sf)
        want = [parts[c + j * n] for j in range(sf)]
    else:
        want = [_torch_chunks(part, n)[c] for part in _torch_chunks(held, sf)]
    got = _strided_shard(intervals, n, c, sf, whole=whole)
    assert [v for a, b in got for v in range(a, b)] == torch.cat(want).tolist()


class _Sizes:
    """A mesh as torch's shard-order decoding sees it: its sizes."""

    def __init__(self, shape):
        self.shape = shape

    def size(self, mesh_dim):
        return self.shape[mesh_dim]


@settings(deadline=None, max_examples=300)
@given(data=st.data(), whole=st.booleans())
def test_even_splits_read_one_way(data, whole):
    """`splits_evenly` lets `readings_differ` skip its scan of every coordinate: where it holds,
    the scan finds no coordinate whose readings differ, on either release's split."""
    mesh_shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    choices = [Replicate()] + [Shard(d) for d in range(2)]
    choices += [_StridedShard(d, split_factor=sf) for d in range(2) for sf in (1, 2, 3, 4, 6)]
    placements = tuple(data.draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape),
                                          max_size=len(mesh_shape))))
    product = [math.prod(n for n, p in zip(mesh_shape, placements, strict=True)
                         if isinstance(p, Shard | _StridedShard) and p.dim == d)
               for d in range(2)]
    shape = tuple(k * data.draw(st.integers(0, 3)) for k in product)
    assert layout.splits_evenly(shape, mesh_shape, placements)
    with strided_split(whole):
        assert not layout._readings_differ(shape, mesh_shape, placements, None)


@settings(deadline=None, max_examples=300)
@given(data=st.data())
def test_strided_order_is_torchs_decoding(data):
    """`_strided_order` against torch's own decoding of split factors, where torch has one."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    decode = getattr(DTensorSpec, "_maybe_convert_StridedShard_to_shard_order", None)
    if decode is None:
        pytest.skip("this torch does not decode split factors into a shard order")
    mesh_shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    choices = [Replicate()] + [Shard(d) for d in range(2)]
    choices += [_StridedShard(d, split_factor=sf) for d in range(2) for sf in (1, 2, 3, 4, 6, 8)]
    placements = tuple(data.draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape),
                                          max_size=len(mesh_shape))))
    assume(any(isinstance(p, _StridedShard) for p in placements))
    theirs = decode(placements, _Sizes(mesh_shape))
    ours = _strided_order(placements, mesh_shape, 2)
    assert ours == (None if theirs is None else {entry.tensor_dim: list(entry.mesh_dims) for entry in theirs})


def ambiguous_spec_pieces():
    """_StridedShard(0, sf=3) read left to right and shard_order (1, 0) read as plain shards
    give other rows for 7 rows at some coordinate; no reading is right, so it is refused."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry

    mesh = world.mesh((2, 2))
    full = torch.arange(21).reshape(7, 3)
    placements = (_StridedShard(0, split_factor=3), Shard(0))
    ref = distribute_tensor(full, mesh, (Shard(0), Shard(0)))
    order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
    try:
        spec = DTensorSpec(mesh, placements, tensor_meta=ref._spec.tensor_meta, shard_order=order)
    except Exception as e:  # a torch that checks shard_order against the placements itself
        return "torch refused", f"{type(e).__name__}: {e}"
    dt = DTensor(ref.to_local(), spec, requires_grad=False)
    try:
        return "ours", dtensor_pieces(dt)
    except ValueError as e:
        return "refused", str(e)


def test_strided_shard_with_a_contrary_shard_order_is_refused():
    if not hasattr(importlib.import_module("torch.distributed.tensor._dtensor_spec"), "ShardOrderEntry"):
        pytest.skip("this torch has no DTensor shard_order")
    results = world.run(4, ambiguous_spec_pieces)
    if all(status == "torch refused" for status, _ in results):
        pytest.skip(f"torch refuses such a spec itself: {results[0][1]}")
    # Ranks where both readings agree hold what either says; the others refuse.
    coords = list(itertools.product(range(2), range(2)))
    placements = (_StridedShard(0, split_factor=3), Shard(0))
    for rank, (status, detail) in enumerate(results):
        left = shard_pieces((7, 3), (2, 2), coords[rank], placements)
        plain = _pieces((7, 3), (2, 2), coords[rank], (Shard(0), Shard(0)), (1, 0))
        if left == plain:
            assert (status, detail) == ("ours", left)
        else:
            assert status == "refused" and detail.startswith("ambiguous layout: _StridedShard in"), detail
    assert any(status == "refused" for status, _ in results)


def pieces_outside_mesh():
    """A rank outside the DTensor's mesh holds nothing."""
    mesh = DeviceMesh("cpu", [0, 1])
    dt = distribute_tensor(torch.arange(6), mesh, [Shard(0)])
    return dtensor_pieces(dt)


def test_rank_outside_the_mesh_has_no_pieces():
    assert world.run(4, pieces_outside_mesh) == [
        [piece((0,), (3,), (0,))],
        [piece((3,), (3,), (0,))],
        [],
        [],
    ]
