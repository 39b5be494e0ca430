"""The DCP front door: ChunkStoreWriter / ChunkStoreReader / FastLoadPlanner and import-dcp, on
real gloo worlds, against the native front door and against DCP's own planner and storage."""

from __future__ import annotations

import inspect
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import olmo_chunks
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from olmo_chunks import _core, values
from olmo_chunks.cli import main as cli_main
from olmo_chunks.dcp import (
    ChunkStoreReader,
    ChunkStoreWriter,
    FastLoadPlanner,
    dcp_leaves,
    group_entries,
    import_dcp,
    read_items_for_chunk_lists,
)
from olmo_chunks.errors import InvalidArgumentError, UnsupportedFormatError
from olmo_chunks.shards import TensorShard
from olmo_chunks.tree import flatten
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests import world

# single-process DCP calls (**world.NO_DIST) warn that they run without a process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# ------------------------------------------------------------------------------------------------
# Plain values: the DCP door groups them exactly as the native door does
# ------------------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=4)
)
_names = st.text("abcxyz_", min_size=1, max_size=3)


def _tree(leaf):
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=3), st.tuples(kids, kids), st.dictionaries(_names, kids, max_size=3)
        ),
        max_leaves=8,
    )


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_names, _tree(st.one_of(_scalars, st.just("TENSOR"))), min_size=1, max_size=4))
def test_plain_values_are_grouped_like_the_native_door(raw):
    """DCP flattens every mapping; the native door keeps tensor-free containers whole. Grouping the
    DCP leaves gives the native entries, and expanding those gives the DCP leaves back."""

    def tensors_in(v):
        if v == "TENSOR":
            return torch.zeros(1)
        if isinstance(v, dict):
            return {k: tensors_in(x) for k, x in v.items()}
        if isinstance(v, list):
            return [tensors_in(x) for x in v]
        return v

    sd = tensors_in(raw)
    flat, paths = flatten_state_dict(sd)
    tensor_keys = [k for k, v in flat.items() if isinstance(v, torch.Tensor)]
    if any(isinstance(v, (tuple, list, dict)) and _has_tensor(v) for v in flat.values()):
        return  # a tensor inside a tuple: DCP would pickle it, not a plain value
    leaves = {k: values.encode(v, k) for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    grouped = group_entries(leaves, paths, tensor_keys)
    native = {k: values.encode(leaf.value, k) for k, leaf in flatten(sd).items() if not leaf.is_tensor}
    # A list emptied of everything DCP visits cannot be rebuilt; such values are not plain leaves.
    if any(_has_empty_dict(v) for v in raw.values()):
        return
    assert grouped == native
    back = {}
    for key, enc in grouped.items():
        for fqn, (path, v) in dcp_leaves(key, values.decode(enc)).items():
            back[fqn] = (path, v)
    assert {k: values.encode(v, k) for k, (_, v) in back.items()} == leaves
    # object paths are known within an entry; the entry's own key is one opaque component
    assert all(tuple(paths[k][-len(p) + 1 :]) == p[1:] for k, (p, _) in back.items() if len(p) > 1)


def _has_tensor(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def _has_empty_dict(v) -> bool:
    if isinstance(v, dict):
        return not v or any(_has_empty_dict(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_empty_dict(x) for x in v)
    return False


# ------------------------------------------------------------------------------------------------
# FastLoadPlanner: the same read items as DCP's planner over random layouts
# ------------------------------------------------------------------------------------------------


@st.composite
def _tiling(draw, shape, max_depth=4):
    """A random guillotine tiling of `shape` (grids and irregular layouts alike)."""

    def split(off, size, depth):
        if depth == 0 or not shape or draw(st.integers(0, 3)) == 0:
            return [(off, size)]
        d = draw(st.integers(0, len(shape) - 1))
        if size[d] < 2:
            return [(off, size)]
        parts = sorted(set(draw(st.lists(st.integers(1, size[d] - 1), min_size=1, max_size=3))))
        out, lo = [], 0
        for hi in [*parts, size[d]]:
            o, s = list(off), list(size)
            o[d], s[d] = off[d] + lo, hi - lo
            out += split(o, s, depth - 1)
            lo = hi
        return out

    return split([0] * len(shape), list(shape), max_depth)


@st.composite
def _layout(draw):
    shape = draw(st.lists(st.integers(1, 12), min_size=0, max_size=3))
    saved = draw(_tiling(shape))
    local = draw(_tiling(shape))
    keep = draw(st.lists(st.booleans(), min_size=len(local), max_size=len(local)))
    local = [b for b, k in zip(local, keep, strict=True) if k] or local[:1]
    if shape and draw(st.booleans()):  # an empty local chunk, as uneven DTensor shards give
        local.append(([shape[0]] + [0] * (len(shape) - 1), [0] * len(shape)))
    return shape, saved, local


def _chunks(boxes):
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]


def _item_key(r):
    return (
        r.type,
        r.dest_index.fqn,
        tuple(r.dest_index.offset or ()),
        r.dest_index.index,
        tuple(r.dest_offsets),
        r.storage_index.fqn,
        tuple(r.storage_index.offset or ()),
        r.storage_index.index,
        tuple(r.storage_offsets),
        tuple(r.lengths),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(_layout(), min_size=1, max_size=3))
def test_fast_read_items_equal_dcp_read_items(layouts):
    batch, expected = [], []
    for i, (shape, saved, local) in enumerate(layouts):
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), _chunks(saved))
        expected.append(sorted(map(_item_key, create_read_items_for_chunk_list(f"t{i}", md, _chunks(local)))))
        batch.append((f"t{i}", torch.Size(shape), _chunks(saved), _chunks(local)))
    got = [sorted(map(_item_key, items)) for items in read_items_for_chunk_lists(batch)]
    assert got == expected


