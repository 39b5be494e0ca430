"""Coordination at the edges (issue 20), on fresh 2- and 4-process gloo worlds with a TCPStore
rendezvous, as torchrun jobs have: a late first call and a GIL-holding C call are not deaths; a rank
stopped or killed inside the read-once exchange fails every survivor, naming it, within
peer_timeout + a few seconds; ranks passing different arguments all get InvalidArgumentError; and a
process that exits right after its last save, load or async save never turns the others' success
into an error. Each test prints the seconds it measured."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import olmo_chunks
import pytest
import torch
import torch.distributed as dist
from olmo_chunks.errors import InvalidArgumentError

from tests.test_failures import PEER_TIMEOUT, full_state, holds, run_raw, state


def _zeros(rank: int, ranks: int) -> dict[str, Any]:
    sd = full_state(rank, ranks, 0)
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}


def _hold_gil(seconds: float) -> None:
    """One C call that keeps the GIL for `seconds` (PyDLL never releases it)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def _late_or_gil(rank: int, path: str, how: str, op: str) -> float:
    if rank == 1:
        if how == "late":
            time.sleep(PEER_TIMEOUT + 3)  # no heartbeat yet: this process never used the package
        else:
            from olmo_chunks import checkpoint

            orig = checkpoint.flatten
            checkpoint.flatten = lambda sd: (_hold_gil(PEER_TIMEOUT + 3), orig(sd))[1]
    t0 = time.time()
    if op == "save":
        olmo_chunks.save(full_state(rank, 2, 1), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    else:
        sd = _zeros(rank, 2)
        olmo_chunks.load(sd, path, peer_timeout=PEER_TIMEOUT)
        assert torch.equal(sd["w"], full_state(rank, 2, 1)["w"])
    return time.time() - t0


@pytest.mark.parametrize("how", ["late", "gil"])
def test_a_late_or_gil_bound_rank_is_never_declared_dead(tmp_path, how):
    path = str(tmp_path / "ckpt")
    for op in ("save", "load"):
        results = run_raw(2, _late_or_gil, path, how, op, timeout=120)
        assert all(r is not None and r[0] == "ok" for r in results), (how, op, results)
        print(f"{how} rank 1, {op}: rank 0 waited {results[0][1]:.1f} s and succeeded (peer_timeout {PEER_TIMEOUT} s)")
    assert holds(path, 1, 2)


# The timeout of the process group made for the next test.
_GROUP_TIMEOUT = 6.0


def _absent_past_the_groups_timeout(rank: int, path: str) -> tuple[str, float] | str:
    from datetime import timedelta

    group = dist.new_group([0, 1], timeout=timedelta(seconds=_GROUP_TIMEOUT))
    if rank == 1:  # alive, and never calling (stuck before its first save) until rank 0 has ended
        deadline = time.time() + 60
        while not Path(f"{path}.done").exists() and time.time() < deadline:
            time.sleep(0.2)
        return "idle"
    t0 = time.time()
    try:
        olmo_chunks.save(full_state(0, 2, 1), path, process_group=group, peer_timeout=PEER_TIMEOUT)
        return "saved", time.time() - t0
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.time() - t0
    finally:
        Path(f"{path}.done").write_text("")


def test_a_rank_that_never_arrives_fails_the_others_once_the_groups_own_timeout_passed(tmp_path):
    """A rank that never starts an operation is waited for as long as the group's collectives
    would wait: the timeout the group was made with. Until 2026-12-07 it was torch's default for
    the backend (30 min on gloo) whatever the group said, and rank 0 then waited twice over (it
    heard the others out, the absent one included) plus peer_timeout at the end."""
    path = str(tmp_path / "ckpt")
    results = run_raw(2, _absent_past_the_groups_timeout, path, timeout=60)
    assert results[1] is not None and results[1][:2] == ("ok", "idle"), results
    msg, waited = results[0][1]
    assert msg == f"RankFailedError: rank 1 did not reach this step within the arrival timeout ({_GROUP_TIMEOUT:g} s)"
    assert _GROUP_TIMEOUT <= waited < _GROUP_TIMEOUT + 3, waited
    print(f"rank 1 absent: rank 0 raised after {waited:.1f} s (the group's timeout: {_GROUP_TIMEOUT:g} s)")
    assert not os.path.exists(os.path.join(path, olmo_chunks.MANIFEST_NAME))


def _stop_in_exchange(rank: int, path: str, victim: int, sig: int) -> tuple[str, float]:
    from olmo_chunks import fill

    orig = fill._Exchange.start

    def start(self: Any) -> None:
        if rank == victim:
            Path(f"{path}.died").write_text(str(time.time()))
            os.kill(os.getpid(), sig)
        orig(self)

    fill._Exchange.start = start  # type: ignore[method-assign]
    sd = _zeros(rank, 2)
    olmo_chunks.load(sd, path, peer_timeout=PEER_TIMEOUT, read="once")
    return "loaded", time.time()


@pytest.mark.parametrize(("victim", "sig"), [(1, signal.SIGSTOP), (0, signal.SIGSTOP), (1, signal.SIGKILL)])
def test_a_rank_stopped_or_killed_inside_the_exchange_fails_every_survivor(tmp_path, victim, sig):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    survivor = 1 - victim
    results = run_raw(2, _stop_in_exchange, path, victim, sig, timeout=PEER_TIMEOUT + 10, awaited=(survivor,))
    died = float(Path(f"{path}.died").read_text())
    status, msg, end = results[survivor]
    assert status == "err" and msg.startswith("RankFailedError"), results
    assert f"rank {victim}" in msg and "process group is unusable" in msg, msg
    assert end - died < PEER_TIMEOUT + 6, end - died
    print(f"rank {victim} {signal.Signals(sig).name} in the exchange: rank {survivor} raised after "
          f"{end - died:.1f} s: {msg[:160]}")
    assert holds(path, 1, 2)


def _first(rank: int, path: str) -> None:
    olmo_chunks.save(full_state(rank, 2, 1), path)


def _mismatched(rank: int, path: str, what: str) -> float:
    t0 = time.time()
    if what == "read":
        sd = _zeros(rank, 2)
        olmo_chunks.load(sd, path, peer_timeout=PEER_TIMEOUT, read="direct" if rank == 1 else "once")
    elif what == "path":
        olmo_chunks.load(_zeros(rank, 2), path if rank == 0 else path + "-other", peer_timeout=PEER_TIMEOUT)
    elif what == "verify":
        olmo_chunks.load(_zeros(rank, 2), path, peer_timeout=PEER_TIMEOUT, verify=rank == 0)
    else:
        olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT,
                         compression="zstd" if rank == 1 else None)
    return time.time() - t0


