"""Declarative name and layout mappings between native checkpoint tensors and Hugging Face ones.

A mapping spec is JSON (see `mappings/*.json`, shipped in the wheel). Each rule maps one native
tensor name pattern to one HF name pattern, with `{var}` placeholders (`{layer}` matched from
names, `{expert}` enumerated by a `take` op) and a list of layout ops applied native -> HF:

- `{"unflatten": {"dim": d, "sizes": [-1, "d_model"]}}` (first op only): view a dim as several;
  sizes are ints, `-1` or names from the spec's `dims`;
- `{"take": {"dim": d, "index": "expert"}}`: one index of a dim (per-expert unpacking);
- `{"blocks": {"dim": d, "parts": n, "order": [1, 0]}}`: cut a dim into `n` equal blocks and keep
  the listed ones in that order (gate/up halves and their order);
- `{"permute": [0, 2, 1]}` or `{"transpose": [1, 2]}`;
- `{"trim_vocab": {"dim": d}}` (first op after `unflatten`): keep the saved true vocab size
  of a padded vocab dim.

Every op maps boxes to boxes, so any box of an HF tensor is read from the native checkpoint as a
few boxes (or flat runs) of the saved tensor, and the reverse writes HF boxes as native chunks.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .. import _core, values
from ..errors import InvalidArgumentError
from ..roles import MAIN_WEIGHT
from ..shards import torch_dtype
from .ops import Op, Take, TrimVocab, Unflatten, parse_op
from .shapes import numel, strides

__all__ = [
    "BUILTIN_MAPPINGS",
    "MappingSpec",
    "NativeSource",
    "Op",
    "Planned",
    "TensorPlan",
    "builtin_names",
    "hf_expert_layout",
    "lookup_entry",
    "plan_export",
    "plan_identity",
    "plan_import",
    "read_planned",
    "scatter_planned",
]

FORMAT = "olmo-chunks-mapping/1"
BUILTIN_MAPPINGS = ("olmo2", "olmoe", "olmoe-fused")
_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _natural(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


@dataclass
class _Rule:
    native: str
    hf: str
    ops: list[Op | Unflatten]
    native_re: re.Pattern[str]
    hf_re: re.Pattern[str]
    take_vars: list[str]


def _pattern(template: str) -> re.Pattern[str]:
    out, pos, seen = "", 0, set()
    for m in _VAR.finditer(template):
        out += re.escape(template[pos : m.start()])
        name = m.group(1)
        out += f"(?P={name})" if name in seen else f"(?P<{name}>\\d+)"
        seen.add(name)
        pos = m.end()
    return re.compile(out + re.escape(template[pos:]) + r"\Z")


def _bad(where: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"mapping spec {where}: {why}")


@dataclass
class MappingSpec:
    """A parsed mapping spec. `load` takes a built-in name or a JSON file path."""

    name: str
    raw: dict[str, Any]
    rules: list[_Rule]
    native_keys: list[str]
    import_prefix: str
    vocab_size_from: list[str]
    pad_multiple: int
    dims: dict[str, dict[str, Any]]
    config_checks: dict[str, str]
    hf_model_type: str | None
    sha256: str
    source: str

    @classmethod
    def load(cls, spec: str | Path) -> MappingSpec:
        """A built-in mapping (`olmo2`, `olmoe`, `olmoe-fused`) or a spec file."""
        s = str(spec)
        if s in BUILTIN_MAPPINGS:
            text = resources.files("olmo_chunks.mappings").joinpath(f"{s}.json").read_text()
            return cls.parse(text, source=f"builtin:{s}")
        p = Path(s)
        if not p.is_file():
            raise InvalidArgumentError(
                f"mapping {s!r} is neither a built-in ({', '.join(BUILTIN_MAPPINGS)}) nor a file"
            )
        return cls.parse(p.read_text(), source=str(p))

    @classmethod
    def parse(cls, text: str, *, source: str = "<string>") -> MappingSpec:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _bad(source, f"not JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise _bad(source, f'needs a top-level object with "format": "{FORMAT}"')
        rules = []
        for i, r in enumerate(raw.get("tensors") or []):
            where = f"{source} tensors[{i}]"
            if (
                not isinstance(r, dict)
                or not isinstance(r.get("native"), str)
                or not isinstance(r.get("hf"), str)
            ):
                raise _bad(where, 'each rule needs "native" and "hf" name patterns')
            ops = r.get("ops", [])
            if not isinstance(ops, list):
                raise _bad(where, '"ops" must be a list')
            parsed = [parse_op(op, f"{where} op {j}") for j, op in enumerate(ops)]
            for j, op in enumerate(parsed):
                if isinstance(op, Unflatten) and j != 0:
                    raise _bad(where, "unflatten must be the first op")
                if isinstance(op, TrimVocab) and not (j == 0 or (j == 1 and isinstance(parsed[0], Unflatten))):
                    raise _bad(where, "trim_vocab must come first (after unflatten)")
            take_vars = [v for op in parsed if isinstance(op, Take) and (v := op.variable) is not None]
            native_vars = set(_VAR.findall(r["native"]))
            hf_vars = set(_VAR.findall(r["hf"]))
            if hf_vars != native_vars | set(take_vars) or native_vars & set(take_vars):
                raise _bad(where, "HF placeholders must be the native ones plus the take variables")
            rules.append(
                _Rule(r["native"], r["hf"], parsed, _pattern(r["native"]), _pattern(r["hf"]), take_vars)
            )
        if not rules:
            raise _bad(source, 'no "tensors" rules')
        vocab = raw.get("vocab") or {}
        native_keys = raw.get("native_keys") or ["{name}"]
        if not all(isinstance(t, str) and t.count("{name}") == 1 for t in native_keys):
            raise _bad(source, 'every "native_keys" template needs exactly one {name}')
        return cls(
            name=str(raw.get("name", source)),
            raw=raw,
            rules=rules,
            native_keys=list(native_keys),
            import_prefix=str(raw.get("import_prefix", "")),
            vocab_size_from=list(vocab.get("size_from", [])),
            pad_multiple=int(vocab.get("pad_multiple", 1)),
            dims=dict(raw.get("dims") or {}),
            config_checks=dict(raw.get("config") or {}),
            hf_model_type=raw.get("hf_model_type"),
            sha256=hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest(),
            source=source,
        )

    def hf_rule(self, name: str) -> tuple[_Rule, dict[str, int]] | None:
        """The rule whose HF pattern matches `name`, with the placeholder values."""
        found = [(r, m) for r in self.rules if (m := r.hf_re.match(name))]
        if len(found) > 1:
            raise _bad(self.source, f"HF name {name!r} matches {len(found)} rules")
        if not found:
            return None
        r, m = found[0]
        return r, {k: int(v) for k, v in m.groupdict().items()}

    def covers_hf(self, names: Iterable[str]) -> bool:
        """True if every name matches a rule."""
        return all(self.hf_rule(n) is not None for n in names)


def builtin_names() -> tuple[str, ...]:
    return BUILTIN_MAPPINGS


def hf_expert_layout() -> str | None:
    """How the installed transformers holds OLMoE experts in a model's state dict: `"fused"`
    (v5: `mlp.experts.gate_up_proj` [E, 2I, D], gate first) or `"per_expert"` (v4:
    `mlp.experts.{e}.gate_proj.weight`); None without transformers."""
    try:
        from transformers import OlmoeConfig
        from transformers.models.olmoe import modeling_olmoe
    except ImportError:
        return None
    experts = getattr(modeling_olmoe, "OlmoeExperts", None)
    if experts is None:
        return "per_expert"
    cfg = OlmoeConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_experts=2,
        num_experts_per_tok=1,
    )
    with torch.device("meta"):
        names = {n for n, _ in experts(cfg).named_parameters()}
    return "fused" if "gate_up_proj" in names else "per_expert"


def lookup_entry(entries: Mapping[str, Any], dotted: str) -> Any:
    """The value at dotted path `dotted` among checkpoint plain entries (stored flattened or
    nested), or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in entries:
            v = values.decode(entries[head], head)
            for p in parts[i:]:
                if not isinstance(v, dict) or p not in v:
                    return None
                v = v[p]
            return v
    return None


