"""Trainer state: counters, data position and per-rank RNG states, restored exactly on the same
layout and reseeded by the documented rule on a new one, on real gloo worlds."""

import random

import numpy as np
import olmo_chunks as oc
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import roles
from olmo_chunks.errors import InvalidArgumentError, MismatchError
from olmo_chunks.trainer_state import (
    TrainerState,
    capture_rng,
    derive_seed,
    load_trainer_state,
    reseed_rng,
    restore_rng,
)

from tests import world


def draws() -> tuple:
    """The next values of every generator, as exact data."""
    return (random.random(), random.getrandbits(64), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1 << 30, (2,)).tolist())


def sample_state(step: int = 7) -> TrainerState:
    return TrainerState(
        step=step, tokens=step * 4096, epoch=1, seed=1234,
        data_position={"batches_processed": step, "tokens_processed": step * 4096, "sampler_epoch": 1},
        config={"model": {"d_model": 64, "num_experts": 4}, "optim": {"lr": 1e-3, "betas": (0.9, 0.95)}},
        data_manifest=[{"path": "data/part-000.npy", "tokens": 1 << 20}, {"path": "data/part-001.npy"}],
        extra={"callbacks": {"speed_monitor": {"last_step_time": 1.5}}},
    )


def test_capture_restore_roundtrip_in_process():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    saved = capture_rng()
    want = draws()
    draws()
    restore_rng(saved)
    assert draws() == want


def test_single_process_save_load(tmp_path):
    path = tmp_path / "ck"
    ts = sample_state()
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    oc.save({"w": torch.ones(3), **ts.state_dict(layout={"dp": 1})}, path)
    want = draws()
    resumed = load_trainer_state(path, layout={"dp": 1})
    assert resumed.rng == "restored"
    assert resumed.state == ts
    assert resumed.saved_layout == {"world_size": 1, "dp": 1}
    assert draws() == want


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a single-process DCP save
@pytest.mark.parametrize("empty", [False, True])
def test_trainer_state_saved_through_the_dcp_door(tmp_path, empty):
    """DCP's flattening drops empty dicts: a state whose config, extra or data position is empty
    saved through the DCP door lacked those entries, and `load_trainer_state` refused it as
    incomplete (until 2026-12-07)."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreWriter

    ts = TrainerState(step=6, seed=5) if empty else sample_state()
    torch.manual_seed(7)
    dcp.save({"w": torch.ones(3), **ts.state_dict()}, storage_writer=ChunkStoreWriter(tmp_path / "ck"),
             **world.NO_DIST)
    want = draws()
    resumed = load_trainer_state(tmp_path / "ck")
    assert resumed.state == ts and resumed.rng == "restored"
    assert draws() == want


def test_saved_entries_and_roles(tmp_path):
    path = tmp_path / "ck"
    oc.save(sample_state().state_dict(), path)
    tensors = {t.key: (t.dtype, t.role) for t in oc._core.Manifest.open(str(path)).tensors}
    assert tensors["trainer.rng.rank00000.torch"] == ("uint8", roles.TRAINER_STATE)
    assert set(tensors) == {"trainer.rng.rank00000.torch"} | (
        {f"trainer.rng.rank00000.cuda.{i}" for i in range(torch.cuda.device_count())}
        if torch.cuda.is_available() else set())


def test_missing_trainer_state_is_a_mismatch(tmp_path):
    oc.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(MismatchError, match="no complete trainer state") as info:
        load_trainer_state(tmp_path / "ck")
    assert "trainer.step: missing from the checkpoint" in info.value.mismatches


def test_unstorable_fields_are_refused():
    with pytest.raises(InvalidArgumentError, match=r"trainer\.config"):
        TrainerState(config={"fn": print}).state_dict()
    with pytest.raises(InvalidArgumentError, match="world_size"):
        TrainerState().state_dict(layout={"world_size": 3})


def _save_on_world(path, layout):
    rank = dist.get_rank()
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    draws()
    state = {"model": {"w": torch.arange(4.0)}, **sample_state().state_dict(layout=layout)}
    oc.save(state, path)
    return draws()


def _resume_on_world(path, layout):
    rank = dist.get_rank()
    random.seed(999)  # disturb every generator first
    np.random.seed(999)
    torch.manual_seed(999)
    w = torch.zeros(4)
    report = oc.load({"model": {"w": w}}, path, partial=True)
    resumed = load_trainer_state(path, layout=layout)
    got = draws()
    reseed_rng(derive_seed(resumed.state.seed, resumed.state.step, rank))
    reseeded = draws()
    return resumed, got, reseeded, w.tolist(), report.unexpected


def test_same_layout_restores_every_rank_exactly(tmp_path):
    path = str(tmp_path / "ck")
    after_save = world.run(4, _save_on_world, path, {"dp": 2, "ep_mp": 2})
    out = world.run(4, _resume_on_world, path, {"dp": 2, "ep_mp": 2})
    for rank, (resumed, got, _, w, unexpected) in enumerate(out):
        assert resumed.rng == "restored"
        assert resumed.state == sample_state()
        assert got == after_save[rank]
        assert w == [0.0, 1.0, 2.0, 3.0] and unexpected == []
    assert len({str(o[1]) for o in out}) == 4  # each rank had its own stream


def _state_dict_on_one_rank_then_save_and_load(path):
    if dist.get_rank() == 0:
        sample_state().state_dict()  # e.g. to log it: not collective
    oc.save({"w": torch.arange(4.0), **sample_state().state_dict()}, path, peer_timeout=5)
    w = torch.zeros(4)
    oc.load({"w": w}, path, partial=True, peer_timeout=5)
    return w.tolist(), load_trainer_state(path).state == sample_state()


def test_trainer_state_dict_on_some_ranks_only_leaves_later_saves_alone(tmp_path):
    """`state_dict` is not collective: it once made a coordination group, so calling it on rank 0
    alone shifted rank 0's keys for every later save and load, which then hung."""
    out = world.run(2, _state_dict_on_one_rank_then_save_and_load, str(tmp_path / "ck"), timeout=60)
    assert out == [([0.0, 1.0, 2.0, 3.0], True)] * 2


def test_changed_world_restores_counters_and_reseeds(tmp_path):
    path = str(tmp_path / "ck")
    world.run(4, _save_on_world, path, {"dp": 4})
    out = world.run(2, _resume_on_world, path, {"dp": 2})
    for resumed, got, reseeded, w, _ in out:
        assert resumed.rng == "reseeded"
        assert resumed.saved_layout == {"world_size": 4, "dp": 4}
        assert resumed.state == sample_state()
        assert resumed.state.data_position["batches_processed"] == 7
        assert got == reseeded  # exactly the documented rule, derive_seed(seed, step, new rank)
        assert w == [0.0, 1.0, 2.0, 3.0]
    assert out[0][1] != out[1][1]


def test_changed_layout_on_same_world_reseeds(tmp_path):
    path = str(tmp_path / "ck")
    world.run(4, _save_on_world, path, {"dp": 2, "ep_mp": 2})
    out = world.run(4, _resume_on_world, path, {"dp": 1, "ep_mp": 4})
    assert [o[0].rng for o in out] == ["reseeded"] * 4
    assert all(o[1] == o[2] for o in out)