@pytest.mark.parametrize("what", ["read", "path", "verify", "compression"])
def test_ranks_passing_different_arguments_all_get_invalid_argument(tmp_path, what):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    results = run_raw(2, _mismatched, path, what, timeout=60)
    for status, msg, _ in results:
        assert status == "err" and msg.startswith("InvalidArgumentError") and "must pass the same" in msg, results
    print(f"{what} differs: both ranks raised InvalidArgumentError: {results[1][1][:140]}")
    assert holds(path, 1, 2)


def _then_exit(rank: int, path: str, op: str) -> str:
    """The last call of a script; `run_raw` ends the process right after it returns."""
    if op == "save":
        olmo_chunks.save(state(rank, 3), path, overwrite=True)
    elif op == "async":
        olmo_chunks.async_save(state(rank, 3), path, overwrite=True).result()
    else:
        sd = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state(rank, 3).items()}
        olmo_chunks.load(sd, path, strict=False)
    return op


def test_every_rank_exiting_right_after_its_last_call_reports_success(tmp_path):
    path = str(tmp_path / "ckpt")
    failures = 0
    trials = 0
    for op in ("save", "load", "async", "save", "load", "async"):
        results = run_raw(4, _then_exit, path, op, timeout=90)
        trials += 1
        failures += sum(r is None or r[0] != "ok" for r in results)
        assert all(r is not None and r[0] == "ok" for r in results), (op, results)
    print(f"{trials} trials x 4 ranks exiting right after save / load / async_save: {failures} failures")


