"""End to end: a tiny MoE transformer trained with EP-MP x EP-DP x DP on gloo, saved on one layout and
resumed on others (EP-MP, EP-DP, world size and PP changes): weights, both Adam moments and the
bookkeeping bit-exact after load, training continues, and the same layout reproduces the
uninterrupted run's losses bit for bit."""

import contextlib
import io
import math
import random

import numpy as np
import pytest
import torch
from olmo_chunks import cli, roles

from examples.moe_train import Layout, ModelConfig, Trainer, global_state
from tests import world

CFG = ModelConfig()
SAVED_ON = Layout(pp=1, ep_mp=2, ep_dp=2)
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _uninterrupted_then_saved(path):
    """The reference run (all steps), then a run of the first steps saved at `path`."""
    ref = Trainer(CFG, SAVED_ON)
    ref_losses = [ref.train_step() for _ in range(STEPS_BEFORE + STEPS_AFTER)]
    run = Trainer(CFG, SAVED_ON)
    losses = [run.train_step() for _ in range(STEPS_BEFORE)]
    run.save(path)
    return ref_losses, losses, global_state(run), run.state


def _resume(path, layout, steps, save_to=None):
    """A fresh rank (NaN storage, disturbed RNG) resumes from `path` on `layout`, trains `steps`."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    tr = Trainer(CFG, layout, init=False)
    rng = tr.load(path)
    loaded = global_state(tr)
    resumed_at = tr.state.step
    losses = [tr.train_step() for _ in range(steps)]
    saved = None
    if save_to:
        tr.save(save_to)
        saved = global_state(tr)
    return rng, resumed_at, loaded, losses, tr.state, saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe") / "step2")
    ref_losses, losses, state, trainer_state = world.run(4, _uninterrupted_then_saved, path, timeout=300)[0]
    return path, ref_losses, losses, state, trainer_state


def assert_same_state(got, want):
    assert got.keys() == want.keys()
    kinds = {k.rsplit(".", 1)[-1] for k in want}
    assert {"main", "exp_avg", "exp_avg_sq", "step", "recent_losses", "grad_norms"} <= kinds
    for key in want:
        assert got[key].dtype == want[key].dtype == torch.float32, key
        assert torch.equal(got[key], want[key]), key


def test_training_moves_and_state_is_sane(saved):
    _, ref_losses, losses, state, trainer_state = saved
    assert losses == ref_losses[:STEPS_BEFORE]
    assert all(math.isfinite(x) for x in ref_losses) and ref_losses[-1] < ref_losses[0]
    assert trainer_state.step == STEPS_BEFORE
    assert trainer_state.data_position == {"batches_processed": 2, "tokens_processed": 2 * 8 * 8}
    assert state["layers.0.experts.w_in.main"].shape == (4, 32, 32)
    assert torch.equal(state["layers.3.router.step"], torch.tensor(float(STEPS_BEFORE)))
    assert state["bookkeeping.recent_losses"][-STEPS_BEFORE:].tolist() == pytest.approx(losses, rel=1e-6)
    assert (state["layers.1.experts.w_out.exp_avg_sq"] > 0).any()


def test_same_layout_resume_is_bit_exact(saved):
    path, ref_losses, _, state, _ = saved
    out = world.run(4, _resume, path, SAVED_ON, STEPS_AFTER, timeout=300)
    _, resumed_at, loaded, losses, trainer_state, _ = out[0]
    assert [o[0] for o in out] == ["restored"] * 4
    assert resumed_at == STEPS_BEFORE
    assert_same_state(loaded, state)
    assert losses == ref_losses[STEPS_BEFORE:]  # bit for bit, router jitter RNG included
    assert trainer_state.step == STEPS_BEFORE + STEPS_AFTER


@pytest.mark.parametrize("layout", [Layout(1, 1, 2), Layout(1, 4, 1)], ids=["2ranks-ep1", "4ranks-ep4"])
def test_resume_on_new_expert_layout(saved, layout):
    path, ref_losses, _, state, _ = saved
    out = world.run(layout.world_size, _resume, path, layout, STEPS_AFTER, timeout=300)
    _, resumed_at, loaded, losses, trainer_state, _ = out[0]
    assert {o[0] for o in out} == {"reseeded"}
    assert resumed_at == STEPS_BEFORE
    assert_same_state(loaded, state)
    # Training continues along the same trajectory, up to BF16 reduction order and router jitter.
    assert losses == pytest.approx(ref_losses[STEPS_BEFORE:], rel=0.05)
    assert trainer_state.step == STEPS_BEFORE + STEPS_AFTER


def test_pipeline_change(saved, tmp_path):
    """PP=1 -> PP=2 (each stage saves its own layers under global names) -> PP=4 and PP=1."""
    path, ref_losses, _, state, _ = saved
    pp2_path = str(tmp_path / "pp2")
    out = world.run(4, _resume, path, Layout(2, 2, 1), 1, pp2_path, timeout=300)
    _, _, loaded, losses, _, pp2_state = out[0]
    assert_same_state(loaded, state)
    assert losses == pytest.approx(ref_losses[STEPS_BEFORE : STEPS_BEFORE + 1], rel=0.05)
    for layout in (Layout(4, 1, 1), Layout(1, 2, 1)):
        out = world.run(layout.world_size, _resume, pp2_path, layout, 1, timeout=300)
        rng, resumed_at, loaded, losses, _, _ = out[0]
        assert resumed_at == STEPS_BEFORE + 1 and rng == "reseeded"
        assert_same_state(loaded, pp2_state)
        assert math.isfinite(losses[0])


def test_inspect_shows_12p_breakdown(saved):
    path = saved[0]
    s = cli.summarize(path)
    per = {r["role"]: r for r in s["roles"]}
    params = s["parameters"]
    assert params == sum(math.prod(t["shape"]) for t in s["tensors"] if t["role"] == roles.MAIN_WEIGHT)
    for role in (roles.MAIN_WEIGHT, roles.EXP_AVG, roles.EXP_AVG_SQ):
        assert per[role]["bytes"] == 4 * params
    # The rest: per-parameter step counters and loss / grad-norm windows, and 4 ranks' RNG states.
    steps = sum(1 for t in s["tensors"] if t["key"].endswith(".step"))
    assert per[roles.OPTIMIZER_STATE]["bytes"] == 4 * (steps + 2 * CFG.window)
    assert per[roles.TRAINER_STATE]["bytes"] == 4 * torch.get_rng_state().numel()
    small = per[roles.OPTIMIZER_STATE]["bytes"] + per[roles.TRAINER_STATE]["bytes"]
    assert s["total_bytes"] == 12 * params + small
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", path, "--no-tensors"]) == 0
    text = out.getvalue()
    for role in (roles.MAIN_WEIGHT, roles.EXP_AVG, roles.EXP_AVG_SQ):
        # role, GiB, bytes/P, stored GiB, stored/raw (uncompressed: 1.000)
        assert any(line.split()[:1] == [role] and line.split()[2::2] == ["4.00P", "1.000"]
                   for line in text.splitlines())


def _async_while_training(root):
    """An async save at step 2, then training goes on (overwriting the aliased optimizer storage):
    the checkpoint equals a synchronous save taken at the same step."""
    run = Trainer(CFG, SAVED_ON)
    for _ in range(STEPS_BEFORE):
        run.train_step()
    run.save(f"{root}/sync")
    fut = run.save_async(f"{root}/async")
    run.train_step()
    fut.result(timeout=120)
    a = Trainer(CFG, SAVED_ON, init=False)
    a.load(f"{root}/async")
    b = Trainer(CFG, SAVED_ON, init=False)
    b.load(f"{root}/sync")
    return global_state(a), global_state(b)


def test_async_save_while_training_holds_the_step_it_was_called_at(tmp_path):
    got, want = world.run(4, _async_while_training, str(tmp_path), timeout=300)[0]
    assert_same_state(got, want)

