"""Export to safetensors / HF, import from HF, and the two-pass conversion validator: real
transformers round trips, a hand-written oracle of the OLMo-core <-> HF layouts, every planted
fault named, multi-rank checkpoints with expert flat views, and bounded export memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import _core
from olmo_chunks.cli import main
from olmo_chunks.errors import CheckpointLockedError, ConversionError, InvalidArgumentError
from olmo_chunks.experts import ExpertFlatView, ExpertLayout
from olmo_chunks.hf.common import parse_bytes
from olmo_chunks.hf.export import export_checkpoint
from olmo_chunks.hf.importer import import_hf
from olmo_chunks.hf.mapping import hf_expert_layout
from olmo_chunks.hf.safetensors_io import INDEX_NAME, SafetensorsDir, ShardedWriter
from olmo_chunks.hf.validate import validate_conversion

from tests import world

V, VP, D, H, E, L = 100, 128, 32, 16, 4, 2


@dataclass(frozen=True)
class Geo:
    """A tiny MoE geometry: true and padded vocab, width, expert width, experts, layers."""

    v: int = V
    vp: int = VP
    d: int = D
    h: int = H
    e: int = E
    layers: int = L


GEO = Geo()


# --- a native OLMo-core-style MoE checkpoint and a hand-written HF oracle ----------------------


def olmoe_native(seed: int = 0, geo: Geo = GEO) -> dict[str, torch.Tensor]:
    """Full main weights of a tiny OLMo-core MoE v2 model (vocab padded to `vp` rows)."""
    g = torch.Generator().manual_seed(seed)
    d, h, e = geo.d, geo.h, geo.e

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    t = {"embeddings.weight": r(geo.vp, d), "lm_head.w_out.weight": r(geo.vp, d), "lm_head.norm.weight": r(d)}
    for i in range(geo.layers):
        b = f"blocks.{i}."
        for n in ("w_q", "w_k", "w_v", "w_out"):
            t[b + f"attention.{n}.weight"] = r(d, d)
        t[b + "attention.q_norm.weight"] = r(d)
        t[b + "attention.k_norm.weight"] = r(d)
        t[b + "attention_norm.weight"] = r(d)
        t[b + "feed_forward_norm.weight"] = r(d)
        t[b + "feed_forward_moe.router.weight"] = r(e * d)
        t[b + "feed_forward_moe.experts.w_up_gate"] = r(e, 2 * h, d)
        t[b + "feed_forward_moe.experts.w_down"] = r(e, h, d)
    return t


def olmoe_hf_oracle(t: dict[str, torch.Tensor], geo: Geo = GEO) -> dict[str, torch.Tensor]:
    """The HF OLMoE (Hub, per-expert) tensors of `olmoe_native`, by hand."""
    out = {
        "model.embed_tokens.weight": t["embeddings.weight"][: geo.v],
        "lm_head.weight": t["lm_head.w_out.weight"][: geo.v],
        "model.norm.weight": t["lm_head.norm.weight"],
    }
    for i in range(geo.layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for n, m in (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_out", "o_proj")):
            out[h + f"self_attn.{m}.weight"] = t[b + f"attention.{n}.weight"]
        out[h + "self_attn.q_norm.weight"] = t[b + "attention.q_norm.weight"]
        out[h + "self_attn.k_norm.weight"] = t[b + "attention.k_norm.weight"]
        out[h + "input_layernorm.weight"] = t[b + "attention_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = t[b + "feed_forward_norm.weight"]
        out[h + "mlp.gate.weight"] = t[b + "feed_forward_moe.router.weight"].reshape(geo.e, geo.d)
        for e in range(geo.e):
            up_gate = t[b + "feed_forward_moe.experts.w_up_gate"][e]
            out[h + f"mlp.experts.{e}.up_proj.weight"] = up_gate[: geo.h]
            out[h + f"mlp.experts.{e}.gate_proj.weight"] = up_gate[geo.h :]
            out[h + f"mlp.experts.{e}.down_proj.weight"] = t[b + "feed_forward_moe.experts.w_down"][e].T
    return out


def hf_config(geo: Geo = GEO) -> dict:
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": geo.v,
        "hidden_size": geo.d,
        "intermediate_size": geo.h,
        "num_hidden_layers": geo.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": geo.e,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_hf(
    path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None, shard: int = 1 << 30
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    w = ShardedWriter(path, [(k, v.dtype, v.shape) for k, v in tensors.items()], max_shard_bytes=shard)
    for k, v in tensors.items():
        w.write(k, v.contiguous())
    w.close()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = s.get_tensor(k)
    return out


def save_native(
    path: Path,
    t: dict[str, torch.Tensor],
    *,
    moments: bool = True,
    flat_main: bool = False,
    geo: Geo = GEO,
) -> None:
    """Saves like a trainer would: model weights, Adam moments, the saved architecture; with
    `flat_main` the expert master weights also live as flat 1-D optimizer tensors."""
    state: dict = {"model": dict(t), "model_config": {"vocab_size": geo.v, "padded_vocab_size": geo.vp}}
    optim: dict = {}
    for k, v in t.items():
        if moments:
            optim[k] = {"exp_avg": torch.full_like(v, 7.0), "exp_avg_sq": torch.full_like(v, 9.0)}
        if flat_main and "experts" in k:
            optim.setdefault(k, {})["main"] = v.reshape(-1).clone()
            state["model"][k] = torch.zeros_like(v)  # a stale compute copy: the master weights win
    if optim:
        state["optim"] = optim
    olmo_chunks.save(state, path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    t = olmoe_native()
    save_native(root / "native", t)
    write_hf(root / "oracle", olmoe_hf_oracle(t), hf_config(), shard=60_000)
    return root, t


# --- native pass against the hand-written oracle ----------------------------------------------


def test_export_matches_hand_written_oracle(moe, tmp_path):
    root, t = moe
    export_checkpoint(
        root / "native",
        tmp_path / "hf",
        format="hf",
        config=root / "oracle" / "config.json",
        max_shard_bytes=50_000,
        memory_budget=4096,
    )
    got, want = read_hf(tmp_path / "hf"), olmoe_hf_oracle(t)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(want) and len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["olmo_chunks"]["vocab_size"] == V
    assert index["metadata"]["olmo_chunks"]["padded_vocab_size"] == VP


@pytest.mark.parametrize(
    "geo",
    [Geo(v=50, vp=64, d=8, h=24, e=1, layers=1), Geo(v=257, vp=384, d=16, h=8, e=6, layers=3)],
    ids=["1-expert-wide", "6-experts-3-layers"],
)
def test_other_geometries_match_the_oracle(tmp_path, geo):
    """Other widths, expert counts and vocab paddings, exported in small budgets and validated
    (native pass) against the hand-written oracle."""
    t = olmoe_native(seed=11, geo=geo)
    save_native(tmp_path / "native", t, moments=False, geo=geo)
    export_checkpoint(tmp_path / "native", tmp_path / "hf", config=hf_config(geo), memory_budget=512)
    got, want = read_hf(tmp_path / "hf"), olmoe_hf_oracle(t, geo)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    write_hf(tmp_path / "oracle", want, hf_config(geo))
    report = validate_conversion(
        tmp_path / "native", tmp_path / "oracle", round_trip=False, memory_budget=700
    )
    assert report["ok"], report["failures"]


def test_validate_passes_on_oracle_and_reports(moe, tmp_path):
    root, _ = moe
    report = validate_conversion(root / "native", root / "oracle", memory_budget=2048)
    assert report["ok"], report["failures"]
    native = {r["name"]: r for r in report["passes"]["native"]["tensors"]}
    assert len(native) == len(olmoe_hf_oracle(olmoe_native()))
    emb = native["model.embed_tokens.weight"]
    assert emb["packing"] == [{"trim_vocab": {"dim": 0}}] and emb["source"] == "model.embeddings.weight"
    gate = native["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert gate["packing"] == [
        {"take": {"dim": 0, "index": 2}},
        {"blocks": {"dim": 0, "parts": 2, "order": [1]}},
    ]
    assert gate["sha256"] == gate["expected_sha256"]
    assert report["native_checkpoint"]["vocab_size"] == V
    assert report["native_checkpoint"]["skipped_roles"] == {
        "exp_avg": len(olmoe_native()),
        "exp_avg_sq": len(olmoe_native()),
    }
    assert report["config"]["sha256"] and report["mapping"]["name"] == "olmoe"
    assert report["passes"]["round_trip"]["ok"]


def test_moments_are_never_read(moe, tmp_path):
    """Export and validation succeed with every optimizer-moment chunk corrupted."""
    root, _ = moe
    ckpt = tmp_path / "native"
    shutil.copytree(root / "native", ckpt)
    m = _core.Manifest.open(str(ckpt))
    files = [f.path for f in m.files]
    for i, t in enumerate(m.tensors):
        if t.key.endswith(("exp_avg", "exp_avg_sq")):
            for c in m.chunks(i):
                with open(ckpt / files[c.file], "r+b") as f:
                    f.seek(c.offset)
                    f.write(b"\xff" * c.nbytes)
    with pytest.raises(olmo_chunks.errors.ChecksumError):
        m.verify_data()
    export_checkpoint(ckpt, tmp_path / "hf", config=root / "oracle" / "config.json")
    assert validate_conversion(ckpt, root / "oracle", round_trip=False)["ok"]


def test_flat_optimizer_master_weights_are_the_source(tmp_path):
    t = olmoe_native(seed=3)
    save_native(tmp_path / "native", t, moments=False, flat_main=True)
    write_hf(tmp_path / "oracle", olmoe_hf_oracle(t), hf_config())
    report = validate_conversion(tmp_path / "native", tmp_path / "oracle", round_trip=False)
    assert report["ok"], report["failures"]
    rec = {r["name"]: r for r in report["passes"]["native"]["tensors"]}[
        "model.layers.0.mlp.experts.1.up_proj.weight"
    ]
    assert rec["source"] == "optim.blocks.0.feed_forward_moe.experts.w_up_gate.main"
    assert rec["source_saved_shape"] == [E * 2 * H * D] and rec["source_shape"] == [E, 2 * H, D]
    assert rec["also_saved"] == ["model.blocks.0.feed_forward_moe.experts.w_up_gate"]


def _save_ep(path: str, seed: int, ep_mp: int, ep_dp: int) -> None:
    """Rank body: dense weights as plain tensors, experts as this rank's EP-MP x EP-DP flat view."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model: dict = {}
    for k, v in olmoe_native(seed).items():
        if "experts" in k:
            lo = ExpertLayout(E, tuple(v.shape[1:]), rank // ep_dp, ep_mp, rank % ep_dp, ep_dp)
            start, length = lo.flat_range
            model[k] = ExpertFlatView(lo, v.reshape(-1)[start : start + length].clone())
        else:
            model[k] = v
    olmo_chunks.save({"model": model, "model_config": {"vocab_size": V}}, path)


def test_expert_flat_views_saved_on_four_ranks(tmp_path):
    """Experts saved as EP-MP 2 x EP-DP 2 flat ranges on a real gloo world validate against the
    oracle; the report shows the flat chunks."""
    world.run(4, _save_ep, str(tmp_path / "native"), 5, 2, 2)
    write_hf(tmp_path / "oracle", olmoe_hf_oracle(olmoe_native(5)), hf_config())
    report = validate_conversion(
        tmp_path / "native", tmp_path / "oracle", round_trip=False, memory_budget=1000
    )
    assert report["ok"], report["failures"]
    rec = {r["name"]: r for r in report["passes"]["native"]["tensors"]}
    assert rec["model.layers.1.mlp.experts.3.down_proj.weight"]["source_chunks"] == {"flat": 4}
    assert rec["model.layers.1.self_attn.q_proj.weight"]["source_chunks"] == {"box": 1}


# --- planted faults ---------------------------------------------------------------------------


def _one_ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous().clone()
    x.view(-1)[5] = torch.nextafter(x.view(-1)[5], torch.tensor(float("inf")))
    return x


def _nan(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous().clone()
    x.view(-1)[3] = float("nan")
    return x


GU = "model.layers.0.mlp.experts.1."
FAULTS = {
    "missing": (
        {"model.layers.1.mlp.experts.2.up_proj.weight"},
        lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"),
    ),
    "extra": (
        {"model.layers.0.mlp.experts.4.gate_proj.weight"},
        lambda t: t.__setitem__(
            "model.layers.0.mlp.experts.4.gate_proj.weight", t[GU + "gate_proj.weight"].clone()
        ),
    ),
    "wrong_shape": (
        {"model.layers.0.self_attn.k_proj.weight"},
        lambda t: t.__setitem__(
            "model.layers.0.self_attn.k_proj.weight", t["model.layers.0.self_attn.k_proj.weight"][:, :-1]
        ),
    ),
    "nan": (
        {"model.layers.1.self_attn.v_proj.weight"},
        lambda t: t.__setitem__(
            "model.layers.1.self_attn.v_proj.weight", _nan(t["model.layers.1.self_attn.v_proj.weight"])
        ),
    ),
    "one_ulp": (
        {"model.layers.0.mlp.experts.3.down_proj.weight"},
        lambda t: t.__setitem__(
            "model.layers.0.mlp.experts.3.down_proj.weight",
            _one_ulp(t["model.layers.0.mlp.experts.3.down_proj.weight"]),
        ),
    ),
    "gate_up_swapped": (
        {GU + "gate_proj.weight", GU + "up_proj.weight"},
        lambda t: t.update(
            {
                GU + "gate_proj.weight": t[GU + "up_proj.weight"],
                GU + "up_proj.weight": t[GU + "gate_proj.weight"],
            }
        ),
    ),
    "vocab_trim_beyond_padding": (
        {"model.embed_tokens.weight"},
        lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][: V - 1]),
    ),
}


