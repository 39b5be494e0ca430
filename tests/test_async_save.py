"""`async_save` on real gloo worlds: the checkpoint holds the values at the call, whatever the
caller does next; failures surface from `result()` on every rank; saves queue; exit waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import olmo_chunks as oc
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import ExpertLayout, TrainerState
from torch.distributed.tensor import Shard

from tests import world


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(7)
    full = torch.randn(16, 6, generator=g)
    lo = ExpertLayout(8, (4, 3), rank // 2, 2, rank % 2, 2)
    experts = torch.randn(lo.local_numel, generator=torch.Generator().manual_seed(100 + rank))
    return {
        "w": world.distribute(full, world.mesh((4,)), [Shard(0)]),
        "bias": torch.arange(5.0),  # replicated: one rank writes it
        "experts": lo.view(experts),
        **TrainerState(step=11, tokens=1234, seed=3).state_dict(layout={"dp": 4}),
    }, experts


def _tensors(sd: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, leaf in oc.tree.flatten(sd).items():
        v = leaf.value
        if isinstance(v, torch.Tensor):
            out[key] = v.to_local() if hasattr(v, "to_local") else v
    return out


def _save_then_scribble(path: str) -> bool:
    rank = dist.get_rank()
    sd, experts = _state(rank)
    before = {k: t.clone() for k, t in _tensors(sd).items()}
    experts_before = experts.clone()
    fut = oc.async_save(sd, path, pool_bytes=1 << 20)
    for t in [*_tensors(sd).values(), experts]:  # the next training step overwrites everything
        t.fill_(-1)
    assert fut.result(timeout=60) is None and fut.done() and fut.exception() is None
    back, back_experts = _state(rank)
    for t in [*_tensors(back).values(), back_experts]:
        t.zero_()
    oc.load(back, path)
    after = _tensors(back)
    return all(torch.equal(after[k], before[k]) for k in before) and torch.equal(back_experts, experts_before)


def test_the_checkpoint_holds_the_values_at_the_call(tmp_path):
    assert world.run(4, _save_then_scribble, str(tmp_path / "c")) == [True] * 4


def _failing_async_save(path: str, bad: int, n: int) -> str:
    """An async_save of `n` floats per tensor with a 4 KiB pool whose writes fail on rank `bad`:
    in the background (`n` fits the pool) or while the call stages (it does not: the tensor is
    written from itself at once, before the call returns)."""
    from olmo_chunks.session import SaveSession

    rank = dist.get_rank()
    if rank == bad:
        real = SaveSession.write_file

        def failing(*a, **k):
            raise OSError(28, "No space left on device (simulated)")

        SaveSession.write_file = failing
    t0 = time.monotonic()
    try:
        try:
            fut = oc.async_save({"w": torch.full((n,), 2.0), f"r{rank}": torch.full((n,), 2.0)}, path,
                                overwrite=True, pool_bytes=4096)
        except OSError as exc:
            err, where = exc, "call"
        else:
            err, where = fut.exception(timeout=60), "result"
    finally:
        if rank == bad:
            SaveSession.write_file = real
    waited = time.monotonic() - t0
    sd = {k: torch.zeros(n) for k in ("w", "r0", "r1")}
    oc.load(sd, path)
    return (f"{type(err).__name__}|{where}|{isinstance(err, oc.OlmoChunksError)}|{sd['w'][0].item()}|"
            f"{sd['r1'][0].item()}|{waited < 10}")


def _first(path: str, n: int) -> None:
    oc.save({"w": torch.full((n,), 1.0), f"r{dist.get_rank()}": torch.full((n,), 1.0)}, path)


@pytest.mark.parametrize(("n", "where"), [(8, "result"), (4096, "call")])
def test_a_failing_async_save_raises_on_every_rank_at_once_and_keeps_the_old_checkpoint(tmp_path, n, where):
    path = str(tmp_path / "c")
    world.run(2, _first, path, n)
    out = world.run(2, _failing_async_save, path, 1, n)
    # The failing rank sees its own error; the other one, who failed, at once (a failure while
    # the call staged once left it waiting for ever); the old checkpoint stays.
    assert out[1].split("|")[1:] == [where, str(where == "result"), "1.0", "1.0", "True"], out
    assert out[0] == "RankFailedError|result|True|1.0|1.0|True", out


def _back_to_back(root: str) -> list[float]:
    rank = dist.get_rank()
    futs = []
    for i in range(3):
        t = torch.full((1000,), float(i + 10 * rank))
        futs.append(oc.async_save({f"t{rank}": t}, f"{root}/c{i}", pool_bytes=4096))
        t.fill_(-5)  # the pool is reused: each save must still hold its own values
    for f in futs:
        f.result(timeout=60)
    got = []
    for i in range(3):
        sd = {f"t{r}": torch.zeros(1000) for r in range(dist.get_world_size())}
        oc.load(sd, f"{root}/c{i}")
        got.append(sd[f"t{rank}"][0].item())
    return got


def test_back_to_back_saves_queue_and_reuse_the_pool(tmp_path):
    assert world.run(2, _back_to_back, str(tmp_path)) == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]


def test_a_state_larger_than_the_pool_is_written_in_parts(tmp_path):
    # A larger pool kept from an earlier save stages no more than this save's pool_bytes.
    oc.async_save({"w": torch.zeros(16 << 10)}, tmp_path / "before", pool_bytes=64 << 10).result()
    sd = {f"t{i}": torch.full((1024,), float(i)) for i in range(10)}  # 40 KiB through a 10 KiB pool
    fut = oc.async_save(sd, tmp_path / "c", pool_bytes=10 << 10)
    for t in sd.values():
        t.zero_()
    fut.result()
    back = {k: torch.empty(1024) for k in sd}
    oc.load(back, tmp_path / "c")
    assert all(torch.equal(back[f"t{i}"], torch.full((1024,), float(i))) for i in range(10))
    assert len(oc._core.Manifest.open(str(tmp_path / "c")).files) >= 4


def test_a_failure_nobody_asks_the_future_for_is_logged(tmp_path, caplog):
    """A script that never calls `result()` still hears of a failed background save (it ended as
    if the checkpoint had been saved, silently, until 2026-12-07)."""
    oc.save({"w": torch.ones(3)}, tmp_path / "c")
    with caplog.at_level("ERROR", logger="olmo_chunks.background"):
        fut = oc.async_save({"w": torch.zeros(3)}, tmp_path / "c")  # no overwrite: refused in the background
        while not fut.done():
            time.sleep(0.01)
    assert [r.getMessage().split(": Checkpoint already exists")[0] for r in caplog.records] == [
        f"olmo-chunks: async_save to {tmp_path / 'c'} failed: CheckpointExistsError: {tmp_path / 'c'}/"]
    assert isinstance(fut.exception(), oc.CheckpointExistsError)


def test_interpreter_exit_waits_for_a_save_in_flight(tmp_path):
    script = textwrap.dedent(
        f"""
        import time, torch, olmo_chunks as oc
        from olmo_chunks.session import SaveSession
        real = SaveSession.commit
        def slow(*a, **k):
            time.sleep(2)
            return real(*a, **k)
        SaveSession.commit = slow
        oc.async_save({{"w": torch.arange(6.0)}}, {str(tmp_path / "c")!r})
        print("returned", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr
    sd = {"w": torch.zeros(6)}
    oc.load(sd, tmp_path / "c")
    assert torch.equal(sd["w"], torch.arange(6.0))
    assert Path(tmp_path / "c" / oc.MANIFEST_NAME).exists()