def test_fast_read_items_on_a_large_2d_grid():
    """Every 97th block of a 48x40 grid read from a 64x64 saved grid (unaligned band edges): the
    same read items as DCP's sweep line."""
    n = 768

    def grid(r, c):
        return [
            ([i * n // r, j * n // c], [(i + 1) * n // r - i * n // r, (j + 1) * n // c - j * n // c])
            for i in range(r)
            for j in range(c)
        ]

    saved, local = _chunks(grid(64, 64)), _chunks(grid(48, 40)[::97])
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n, n]), saved)
    expected = sorted(map(_item_key, create_read_items_for_chunk_list("w", md, local)))
    (got,) = read_items_for_chunk_lists([("w", torch.Size([n, n]), saved, local)])
    assert sorted(map(_item_key, got)) == expected


@st.composite
def _dtensor_layouts(draw, world_size: int, n: int):
    """`n` tensors, each (shape, mesh shape, placement specs): Replicate / Shard, uneven and empty
    shards included (DCP describes a _StridedShard by its first index only, so none here)."""
    meshes = [(world_size,), (1, world_size), (world_size, 1)] + (
        [(2, world_size // 2)] if world_size % 2 == 0 else []
    )
    out = []
    for _ in range(n):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        mesh = draw(st.sampled_from(meshes))
        choices = [("R",)] + [("S", d) for d in range(ndim)]
        specs = tuple(draw(st.lists(st.sampled_from(choices), min_size=len(mesh), max_size=len(mesh))))
        out.append((shape, mesh, specs))
    return out


def _layout_state(layouts, fill: bool) -> dict:
    sd = {}
    for i, (shape, mesh, specs) in enumerate(layouts):
        full = _full(shape, torch.float32, 50 + i) if fill else torch.zeros(shape)
        placements = [Replicate() if sp[0] == "R" else Shard(sp[1]) for sp in specs]
        sd[f"t{i}"] = world.distribute(full, world.mesh(mesh), placements)
    return sd


def layout_save_worker(path: str, layouts) -> None:
    dcp.save(_layout_state(layouts, True), storage_writer=ChunkStoreWriter(path))


def planners_agree_worker(path: str, layouts) -> tuple[bool, bool, bool]:
    """(same read items, FastLoadPlanner data right, DefaultLoadPlanner data right) on this rank."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    md = ChunkStoreReader(path).read_metadata()
    plans = []
    for planner in (DefaultLoadPlanner(), FastLoadPlanner()):
        planner.set_up_planner(_layout_state(layouts, False), md, dist.get_rank() == 0)
        plans.append(sorted(map(_item_key, planner.create_local_plan().items)))
    ok = []
    for planner in (FastLoadPlanner(), None):
        sd = _layout_state(layouts, False)
        dcp.load(sd, storage_reader=ChunkStoreReader(path), planner=planner)
        want = _layout_state(layouts, True)
        ok.append(all(torch.equal(sd[k].to_local(), want[k].to_local()) for k in want))
    return plans[0] == plans[1], ok[0], ok[1]


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_fast_planner_equals_default_planner_on_random_dtensor_layouts(tmp_path_factory, data):
    saved = data.draw(_dtensor_layouts(4, 3))
    loaded = [
        (shape, *rest)
        for (shape, _, _), rest in zip(
            saved, [(m, sp) for _, m, sp in data.draw(_dtensor_layouts(3, 3))], strict=True
        )
    ]
    # same shapes on both sides; the load layout's specs must fit the shape's rank
    loaded = [
        (shape, mesh, tuple(sp if sp[0] == "R" or sp[1] < len(shape) else ("R",) for sp in specs))
        for shape, mesh, specs in loaded
    ]
    path = str(tmp_path_factory.mktemp("layouts"))
    world.run(4, layout_save_worker, path, saved)
    assert world.run(3, planners_agree_worker, path, loaded) == [(True, True, True)] * 3


# ------------------------------------------------------------------------------------------------
# Multi-rank: one format, two front doors
# ------------------------------------------------------------------------------------------------


def _full(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64).to(dtype)


# key -> (shape, dtype, seed); layouts say how each rank holds it.
TENSORS = {
    "model.w": ((10, 6), torch.float32, 1),
    "model.m": ((7, 9), torch.bfloat16, 2),
    "model.r": ((5,), torch.int64, 3),
    "model.s": ((), torch.float32, 4),
    "optim.state.w.exp_avg": ((10, 6), torch.float32, 5),
}

SAVE_LAYOUT = {  # on 4 ranks
    "model.w": ((4,), [Shard(0)]),
    "model.m": ((2, 2), [Shard(0), Shard(1)]),
    "model.r": None,
    "model.s": None,
    "optim.state.w.exp_avg": ((2, 2), [Shard(1), Replicate()]),
}
LOAD_LAYOUT = {  # on 3 ranks
    "model.w": ((3,), [Shard(1)]),
    "model.m": ((3,), [Shard(0)]),
    "model.r": ((3,), [Shard(0)]),
    "model.s": None,
    "optim.state.w.exp_avg": ((3,), [Replicate()]),
}


def _state(layout, fill: bool) -> dict:
    sd: dict = {"model": {}, "optim": {"state": {"w": {}}}}
    for key, (shape, dtype, seed) in TENSORS.items():
        full = _full(shape, dtype, seed)
        if not fill:
            full = torch.zeros_like(full)
        spec = layout[key]
        value = (
            full
            if spec is None
            else world.distribute(full, world.mesh(spec[0]), spec[1])
        )
        *parents, leaf = key.split(".")
        node = sd
        for p in parents:
            node = node[p]
        node[leaf] = value
    sd["optim"]["param_groups"] = (
        [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]
        if fill
        else [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]
    )
    sd["step"] = 7 if fill else 0
    sd["meta"] = {"name": "run", "seeds": [1, 2, 3]} if fill else {"name": "", "seeds": []}
    return sd


def _wrong(sd) -> list[str]:
    """Keys of `sd` that differ from the reference data (bit-exact) or plain values."""
    bad = []
    for key, (shape, dtype, seed) in TENSORS.items():
        node = sd
        for p in key.split("."):
            node = node[p]
        full = _full(shape, dtype, seed)
        if isinstance(node, DTensor):
            want = world.distribute(full, node.device_mesh, node.placements).to_local()
            got = node.to_local()
        else:
            want, got = full, node
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(key)
    if sd["optim"]["param_groups"] != [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]:
        bad.append(f"param_groups={sd['optim']['param_groups']}")
    if sd["step"] != 7 or sd["meta"] != {"name": "run", "seeds": [1, 2, 3]}:
        bad.append(f"plain={sd['step']}, {sd['meta']}")
    return bad


def dcp_save_worker(path: str) -> None:
    dcp.save(_state(SAVE_LAYOUT, True), storage_writer=ChunkStoreWriter(path))


def load_both_doors_worker(path: str) -> dict[str, list[str]]:
    out = {}
    sd = _state(LOAD_LAYOUT, False)
    olmo_chunks.load(sd, path)
    out["native"] = _wrong(sd)
    for name, planner in (("dcp-default", None), ("dcp-fast", FastLoadPlanner())):
        sd = _state(LOAD_LAYOUT, False)
        dcp.load(sd, storage_reader=ChunkStoreReader(path), planner=planner)
        out[name] = _wrong(sd)
    return out


def native_save_worker(path: str) -> None:
    olmo_chunks.save(_state(SAVE_LAYOUT, True), path)


def test_dcp_save_loads_through_both_doors_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    world.run(4, dcp_save_worker, path)
    m = _core.Manifest.open(path)
    roles = {t.key: t.role for t in m.tensors}
    assert roles == {
        "model.w": "main_weight",
        "model.m": "main_weight",
        "model.r": "tensor",
        "model.s": "main_weight",
        "optim.state.w.exp_avg": "exp_avg",
    }
    # replicated chunks are written once: exact coverage holds, so nothing is duplicated
    m.check_coverage()
    assert sorted(f.path for f in m.files) == [f"data/{m.save_id}/rank-{r:05d}.bin" for r in range(4)]
    for result in world.run(3, load_both_doors_worker, path):
        assert result == {"native": [], "dcp-default": [], "dcp-fast": []}


def test_native_save_loads_through_the_dcp_door(tmp_path):
    path = str(tmp_path / "ckpt")
    world.run(4, native_save_worker, path)
    for result in world.run(3, load_both_doors_worker, path):
        assert result == {"native": [], "dcp-default": [], "dcp-fast": []}


def verify_unlike_rank_0_worker(path: str) -> None:
    sd = _state(LOAD_LAYOUT, False)
    reader = ChunkStoreReader(path, verify=dist.get_rank() == 0)
    dcp.load(sd, storage_reader=reader, planner=FastLoadPlanner())


def test_the_dcp_door_refuses_ranks_that_differ_on_verify(tmp_path):
    # A rank that does not verify would vouch for unchecked bytes: as a block's reader (read once)
    # or its checker for the host (read directly). `olmo_chunks.load` compares `verify` in its
    # first step; the DCP door compares it where the ranks say what they need.
    path = str(tmp_path / "ckpt")
    world.run(4, native_save_worker, path)
    with pytest.raises(world.WorldError) as err:
        world.run(3, verify_unlike_rank_0_worker, path)
    messages = [f.message for f in err.value.failures]
    assert len(messages) == 3 and all("rank 1 passed verify=False, rank 0 verify=True" in m for m in messages), messages


def dcp_groups_worker(root: str) -> dict[str, Any]:
    """DCP on this process alone (`no_dist=True`, a group of one) and on pairs of ranks, with the
    writer and reader on the world of 4 (given no group)."""
    rank = dist.get_rank()
    ones = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    whole = torch.arange(8.0)
    dcp.save({"w": distribute_tensor(whole, world.mesh((4,)), [Shard(0)])},
             storage_writer=ChunkStoreWriter(f"{root}/world"))
    out: dict[str, Any] = {}
    for how, kw in [("no_dist", world.NO_DIST), ("group of one", {"process_group": ones[rank]})]:
        if not kw:
            continue  # torch 2.6's dcp.save has no no_dist
        mine = {"w": torch.arange(6.0) + 10 * rank, "step": rank}
        dcp.save(mine, storage_writer=ChunkStoreWriter(f"{root}/{how}/{rank}"), **kw)
        back = {"w": torch.zeros(6), "step": -1}
        dcp.load(back, storage_reader=ChunkStoreReader(f"{root}/{how}/{rank}"), **kw)
        alone = {"w": torch.zeros(8)}  # the world's checkpoint, read whole by this rank alone
        dcp.load(alone, storage_reader=ChunkStoreReader(f"{root}/world"), **kw)
        out[how] = torch.equal(back["w"], mine["w"]) and back["step"] == rank and torch.equal(alone["w"], whole)
    for what in ("save", "load"):
        try:
            if what == "save":
                dcp.save({"w": torch.ones(2)}, storage_writer=ChunkStoreWriter(f"{root}/pair{rank // 2}"),
                         process_group=pairs[rank // 2])
            else:
                dcp.load({"w": torch.zeros(8)}, storage_reader=ChunkStoreReader(f"{root}/world"),
                         process_group=pairs[rank // 2])
            out[what] = "no error"
        except CheckpointException as exc:
            out[what] = sorted({f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()})
    return out


@pytest.mark.skipif("global_coordinator_rank" not in inspect.getsource(_DistWrapper.__init__),
                    reason="this torch's DCP takes coordinator_rank for a global rank: it fails on any group without "
                           "global rank 0 (torch 2.6)")
def test_dcp_on_this_process_alone_and_on_another_group(tmp_path):
    """A DCP call on this process alone (`no_dist=True`, or a group of one, as a conversion on one
    rank of a job makes) saves and loads with the writer and reader on the job's group, where
    they refused until 2026-12-07 (they waited for the others' plans); a DCP call on another group
    of several ranks is refused on every rank, and nothing is saved."""
    refused = [f"InvalidArgumentError: {who}: DCP runs on another process group than this {who}'s; pass the "
               f"process_group given to dcp to {who}(..., process_group=...) too"
               for who in ("ChunkStoreWriter", "ChunkStoreReader")]
    ways = {"no_dist": True} if world.NO_DIST else {}
    assert world.run(4, dcp_groups_worker, str(tmp_path)) == [
        {**ways, "group of one": True, "save": [refused[0]], "load": [refused[1]]}] * 4
    assert not any((tmp_path / f"pair{i}" / _core.MANIFEST_NAME).exists() for i in range(2))
    m = _core.Manifest.open(str(tmp_path / "group of one" / "3"))
    assert values.parse_json(m.info_json, "info")["world_size"] == 1


def test_cli_inspects_and_verifies_both_formats(tmp_path, capsys):
    a, b = str(tmp_path / "dcp"), str(tmp_path / "native")
    world.run(4, dcp_save_worker, a)
    world.run(4, native_save_worker, b)
    for path in (a, b):
        assert cli_main(["verify", path]) == 0
        assert cli_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert out.count("exact coverage") == 2 and "optim.state.w.exp_avg" in out


class _FlatHalves:
    """A ChunkSource holding flat ranges of the canonical order (as expert flat views do)."""

    def __init__(self, full: torch.Tensor, rank: int, size: int) -> None:
        n = full.numel()
        self.start, self.stop = rank * n // size, (rank + 1) * n // size
        self.full_shape, self.local = tuple(full.shape), full.reshape(-1)[self.start : self.stop].clone()

    def tensor_shard(self) -> TensorShard:
        return TensorShard(
            self.local.dtype, self.full_shape, self.local, [], [(self.start, self.stop - self.start, 0)]
        )


def flat_save_worker(path: str) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    olmo_chunks.save({"experts.w1": _FlatHalves(_full((5, 7, 3), torch.float32, 9), rank, size)}, path)


def flat_dcp_load_worker(path: str) -> bool:
    full = _full((5, 7, 3), torch.float32, 9)
    mesh = world.mesh((3,))
    ok = True
    for placements in ([Shard(1)], [Shard(2)], [Replicate()]):
        for planner in (None, FastLoadPlanner()):
            dt = world.distribute(torch.zeros_like(full), mesh, placements)
            dcp.load({"experts": {"w1": dt}}, storage_reader=ChunkStoreReader(path), planner=planner)
            want = world.distribute(full, mesh, placements).to_local()
            ok &= torch.equal(dt.to_local(), want)
    return ok


def test_flat_range_chunks_load_through_the_dcp_door(tmp_path):
    """Flat ranges are presented to DCP as the boxes they decompose into."""
    path = str(tmp_path / "ckpt")
    world.run(2, flat_save_worker, path)
    kinds = {type(c.region) for c in _core.Manifest.open(path).chunks(0)}
    assert kinds == {_core.Flat}
    assert world.run(3, flat_dcp_load_worker, path) == [True, True, True]


def async_and_id_worker(root: str) -> list[bool]:
    out = []
    sd = _state(SAVE_LAYOUT_2, True)
    fut = dcp.async_save(sd, checkpoint_id=f"{root}/a", storage_writer=ChunkStoreWriter())
    fut.result()
    writer = ChunkStoreWriter(f"{root}/unused")
    dcp.save(sd, checkpoint_id=f"{root}/b", storage_writer=writer)
    for sub in ("a", "b"):
        back = _state(SAVE_LAYOUT_2, False)
        dcp.load(back, checkpoint_id=f"{root}/{sub}", storage_reader=ChunkStoreReader())
        out.append(_wrong(back) == [])
    # saving again into the same directory replaces the checkpoint and removes the old data
    dcp.save(sd, storage_writer=ChunkStoreWriter(f"{root}/b"))
    dist.barrier()
    out.append(len(os.listdir(f"{root}/b/data")) == 1)
    return out


SAVE_LAYOUT_2 = {
    "model.w": ((2,), [Shard(1)]),
    "model.m": ((2,), [Shard(0)]),
    "model.r": None,
    "model.s": None,
    "optim.state.w.exp_avg": ((2,), [Replicate()]),
}


def test_async_save_and_checkpoint_id(tmp_path):
    assert world.run(2, async_and_id_worker, str(tmp_path)) == [[True, True, True]] * 2
    assert ChunkStoreReader.validate_checkpoint_id(tmp_path / "a")
    assert not ChunkStoreReader.validate_checkpoint_id(tmp_path / "nothing")
    assert ChunkStoreWriter.validate_checkpoint_id(tmp_path / "new")


class Opaque:
    pass


def test_non_plain_values_are_refused_on_save(tmp_path):
    sd = {"w": torch.ones(3), "obj": Opaque()}
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=ChunkStoreWriter(tmp_path / "x"), **world.NO_DIST)
    assert [type(exc) for exc, _ in info.value.failures.values()] == [InvalidArgumentError]
    assert not (tmp_path / "x" / _core.MANIFEST_NAME).exists()


_PLAIN = {
    "empty bytes": b"",
    "bytes": b"\x00\xff",
    "empty BytesIO": io.BytesIO(),
    "BytesIO": io.BytesIO(b"abc"),
    "empty array": np.zeros(0),
    "empty 2-d array": np.zeros((2, 0), dtype=np.uint8),
    "array": np.arange(6, dtype=np.int16).reshape(2, 3),
    "list": [b"", (1, "x"), None, float("inf"), 2**70],
}


def _same_value(a, b) -> bool:
    if isinstance(a, io.BytesIO) or isinstance(b, io.BytesIO):
        return type(a) is type(b) and a.getvalue() == b.getvalue()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", list(_PLAIN))
def test_plain_values_load_back_as_through_dcps_own_storage(tmp_path, name):
    """Each plain value comes back through ChunkStoreWriter/Reader as through FileSystemWriter/
    Reader, type and all. Empty bytes (an empty BytesIO's or numpy array's data too) are pickled
    by DCP as a call of `bytes`, which the writer refused until 2026-12-07."""
    got = {}
    for kind, writer, reader in [("stock", dcp.FileSystemWriter, dcp.FileSystemReader),
                                 ("ours", ChunkStoreWriter, ChunkStoreReader)]:
        path = tmp_path / kind
        dcp.save({"w": torch.ones(2), "v": _PLAIN[name]}, storage_writer=writer(path), **world.NO_DIST)
        back = {"w": torch.zeros(2), "v": None}
        dcp.load(back, storage_reader=reader(path), **world.NO_DIST)
        assert torch.equal(back["w"], torch.ones(2))
        got[kind] = back["v"]
    assert _same_value(got["ours"], _PLAIN[name]) and _same_value(got["ours"], got["stock"])


def test_a_whole_state_dict_loads_back_nested_as_saved(tmp_path):
    """`_EmptyStateDictLoadPlanner` (how `dcp_to_torch_save` reads a checkpoint whole) rebuilds
    the nesting from the reader's object paths: keys starting with `$` keep theirs, as they do
    through FileSystemReader (the paths came back still encoded, so the nesting was lost or the
    load failed on a `TypeError`, until 2026-12-07)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {"$x": 3, "m": {"w": torch.ones(2), "$y": [1, b""]}, "$dict": torch.arange(3), "n": {"$z": {"k": 1.5}}}
    got = {}
    for kind, writer, reader in [("stock", dcp.FileSystemWriter, dcp.FileSystemReader),
                                 ("ours", ChunkStoreWriter, ChunkStoreReader)]:
        dcp.save(sd, storage_writer=writer(tmp_path / kind), **world.NO_DIST)
        got[kind] = {}
        _load_state_dict(got[kind], storage_reader=reader(tmp_path / kind), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    assert got["ours"].keys() == got["stock"].keys() == sd.keys()
    assert torch.equal(got["ours"]["m"]["w"], sd["m"]["w"]) and torch.equal(got["ours"]["$dict"], sd["$dict"])
    assert got["ours"]["m"]["$y"] == got["stock"]["m"]["$y"] == [1, b""]
    assert got["ours"]["n"] == got["stock"]["n"] == {"$z": {"k": 1.5}} and got["ours"]["$x"] == 3


def test_a_pickled_call_of_bytes_with_a_size_is_refused():
    """Empty bytes unpickle through a call of `bytes()`; a crafted value that calls `bytes(n)` (a
    DCP checkpoint given to import-dcp is untrusted) is refused before anything is allocated."""
    from olmo_chunks.dcp.values import encode_object

    buf = io.BytesIO()
    torch.save(b"", buf, _use_new_zipfile_serialization=False)  # its pickles in plain sight
    call = b"c__builtin__\nbytes\nq\x00)R"  # bytes()
    assert buf.getvalue().count(call) == 1 and encode_object("v", buf.getvalue()) == {"$bytes": ""}
    crafted = buf.getvalue().replace(call, b"c__builtin__\nbytes\nq\x00J\x00\x00\x00\x7f\x85R")  # bytes(2**31 - 2**24)
    with pytest.raises(InvalidArgumentError, match=r"'v': only plain values.*\(bytes\(\) with arguments\)"):
        encode_object("v", crafted)


def _cached_planner():
    """OLMo-core's save planner: DCP caches its plans per planner class across saves."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=True, enable_plan_caching=True)


def _clear_plan_cache() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
        cache.clear()


def plan_cache_worker(root: str, stock_first: bool) -> list[str]:
    """Saves through one cached planner class, alternating FileSystemWriter and ChunkStoreWriter
    (new paths, and twice over one path), each save with new values; then loads every checkpoint
    back. Returns the mismatches (none expected)."""
    _clear_plan_cache()
    m = world.mesh((2,))
    sd = {
        "w": distribute_tensor(torch.zeros(4, 3), m, [Shard(0)]),
        "r": distribute_tensor(torch.zeros(5), m, [Replicate()]),
        "step": 0,
    }
    kinds = ["stock", "ours", "ours", "stock", "ours", "ours-again"]
    if not stock_first:
        kinds = [k for k in kinds if k != "stock"] + ["stock"]
    saves = []
    for i, kind in enumerate(kinds):
        with torch.no_grad():
            sd["w"].to_local().copy_(torch.arange(6.0).reshape(2, 3) + 100 * i + 10 * dist.get_rank())
            sd["r"].to_local().copy_(torch.arange(5.0) * i)
        sd["step"] = i
        path = f"{root}/{kind.replace('-again', '')}{i if kind != 'ours-again' else i - 1}"
        writer = dcp.FileSystemWriter(path) if kind == "stock" else ChunkStoreWriter(path, overwrite=True)
        dcp.save(sd, storage_writer=writer, planner=_cached_planner())
        saves.append((kind, path, sd["w"].full_tensor().clone(), sd["r"].full_tensor().clone(), i))
    wrong = []
    for kind, path, w, r, i in saves:
        if kind == "ours" and any(k == "ours-again" and p == path for k, p, *_ in saves):
            continue  # overwritten by the next save
        back = {
            "w": distribute_tensor(torch.zeros(4, 3), m, [Shard(1)]),
            "r": distribute_tensor(torch.zeros(5), m, [Replicate()]),
            "step": -1,
        }
        reader = dcp.FileSystemReader(path) if kind == "stock" else ChunkStoreReader(path)
        dcp.load(back, storage_reader=reader)
        if not (torch.equal(back["w"].full_tensor(), w) and torch.equal(back["r"].full_tensor(), r)):
            wrong.append(f"{kind} {path}: tensors differ")
        if back["step"] != i:
            wrong.append(f"{kind} {path}: step {back['step']} != {i}")
    return wrong


@pytest.mark.parametrize("stock_first", [True, False])
def test_cached_save_plans_get_a_new_save_id_every_save(tmp_path, stock_first):
    """DCP's plan cache (enable_plan_caching, keyed by planner class, as OLMo-core saves) replays a
    rank's plan from an earlier save, stock or ours: every save still commits under its own id and
    every checkpoint, stock and ours, loads back bit-exact (resharded)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    if not hasattr(SavePlanner, "_cached_save_plan"):
        pytest.skip("this torch's DCP caches no save plans (torch 2.6)")
    assert world.run(2, plan_cache_worker, str(tmp_path), stock_first) == [[], []]
    ours = [p for p in tmp_path.iterdir() if p.name.startswith("ours")]
    ids = [_core.Manifest.open(str(p)).save_id for p in ours]
    assert len(ours) == 3 and len(set(ids)) == 3
    # each holds only its committed save's data (the one saved twice: the second save's)
    assert [[d.name for d in (p / "data").iterdir()] for p in ours] == [[i] for i in ids]


def test_tied_weights_load_into_their_one_tensor(tmp_path):
    """Two keys, one tensor (tied embeddings): both reads land, neither trips the core's check
    that destinations do not overlap."""
    w = _full((4, 3), torch.float32, 12)
    dcp.save({"embed.weight": w, "head.weight": w}, storage_writer=ChunkStoreWriter(tmp_path), **world.NO_DIST)
    tied = torch.zeros(4, 3)
    dcp.load(
        {"embed.weight": tied, "head.weight": tied},
        storage_reader=ChunkStoreReader(tmp_path),
        planner=FastLoadPlanner(),
        **world.NO_DIST,
    )
    assert torch.equal(tied, w)


def test_fast_planner_reads_checkpoints_keyed_by_torch_2_3(tmp_path):
    """torch <= 2.3 kept tensor-free dicts whole ("cfg", not "cfg.lr"); like DefaultLoadPlanner,
    FastLoadPlanner falls back to that flattening when the checkpoint's keys call for it."""
    from torch.distributed.checkpoint import _version

    _version._derived_version = "2_3"
    try:
        dcp.save(
            {"w": torch.arange(3.0), "cfg": {"lr": 0.5}},
            storage_writer=dcp.FileSystemWriter(tmp_path),
            **world.NO_DIST,
        )
    finally:
        _version._derived_version = None
    assert "cfg" in dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    sd = {"w": torch.zeros(3), "cfg": {"lr": 0.0}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(tmp_path), planner=FastLoadPlanner(), **world.NO_DIST)
    assert sd["cfg"] == {"lr": 0.5} and torch.equal(sd["w"], torch.arange(3.0))


def test_dtype_conversion_and_noncontiguous_destinations(tmp_path):
    """DCP copies with conversion: a bf16 destination of an fp32 checkpoint, and a transposed one."""
    full = _full((6, 4), torch.float32, 11)
    dcp.save({"w": full, "v": full}, storage_writer=ChunkStoreWriter(tmp_path), **world.NO_DIST)
    w = torch.zeros(6, 4, dtype=torch.bfloat16)
    v = torch.zeros(4, 6).t()
    dcp.load(
        {"w": w, "v": v}, storage_reader=ChunkStoreReader(tmp_path), planner=FastLoadPlanner(), **world.NO_DIST
    )
    assert torch.equal(w, full.to(torch.bfloat16)) and torch.equal(v, full)


# ------------------------------------------------------------------------------------------------
# FSDP2 + AdamW through DCP's state-dict helpers: save on 4, load on 2 and 3, train on
# ------------------------------------------------------------------------------------------------


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 6))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _fsdp_step(model, optim, step: int) -> None:
    """One step on this rank's share of a global batch of 12 (same data on any world size)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(12, 12, generator=g), torch.randn(12, 6, generator=g)
    rank, size = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * 12 // size, (rank + 1) * 12 // size
    loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
    loss.backward()
    optim.step()
    optim.zero_grad()


def _full_state(model, optim) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    out = {f"model.{k}": v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def fsdp_save_worker(path: str) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(world.mesh((dist.get_world_size(),)))
    for step in range(2):
        _fsdp_step(model, optim, step)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=ChunkStoreWriter(path))
    saved = _full_state(model, optim)
    _fsdp_step(model, optim, 2)
    return saved, _full_state(model, optim)


def fsdp_load_worker(path: str, fast: bool) -> tuple[dict, dict, list]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(world.mesh((dist.get_world_size(),)))
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ChunkStoreReader(path), planner=FastLoadPlanner() if fast else None)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(model, optim)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.state_dict()["param_groups"]]
    _fsdp_step(model, optim, 2)
    return loaded, _full_state(model, optim), groups


@pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"), reason="this torch's FSDP2 needs an accelerator")
def test_fsdp2_adamw_save_on_4_load_on_2_and_3(tmp_path):
    path = str(tmp_path / "fsdp")
    saved, after = world.run(4, fsdp_save_worker, path)[0]
    assert any(k.endswith("exp_avg_sq") for k in saved) and any(k.endswith(".step") for k in saved)
    roles = {t.key: t.role for t in _core.Manifest.open(path).tensors}
    assert {roles[k] for k in roles if k.endswith(".exp_avg_sq")} == {"exp_avg_sq"}
    for n, fast in ((2, True), (3, False)):
        loaded, trained, groups = world.run(n, fsdp_load_worker, path, fast)[0]
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert loaded[k].dtype == saved[k].dtype and torch.equal(loaded[k], saved[k]), k
        assert groups[0]["lr"] == 1e-2 and groups[0]["weight_decay"] == 0.1
        # the next step matches the uninterrupted run (up to the reduction order of the new world)
        for k in after:
            torch.testing.assert_close(trained[k], after[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# import-dcp
# ------------------------------------------------------------------------------------------------


def fs_save_worker(path: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(_state(SAVE_LAYOUT_2, True), storage_writer=FileSystemWriter(path))


def native_load_worker(path: str) -> list[str]:
    sd = _state(LOAD_LAYOUT, False)
    olmo_chunks.load(sd, path)
    return _wrong(sd)


def test_import_dcp_streams_and_verifies(tmp_path, capsys):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "store")
    world.run(2, fs_save_worker, src)
    assert cli_main(["import-dcp", src, dst, "--batch-mb", "0"]) == 0
    assert "exact coverage" in capsys.readouterr().out
    m = _core.Manifest.open(dst)
    assert len(m.files) == m.num_chunks  # --batch-mb 0: one saved item staged at a time
    assert world.run(3, native_load_worker, dst) == [[], [], []]
    assert (
        world.run(3, load_both_doors_worker, dst) == [{"native": [], "dcp-default": [], "dcp-fast": []}] * 3
    )


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_import_dcp_reads_olmo_cores_storage_info_without_importing_it(tmp_path, monkeypatch):
    """OLMo-core's RemoteFileSystemWriter pickles its own `_StorageInfo` (relative_path, offset,
    length): import-dcp reads it as DCP's, bit-exact, with OLMo-core's module never imported; any
    other class of that module stays refused."""
    import dataclasses
    import importlib.util
    import sys
    import types

    src = tmp_path / "dcp"
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64), "step": 7}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(src), **world.NO_DIST)
    md = pickle.loads((src / ".metadata").read_bytes())
    fake = types.ModuleType("olmo_core.distributed.checkpoint.filesystem")

    @dataclasses.dataclass
    class _StorageInfo:
        relative_path: str
        offset: int
        length: int

    _StorageInfo.__module__, _StorageInfo.__qualname__ = fake.__name__, "_StorageInfo"
    fake._StorageInfo = _StorageInfo

    def write_metadata() -> None:
        """Pickles `md` as OLMo-core would, with the fake module (and its packages, where OLMo-core
        is not installed) importable only meanwhile."""
        with monkeypatch.context() as m:
            parts = fake.__name__.split(".")
            if importlib.util.find_spec(parts[0]) is None:
                for name in (".".join(parts[:i]) for i in range(1, len(parts))):
                    m.setitem(sys.modules, name, types.ModuleType(name))
            m.setitem(sys.modules, fake.__name__, fake)
            (src / ".metadata").write_bytes(pickle.dumps(md))

    md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    write_metadata()
    assert import_dcp(src, tmp_path / "out")["tensors"] == 2
    assert fake.__name__ not in sys.modules
    back = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    olmo_chunks.load(back, tmp_path / "out")
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"]) and back["step"] == 7

    _StorageInfo.__qualname__ = _StorageInfo.__name__ = "Other"
    fake.Other = _StorageInfo
    write_metadata()
    with pytest.raises(UnsupportedFormatError, match=r"olmo_core\.distributed\.checkpoint\.filesystem\.Other"):
        import_dcp(src, tmp_path / "out2")


def test_import_dcp_refuses_foreign_pickles(tmp_path):
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(src), **world.NO_DIST)
    md = (src / ".metadata").read_bytes()
    (src / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UnsupportedFormatError):
        import_dcp(src, tmp_path / "out")
    (src / ".metadata").write_bytes(md)
    assert import_dcp(src, tmp_path / "out")["tensors"] == 1
    # a non-tensor value pickled by DCP that is not plain data is refused, not unpickled
    src2 = tmp_path / "dcp2"
    dcp.save({"w": torch.ones(3), "obj": Opaque()}, storage_writer=dcp.FileSystemWriter(src2), **world.NO_DIST)
    with pytest.raises(InvalidArgumentError, match="obj"):
        import_dcp(src2, tmp_path / "out2")
    assert not Path(tmp_path / "out2" / _core.MANIFEST_NAME).exists()


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")  # torch.load of the crafted item
def test_import_dcp_refuses_crafted_sizes_and_sparse_items(tmp_path):
    import io

    from olmo_chunks.errors import CorruptCheckpointError
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def crafted(name: str, change) -> Path:
        src = tmp_path / name
        dcp.save({"w": torch.ones(3, 4)}, storage_writer=dcp.FileSystemWriter(src), **world.NO_DIST)
        md = pickle.loads((src / ".metadata").read_bytes())
        change(src, md)
        (src / ".metadata").write_bytes(pickle.dumps(md))
        return src

    def negative(src: Path, md) -> None:
        md.state_dict_metadata["w"].size = torch.Size([-3, 4])

    def sparse(src: Path, md) -> None:  # the item's bytes: a sparse tensor of the right shape
        index = next(i for i in md.storage_data if i.fqn == "w")
        info = md.storage_data[index]
        buf = io.BytesIO()
        torch.save(torch.eye(3, 4).to_sparse(), buf)
        old = (src / info.relative_path).read_bytes()
        (src / info.relative_path).write_bytes(old + buf.getvalue())
        md.storage_data[index] = _StorageInfo(info.relative_path, len(old), len(buf.getvalue()))

    # They were an OverflowError and a RuntimeError of copy_() (dense and sparse).
    with pytest.raises(CorruptCheckpointError, match=r"w: bad size \(-3, 4\) in the DCP metadata"):
        import_dcp(crafted("negative", negative), tmp_path / "out1")
    with pytest.raises(CorruptCheckpointError, match=r"does not match its metadata \(a dense torch.float32 tensor"):
        import_dcp(crafted("sparse", sparse), tmp_path / "out2")