def _plant_duplicate(src: Path, dst: Path, name: str) -> None:
    """Copies the HF dir and stores `name` a second time in another indexed file."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    home = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    files = SafetensorsDir(src)
    tensors = {
        k: files.read_box(k, [0] * len(t.shape), list(t.shape))
        for k, t in files.tensors.items()
        if t.file.name == other
    }
    tensors[name] = files.read_box(
        name, [0] * len(files.tensors[name].shape), list(files.tensors[name].shape)
    )
    tmp = dst / "tmp"
    write_hf(tmp, tensors)
    (tmp / "model-00001-of-00001.safetensors").replace(dst / other)
    shutil.rmtree(tmp)


@pytest.mark.parametrize("fault", [*FAULTS, "duplicate"])
def test_planted_fault_fails_and_names_tensor(moe, tmp_path, fault, capsys):
    root, t = moe
    bad = tmp_path / "bad"
    if fault == "duplicate":
        names = {"model.layers.0.self_attn.q_proj.weight"}
        _plant_duplicate(root / "oracle", bad, next(iter(names)))
    else:
        names, plant = FAULTS[fault]
        tensors = olmoe_hf_oracle(t)
        plant(tensors)
        write_hf(bad, tensors, hf_config(), shard=60_000)
    report_path = tmp_path / "report.json"
    rc = main(
        [
            "validate-conversion",
            "--native",
            str(root / "native"),
            "--hf",
            str(bad),
            "--report",
            str(report_path),
            "--memory-budget",
            "4096",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    for n in names:
        assert f"FAIL native pass: {n}:" in err
    report = json.loads(report_path.read_text())
    assert not report["ok"] and not report["passes"]["native"]["ok"]
    failing = {r["name"] for r in report["passes"]["native"]["tensors"] if r["status"] == "fail"}
    if fault != "duplicate":
        assert failing == names, report["passes"]["native"]["failures"]
    else:
        assert failing == names and any("stored more than once" in f for f in report["failures"])
    # Only the tensors at fault fail (no collateral noise in the native pass).
    assert all(
        f.split(":")[0] in names or f.startswith("config.") for f in report["passes"]["native"]["failures"]
    )


def test_wrong_gate_up_order_in_a_mapping_is_caught(moe, tmp_path):
    root, _ = moe
    spec = json.loads((Path(olmo_chunks.__file__).parent / "mappings" / "olmoe.json").read_text())
    for rule in spec["tensors"]:
        for op in rule.get("ops", []):
            if "blocks" in op:
                op["blocks"]["order"] = [1 - op["blocks"]["order"][0]]
    (tmp_path / "swapped.json").write_text(json.dumps(spec))
    report = validate_conversion(
        root / "native", root / "oracle", mapping=str(tmp_path / "swapped.json"), round_trip=False
    )
    failing = {r["name"] for r in report["passes"]["native"]["tensors"] if r["status"] == "fail"}
    assert failing == {
        f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
        for i in range(L)
        for e in range(E)
        for p in ("gate", "up")
    }


def test_config_mismatch_fails(moe, tmp_path):
    root, _ = moe
    cfg = hf_config()
    cfg["num_experts"] = E + 1
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    report = validate_conversion(
        root / "native", root / "oracle", config=tmp_path / "c.json", round_trip=False
    )
    assert not report["ok"]
    assert any(f.startswith("native pass: config.num_experts:") for f in report["failures"])
    with pytest.raises(ConversionError, match=r"config\.num_experts"):
        export_checkpoint(root / "native", tmp_path / "x", config=cfg)


def test_export_refuses_unmapped_and_nonfinite(tmp_path):
    t = olmoe_native()
    t["blocks.0.mystery.weight"] = torch.ones(3)
    olmo_chunks.save({"model": t}, tmp_path / "a")
    with pytest.raises(ConversionError, match="mystery"):
        export_checkpoint(tmp_path / "a", tmp_path / "out", mapping="olmoe", config=hf_config())
    t = olmoe_native()
    t["blocks.1.attention.w_k.weight"][2, 3] = float("inf")
    olmo_chunks.save({"model": t, "model_config": {"vocab_size": V}}, tmp_path / "b")
    with pytest.raises(ConversionError, match=r"model\.blocks\.1\.attention\.w_k\.weight: nonfinite"):
        export_checkpoint(tmp_path / "b", tmp_path / "out2", config=hf_config())
    assert not (tmp_path / "out2" / INDEX_NAME).exists()


def _model_files(out: Path) -> dict[str, bytes]:
    """What an export directory shows a reader (the hidden lock and stages aside)."""
    return {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}


def test_a_refused_or_killed_export_leaves_the_model_already_there(tmp_path, monkeypatch):
    """--overwrite replaces a model only with a complete one: a refused export (a nonfinite weight
    found after other tensors were written) leaves the old one as it was, and a fresh OUT empty.
    Until 2026-12-07 the old model was deleted first and the refused export left a shard holding
    zeros for the refused tensor. A second export into OUT while one writes there is refused."""
    good = {"a": torch.arange(4.0), "z": torch.ones(3, 2)}
    olmo_chunks.save({"model": good}, tmp_path / "good")
    bad = {"a": torch.arange(4.0) + 1, "z": torch.ones(3, 2)}
    bad["z"][2, 1] = float("nan")
    olmo_chunks.save({"model": bad}, tmp_path / "bad")
    out = tmp_path / "out"
    export_checkpoint(tmp_path / "good", out, format="safetensors", max_shard_bytes=16)  # a file per tensor
    before = _model_files(out)
    assert len(before) == 3
    with pytest.raises(ConversionError, match=r"model\.z: nonfinite"):
        export_checkpoint(tmp_path / "bad", out, format="safetensors", overwrite=True)
    assert _model_files(out) == before and not list(out.glob(".olmo-chunks-export-*"))
    with pytest.raises(ConversionError, match=r"model\.z: nonfinite"):
        export_checkpoint(tmp_path / "bad", tmp_path / "fresh", format="safetensors")
    assert _model_files(tmp_path / "fresh") == {}
    from olmo_chunks.hf import export as export_module

    # Another export writing there: refused, nothing touched (its stage is not removed).
    with export_module._staged(out) as theirs:
        with pytest.raises(CheckpointLockedError, match="another export is writing there"):
            export_checkpoint(tmp_path / "good", out, format="safetensors", overwrite=True)
        assert theirs.is_dir() and _model_files(out) == before
    # A killed export's hidden directory goes with the next export; the new model replaces the old.
    def killed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("killed")

    monkeypatch.setattr(export_module, "_publish", killed)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # as if killed: the stage stays
    with pytest.raises(RuntimeError, match="killed"):
        export_checkpoint(tmp_path / "good", out, format="safetensors", overwrite=True)
    monkeypatch.undo()
    assert _model_files(out) == before
    assert len(list(out.glob(".olmo-chunks-export-*"))) == 1
    bad["z"][2, 1] = 5.0
    olmo_chunks.save({"model": bad}, tmp_path / "bad", overwrite=True)
    export_checkpoint(tmp_path / "bad", out, format="safetensors", overwrite=True)
    assert sorted(_model_files(out)) == ["model-00001-of-00001.safetensors", INDEX_NAME]
    assert not list(out.glob(".olmo-chunks-export-*"))
    got = read_hf(out)
    assert torch.equal(got["model.a"], bad["a"]) and torch.equal(got["model.z"], bad["z"])


def test_values_beyond_the_target_dtype_are_refused_not_written_as_inf(tmp_path, capsys):
    # The finite check ran before the cast: --dtype fp16 wrote [1, 70000, -1e6] as [1, inf, -inf].
    olmo_chunks.save({"model": {"w": torch.ones(4, 4), "big": torch.tensor([1.0, 70000.0, -1e6])}}, tmp_path / "ck")
    with pytest.raises(ConversionError, match=r"model\.big: value 70000\.0 overflows float16 \(exporting model\.big\)"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out", format="safetensors", dtype="fp16")
    assert not (tmp_path / "out" / INDEX_NAME).exists()
    argv = ["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--format", "safetensors", "--dtype", "fp16"]
    assert main(argv) == 1
    assert "model.big: value 70000.0 overflows float16" in capsys.readouterr().err
    assert not (tmp_path / "out" / INDEX_NAME).exists()
    # fp16 holds 65504; the largest float32 rounds to inf in bf16 too (on export and on import).
    olmo_chunks.save({"model": {"ok": torch.tensor([65504.0, -65504.0])}}, tmp_path / "fits")
    export_checkpoint(tmp_path / "fits", tmp_path / "fits16", format="safetensors", dtype="fp16")
    assert read_hf(tmp_path / "fits16")["model.ok"].tolist() == [65504.0, -65504.0]
    top = torch.finfo(torch.float32).max
    olmo_chunks.save({"model": {"top": torch.tensor([top])}}, tmp_path / "top")
    with pytest.raises(ConversionError, match=r"model\.top: value .* overflows bfloat16"):
        export_checkpoint(tmp_path / "top", tmp_path / "top16", format="safetensors", dtype="bf16")
    tensors = olmoe_hf_oracle(olmoe_native())
    tensors["model.norm.weight"][3] = top
    write_hf(tmp_path / "hf", tensors, hf_config())
    with pytest.raises(ConversionError, match=r"model\.norm\.weight: value .* overflows bfloat16"):
        import_hf(tmp_path / "hf", tmp_path / "imported", dtype="bf16")
    assert not (tmp_path / "imported" / "olmo_chunks.manifest").exists()


def test_safetensors_format_keeps_native_names_and_moments_on_request(moe, tmp_path):
    root, t = moe
    rc = main(
        ["export", str(root / "native"), str(tmp_path / "st"), "--format", "safetensors", "--dtype", "bf16"]
    )
    assert rc == 0
    got = read_hf(tmp_path / "st")
    assert sorted(got) == sorted(f"model.{k}" for k in t)
    assert all(torch.equal(got[f"model.{k}"], v.to(torch.bfloat16)) for k, v in t.items())
    export_checkpoint(root / "native", tmp_path / "st2", format="safetensors", include_moments=True)
    got = read_hf(tmp_path / "st2")
    assert len(got) == 3 * len(t) and torch.equal(
        got["optim.embeddings.weight.exp_avg"], torch.full((VP, D), 7.0)
    )


def test_bf16_export_validates_with_recorded_cast(moe, tmp_path):
    root, _ = moe
    export_checkpoint(root / "native", tmp_path / "hf", dtype="bf16", config=hf_config())
    report = validate_conversion(root / "native", tmp_path / "hf", round_trip=False)
    assert report["ok"], report["failures"]
    assert {r["cast"] for r in report["passes"]["native"]["tensors"]} == {"float32->bfloat16"}
    assert report["recorded_export"]["casts"] == {"float32->bfloat16": len(olmoe_hf_oracle(olmoe_native()))}


def test_parse_bytes():
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1GiB") == 1 << 30 and parse_bytes("4096") == 4096
    with pytest.raises(InvalidArgumentError):
        parse_bytes("lots")


# --- real transformers clients ----------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _tiny(transformers, kind: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=H,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "olmoe":
        model = transformers.OlmoeForCausalLM(
            transformers.OlmoeConfig(num_experts=E, num_experts_per_tok=2, **common)
        )
    else:
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # distinct, non-unit norms and gains everywhere
    return model.eval()


def _hub_names(kind: str) -> set[str]:
    """Tensor names of the HF (Hub) layout, written by hand."""
    names = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    for i in range(L):
        p = f"model.layers.{i}."
        names |= {
            p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        if kind == "olmoe":
            names |= {
                p + "input_layernorm.weight",
                p + "post_attention_layernorm.weight",
                p + "mlp.gate.weight",
            }
            names |= {
                p + f"mlp.experts.{e}.{m}_proj.weight" for e in range(E) for m in ("gate", "up", "down")
            }
        else:
            names |= {p + "post_attention_layernorm.weight", p + "post_feedforward_layernorm.weight"}
            names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
    return names


def _model_names(kind: str) -> set[str]:
    """Names the installed transformers uses in the model's state dict: v5 fuses OLMoE experts."""
    names = _hub_names(kind)
    if kind == "olmoe" and hf_expert_layout() == "fused":
        names = {n for n in names if ".mlp.experts." not in n}
        names |= {
            f"model.layers.{i}.mlp.experts.{m}" for i in range(L) for m in ("gate_up_proj", "down_proj")
        }
    return names