# --- plans ------------------------------------------------------------------------------------


@dataclass
class NativeSource:
    """A native tensor as the mapping sees it: saved `key` (index `index` in the manifest) read
    with logical shape `shape` (a reshape of `saved_shape` when they differ)."""

    name: str
    key: str
    index: int
    dtype: torch.dtype
    saved_shape: tuple[int, ...]
    shape: tuple[int, ...]
    also_saved: list[str] = field(default_factory=list)
    chunk_kinds: dict[str, int] = field(default_factory=dict)

    def pieces(self, off: Sequence[int], size: Sequence[int]) -> list[_core.Piece]:
        """Core target pieces filling a dense buffer of box `size` at `off` (logical coords)."""
        off, size = [int(x) for x in off], [int(x) for x in size]
        if tuple(self.saved_shape) == tuple(self.shape):
            return [_core.Piece(off, size, 0, strides(size))]
        out: list[_core.Piece] = []
        for start, length, local in _core.box_runs(list(self.shape), list(off), list(size)):
            out.extend(p.shifted(local) for p in _core.flat_pieces(list(self.saved_shape), start, length))
        return out


@dataclass
class Planned:
    """One HF tensor and how it is laid out in a native tensor: `ops` take stage 0 (the native
    tensor's logical shape, `shapes[0]`) to the HF shape (`shapes[-1]`)."""

    hf_name: str
    native_name: str
    ops: list[Op]
    shapes: list[tuple[int, ...]]
    source: NativeSource | None = None
    rule: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[-1]

    def packing(self) -> list[dict[str, Any]]:
        return [op.describe() for op in self.ops]


