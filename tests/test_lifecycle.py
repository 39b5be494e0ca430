"""Threads, forks and interrupts around a save: two threads' async saves, a fork with a save in
flight, a Ctrl-C while the core writes or as the commit returns, and a rank 0 failing while the
others still write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks.session import SaveSession

from tests.test_failures import run_raw


def _loads_as(path: Path, want: dict[str, torch.Tensor]) -> bool:
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    olmo_chunks.load(got, path)
    return all(torch.equal(got[k], want[k]) for k in want)


def test_async_saves_called_from_two_threads_at_once_each_hold_their_own_values(tmp_path: Path):
    # Both staged into the one pool of their process group: 6 of 20 such pairs committed a mix of
    # the two states, and `verify` called them sound.
    olmo_chunks.async_save({"w": torch.zeros(1 << 16)}, tmp_path / "warm").result()  # the pool exists
    for i in range(6):
        states = [{"w": torch.full((1 << 20,), float(2 * i + t))} for t in range(2)]
        paths = [tmp_path / f"{i}-{t}" for t in range(2)]
        futures: list = [None, None]
        start = threading.Barrier(2)

        def call(t: int, states: list = states, paths: list = paths, futures: list = futures,
                 start: threading.Barrier = start) -> None:
            start.wait()
            futures[t] = olmo_chunks.async_save(states[t], paths[t])

        threads = [threading.Thread(target=call, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for t in range(2):
            futures[t].result(timeout=60)
            assert _loads_as(paths[t], states[t]), (i, t)


def test_a_save_waits_for_the_async_save_in_flight_on_its_group(tmp_path: Path):
    # It raised CheckpointLockedError naming this very process (the async save held the lease).
    first, second = {"w": torch.full((1 << 22,), 1.0)}, {"w": torch.full((1 << 22,), 2.0)}
    future = olmo_chunks.async_save(first, tmp_path / "ckpt")
    olmo_chunks.save(second, tmp_path / "ckpt", overwrite=True)
    assert future.done() and future.exception() is None
    assert _loads_as(tmp_path / "ckpt", second)


_FORK = """
    import os, sys, torch, olmo_chunks
    root = sys.argv[1]
    big = {"w": torch.full((1 << 24,), 1.0)}
    future = olmo_chunks.async_save(big, os.path.join(root, "parent"))  # in flight at the fork
    pid = os.fork()
    if pid == 0:
        try:
            small = {"w": torch.full((8,), 2.0)}
            olmo_chunks.async_save(small, os.path.join(root, "child")).result(timeout=30)
            got = {"w": torch.zeros(8)}
            olmo_chunks.load(got, os.path.join(root, "child"))
            os._exit(0 if torch.equal(got["w"], small["w"]) else 3)
        except BaseException:
            os._exit(4)
    future.result()
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_saves_while_its_parents_async_save_is_in_flight(tmp_path: Path):
    # The child waited for ever on its parent's save, which no thread of the child finishes.
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORK), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["child", "0"], (done.stdout, done.stderr[-2000:])


def test_ctrl_c_while_the_core_writes_is_raised_once_the_write_has_ended(tmp_path: Path, monkeypatch):
    # Python 3.11's Thread.join, interrupted, takes the thread for ended: the save was abandoned
    # (its data removed) while the core still wrote, and a process exiting then aborted (SIGABRT).
    real = SaveSession.write_file
    seen: dict[str, object] = {}

    def slow(self: SaveSession, chunks: list) -> list:
        time.sleep(0.3)  # the main thread waits for this write by now
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        time.sleep(1.0)
        out = real(self, chunks)
        seen["data kept while writing"] = (Path(self.target) / "data" / self.save_id).is_dir()
        seen["ended"] = time.monotonic()
        return out

    olmo_chunks.save({"w": torch.ones(8)}, tmp_path / "ckpt")
    monkeypatch.setattr(SaveSession, "write_file", slow)
    # A Ctrl-C as a script gets it, whatever earlier tests of this process set.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with pytest.raises(KeyboardInterrupt):
            olmo_chunks.save({"w": torch.full((8,), 2.0)}, tmp_path / "ckpt", overwrite=True)
        raised = time.monotonic()
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    monkeypatch.undo()
    assert seen["data kept while writing"] is True and seen["ended"] < raised, seen  # type: ignore[operator]
    assert _loads_as(tmp_path / "ckpt", {"w": torch.ones(8)})
    assert len(os.listdir(tmp_path / "ckpt" / "data")) == 1  # the interrupted save's data removed, once written


def _interrupted_as_the_commit_returns(rank: int, path: str) -> str:
    if rank == 0:
        real = SaveSession.commit

        def commit(*args: object, **kwargs: object) -> object:
            real(*args, **kwargs)  # type: ignore[arg-type]
            raise KeyboardInterrupt  # a Ctrl-C as the call returned

        SaveSession.commit = commit  # type: ignore[method-assign]
    try:
        olmo_chunks.save({f"r{rank}": torch.full((64,), 2.0)}, path, overwrite=True)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "saved"


def test_a_ctrl_c_after_the_commit_does_not_tell_the_others_it_failed(tmp_path: Path):
    # They raised "rank 0 failed: KeyboardInterrupt" for a save that had replaced the checkpoint.
    path = str(tmp_path / "ckpt")
    results = run_raw(2, _interrupted_as_the_commit_returns, path, timeout=60)
    assert [r[:2] for r in results] == [("ok", "KeyboardInterrupt"), ("ok", "saved")], results  # type: ignore[index]
    assert _loads_as(Path(path), {"r0": torch.full((64,), 2.0), "r1": torch.full((64,), 2.0)})


def _root_fails_while_others_write(rank: int, path: str) -> str:
    if rank == 0:
        def failing(self: SaveSession, chunks: list) -> list:
            raise OSError("rank 0's write failed (simulated)")

        SaveSession.write_file = failing  # type: ignore[method-assign]
    n = 8 if rank == 0 else 1 << 25  # rank 1 writes 128 MiB
    try:
        olmo_chunks.save({f"r{rank}": torch.ones(n)}, path, overwrite=True)
    except olmo_chunks.OlmoChunksError as exc:
        return f"{type(exc).__name__}: {exc}"
    except OSError as exc:
        return f"OSError: {exc}"
    return "saved"


def test_a_rank_0_failing_in_its_write_waits_for_the_others_before_removing_the_data(tmp_path: Path):
    # Rank 0 removed the save's data at once: the others, still writing there, raised
    # MissingDataFileError (a corrupt-checkpoint error) instead of rank 0's failure.
    results = run_raw(2, _root_fails_while_others_write, str(tmp_path / "ckpt"), timeout=90)
    (s0, r0, _), (s1, r1, _) = results  # type: ignore[misc]
    assert (s0, r0) == ("ok", "OSError: rank 0's write failed (simulated)"), results
    assert (s1, r1) == ("ok", "RankFailedError: rank 0 failed: OSError: rank 0's write failed (simulated)"), results
    assert not (tmp_path / "ckpt" / "data").exists() or os.listdir(tmp_path / "ckpt" / "data") == []