@pytest.mark.parametrize("kind", ["olmoe", "olmo2"])
def test_transformers_round_trip_identical_logits(transformers, tmp_path, kind):
    model = _tiny(transformers, kind)
    assert set(model.state_dict()) == _model_names(kind)
    model.save_pretrained(tmp_path / "orig")
    assert main(["import-hf", str(tmp_path / "orig"), str(tmp_path / "native")]) == 0
    m = _core.Manifest.open(str(tmp_path / "native"))
    shapes = {t.key: t.shape for t in m.tensors}
    assert shapes["model.embeddings.weight"] == [VP, D]  # padded to a multiple of 128
    assert (
        main(
            [
                "export",
                str(tmp_path / "native"),
                str(tmp_path / "out"),
                "--memory-budget",
                "8K",
                "--max-shard-size",
                "40K",
            ]
        )
        == 0
    )
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 1
    got = read_hf(tmp_path / "out")  # safe_open reads every file
    assert set(got) == _hub_names(kind)
    weight_map = json.loads((tmp_path / "out" / INDEX_NAME).read_text())["weight_map"]
    assert set(weight_map) == set(got) and set(weight_map.values()) == {f.name for f in files}
    back = type(model).from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    report_path = tmp_path / "report.json"
    assert (
        main(
            [
                "validate-conversion",
                "--native",
                str(tmp_path / "native"),
                "--hf",
                str(tmp_path / "out"),
                "--report",
                str(report_path),
            ]
        )
        == 0
    )
    rt = json.loads(report_path.read_text())["passes"]["round_trip"]
    assert rt["ok"] and rt["hf_model"].startswith(f"transformers {transformers.__version__}")
    if kind == "olmoe":
        assert rt["model_mapping"]["name"] == ("olmoe-fused" if hf_expert_layout() == "fused" else "olmoe")


