"""Mapping specs: layout ops against a brute-force torch oracle, reshaped native reads through the
core, coverage checks and spec validation."""

from __future__ import annotations

import json

import olmo_chunks
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from olmo_chunks import _core
from olmo_chunks.errors import InvalidArgumentError
from olmo_chunks.hf.mapping import (
    BUILTIN_MAPPINGS,
    MappingSpec,
    NativeSource,
    Planned,
    plan_export,
    plan_import,
    read_planned,
    scatter_planned,
)
from olmo_chunks.hf.ops import Blocks, Op, Permute, Take, TrimVocab


def oracle(x: torch.Tensor, ops: list[Op], vocab: int | None) -> torch.Tensor:
    """The HF tensor from the whole native tensor, op by op with plain torch."""
    for op in ops:
        if isinstance(op, Take):
            assert isinstance(op.index, int)
            x = x.select(op.dim, op.index)
        elif isinstance(op, Blocks):
            parts = x.chunk(op.parts, op.dim)
            x = torch.cat([parts[o] for o in op.order], op.dim)
        elif isinstance(op, Permute):
            x = x.permute(op.perm)
        elif isinstance(op, TrimVocab) and vocab is not None:
            x = x.narrow(op.dim, 0, vocab)
    return x


@st.composite
def pipelines(draw):
    """A native shape, a random op pipeline over it, and a box of the result."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 4)) * (2 if i == 0 else 1) for i in range(ndim)]
    vocab = None
    ops: list[Op] = []
    cur = tuple(shape)
    if draw(st.booleans()):
        vocab = draw(st.integers(1, cur[0]))
        ops.append(TrimVocab(0))
        cur = ops[-1].forward(cur, vocab, "")
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["take", "blocks", "permute"]))
        if kind == "take" and len(cur) > 1:
            d = draw(st.integers(0, len(cur) - 1))
            op: Op = Take(d, draw(st.integers(0, cur[d] - 1)))
        elif kind == "blocks":
            d = draw(st.integers(0, len(cur) - 1))
            parts = draw(st.sampled_from([p for p in (1, 2, 3) if cur[d] % p == 0]))
            order = tuple(draw(st.lists(st.integers(0, parts - 1), min_size=1, max_size=parts)))
            op = Blocks(d, parts, order)
        elif kind == "permute":
            op = Permute(tuple(draw(st.permutations(range(len(cur))))))
        else:
            continue
        ops.append(op)
        cur = op.forward(cur, vocab, "")
    off = [draw(st.integers(0, n - 1)) for n in cur]
    size = [draw(st.integers(1, n - o)) for n, o in zip(cur, off, strict=True)]
    return shape, vocab, ops, off, size


def _planned(shape, vocab, ops) -> Planned:
    shapes = [tuple(shape)]
    for op in ops:
        shapes.append(op.forward(shapes[-1], vocab, ""))
    src = NativeSource("n", "n", 0, torch.float32, tuple(shape), tuple(shape))
    return Planned("h", "n", ops, shapes, src)


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_read_box_matches_oracle(case):
    shape, vocab, ops, off, size = case
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    e = _planned(shape, vocab, ops)
    full = oracle(x, ops, vocab)
    assert tuple(full.shape) == e.shape

    def load(src, o, s):
        return x[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))].clone()

    got = read_planned(e, off, size, load)
    want = full[tuple(slice(a, a + b) for a, b in zip(off, size, strict=True))]
    assert torch.equal(got, want)


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_scatter_inverts_read(case):
    """Scattering an HF box puts every element back where the oracle took it from."""
    shape, vocab, ops, off, size = case
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    e = _planned(shape, vocab, ops)
    box = oracle(x, ops, vocab)[tuple(slice(a, a + b) for a, b in zip(off, size, strict=True))]
    native = torch.full(shape, -1.0)
    for o, s, d in scatter_planned(e, off, size, box):
        native[tuple(slice(a, a + b) for a, b in zip(o, s, strict=True))] = d
    hit = native >= 0
    assert torch.equal(native[hit], x[hit])
    # Distinct source elements unless a blocks op repeats a block.
    if all(len(set(op.order)) == len(op.order) for op in ops if isinstance(op, Blocks)):
        assert int(hit.sum()) == box.numel()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_runs_match_brute_force(shape, data):
    off = [data.draw(st.integers(0, n - 1)) for n in shape]
    size = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, off, strict=True)]
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    want = x[tuple(slice(a, a + b) for a, b in zip(off, size, strict=True))].reshape(-1)
    runs = _core.box_runs(shape, off, size)
    got = torch.cat([torch.arange(start, start + n) for start, n, _ in runs])
    assert torch.equal(got, want)
    # local starts: each run follows the previous one in the box's own row-major order
    assert [loc for _, _, loc in runs] == [sum(n for _, n, _ in runs[:i]) for i in range(len(runs))]


def test_reshaped_native_reads_through_core(tmp_path):
    """A router saved flat [E*D] is read as [E, D] boxes straight from the chunk store, whatever
    its chunks (here two flat ranges and a box)."""
    w = torch.arange(6 * 5, dtype=torch.float32)
    olmo_chunks.save(
        {"model": {"blocks": {"0": {"feed_forward_moe": {"router": {"weight": w}}}}}}, tmp_path / "c"
    )
    m = _core.Manifest.open(str(tmp_path / "c"))
    src = NativeSource("r", "model.blocks.0.feed_forward_moe.router.weight", 0, torch.float32, (30,), (6, 5))
    buf = torch.empty(3, 2)
    m.load([_core.Target(0, src.pieces([2, 1], [3, 2]))], [(buf.data_ptr(), buf.numel() * 4)])
    assert torch.equal(buf, w.reshape(6, 5)[2:5, 1:3])


def _spec(**over) -> str:
    raw = {
        "format": "olmo-chunks-mapping/1",
        "name": "t",
        "tensors": [{"native": "a.{layer}", "hf": "b.{layer}"}],
    }
    raw.update(over)
    return json.dumps(raw)


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        json.dumps({"tensors": []}),
        _spec(tensors=[]),
        _spec(tensors=[{"native": "a", "hf": "b", "ops": [{"explode": {}}]}]),
        _spec(tensors=[{"native": "a", "hf": "b.{expert}", "ops": []}]),
        _spec(tensors=[{"native": "a", "hf": "b", "ops": [{"take": {"dim": 0, "index": "e"}}]}]),
        _spec(
            tensors=[{"native": "a", "hf": "b", "ops": [{"permute": [0]}, {"unflatten": {"sizes": [2, -1]}}]}]
        ),
        _spec(
            tensors=[{"native": "a", "hf": "b", "ops": [{"blocks": {"dim": 0, "parts": 2, "order": [2]}}]}]
        ),
        _spec(native_keys=["model.x"]),
    ],
)
def test_bad_specs_are_refused(bad):
    with pytest.raises(InvalidArgumentError, match="mapping spec"):
        MappingSpec.parse(bad)


def test_builtins_parse_and_unknown_name_is_refused():
    for name in BUILTIN_MAPPINGS:
        assert MappingSpec.load(name).name == name
    with pytest.raises(InvalidArgumentError, match="neither a built-in"):
        MappingSpec.load("no-such-mapping")


def test_inexact_coverage_is_a_problem(tmp_path):
    """A spec that exports only the gate half of w_up_gate, or the same half twice, is refused
    before anything is written."""
    olmo_chunks.save({"w": torch.zeros(2, 4, 3)}, tmp_path / "c")
    m = _core.Manifest.open(str(tmp_path / "c"))
    half = _spec(
        tensors=[
            {
                "native": "w",
                "hf": "g.{expert}",
                "ops": [
                    {"take": {"dim": 0, "index": "expert"}},
                    {"blocks": {"dim": 0, "parts": 2, "order": [1]}},
                ],
            }
        ]
    )
    plan = plan_export(m, MappingSpec.parse(half))
    assert any("does not cover it exactly once (12 of 24" in p for p in plan.problems)
    twice = _spec(
        tensors=[{"native": "w", "hf": "g", "ops": [{"blocks": {"dim": 1, "parts": 2, "order": [0, 0]}}]}]
    )
    plan = plan_export(m, MappingSpec.parse(twice))
    assert any("overlapping" in p or "12 of 24" in p for p in plan.problems)


def test_import_plan_infers_native_shapes():
    spec = MappingSpec.load("olmoe")
    shapes = {"model.embed_tokens.weight": (100, 8), "lm_head.weight": (100, 8), "model.norm.weight": (8,)}
    for e in range(3):
        shapes[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = (4, 8)
        shapes[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = (4, 8)
        shapes[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = (8, 4)
    shapes["model.layers.0.mlp.gate.weight"] = (3, 8)
    plan = plan_import(shapes, spec)
    assert not plan.problems, plan.problems
    assert plan.natives["embeddings.weight"] == ((128, 8), (128, 8))
    assert plan.natives["blocks.0.feed_forward_moe.experts.w_up_gate"][0] == (3, 8, 8)
    assert plan.natives["blocks.0.feed_forward_moe.experts.w_down"][0] == (3, 4, 8)
    assert plan.natives["blocks.0.feed_forward_moe.router.weight"] == ((24,), (3, 8))
    del shapes["model.layers.0.mlp.experts.1.up_proj.weight"]
    shapes["model.layers.0.bogus.weight"] = (1,)
    problems = plan_import(shapes, spec).problems
    assert any(
        p.startswith("model.layers.0.bogus.weight: HF tensor that no mapping rule covers") for p in problems
    )
    assert any("w_up_gate: the mapping does not cover it exactly once" in p for p in problems)
    assert (
        "model.layers.0.mlp.experts.1.up_proj.weight: missing (part of native "
        "blocks.0.feed_forward_moe.experts.w_up_gate)" in problems
    )


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_each_op_inverts_its_own_shape_map(data):
    """Every op owns both directions of its shape map: where it is a bijection (a permutation,
    all blocks reordered, a take enumerated over its variable, an untrimmed vocab), the inverse of
    the forward shape is the input shape."""
    from olmo_chunks.hf.ops import Transpose

    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=4)))
    d = data.draw(st.integers(0, len(shape) - 1))
    kind = data.draw(st.sampled_from(["take", "blocks", "permute", "transpose", "trim_vocab"]))
    counts: dict[str, int] = {}
    vocab = None
    if kind == "take":
        spec_op: Op = Take(d, "e")
        counts = {"e": shape[d]}
        op = spec_op.bind({"e": data.draw(st.integers(0, shape[d] - 1))}, len(shape))
    elif kind == "blocks":
        parts = data.draw(st.sampled_from([p for p in (1, 2, 3) if shape[d] % p == 0]))
        spec_op = op = Blocks(d, parts, tuple(data.draw(st.permutations(range(parts)))))
    elif kind == "permute":
        spec_op = op = Permute(tuple(data.draw(st.permutations(range(len(shape))))))
    elif kind == "transpose":
        spec_op = Transpose(d, data.draw(st.integers(0, len(shape) - 1)))
        op = spec_op.bind({}, len(shape))
    else:
        spec_op = op = TrimVocab(d)
        vocab = shape[d]
    out = op.forward(shape, vocab, "")
    assert spec_op.inverse(out, counts, 1, "") == shape
    assert op.describe() == {next(iter(op.describe())): next(iter(op.describe().values()))}


@pytest.mark.parametrize(("ops", "message"), [
    ([{"squeeze": {}}], "unknown op 'squeeze'"),
    ([{"take": {"index": 1.5}}], "take needs an int index or a variable name"),
    ([{"blocks": {"parts": 2, "order": [2]}}], "blocks needs parts > 0"),
    ([{"take": {"dim": "0", "index": 0}}], "take dim must be an int"),
    ([{"permute": [0], "take": {}}], "must be an object with one key"),
    ([{"unflatten": {"sizes": "x"}}], "unflatten needs a list of sizes"),
])
def test_each_op_refuses_its_bad_arguments(ops, message):
    text = json.dumps({"format": "olmo-chunks-mapping/1", "tensors": [{"native": "a", "hf": "b", "ops": ops}]})
    with pytest.raises(InvalidArgumentError, match=message):
        MappingSpec.parse(text)