def test_invalid_argument_is_raised_where_it_is_wrong_too():
    with pytest.raises(InvalidArgumentError, match="read must be one of"):
        olmo_chunks.load({}, "/nonexistent", read="sometimes")


def _one_bad_read(rank: int, path: str) -> None:
    olmo_chunks.load(_zeros(rank, 2), path, peer_timeout=PEER_TIMEOUT, read="sometimes" if rank == 1 else "once")


def test_one_rank_with_a_bad_read_mode_fails_both_at_once(tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    t0 = time.time()
    (s0, m0, e0), (s1, m1, _) = run_raw(2, _one_bad_read, path, timeout=60)
    assert s1 == "err" and m1.startswith("InvalidArgumentError") and "read must be one of" in m1, m1
    assert s0 == "err" and m0.startswith("RankFailedError") and "rank 1" in m0, m0
    assert e0 - t0 < 30, e0 - t0


def _one_bad_compression(rank: int, path: str) -> None:
    olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT,
                     compression="lz4" if rank == 1 else None)


def test_one_rank_with_an_unsupported_compression_fails_both_at_once(tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    t0 = time.time()
    (s0, m0, e0), (s1, m1, _) = run_raw(2, _one_bad_compression, path, timeout=60)
    assert s1 == "err" and m1.startswith("InvalidArgumentError") and "only 'zstd'" in m1, m1
    assert s0 == "err" and m0.startswith("RankFailedError") and "rank 1" in m0, m0
    assert e0 - t0 < 30, e0 - t0
    assert holds(path, 1, 2)


def _one_bad_call(rank: int, path: str, what: str) -> None:
    try:
        if what == "peer_timeout":
            olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=0 if rank else PEER_TIMEOUT)
        elif what == "async_path":
            olmo_chunks.async_save(full_state(rank, 2, 2), "ftp://x/y" if rank else path, overwrite=True,
                                   peer_timeout=PEER_TIMEOUT).result()
        elif rank == 1:  # "call": rank 1 loads while rank 0 saves
            olmo_chunks.load(_zeros(rank, 2), path, peer_timeout=PEER_TIMEOUT)
        else:
            olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    finally:
        _outlive_rank_0(rank, path, 4 * PEER_TIMEOUT)  # alive and beating: rank 0 must not wait for it


@pytest.mark.parametrize(("what", "error0", "error1"), [
    ("peer_timeout", "RankFailedError: rank 1 failed: InvalidArgumentError: peer_timeout must be a positive",
     "InvalidArgumentError: peer_timeout must be a positive number of seconds up to 1e+06, got 0"),
    ("async_path", "RankFailedError: rank 1 failed: InvalidArgumentError: ftp://x/y: unsupported URL scheme",
     "InvalidArgumentError: ftp://x/y: unsupported URL scheme"),
    ("call", "InvalidArgumentError: the ranks of a process group must make the same call: rank 0 called save, "
     "rank 1 load", "InvalidArgumentError: the ranks of a process group must make the same call"),
])
def test_a_bad_call_on_one_rank_fails_every_rank_at_once(tmp_path, what, error0, error1):
    """Where the bad rank's error came before its first step (a bad peer_timeout; async_save's bad
    path), or where it called another operation, the others waited for it until it exited."""
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    t0 = time.time()
    (s0, m0, e0), (s1, m1, _) = run_raw(2, _one_bad_call, path, what, timeout=60)
    assert (s0, s1) == ("err", "err") and m0.startswith(error0) and m1.startswith(error1), (m0, m1)
    assert e0 - t0 < 3 * PEER_TIMEOUT, e0 - t0  # rank 1 lives on for 4 peer_timeouts
    print(f"{what}: rank 0 raised {e0 - t0:.1f} s after the world started: {m0[:120]}")
    assert holds(path, 1, 2)