@dataclass
class TensorPlan:
    """The full correspondence between a native checkpoint and an HF tensor set."""

    entries: list[Planned]
    problems: list[str]
    vocab_size: int | None
    padded_vocab_size: int | None
    derived: dict[str, int]
    natives: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    spec: MappingSpec | None = None


def _expand(
    rule: _Rule, vars: dict[str, int], shape0: tuple[int, ...], vocab: int | None, where: str
) -> list[tuple[dict[str, int], list[Op], list[tuple[int, ...]]]]:
    """Every concrete instance of `rule` (one per value of its take variables)."""
    ops = [o for o in rule.ops if isinstance(o, Op)]
    out = []

    def rec(i: int, vs: dict[str, int], done: list[Op], shapes: list[tuple[int, ...]]) -> None:
        if i == len(ops):
            out.append((dict(vs), list(done), list(shapes)))
            return
        spec_op, cur = ops[i], shapes[-1]
        choices = [vs]
        if isinstance(spec_op, Take) and (var := spec_op.variable) is not None:
            n = cur[spec_op.dim] if spec_op.dim < len(cur) else 0
            choices = [{**vs, var: v} for v in ([vs[var]] if var in vs else range(n))]
        for bound in choices:
            op = spec_op.bind(bound, len(shapes[-1]))
            rec(i + 1, bound, [*done, op], [*shapes, op.forward(shapes[-1], vocab, where)])

    rec(0, dict(vars), [], [shape0])
    return out


def _native_keys(spec: MappingSpec, key: str) -> Iterable[tuple[int, str]]:
    for t_i, t in enumerate(spec.native_keys):
        pre, post = t.split("{name}")
        if key.startswith(pre) and key.endswith(post) and len(key) > len(pre) + len(post):
            yield t_i, key[len(pre) : len(key) - len(post)]