def test_transformers_fused_layout_export_loads(transformers, tmp_path):
    """Exporting with the installed version's own state-dict layout loads too (v5: fused experts)."""
    model = _tiny(transformers, "olmoe")
    model.save_pretrained(tmp_path / "orig")
    import_hf(tmp_path / "orig", tmp_path / "native")
    mapping = "olmoe-fused" if hf_expert_layout() == "fused" else "olmoe"
    export_checkpoint(tmp_path / "native", tmp_path / "out", mapping=mapping, dtype="bf16")
    assert set(read_hf(tmp_path / "out")) == _model_names("olmoe")
    # The reference is the original loaded the same way (`model.to(bf16)` also casts the rotary buffers).
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.bfloat16}
    back = type(model).from_pretrained(tmp_path / "out", **kw).eval()
    ref = type(model).from_pretrained(tmp_path / "orig", **kw).eval()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ref.state_dict().items())
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, back(ids).logits)
    assert validate_conversion(tmp_path / "native", tmp_path / "out", mapping=mapping)["ok"]


# --- bounded memory ---------------------------------------------------------------------------

RSS_SCRIPT = r"""
import re, sys
from olmo_chunks import cli
from olmo_chunks.hf import export  # everything the command imports, before the baseline

def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) so the imports' transient peak does not count
base = status("VmRSS")
rc = cli.main(sys.argv[1:])
print(rc, base, status("VmHWM"))
"""