def _locked(rank: int, path: str) -> None:
    from olmo_chunks import _core

    held = _core.SaveTransaction.begin(path, True, 60.0) if rank == 0 else None  # a live writer's lease
    dist.barrier()
    try:
        olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    finally:
        if held is not None:
            held.abort()


def test_a_locked_path_is_checkpoint_locked_error_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(2, _first, path))
    results = run_raw(2, _locked, path, timeout=60)
    for status, msg, _ in results:  # rank 1 had RankFailedError("rank 0 failed: CheckpointLockedError ...")
        assert status == "err" and msg.startswith("CheckpointLockedError: ") and "holds its lease" in msg, results
    assert holds(path, 1, 2)


def _timeouts(rank: int, path: str, what: str, port: int, mark: str) -> str:
    from olmo_chunks.session import SaveSession

    olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True)  # the default peer_timeout (45 s)
    if what == "slow_beater":  # rank 1 beats every 2 s (its calls give 45 s), rank 0 judges with 1 s
        time.sleep(3 * rank)
        olmo_chunks.save(full_state(rank, 2, 3), path, overwrite=True, peer_timeout=1.0 if rank == 0 else 45.0)
    elif what == "stopped_host":  # rank 0, the store's host, stops in a call with a short peer_timeout
        if rank == 0:
            SaveSession.write = lambda *a, **k: (Path(mark).write_text(str(time.time())),
                                                 os.kill(os.getpid(), signal.SIGSTOP))
        olmo_chunks.save(full_state(rank, 2, 3), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    else:  # "new_group": the process group made again, on another store
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        olmo_chunks.save(full_state(rank, 2, 3), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    return "saved"


@pytest.mark.parametrize("what", ["slow_beater", "stopped_host", "new_group"])
def test_each_call_keeps_its_own_peer_timeout(tmp_path, what):
    """A process's first call used to fix the store's deadlines for good: its peer_timeout bounded
    every later call's store requests (a host stopped under a later, shorter one was found after
    45 s), heartbeats slower than a peer's shorter peer_timeout were deaths, and a process group
    made again kept talking to the old store."""
    from tests import world

    path, mark = str(tmp_path / "ckpt"), str(tmp_path / "stopped")
    # A stopped host never answers: the run ends with rank 1's.
    results = run_raw(2, _timeouts, path, what, world.free_port(), mark, timeout=60,
                      awaited=(1,) if what == "stopped_host" else None)
    if what == "stopped_host":
        status, msg, end = results[1]
        assert status == "err" and "rank 0 died or stopped responding" in msg, results
        assert end - float(Path(mark).read_text()) < PEER_TIMEOUT + 6, results
        assert holds(path, 2, 2)
    else:
        assert [r[:2] for r in results] == [("ok", "saved")] * 2, results
        assert holds(path, 3, 2)


def _frozen_host(rank: int, path: str, where: str) -> str:
    import subprocess

    from olmo_chunks.session import SaveSession

    def freeze() -> None:  # a timer resumes it
        subprocess.Popen(["sh", "-c", f"sleep {PEER_TIMEOUT + 3}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)

    olmo_chunks.save(full_state(rank, 2, 1), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    if where == "between":  # nobody waits for it meanwhile: no reason to fail the next save
        if rank == 0:
            freeze()
        dist.barrier()
    elif rank == 0 and where == "after_commit":  # committed: rank 1 finds the manifest, and goes on
        orig = SaveSession.commit
        SaveSession.commit = lambda *args, **kwargs: (orig(*args, **kwargs), freeze())[0]  # type: ignore[method-assign]
    elif rank == 0 and where == "core_commit":  # inside the core's commit, the manifest written beside
        orig = SaveSession.commit

        def late(*args: Any, ready: Callable[[], None], **kwargs: Any) -> Any:
            return orig(*args, ready=lambda: (freeze(), ready())[1], **kwargs)

        SaveSession.commit = late  # type: ignore[method-assign]
    elif rank == 0:  # the store's host freezes in its write, or in the commit after the last check
        orig = getattr(SaveSession, where)
        setattr(SaveSession, where, lambda *args, **kwargs: (freeze(), orig(*args, **kwargs))[1])
    try:
        olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    finally:
        if where != "between":  # alive, and never calling again (a job that moved on)
            _outlive_rank_0(rank, path, PEER_TIMEOUT + 8)
            if rank == 1 and where == "after_commit":
                time.sleep(3.5)  # and on: rank 0 must not wait for its exit
    return "saved"


def _outlive_rank_0(rank: int, path: str, cap: float) -> None:
    """Called as each rank's call has ended: rank 0 says so; any other rank stays alive, and
    beating, until it has (at most `cap` seconds)."""
    marker = f"{path}.rank0-ended"
    if rank == 0:
        Path(marker).touch()
        return
    deadline = time.time() + cap
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("where", ["write", "commit", "core_commit", "between", "after_commit"])
def test_a_store_host_frozen_past_peer_timeout_does_not_commit_what_the_others_reported_failed(tmp_path, where):
    # Rank 1 gave up on the frozen host ("the store it hosts is gone") and went on; the host,
    # resumed, committed the save all the same and returned success. A freeze between two
    # operations fails neither.
    path = str(tmp_path / "ckpt")
    results = run_raw(2, _frozen_host, path, where, timeout=60)
    if where in ("between", "after_commit"):
        assert [r[:2] for r in results] == [("ok", "saved")] * 2, results  # type: ignore[index]
        assert holds(path, 2, 2)
        # Rank 0 waited for rank 1's acknowledgement, which never came, until rank 1 exited; now
        # it ends while rank 1 still lives.
        assert where == "between" or results[0][2] < results[1][2] - 3, results  # type: ignore[index]
        return
    (status0, msg0, _), (status1, msg1, _) = results  # type: ignore[misc]
    assert status1 == "err" and "rank 0 died or stopped responding" in msg1, results
    assert status0 == "err" and msg0.startswith("RankFailedError: rank 0 went silent for ") and (
        f"long enough for the other ranks to give up on it (peer_timeout={PEER_TIMEOUT:g} s)" in msg0), results
    print(f"host frozen in its {where}: {msg0[:120]}")
    assert holds(path, 1, 2)


@pytest.mark.parametrize("peer_timeout", [0, -1, 1e20, float("nan"), float("inf"), "5", True])
def test_peer_timeouts_beyond_what_a_deadline_holds_are_invalid_arguments(tmp_path, peer_timeout):
    # 1e20 s was a ValueError of the core's duration conversion, raised before the first step.
    with pytest.raises(InvalidArgumentError, match="peer_timeout must be a positive number of seconds up to 1e"):
        olmo_chunks.save(full_state(0, 1, 1), tmp_path / "x", peer_timeout=peer_timeout)


def _signalled(rank: int, path: str) -> str:
    """Rank 1 handles SIGUSR1 (as a preemption handler would) and gets it while it waits in the
    store for rank 0, which is still writing."""
    from olmo_chunks.session import SaveSession

    if rank == 1:
        signal.signal(signal.SIGUSR1, lambda *_: None)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    else:
        write = SaveSession.write
        SaveSession.write = lambda *a, **k: (time.sleep(3), write(*a, **k))[1]
    olmo_chunks.save(full_state(rank, 2, 2), path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    return "saved"


def test_a_signal_handled_while_waiting_is_not_a_lost_store(tmp_path):
    # The wait's read returned EINTR, taken for a lost connection: "rank 0 died", on a save that committed.
    path = str(tmp_path / "ckpt")
    results = run_raw(2, _signalled, path, timeout=60)
    assert [r[:2] for r in results] == [("ok", "saved")] * 2, results
    assert holds(path, 2, 2)


def test_waiting_ranks_look_less_often_in_large_groups() -> None:
    """All the waiting ranks of a group together ask the store's host at most about 4,000
    requests a second (about 4 per look); never less often than a quarter of peer_timeout."""
    from olmo_chunks._dist import Group

    def interval(size: int, peer_timeout: float = 45.0) -> float:
        return Group.simulated(0, size, None, "p", peer_timeout=peer_timeout, arrival_timeout=60).poll_interval

    assert interval(4) == interval(500) == 0.5
    assert interval(4096) == pytest.approx(4.096)
    assert 4096 * 4 / interval(4096) <= 4000.0 + 1e-6
    assert interval(4, peer_timeout=1.0) == 0.25 and interval(4096, peer_timeout=8.0) == 2.0


def _world_or_none(rank: int, path: str) -> bool:

    pg = dist.group.WORLD if rank == 1 else None
    olmo_chunks.save(full_state(rank, 2, 1), path, overwrite=True, process_group=pg, peer_timeout=PEER_TIMEOUT)
    olmo_chunks.async_save(full_state(rank, 2, 2), path, overwrite=True, process_group=pg,
                           peer_timeout=PEER_TIMEOUT).result()
    sd = _zeros(rank, 2)
    olmo_chunks.load(sd, path, process_group=pg, peer_timeout=PEER_TIMEOUT)
    return torch.equal(sd["w"], full_state(rank, 2, 2)["w"])


def test_none_and_the_world_group_are_one_group(tmp_path):
    # Both name the default group, as for torch's collectives (they waited for each other in
    # different store keys until the arrival timeout).
    path = str(tmp_path / "ckpt")
    results = run_raw(2, _world_or_none, path, timeout=60)
    assert [r and r[:2] for r in results] == [("ok", True), ("ok", True)], results
    assert holds(path, 2, 2)


def _subgroup_or_world(rank: int, path: str) -> tuple[str, float]:

    sub = dist.new_group([0, 1])
    t0 = time.time()
    try:
        olmo_chunks.save(full_state(rank, 2, 1), path, process_group=sub if rank == 0 else None,
                         peer_timeout=PEER_TIMEOUT)
    except InvalidArgumentError as exc:
        return str(exc), time.time() - t0
    return "saved", time.time() - t0


def test_ranks_passing_different_groups_of_the_same_ranks_get_invalid_argument(tmp_path):
    # Each waited for the other in its own group's keys until the arrival timeout (30 min by
    # default; 60 s here).
    path = str(tmp_path / "ckpt")
    os.environ["OLMO_CHUNKS_ARRIVAL_TIMEOUT"] = "60"
    try:
        results = run_raw(2, _subgroup_or_world, path, timeout=90)
    finally:
        del os.environ["OLMO_CHUNKS_ARRIVAL_TIMEOUT"]
    assert all(r is not None and r[0] == "ok" for r in results), results
    for rank, (_, (msg, seconds), _) in enumerate(results):
        other, mine = ("'0'", "'1'") if rank == 0 else ("'1'", "'0'")
        assert f"must pass the same process group: global rank {1 - rank} is in its call of this place on " \
               f"process group {other}, while this rank (global rank {rank}) called save on {mine}" in msg, msg
        assert seconds < 2 * PEER_TIMEOUT + 10, seconds
        print(f"rank {rank}: InvalidArgumentError after {seconds:.1f} s (peer_timeout {PEER_TIMEOUT} s)")
    assert not os.path.exists(os.path.join(path, olmo_chunks.MANIFEST_NAME))