def _saved_vocab(spec: MappingSpec, entries: Mapping[str, Any]) -> int | None:
    for path in spec.vocab_size_from:
        v = lookup_entry(entries, path)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def plan_export(manifest: Any, spec: MappingSpec, *, roles: Sequence[str] = (MAIN_WEIGHT,)) -> TensorPlan:  # noqa: PLR0915
    """How every HF tensor of `spec` is read from `manifest` (a `_core.Manifest`). Problems
    (unmapped or ambiguous native tensors, duplicate HF names, inexact coverage) are collected,
    not raised."""
    problems: list[str] = []
    entries_raw = values.entries(manifest)
    saved = {t.key: (i, t) for i, t in enumerate(manifest.tensors)}
    ignored: dict[str, int] = {}
    candidates: dict[str, list[tuple[int, str]]] = {}
    for key, (_, info) in saved.items():
        role = info.role
        if role not in roles:
            ignored[role] = ignored.get(role, 0) + 1
            continue
        names = [
            (t_i, n) for t_i, n in _native_keys(spec, key) if any(r.native_re.match(n) for r in spec.rules)
        ]
        if not names:
            problems.append(f"{key}: saved {role} tensor that no mapping rule covers")
            continue
        for t_i, n in names[:1]:
            candidates.setdefault(n, []).append((t_i, key))
    sources: dict[str, NativeSource] = {}
    for name, cands in candidates.items():
        cands.sort()
        keys = [k for _, k in cands]
        data_key = keys[0]
        i, info = saved[data_key]
        dtype, sshape = info.dtype, info.shape
        shaped = [tuple(saved[k][1].shape) for k in keys if len(saved[k][1].shape) != 1] or [tuple(sshape)]
        logical = shaped[0]
        bad = [k for k in keys if numel(saved[k][1].shape) != numel(logical)]
        if bad:
            problems.append(f"{name}: saved as {', '.join(keys)} with different element counts")
            continue
        sources[name] = NativeSource(
            name, data_key, i, torch_dtype(dtype), tuple(sshape), logical, keys[1:], _chunk_kinds(manifest, i)
        )
    dims: dict[str, int] = {}
    for dname, d in spec.dims.items():
        src = sources.get(d.get("native", ""))
        if src is not None and int(d.get("dim", 0)) < len(src.shape):
            dims[dname] = src.shape[int(d.get("dim", 0))]
    vocab = _saved_vocab(spec, entries_raw)
    plan = TensorPlan([], problems, vocab, None, {}, ignored=ignored, spec=spec)
    layers: set[int] = set()
    take_counts: dict[str, set[int]] = {}
    for name in sorted(sources, key=_natural):
        src = sources[name]
        matched = False
        for rule in spec.rules:
            m = rule.native_re.match(name)
            if not m:
                continue
            matched = True
            vars = {k: int(v) for k, v in m.groupdict().items()}
            if "layer" in vars:
                layers.add(vars["layer"])
            where = f"{src.key} -> {rule.hf}"
            try:
                shape0 = src.shape
                if rule.ops and isinstance(rule.ops[0], Unflatten):
                    shape0 = rule.ops[0].logical_shape(src.shape, dims, where)
                    if src.shape != shape0:
                        src.shape = shape0
                for vs, ops, shapes in _expand(rule, vars, shape0, vocab, where):
                    for v in rule.take_vars:
                        take_counts.setdefault(v, set()).add(vs[v])
                    for op, shp in zip(ops, shapes, strict=False):
                        if isinstance(op, TrimVocab):
                            plan.padded_vocab_size = shp[op.dim]
                    plan.entries.append(Planned(rule.hf.format(**vs), name, ops, shapes, src, rule.hf))
            except InvalidArgumentError as exc:
                problems.append(str(exc))
        if not matched:
            problems.append(f"{src.key}: no mapping rule matches {name!r}")
    rows = vocab if vocab is not None else plan.padded_vocab_size
    plan.derived = {
        "layers": len(layers),
        "vocab": rows if rows is not None else -1,
        **{f"count:{k}": len(v) for k, v in take_counts.items()},
        **{f"dim:{k}": v for k, v in dims.items()},
    }
    plan.natives = {n: (s.saved_shape, s.shape) for n, s in sources.items()}
    _check_plan(plan)
    return plan


def _chunk_kinds(manifest: _core.Manifest, i: int) -> dict[str, int]:
    """How many of tensor `i`'s saved chunks are boxes and how many flat ranges (for reports)."""
    kinds: dict[str, int] = {}
    for ch in manifest.chunks(i):
        kind = "flat" if isinstance(ch.region, _core.Flat) else "box"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def plan_identity(manifest: Any, roles: Sequence[str]) -> TensorPlan:
    """Every saved tensor of the given roles under its own name, unchanged."""
    entries: list[Planned] = []
    ignored: dict[str, int] = {}
    for i, t in enumerate(manifest.tensors):
        key, dtype, shape, role = t.key, t.dtype, t.shape, t.role
        if role not in roles:
            ignored[role] = ignored.get(role, 0) + 1
            continue
        src = NativeSource(key, key, i, torch_dtype(dtype), tuple(shape), tuple(shape), [], _chunk_kinds(manifest, i))
        entries.append(Planned(key, key, [], [tuple(shape)], src, "identity"))
    return TensorPlan(entries, [], None, None, {}, ignored=ignored)


