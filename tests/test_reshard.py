"""Save on N gloo ranks in one layout, load on M ranks in another: bit-exact, whatever the layouts."""

from __future__ import annotations

import itertools
import math

import olmo_chunks
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from olmo_chunks.errors import InvalidArgumentError
from olmo_chunks.layout import local_extent, shard_pieces, spec_pieces
from olmo_chunks.weights import dtensor_weight
from packaging.version import Version
from torch.distributed.tensor import DTensor

from tests import world
from tests.test_layout import build_placement, mesh_shapes, strided_rows, strided_split

DTYPES = ("float32", "bfloat16", "float16", "int64")
BITS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16, "int64": torch.int64}


def global_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads included) that only equal bits reproduce."""
    bits = BITS[dtype]
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits)
    return raw.view(getattr(torch, dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    dtype = str(a.dtype).removeprefix("torch.")
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(BITS[dtype]), b.view(BITS[dtype]))


def make_state(tensors, fill: bool) -> dict:
    """DTensors laid out as `tensors` says, holding the global data or zeros."""
    state = {}
    for key, (shape, dtype, seed, mesh_shape, specs) in tensors.items():
        full = global_tensor(shape, dtype, seed)
        if not fill:
            full = torch.zeros_like(full)
        if mesh_shape is None:
            state[key] = full
        else:
            placements = [build_placement(p) for p in specs]
            state[key] = world.distribute(full, world.mesh(mesh_shape), placements)
    return state


def save_layout(path: str, tensors, plain) -> None:
    state = make_state(tensors, fill=True)
    if plain is not None:
        state["extra"] = dict(plain)
    olmo_chunks.save(state, path)


def load_and_check(path: str, tensors, plain) -> list[str]:
    """Loads into zeroed tensors of the given layout; returns the keys that came back wrong."""
    state = make_state(tensors, fill=False)
    if plain is not None:
        state["extra"] = {k: None for k in plain}
    olmo_chunks.load(state, path)
    wrong = []
    for key, (shape, dtype, seed, _, _) in tensors.items():
        got = state[key]
        want = global_tensor(shape, dtype, seed)
        if isinstance(got, DTensor):
            expect = world.distribute(want, got.device_mesh, got.placements).to_local()
            got = got.to_local()
        else:
            expect = want
        if not same_bits(got, expect):
            wrong.append(key)
    if plain is not None and state["extra"] != dict(plain):
        wrong.append("extra")
    return wrong


@st.composite
def placement_specs(draw, ndim: int, mesh_ndim: int):
    choices = [("R",)] + [("S", d) for d in range(ndim)] + [("SS", d, sf) for d in range(ndim) for sf in (2, 3)]
    return tuple(draw(st.lists(st.sampled_from(choices), min_size=mesh_ndim, max_size=mesh_ndim)))


@st.composite
def layout(draw, world_size: int, shape: tuple[int, ...]):
    mesh_shape = draw(st.sampled_from(mesh_shapes(world_size)))
    return mesh_shape, draw(placement_specs(len(shape), len(mesh_shape)))


# Torch before 2.8 refuses an uneven _StridedShard itself (on the ranks whose part is uneven).
EVEN_STRIDED_ONLY = Version(torch.__version__).release < (2, 8)


def strided_ok(shape, specs, mesh_shape) -> bool:
    """Whether torch can lay a tensor of `shape` out as `specs` says (an empty dim is never strided,
    and before torch 2.8 a strided dim splits exactly at every sharding of it) and olmo-chunks takes
    it as unambiguous (`test_layout.py` checks those refusals)."""
    if any(p[0] == "SS" and not shape[p[1]] for p in specs):
        return False
    placements = tuple(build_placement(p) for p in specs)
    try:
        for coordinate in itertools.product(*map(range, mesh_shape)):
            # the local shard `world.distribute` makes (left to right), where it holds anything
            held = shard_pieces(shape, mesh_shape, coordinate, placements)
            local = local_extent(held, len(shape)) if held else None
            spec_pieces(shape, mesh_shape, coordinate, placements, None, local)
    except InvalidArgumentError:
        return False
    for d in {p[1] for p in specs if p[0] == "SS"} if EVEN_STRIDED_ONLY else ():
        parts = math.prod(n * (p[2] if p[0] == "SS" else 1) for n, p in zip(mesh_shape, specs, strict=True)
                          if p[0] != "R" and p[1] == d)
        if shape[d] % parts:
            return False
    return True


PAIRS = [(4, 2), (2, 4), (4, 3), (3, 1), (1, 4)]


@pytest.mark.parametrize(("n", "m"), PAIRS)
@settings(
    deadline=None, max_examples=12,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_resharded_load_is_bit_exact(tmp_path_factory, n, m, data):
    path = str(tmp_path_factory.mktemp("ckpt"))
    save_tensors, load_tensors = {}, {}
    for i in range(data.draw(st.integers(1, 3))):
        ndim = data.draw(st.integers(0, 3))
        shape = tuple(data.draw(st.lists(st.integers(0, 11), min_size=ndim, max_size=ndim)))
        dtype = data.draw(st.sampled_from(DTYPES))
        seed = data.draw(st.integers(0, 2**16))
        save_mesh, save_specs = data.draw(layout(n, shape))
        load_mesh, load_specs = data.draw(layout(m, shape))
        assume(strided_ok(shape, save_specs, save_mesh) and strided_ok(shape, load_specs, load_mesh))
        save_tensors[f"t{i}"] = (shape, dtype, seed, save_mesh, save_specs)
        load_tensors[f"t{i}"] = (shape, dtype, seed, load_mesh, load_specs)
    plain = {"step": data.draw(st.integers(0, 2**70)), "lr": data.draw(st.floats(allow_nan=False))}
    world.run(n, save_layout, path, save_tensors, plain)
    results = world.run(m, load_and_check, path, load_tensors, plain)
    assert results == [[]] * m


def test_plain_tensors_on_one_process_load_as_dtensors_and_back(tmp_path):
    """A single-process save of plain tensors loads as DTensors on 4 ranks, and back again."""
    first, second = str(tmp_path / "one"), str(tmp_path / "four")
    tensors = {"w": ((8, 5), "float32", 1), "b": ((7,), "bfloat16", 2)}
    olmo_chunks.save({k: global_tensor(*v) for k, v in tensors.items()}, first)
    layouts = {"w": ((2, 2), (("S", 1), ("SS", 0, 2))), "b": ((4,), (("S", 0),))}
    as_dtensors = {k: (*tensors[k], *layouts[k]) for k in tensors}
    assert world.run(4, load_and_check, first, as_dtensors, None) == [[]] * 4
    world.run(4, save_layout, second, as_dtensors, None)
    back = {k: torch.zeros_like(global_tensor(*v)) for k, v in tensors.items()}
    olmo_chunks.load(back, second)
    for k, v in tensors.items():
        assert same_bits(back[k], global_tensor(*v)), k


def test_replicated_chunks_are_written_once_and_balanced(tmp_path):
    path = str(tmp_path / "ckpt")
    tensors = {f"r{i}": ((64, 16), "float32", i, (4,), (("R",),)) for i in range(4)}
    world.run(4, save_layout, path, tensors, None)
    m = olmo_chunks._core.Manifest.open(path)
    assert [t.chunks for t in m.tensors] == [1, 1, 1, 1]
    sizes = [f.size for f in m.files]
    # Four equal replicated tensors over four replicas: one per rank, each written once.
    assert len(sizes) == 4 and sum(sizes) == 4 * 64 * 16 * 4
    assert world.run(4, load_and_check, path, tensors, None) == [[]] * 4


def test_1d_mesh_on_2d_mesh_shard_grid(tmp_path):
    """Shard(0) on 4 ranks -> a 2x2 Shard(0)xShard(1) grid on 4 ranks -> Shard(1) on 3 ranks."""
    path1, path2 = str(tmp_path / "a"), str(tmp_path / "b")
    shape = (37, 23)
    row = {"w": (shape, "float32", 7, (4,), (("S", 0),))}
    grid = {"w": (shape, "float32", 7, (2, 2), (("S", 0), ("S", 1)))}
    col = {"w": (shape, "float32", 7, (3,), (("S", 1),))}
    world.run(4, save_layout, path1, row, None)
    assert world.run(4, load_and_check, path1, grid, None) == [[]] * 4
    world.run(4, save_layout, path2, grid, None)
    assert world.run(3, load_and_check, path2, col, None) == [[]] * 3
    m = olmo_chunks._core.Manifest.open(path2)
    assert m.tensors[0].chunks == 4 and math.prod(shape) * 4 == m.tensors[0].nbytes


def fsdp_over_tp_worker(path: str, rows: int):
    """FSDP2 over tensor parallelism (dp 4 x tp 2) of a Linear with `rows` output rows: its weight is
    `(_StridedShard(0, sf=2), Shard(0))`, each TP shard's rows sharded over dp. Saves the state dict,
    loads it into a model made with other values; returns the placements, the local rows, and whether
    the loaded shard equals the saved one and the compute weight the weight the model was made with."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, rows, bias=False))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel()})
        fully_shard(m, mesh=mesh["dp"])
        return m

    saved = model(0)
    olmo_chunks.save({"model": saved.state_dict()}, path)
    loaded = model(1)
    olmo_chunks.load({"model": loaded.state_dict()}, path)
    w = saved[0].weight
    torch.manual_seed(0)
    truth = nn.Linear(3, rows, bias=False).weight.detach()
    # Its compute weight too, which needs every coordinate's rows: the ranks' shapes tell which reading
    # made it. (Not torch's `full_tensor()`: on 2.9.1 half the ranks wait in it for ever on this layout.)
    same = torch.equal(loaded[0].weight.to_local(), w.to_local()) and torch.equal(dtensor_weight(w), truth.bfloat16())
    return str(tuple(w.placements)), w.to_local().shape[0], same


@pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"), reason="this torch's FSDP2 needs an accelerator")
def test_fsdp2_over_tensor_parallel_with_uneven_rows_round_trips(tmp_path):
    """9 rows: FSDP2 keeps each TP shard's rows together (rank 6 holds none, rank 7 row 8), which
    `distribute_tensor` of the same spec would not. Before, that save failed at its commit
    (CorruptManifestError: "chunk 6: byte length 0 does not match its region"). Before torch 2.10,
    whose left-to-right split differs, rank 3's one row fits both readings: the other ranks' shapes
    tell which made it (refused as ambiguous until they were asked)."""
    path = str(tmp_path / "ckpt")
    results = world.run(8, fsdp_over_tp_worker, path, 9)
    assert {placements for placements, _, _ in results} == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))"}
    assert [n for _, n, _ in results] == [2, 1, 2, 1, 1, 1, 0, 1]
    assert all(same for _, _, same in results)
    back = {"model": {"0.weight": torch.zeros(9, 3)}}
    olmo_chunks.load(back, path)
    torch.manual_seed(0)
    assert torch.equal(back["model"]["0.weight"], torch.nn.Linear(3, 9, bias=False).weight.detach())


def strided_round_trip(path: str, mesh_shape: tuple[int, int], rows: int, made_by: str, whole: bool):
    """(rows, 2) cut by the `made_by` reading on a dp x tp mesh (`strided_rows`; torch 2.8/2.9's
    split where `whole`): saved, then loaded into the same layout and whole. Returns ("ok",
    bit-exact both times) or ("refused", message)."""
    mesh = world.mesh(mesh_shape)
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    with strided_split(whole):
        try:
            olmo_chunks.save({"w": strided_rows(full, mesh, made_by)}, path)
        except InvalidArgumentError as e:
            return "refused", str(e)
        back, whole_back = strided_rows(torch.zeros_like(full), mesh, made_by), torch.zeros_like(full)
        olmo_chunks.load({"w": back}, path)
        olmo_chunks.load({"w": whole_back}, path)
        return "ok", (torch.equal(back.to_local(), strided_rows(full, mesh, made_by).to_local())
                      and torch.equal(whole_back, full))


