"""A checkpoint holding `TrainerState` saved on several ranks loads with `strict=True` on the same
layout: each rank holds only its own `trainer.rng.rankNNNNN.*`, and the other ranks' are trainer
state (restored by `load_trainer_state`), not unexpected keys; a load of model and optimizer alone
leaves every trainer entry to `load_trainer_state`. Everything else stays strict. The
docs/RESUME.md example is run from the document's own text on 2 gloo ranks."""

from pathlib import Path

import olmo_chunks
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import _core
from olmo_chunks.errors import MismatchError
from olmo_chunks.trainer_state import RNG_PREFIX, TrainerState
from torch.distributed.tensor import DTensor, Shard

from tests import world

RESUME_MD = Path(__file__).resolve().parents[1] / "docs" / "RESUME.md"
LAYOUT = {"pp": 1, "ep_mp": 2, "ep_dp": 2}  # the example's; world_size is the group's own
EXAMPLE = {
    "step": 120, "tokens": 120 * 4096, "epoch": 1, "seed": 1234,
    "data_position": {"batches_processed": 120, "sampler_epoch": 1},
    "config": {"model": {"d_model": 8}, "optim": {"lr": 1e-3, "betas": [0.9, 0.95]}},
    "data_manifest": [{"path": "data/part-000.npy", "tokens": 1 << 20}],
    "extra": {"callbacks": {"speed_monitor": {"last_step_time": 1.5}}},
}


def _model_and_optim(fill: float | None = None) -> dict:
    """A row-sharded weight with its Adam moments, and a replicated bias: FP32, 2-rank layout."""
    mesh = world.mesh((dist.get_world_size(),))
    rank = dist.get_rank()

    def sharded(base: float) -> DTensor:
        local = torch.arange(12.0).reshape(3, 4) + 100 * rank + base
        return DTensor.from_local(local if fill is None else torch.full_like(local, fill), mesh, [Shard(0)])

    bias = torch.arange(4.0) if fill is None else torch.full((4,), fill)
    return {"model": {"w": sharded(0), "b": bias},
            "optim": {"w": {"exp_avg": sharded(1), "exp_avg_sq": sharded(2)}, "b": {"step": torch.tensor(5.0)}}}


def _plain(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _plain(v).items()})
        else:
            out[k] = (v.to_local() if isinstance(v, DTensor) else v).tolist()
    return out


def _save_then_load_strict(path: str) -> dict:
    ts = TrainerState(**EXAMPLE)
    olmo_chunks.save({**_model_and_optim(), **ts.state_dict(layout=LAYOUT)}, path)
    saved_keys = {t.key for t in _core.Manifest.open(path).tensors}

    dest = {**_model_and_optim(fill=-1.0), **TrainerState().state_dict(layout=LAYOUT)}
    report = olmo_chunks.load(dest, path)  # strict=True is the default
    mine = f"{RNG_PREFIX}rank{dist.get_rank():05d}."
    return {
        "ok": report.ok, "unexpected": report.unexpected, "missing": report.missing,
        "loaded_rng": sorted(k for k in report.loaded if k.startswith(RNG_PREFIX)),
        "mine": mine, "saved_keys": saved_keys,
        "values_equal": _plain({k: dest[k] for k in ("model", "optim")}) == _plain(_model_and_optim()),
        "step": dest["trainer"]["step"],
    }


def test_strict_load_of_a_two_rank_trainer_state_on_the_same_layout(tmp_path):
    out = world.run(2, _save_then_load_strict, str(tmp_path / "ck"))
    other = {0: "rank00001", 1: "rank00000"}
    for rank, r in enumerate(out):
        # The checkpoint holds both ranks' RNG states (what made the strict load fail before).
        assert any(k.startswith(f"{RNG_PREFIX}{other[rank]}.") for k in r["saved_keys"])
        assert r["ok"] and r["unexpected"] == [] and r["missing"] == []
        assert r["values_equal"] and r["step"] == EXAMPLE["step"]
        # Each rank loaded its own RNG entries and none of the other rank's.
        assert r["loaded_rng"] and all(k.startswith(r["mine"]) for k in r["loaded_rng"])


def _still_strict(path: str) -> list:
    olmo_chunks.save({**_model_and_optim(), **TrainerState(**EXAMPLE).state_dict(layout=LAYOUT)}, path)
    dest = _model_and_optim(fill=0.0)
    del dest["optim"]["b"]  # a genuinely unexpected model/optimizer key
    partial_trainer = TrainerState().state_dict(layout=LAYOUT)
    del partial_trainer["trainer"]["step"]
    errors = []
    for sd in ({**dest, **TrainerState().state_dict(layout=LAYOUT)},  # optim.b.step unexpected
               {**_model_and_optim(fill=0.0), **partial_trainer}):  # holds trainer state: still checked
        with pytest.raises(MismatchError) as info:
            olmo_chunks.load(sd, path)
        errors.append(info.value.mismatches)
    report = olmo_chunks.load({**dest, **TrainerState().state_dict(layout=LAYOUT)}, path, strict=False)
    # Model and optimizer alone: the trainer entries are load_trainer_state's, not unexpected.
    alone = _model_and_optim(fill=0.0)
    alone_report = olmo_chunks.load(alone, path)
    alone_equal = _plain(alone) == _plain(_model_and_optim())
    return [*errors, report.unexpected, (alone_report.ok, alone_report.unexpected, alone_equal)]


def test_other_unexpected_keys_still_fail_a_strict_load(tmp_path):
    for m_optim, m_trainer, unexpected, alone in world.run(2, _still_strict, str(tmp_path / "ck")):
        assert m_optim == ["optim.b.step: in the checkpoint but not in the state dict"]
        assert m_trainer == ["trainer.step: in the checkpoint but not in the state dict"]
        assert unexpected == ["optim.b.step"]
        assert alone == (True, [], True)