def _check_plan(plan: TensorPlan) -> None:
    """Duplicate HF names and inexact coverage of each native tensor (vocab padding aside)."""
    seen: dict[str, str] = {}
    by_native: dict[str, list[Planned]] = {}
    for e in plan.entries:
        if e.hf_name in seen:
            plan.problems.append(f"{e.hf_name}: produced by two rules ({seen[e.hf_name]}, {e.native_name})")
        seen[e.hf_name] = e.native_name
        by_native.setdefault(e.native_name, []).append(e)
    for name, es in by_native.items():
        shape0 = es[0].shapes[0]
        boxes: list[tuple[list[int], list[int]]] = []
        want = numel(shape0)
        for e in es:
            if e.shapes[0] != shape0:
                plan.problems.append(f"{name}: rules disagree on its shape ({shape0} vs {e.shapes[0]})")
                continue
            for op, shp in zip(e.ops, e.shapes, strict=False):
                if isinstance(op, TrimVocab):
                    want = (
                        want
                        // shp[op.dim]
                        * (plan.vocab_size if plan.vocab_size is not None else shp[op.dim])
                    )
            boxes.extend((o, s) for o, s, _ in scatter_planned(e, [0] * len(e.shape), list(e.shape), None))
        got = sum(numel(s) for _, s in boxes)
        overlap = _overlap(boxes)
        if got != want or overlap:
            why = f"overlapping parts {overlap}" if overlap else f"{got} of {want} elements mapped"
            plan.problems.append(f"{name}: the mapping does not cover it exactly once ({why})")


def _overlap(boxes: list[tuple[list[int], list[int]]]) -> str | None:
    boxes = sorted(boxes)
    active: list[tuple[list[int], list[int]]] = []
    for o, s in boxes:
        active = [(ao, as_) for ao, as_ in active if ao[0] + as_[0] > o[0]] if o else active
        for ao, as_ in active:
            if all(a < b + bs and b < a + s_ for a, s_, b, bs in zip(o, s, ao, as_, strict=True)):
                return f"{ao}+{as_} and {o}+{s}"
        active.append((o, s))
    return None


# --- reading (native -> HF) and scattering (HF -> native) boxes --------------------------------


def read_planned(
    e: Planned,
    off: Sequence[int],
    size: Sequence[int],
    load: Callable[[NativeSource, list[int], list[int]], torch.Tensor],
) -> torch.Tensor:
    """Box `off`/`size` of HF tensor `e`, built from native boxes fetched with `load`."""

    def rec(k: int, off: list[int], size: list[int]) -> torch.Tensor:
        if k == 0:
            assert e.source is not None
            return load(e.source, off, size)
        return e.ops[k - 1].read(lambda o, s: rec(k - 1, o, s), off, size, e.shapes[k - 1])

    out = rec(len(e.ops), [int(x) for x in off], [int(x) for x in size])
    return out if out.is_contiguous() else out.contiguous()


def scatter_planned(
    e: Planned, off: Sequence[int], size: Sequence[int], data: torch.Tensor | None
) -> list[tuple[list[int], list[int], torch.Tensor | None]]:
    """Where box `off`/`size` of HF tensor `e` (holding `data`, or None for boxes only) lands in
    the native tensor: `(offsets, sizes, data)` boxes of stage 0."""

    def rec(k: int, off: list[int], size: list[int], x: torch.Tensor | None) -> list[Any]:
        if k == 0:
            return [(off, size, x)]
        return e.ops[k - 1].scatter(lambda o, s, y: rec(k - 1, o, s, y), off, size, x, e.shapes[k - 1])

    return rec(len(e.ops), [int(x) for x in off], [int(x) for x in size], data)


# --- import planning (HF names -> native tensors) ---------------------------------------------