@pytest.mark.parametrize("made_by", ["left to right", "ordered"])
def test_a_strided_shard_that_fits_both_readings_here_is_decided_by_the_other_ranks(tmp_path, made_by):
    """7 rows on 3 x 2, split as torch 2.8/2.9 do: on some rank the two readings of the spec hold
    other rows of the same shape, so its own shard cannot tell which made the tensor; the others'
    shapes do. The save and the load agree it in their first step (rank 0 takes the agreed
    reading's regions from a rank that sent both). Before, that rank refused both as ambiguous."""
    results = world.run(6, strided_round_trip, str(tmp_path / "ckpt"), (3, 2), 7, made_by, True)
    assert results == [("ok", True)] * 6


def test_a_strided_shard_that_every_rank_fits_both_ways_is_refused(tmp_path):
    """5 rows on 2 x 2, split as torch 2.8/2.9 do: the readings hold other rows at some rank and
    the same shapes at every rank; refused on every rank, nothing written."""
    path = tmp_path / "ckpt"
    for status, message in world.run(4, strided_round_trip, str(path), (2, 2), 5, "ordered", True):
        assert status == "refused"
        assert message.startswith("ambiguous layout of 'w': every rank's local shard fits both readings"), message
    assert not path.exists() or not any(path.iterdir())