def _peak_rss(args: list[str]) -> tuple[int, int, int]:
    """`(exit status, RSS after imports, peak RSS during the command)` of a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, *args], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[-3]), int(out[-2]), int(out[-1])


def test_export_peak_rss_bounded_by_budget(tmp_path):
    """Export of a ~130 MiB checkpoint with an 8 MiB budget: the peak RSS above the process with
    its imports stays within a few budgets, far below the checkpoint size."""
    d, ffn, layers = 1024, 4096, 2
    g = torch.Generator().manual_seed(0)
    t = {
        "embeddings.weight": torch.randn(512, d, generator=g),
        "lm_head.w_out.weight": torch.randn(512, d, generator=g),
        "lm_head.norm.weight": torch.randn(d, generator=g),
    }
    for i in range(layers):
        b = f"blocks.{i}."
        for n in ("w_q", "w_k", "w_v", "w_out"):
            t[b + f"attention.{n}.weight"] = torch.randn(d, d, generator=g)
        for n in ("q_norm", "k_norm"):
            t[b + f"attention.{n}.weight"] = torch.randn(d, generator=g)
        t[b + "attention_norm.weight"] = torch.randn(d, generator=g)
        t[b + "feed_forward_norm.weight"] = torch.randn(d, generator=g)
        t[b + "feed_forward.w1.weight"] = torch.randn(ffn, d, generator=g)
        t[b + "feed_forward.w3.weight"] = torch.randn(ffn, d, generator=g)
        t[b + "feed_forward.w2.weight"] = torch.randn(d, ffn, generator=g)
    size = sum(v.numel() * 4 for v in t.values())
    olmo_chunks.save({"model": t, "model_config": {"vocab_size": 500}}, tmp_path / "big")
    del t
    cfg = {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "vocab_size": 500,
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    budget = 8 << 20
    rc, base, peak = _peak_rss(
        [
            "export",
            str(tmp_path / "big"),
            str(tmp_path / "out"),
            "--config",
            str(tmp_path / "cfg.json"),
            "--memory-budget",
            str(budget),
        ]
    )
    assert rc == 0
    extra = peak - base
    print(
        f"\nexport peak RSS: checkpoint {size / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB, "
        f"after imports {base / 2**20:.0f} MiB, export {peak / 2**20:.0f} MiB (+{extra / 2**20:.0f} MiB)"
    )
    assert size >= 16 * budget
    # A few budgets of tensor data plus a fixed overhead (reader threads and buffers, code pages of
    # the torch ops touched on first use), independent of the checkpoint size.
    assert extra < 3 * budget + (24 << 20) and extra < size / 4, (base, peak)
    out = SafetensorsDir(tmp_path / "out")
    assert out.tensors["model.layers.1.mlp.down_proj.weight"].shape == (d, ffn)
    assert out.read_box("model.embed_tokens.weight", [0, 0], [500, d]).shape == (500, d)


def test_round_trip_without_transformers_uses_the_files(moe, monkeypatch):
    root, _ = moe
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    report = validate_conversion(root / "native", root / "oracle")
    rt = report["passes"]["round_trip"]
    assert report["ok"] and rt["hf_model"] == "safetensors files (transformers not installed)"
    assert rt["model_mapping"]["name"] == "olmoe" and len(rt["tensors"]) == len(
        olmoe_hf_oracle(olmoe_native())
    )


def test_import_refuses_unmapped_and_inconsistent_hf_tensors(moe, tmp_path):
    _, t = moe
    tensors = olmoe_hf_oracle(t)
    tensors["model.layers.0.mlp.shared_expert.weight"] = torch.ones(2)
    write_hf(tmp_path / "a", tensors, hf_config())
    with pytest.raises(
        ConversionError, match=r"model\.layers\.0\.mlp\.shared_expert\.weight: HF tensor that no"
    ):
        import_hf(tmp_path / "a", tmp_path / "n1", mapping="olmoe")
    tensors = olmoe_hf_oracle(t)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:90]
    write_hf(tmp_path / "b", tensors, hf_config())
    assert main(["import-hf", str(tmp_path / "b"), str(tmp_path / "n2")]) == 1
    assert not (tmp_path / "n2" / "olmo_chunks.manifest").exists()


def test_nonfinite_native_weights_fail_validation(tmp_path):
    t = olmoe_native(seed=2)
    t["blocks.0.feed_forward_moe.experts.w_down"][1, 2, 3] = float("nan")
    save_native(tmp_path / "native", t, moments=False)
    write_hf(tmp_path / "hf", olmoe_hf_oracle(t), hf_config())
    report = validate_conversion(tmp_path / "native", tmp_path / "hf", round_trip=False)
    assert report["passes"]["native"]["failures"] == [
        "model.layers.0.mlp.experts.1.down_proj.weight: nonfinite values in the HF tensor",
        "model.layers.0.mlp.experts.1.down_proj.weight: nonfinite values in the native tensor "
        "model.blocks.0.feed_forward_moe.experts.w_down",
    ]


def test_unreadable_hf_dir_fails_with_a_report(moe, tmp_path, capsys):
    root, _ = moe
    shutil.copytree(root / "oracle", tmp_path / "hf")
    victim = sorted((tmp_path / "hf").glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated file
    rc = main(
        [
            "validate-conversion",
            "--native",
            str(root / "native"),
            "--hf",
            str(tmp_path / "hf"),
            "--report",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 1 and "data section" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is False


def test_import_hf_with_compression_holds_the_same_tensors(transformers, tmp_path):
    _tiny(transformers, "olmo2").save_pretrained(tmp_path / "orig")
    import_hf(tmp_path / "orig", tmp_path / "raw")
    args = ["--compression", "zstd", "--compression-level", "1"]
    assert main(["import-hf", str(tmp_path / "orig"), str(tmp_path / "z"), *args]) == 0
    raw, z = _core.Manifest.open(str(tmp_path / "raw")), _core.Manifest.open(str(tmp_path / "z"))
    assert (raw.format_version, z.format_version) == (1, 2)
    assert sum(t.stored_nbytes for t in z.tensors) < sum(t.nbytes for t in z.tensors)
    states = [{t.key: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in raw.tensors} for _ in range(2)]
    for sd, path in zip(states, ("raw", "z"), strict=True):
        olmo_chunks.load(sd, tmp_path / path, strict=False)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