def plan_import(  # noqa: PLR0915
    hf_shapes: Mapping[str, tuple[int, ...]], spec: MappingSpec, *, pad_multiple: int | None = None
) -> TensorPlan:
    """How each HF tensor lands in the native tensors `spec` names (native shapes inferred from
    the HF shapes; vocab padded to `pad_multiple`, default the spec's). Problems (unmapped HF
    tensors, inconsistent shapes, gaps) are collected."""
    pad = spec.pad_multiple if pad_multiple is None else int(pad_multiple)
    if pad < 1:
        raise InvalidArgumentError("pad multiple must be >= 1")
    problems: list[str] = []
    groups: dict[str, list[tuple[str, _Rule, dict[str, int]]]] = {}
    for name in sorted(hf_shapes, key=_natural):
        hit = spec.hf_rule(name)
        if hit is None:
            problems.append(f"{name}: HF tensor that no mapping rule covers")
            continue
        rule, vars = hit
        native = rule.native.format(**{k: v for k, v in vars.items() if k not in rule.take_vars})
        groups.setdefault(native, []).append((name, rule, vars))
    vocab: int | None = None
    plan = TensorPlan([], problems, None, None, {}, spec=spec)
    layers: set[int] = set()
    for native, members in groups.items():
        counts: dict[str, int] = {}
        for _, rule, vars in members:
            for v in rule.take_vars:
                counts[v] = max(counts.get(v, 0), vars[v] + 1)
        shape0s: dict[tuple[int, ...], str] = {}
        saved_shape: tuple[int, ...] | None = None
        for name, rule, vars in members:
            where = f"{name} -> {native}"
            if "layer" in vars:
                layers.add(vars["layer"])
            s = tuple(hf_shapes[name])
            try:
                for op in reversed([o for o in rule.ops if isinstance(o, Op)]):
                    if isinstance(op, TrimVocab):
                        if vocab is not None and vocab != s[op.dim]:
                            problems.append(f"{name}: vocab size {s[op.dim]}, another tensor has {vocab}")
                        vocab = s[op.dim]
                    s = op.inverse(s, counts, pad, where)
            except (InvalidArgumentError, IndexError, KeyError) as exc:
                problems.append(f"{where}: cannot invert the mapping ({exc})")
                continue
            shape0s.setdefault(s, name)
            if rule.ops and isinstance(rule.ops[0], Unflatten):
                saved_shape = rule.ops[0].saved_shape(s)
        if len(shape0s) != 1:
            problems.append(f"{native}: HF tensors imply different shapes {sorted(shape0s)}")
            continue
        (shape0,) = shape0s
        # Name the HF tensors this native tensor needs but the source lacks.
        present = {name for name, _, _ in members}
        fixed = {k: v for k, v in members[0][2].items() if k not in members[0][1].take_vars}
        for rule in spec.rules:
            if set(_VAR.findall(rule.native)) != set(fixed) or rule.native.format(**fixed) != native:
                continue
            try:
                for vs, _, _ in _expand(rule, fixed, shape0, vocab, native):
                    if (want := rule.hf.format(**vs)) not in present:
                        problems.append(f"{want}: missing (part of native {native})")
            except (InvalidArgumentError, IndexError):
                pass  # the shape problem is reported below
        for name, rule, vars in members:
            try:
                ((_vs, ops, shapes),) = _expand(rule, vars, shape0, vocab, name)
            except InvalidArgumentError as exc:
                problems.append(str(exc))
                continue
            if shapes[-1] != tuple(hf_shapes[name]):
                problems.append(f"{name}: shape {tuple(hf_shapes[name])}, mapping implies {shapes[-1]}")
                continue
            src = NativeSource(
                native, spec.import_prefix + native, -1, torch.float32, saved_shape or shape0, shape0
            )
            plan.entries.append(Planned(name, native, ops, shapes, src, rule.hf))
        plan.natives[native] = (saved_shape or shape0, shape0)
    plan.vocab_size = vocab
    if vocab is not None:
        plan.padded_vocab_size = -(-vocab // pad) * pad
    plan.derived = {"layers": len(layers), "vocab": vocab if vocab is not None else -1}
    _check_plan(plan)
    return plan
