"""Never lose a checkpoint, never hang: dead ranks, interrupted ranks and racing saves on real gloo
worlds, and the save transaction's treatment of what it finds at the path (issue 15, items 1-3, 11,
14)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import time
from pathlib import Path
from typing import Any

import olmo_chunks
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import _core
from olmo_chunks.errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    InvalidArgumentError,
    RankFailedError,
    StorageError,
)

from tests import world

PEER_TIMEOUT = 4.0
LEASE = ".olmo_chunks.lease"


def state(rank: int, version: int, mib: int = 4) -> dict[str, Any]:
    """The same global tensors on every rank (replicated), plus per-rank values, distinct per
    `version` so a checkpoint tells which save wrote it."""
    n = mib << 18
    return {
        "w": torch.arange(n, dtype=torch.float32) + version,
        "b": torch.full((1000,), float(version)),
        f"rank{rank}": torch.full((10,), float(rank)),
        "version": version,
    }


def holds(path: str | Path, version: int, ranks: int) -> bool:
    sd = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
          for r in range(ranks) for k, v in state(r, version).items()}
    olmo_chunks.load(sd, path)
    want = {k: v for r in range(ranks) for k, v in state(r, version).items()}
    return all(
        torch.equal(sd[k], v) if isinstance(v, torch.Tensor) else sd[k] == v for k, v in want.items()
    )


def full_state(rank: int, ranks: int, version: int) -> dict[str, Any]:
    sd = state(rank, version)
    for r in range(ranks):
        sd[f"rank{r}"] = torch.full((10,), float(r))
    return sd


# --------------------------------------------------------------------------------------------
# Raw worlds: ranks may die, so each trial gets fresh processes and reports per rank.
# --------------------------------------------------------------------------------------------


def _rank_main(rank: int, size: int, rendezvous: str, conn: mpc.Connection, fn: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size)
    try:
        out = ("ok", fn(rank, *args), time.time())
    except BaseException as exc:
        out = ("err", f"{type(exc).__name__}: {exc}", time.time())
    conn.send_bytes(pickle.dumps(out))
    conn.close()
    os._exit(0)


def run_raw(size: int, fn: Any, *args: Any, timeout: float = 120,
            awaited: tuple[int, ...] | None = None) -> list[tuple[str, Any, float] | None]:
    """Runs `fn(rank, *args)` on a fresh gloo world; per rank `(status, result or error, end
    time)`, or None for a rank that died. Ranks still running at `timeout`, or once every rank in
    `awaited` (default: all) has ended, count as hung and are killed."""
    ctx = world._context()
    rendezvous = f"tcp://127.0.0.1:{world.free_port()}"
    pipes, procs = [], []
    with world._single_threaded_children():
        for r in range(size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(r, size, rendezvous, child, fn, args), daemon=True)
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
    out: list[Any] = [None] * size
    running = dict(enumerate(pipes))
    deadline = time.monotonic() + timeout
    while running and any(r in running for r in (range(size) if awaited is None else awaited)):
        ready = mpc.wait(list(running.values()), max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for r, conn in list(running.items()):
            if conn in ready:  # its answer, or the end of a process that died without one
                with contextlib.suppress(EOFError):
                    out[r] = pickle.loads(conn.recv_bytes())
                del running[r]
    for r in running:
        if procs[r].is_alive():
            out[r] = ("hung", None, time.time())
            procs[r].kill()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return out


def _die_at(point: str, victim: int | tuple[int, ...], rank: int, mark: str) -> None:
    """Makes this process SIGKILL itself at `point` if it is the victim (or one of them)."""
    if rank not in (victim if isinstance(victim, tuple) else (victim,)):
        return
    from olmo_chunks import _dist, checkpoint
    from olmo_chunks.fill import FillStep
    from olmo_chunks.session import SaveSession

    def kill() -> None:
        Path(mark).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "describe":
        orig_flatten = checkpoint.flatten
        checkpoint.flatten = lambda sd: (kill(), orig_flatten(sd))[1]
    elif point == "write":
        SaveSession.write = lambda *a, **k: kill()
    elif point == "after-write":
        orig_write = SaveSession.write
        SaveSession.write = lambda *a, **k: (orig_write(*a, **k), kill())[0]
    elif point == "commit":
        SaveSession.commit = lambda *a, **k: kill()
    elif point == "load":
        orig = FillStep.run
        FillStep.run = lambda *a, **k: (kill(), orig(*a, **k))[1]
    elif point == "exchange":
        orig_ex = _dist.Group.exchange
        _dist.Group.exchange = lambda self, *a, **k: (kill(), orig_ex(self, *a, **k))[1]
    elif point == "half-sent":  # between its two store calls: its message appended, not counted
        def half_sent(self: Any, key: str, mine: Any, failure: Any) -> None:
            frame = pickle.dumps((self.rank, "ok", mine, self.op))
            self.store.append(f"{key}/in", len(frame).to_bytes(8, "little") + frame)
            kill()

        _dist.Group._send = half_sent


def _save_and_maybe_die(rank: int, path: str, point: str, victim: int, mark: str) -> str:
    _die_at(point, victim, rank, mark)
    sd = full_state(rank, 4, 2)
    if point == "load":
        olmo_chunks.load(sd, path, peer_timeout=PEER_TIMEOUT)
    else:
        olmo_chunks.save(sd, path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    return "done"


def _first_save(rank: int, path: str) -> None:
    olmo_chunks.save(full_state(rank, 4, 1), path)


def _kill_trial(tmp_path: Path, fn: Any, victim: int | tuple[int, ...], *args: Any) -> tuple[str, list, float]:
    """A checkpoint saved on 4 ranks (version 1), then `fn(rank, path, *args, mark)` on a fresh
    world of 4 where rank `victim` (or each of them) SIGKILLs itself, writing the time it died to
    `mark` first. Returns the path, every rank's result (None for a victim) and the time of death."""
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(4, _first_save, path))
    mark = str(tmp_path / "died")
    results = run_raw(4, fn, path, *args, mark, timeout=90)
    assert all(results[v] is None for v in (victim if isinstance(victim, tuple) else (victim,))), results
    return path, results, float(Path(mark).read_text())


@pytest.mark.parametrize(
    ("point", "victim"),
    [("describe", 2), ("write", 1), ("after-write", 3), ("commit", 0), ("load", 2), ("exchange", 0),
     ("half-sent", 2), ("write", (2, 3))],
)
def test_a_dead_rank_fails_every_survivor_in_bounded_time(tmp_path, point, victim):
    """Within one peer_timeout, also where a rank died between two store calls of a step (the
    root had its message but not its count, and waited for ever) and where two died at once (the
    root waited one peer_timeout more for the second one's goodbye)."""
    path, results, died = _kill_trial(tmp_path, _save_and_maybe_die, victim, point, victim)
    victims = victim if isinstance(victim, tuple) else (victim,)
    for r, res in enumerate(results):
        if r in victims:
            continue
        status, msg, end = res
        assert status == "err" and msg.startswith("RankFailedError"), (r, res)
        assert any(f"rank {v}" in msg for v in victims), (r, msg)
        assert end - died < PEER_TIMEOUT + (3.5 if len(victims) > 1 else 6), (r, end - died)
    # The checkpoint that was there is intact, and nothing of the failed save survives it.
    assert holds(path, 1, 4)
    m = _core.Manifest.open(path)
    m.check_coverage()
    m.verify_data()


def _save_killed_after(rank: int, path: str, victim: int, delay: float, mark: str) -> str:
    import threading

    def kill() -> None:
        Path(mark).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    sd = full_state(rank, 4, 2)
    if rank == victim:
        threading.Timer(delay, kill).start()
    olmo_chunks.save(sd, path, overwrite=True, peer_timeout=PEER_TIMEOUT)
    if rank == victim:
        time.sleep(5)  # the kill lands, whether the save finished first or not
    return "done"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_rank_killed_at_a_random_moment_of_a_save(tmp_path, seed):
    import random

    rng = random.Random(seed)
    victim, delay = rng.randrange(4), rng.uniform(0.0, 0.6)
    path, results, died = _kill_trial(tmp_path, _save_killed_after, victim, victim, delay)
    survivors = [res for r, res in enumerate(results) if r != victim]
    if all(res[:2] == ("ok", "done") for res in survivors):
        assert holds(path, 2, 4)  # it died after the commit
    else:
        for res in survivors:
            assert res[0] == "err" and res[1].startswith("RankFailedError") and f"rank {victim}" in res[1], res
            assert res[2] - died < PEER_TIMEOUT + 6, res
        assert holds(path, 1, 4) or holds(path, 2, 4)  # the kill may come after the commit's rename
    _core.Manifest.open(path).verify_data()


def _interrupt(rank: int, path: str, victim: int) -> str:
    if rank == victim:
        from olmo_chunks.session import SaveSession

        def boom(*a: Any, **k: Any) -> None:
            raise KeyboardInterrupt

        SaveSession.write = boom
    olmo_chunks.save(full_state(rank, 4, 2), path, overwrite=True, peer_timeout=60)
    return "done"


def test_a_keyboard_interrupt_on_one_rank_fails_all_at_once(tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(r[0] == "ok" for r in run_raw(4, _first_save, path))
    t0 = time.time()
    results = run_raw(4, _interrupt, path, 3)
    assert results[3][:2] == ("err", "KeyboardInterrupt: "), results
    for r in range(3):
        assert results[r][0] == "err" and "RankFailedError: rank 3 failed: KeyboardInterrupt" in results[r][1]
        assert results[r][2] - t0 < 30  # well inside the 60 s peer timeout: nobody waited for it
    assert holds(path, 1, 4)
    assert os.listdir(Path(path) / "data") == [_core.Manifest.open(path).save_id]
    assert not (Path(path) / LEASE).exists()


# --------------------------------------------------------------------------------------------
# Racing saves
# --------------------------------------------------------------------------------------------


def _racer(rank: int, path: str, version: int, gate: str, delay: float, hold: float) -> str:
    from olmo_chunks.session import SaveSession

    if hold:
        orig = SaveSession.write

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(hold)
            return orig(*a, **k)

        SaveSession.write = slow
    # The race starts once the 4 ranks of both worlds are up: at the same moment on each.
    tmp = Path(gate) / f".{version}-{rank}"
    tmp.write_text(str(time.time()))
    tmp.rename(Path(gate) / f"{version}-{rank}")
    deadline = time.time() + 120
    while len(ready := [p for p in Path(gate).iterdir() if not p.name.startswith(".")]) < 4:
        assert time.time() < deadline, ready
        time.sleep(0.01)
    time.sleep(max(0.0, max(float(p.read_text()) for p in ready) + 0.2 + delay - time.time()))
    try:
        olmo_chunks.save(full_state(rank, 2, version), path, overwrite=True, peer_timeout=30)
    except (CheckpointLockedError, RankFailedError) as exc:
        return f"lost: {type(exc).__name__}: {exc}"
    return "won"


def _race(path: str, holds_a: float, delay_b: float) -> tuple[list, list]:
    """World A (version 10) and world B (version 20), 2 ranks each, saving to one path at once."""
    import tempfile
    import threading

    gate = tempfile.mkdtemp(dir=Path(path).parent)
    out: dict[str, list] = {}
    ta = threading.Thread(target=lambda: out.__setitem__("a", run_raw(2, _racer, path, 10, gate, 0.0, holds_a)))
    ta.start()
    out["b"] = run_raw(2, _racer, path, 20, gate, delay_b, 0.0)
    ta.join()
    return out["a"], out["b"]


def test_two_worlds_racing_to_one_path(tmp_path):
    path = str(tmp_path / "ckpt")
    # A holds its lease for 3 s while B starts: B must lose on every rank, A must win.
    a, b = _race(path, holds_a=3.0, delay_b=1.0)
    assert [r[1] for r in a] == ["won", "won"], a
    assert all(r[1].startswith("lost") for r in b), b
    assert "CheckpointLockedError" in b[0][1] and "another save holds its lease" in b[0][1]
    assert holds(path, 10, 2)
    # Free-running races: whoever wins, the path holds exactly one complete save.
    for _ in range(2):
        a, b = _race(path, holds_a=0.0, delay_b=0.0)
        outcomes = {"a": {r[1].split(":")[0] for r in a}, "b": {r[1].split(":")[0] for r in b}}
        assert all(len(v) == 1 for v in outcomes.values()), (a, b)  # a world wins or loses as one
        winners = [w for w, v in outcomes.items() if v == {"won"}]
        assert winners, (a, b)
        assert any(holds(path, {"a": 10, "b": 20}[w], 2) for w in winners)
        _core.Manifest.open(path).verify_data()
        assert len(os.listdir(Path(path) / "data")) == 1


# --------------------------------------------------------------------------------------------
# What a save finds at the path (single process)
# --------------------------------------------------------------------------------------------


def test_save_refuses_a_data_directory_it_did_not_write(tmp_path):
    p = tmp_path / "ckpt"
    (p / "data").mkdir(parents=True)
    (p / "data" / "train.jsonl").write_text("hi")
    refused = r"its data/ holds entries this store did not write \(found data/train.jsonl\)"
    with pytest.raises(InvalidArgumentError, match=refused):
        olmo_chunks.save({"w": torch.ones(3)}, p)
    assert (p / "data" / "train.jsonl").read_text() == "hi"
    assert sorted(os.listdir(p)) == ["data"]


def test_save_beside_foreign_files_never_touches_or_lists_them(tmp_path):
    """As DCP does (format_utils.torch_save_to_dcp writes beside its source model.pt): files this
    store did not write may sit in the directory before the first save; no save touches them."""
    p = tmp_path / "ckpt"
    p.mkdir()
    foreign = {"model.pt": b"torch.save bytes", "README": b"user", ".olmo_chunks.manifest.tmp-notes": b"not ours",
               ".olmo_chunks.manifest.tmp-" + "A" * 32: b"upper-case: not a save id",
               ".olmo_chunks.lease.stale-mine": b"not a save id"}
    for name, data in foreign.items():
        (p / name).write_bytes(data)
    (p / "sub").mkdir()
    (p / "sub" / "x.bin").write_bytes(b"user")
    olmo_chunks.save({"w": torch.ones(3)}, p)
    olmo_chunks.save({"w": torch.full((3,), 2.0)}, p, overwrite=True)
    assert {name: (p / name).read_bytes() for name in foreign} == foreign
    assert (p / "sub" / "x.bin").read_bytes() == b"user"
    m = _core.Manifest.open(str(p))
    assert all(f.path.startswith("data/") for f in m.files), [f.path for f in m.files]
    sd = {"w": torch.zeros(3)}
    olmo_chunks.load(sd, p)
    assert torch.equal(sd["w"], torch.full((3,), 2.0))


def test_save_never_writes_through_a_symlinked_data_dir(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.bin").write_bytes(b"x")
    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)
    import shutil

    shutil.rmtree(p / "data")
    os.symlink(target, p / "data")
    with pytest.raises(InvalidArgumentError, match="data \\(not a directory\\)"):
        olmo_chunks.save({"w": torch.ones(3)}, p, overwrite=True)
    assert os.listdir(target) == ["precious.bin"]


def test_foreign_files_beside_a_checkpoint_survive_saves(tmp_path):
    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)
    (p / "README").write_text("user")
    (p / "data" / "user-dir").mkdir()
    (p / "data" / "user-dir" / "x.txt").write_text("user")
    (p / "data" / ("e" * 32)).mkdir()  # looks like a save id but holds a file no save writes
    (p / "data" / ("e" * 32) / "notes.txt").write_text("user")
    olmo_chunks.save({"w": torch.full((3,), 2.0)}, p, overwrite=True)
    assert (p / "README").read_text() == "user"
    assert (p / "data" / "user-dir" / "x.txt").read_text() == "user"
    assert (p / "data" / ("e" * 32) / "notes.txt").read_text() == "user"
    sd = {"w": torch.zeros(3)}
    olmo_chunks.load(sd, p)
    assert torch.equal(sd["w"], torch.full((3,), 2.0))


def test_overwrite_is_explicit(tmp_path):
    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        olmo_chunks.save({"w": torch.zeros(3)}, p)
    sd = {"w": torch.zeros(3)}
    olmo_chunks.load(sd, p)
    assert torch.equal(sd["w"], torch.ones(3))


@pytest.mark.parametrize("sd", [{"step": 1}, {}, {"w": torch.empty(0), "cfg": {"lr": 0.1}}])
def test_saves_without_tensor_bytes(tmp_path, sd):
    p = tmp_path / "new" / "ckpt"
    olmo_chunks.save(sd, p)
    back = {k: (torch.empty(0) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    olmo_chunks.load(back, p)
    assert back.keys() == sd.keys()
    assert all(back[k] == v for k, v in sd.items() if not isinstance(v, torch.Tensor))


def test_one_prefix_written_two_ways_is_one_location():
    """Ranks passing `s3://b/x` and `s3://b//x/` (the same keys) were refused as passing different
    paths, until 2026-12-07."""
    from olmo_chunks.location import checkpoint_location

    assert {checkpoint_location(u) for u in ("s3://b/x/y", "s3://b//x/y/", "s3://b/x//y")} == {"s3://b/x/y"}
    assert checkpoint_location("gs://b/") == checkpoint_location("gs://b//") == "gs://b"
    assert checkpoint_location("a//b/") == "a//b/"  # local paths as given


def test_urls_of_unsupported_stores_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="unsupported URL scheme 'ftp'"):
        olmo_chunks.save({"w": torch.ones(3)}, "ftp://host/x")
    with pytest.raises(InvalidArgumentError, match="no bucket name"):
        olmo_chunks.load({"w": torch.ones(3)}, "s3:///x")
    assert os.listdir(tmp_path) == []


def _fake_lease(p: Path, *, pid: int, host: str, age: float, **more: float) -> None:
    p.mkdir(parents=True, exist_ok=True)
    me = json.loads(json.dumps({"save_id": "0" * 32, "host": host, "boot_id": "", "pid_ns": "", "pid": pid, **more}))
    if host == socket.gethostname():
        me["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        me["pid_ns"] = os.readlink("/proc/self/ns/pid")
    (p / LEASE).write_text(json.dumps(me))
    t = time.time() - age
    os.utime(p / LEASE, (t, t))


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("fails", ["write", "upload"])
def test_a_save_whose_lease_was_taken_over_fails_saying_so(tmp_path, monkeypatch, fails):
    """Its writer stalled past the lease, another save took the path over and removed this one's
    data (aborted its uploads): the write that then fails is `CheckpointLockedError`, as the
    docs promise, not the StorageError or MissingDataFileError of the lost upload (until
    2026-12-07). Nothing is committed; the checkpoint there stays."""
    from olmo_chunks.errors import MissingDataFileError
    from olmo_chunks.session import SaveSession

    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)

    def taken_over(self: Any, chunks: Any) -> None:
        _fake_lease(p, pid=1, host="other-host", age=0)  # the other save's lease now
        raise (StorageError if fails == "write" else MissingDataFileError)(f"{p}/data: the upload is gone")

    monkeypatch.setattr(SaveSession, "write_file", taken_over)
    with pytest.raises(CheckpointLockedError, match="this save's lease was taken over by another writer"):
        olmo_chunks.save({"w": torch.zeros(3)}, p, overwrite=True)
    monkeypatch.undo()
    got = {"w": torch.zeros(3)}
    olmo_chunks.load(got, p)
    assert torch.equal(got["w"], torch.ones(3))
    # A write that fails for another reason, the lease still held, is that error.
    def disk_full(self: Any, chunks: Any) -> None:
        raise StorageError(f"{p}/data: no space left on device")

    (p / LEASE).unlink()  # the other save is done
    monkeypatch.setattr(SaveSession, "write_file", disk_full)
    with pytest.raises(StorageError, match="no space left"):
        olmo_chunks.save({"w": torch.zeros(3)}, p, overwrite=True)


def test_leases_of_dead_writers_are_taken_over_and_live_ones_refused(tmp_path):
    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)
    # A live writer elsewhere, heartbeat fresh: refused, the checkpoint untouched.
    _fake_lease(p, pid=1, host="other-host", age=1)
    with pytest.raises(CheckpointLockedError, match="another save holds its lease"):
        olmo_chunks.save({"w": torch.zeros(3)}, p, overwrite=True)
    # Quoted with its control characters escaped: a planted lease cannot forge log lines.
    (p / LEASE).write_text((p / LEASE).read_text().replace("other-host", "other-host\x1b[2J\r\nolmo-chunks: saved"))
    with pytest.raises(CheckpointLockedError, match="another save holds its lease") as info:
        olmo_chunks.save({"w": torch.zeros(3)}, p, overwrite=True)
    assert r"other-host\u{1b}[2J\u{d}\u{a}olmo-chunks: saved" in str(info.value), str(info.value)
    _fake_lease(p, pid=1, host="other-host", age=1)
    # A writer whose own lease timeout is longer (it renews less often): judged by its own.
    _fake_lease(p, pid=1, host="other-host", age=120, lease_timeout_s=300)
    with pytest.raises(CheckpointLockedError, match=r"heartbeat 12\ds ago.*for 300s belongs to a dead writer"):
        olmo_chunks.save({"w": torch.zeros(3)}, p, overwrite=True)
    # The same writer silent for longer than the lease timeout: dead, taken over.
    _fake_lease(p, pid=1, host="other-host", age=120)
    olmo_chunks.save({"w": torch.full((3,), 2.0)}, p, overwrite=True)
    # A writer of this machine whose process is gone: dead at once, whatever its heartbeat says.
    _fake_lease(p, pid=_dead_pid(), host=socket.gethostname(), age=0)
    olmo_chunks.save({"w": torch.full((3,), 3.0)}, p, overwrite=True)
    sd = {"w": torch.zeros(3)}
    olmo_chunks.load(sd, p)
    assert torch.equal(sd["w"], torch.full((3,), 3.0))
    assert not (p / LEASE).exists()


def test_a_failed_save_removes_its_data_and_the_next_save_cleans_what_a_killed_one_left(tmp_path):
    p = tmp_path / "ckpt"
    olmo_chunks.save({"w": torch.ones(3)}, p)
    live = _core.Manifest.open(str(p)).save_id
    with pytest.raises(InvalidArgumentError, match="block size"):  # fails after the lease, in the write
        olmo_chunks.save({"w": torch.ones(3)}, p, overwrite=True, block_size=(64 << 20) + 1)
    assert os.listdir(p / "data") == [live]
    # What a kill -9 leaves: a partial save directory, a temp manifest, a lease of a dead pid, and
    # (killed while breaking an older dead writer's lease) that lease moved aside.
    dead = "d" * 32
    (p / "data" / dead).mkdir()
    (p / "data" / dead / "rank-00000.bin").write_bytes(b"\0" * 100)
    (p / f".olmo_chunks.manifest.tmp-{dead}").write_bytes(b"partial")
    (p / f".olmo_chunks.lease.stale-{dead}").write_bytes(b'{"save_id": "older"}')
    _fake_lease(p, pid=_dead_pid(), host=socket.gethostname(), age=0)
    olmo_chunks.save({"w": torch.full((3,), 2.0)}, p, overwrite=True)
    new = _core.Manifest.open(str(p)).save_id
    assert sorted(os.listdir(p)) == ["data", "olmo_chunks.manifest"]
    assert os.listdir(p / "data") == [new]


def test_tied_weights_load_through_the_native_door(tmp_path):
    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
        m[1].weight = m[0].weight
        return m

    src = model()
    olmo_chunks.save(src.state_dict(), tmp_path / "c")
    dst = model()
    with torch.no_grad():
        dst[0].weight.zero_()
    report = olmo_chunks.load(dst.state_dict(), tmp_path / "c")
    assert report.loaded == ["0.weight", "1.weight"]
    assert torch.equal(dst[0].weight, src[0].weight) and dst[1].weight is dst[0].weight
    # A checkpoint whose two keys differ cannot fill one shared storage.
    olmo_chunks.save({"0.weight": torch.ones(7, 4), "1.weight": torch.zeros(7, 4)}, tmp_path / "d")
    with pytest.raises(olmo_chunks.MismatchError, match=r"shares memory with 0\.weight"):
        olmo_chunks.load(model().state_dict(), tmp_path / "d")


def test_parameters_that_require_grad_load_in_place_and_staged(tmp_path):
    """Parameters passed as they are (not a detached state_dict): filled in place, or through a
    staging buffer where two keys' elements interleave in one storage (a torch RuntimeError about
    an in-place operation on a leaf view before)."""
    olmo_chunks.save({"a": torch.arange(8.0), "b": torch.arange(8.0) + 10, "p": torch.arange(4.0)}, tmp_path / "c")
    buf, p = torch.nn.Parameter(torch.zeros(8, 2)), torch.nn.Parameter(torch.zeros(4))
    version = buf._version
    olmo_chunks.load({"a": buf[:, 0], "b": buf[:, 1], "p": p}, tmp_path / "c")
    assert torch.equal(buf.detach(), torch.stack([torch.arange(8.0), torch.arange(8.0) + 10], dim=1))
    assert torch.equal(p.detach(), torch.arange(4.0)) and p.requires_grad and buf.requires_grad
    assert buf._version > version  # autograd sees the staged copies


def test_loading_into_an_expanded_destination_is_refused(tmp_path):
    olmo_chunks.save({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "c")
    sd = {"w": torch.zeros(3).expand(2, 3)}
    with pytest.raises(InvalidArgumentError, match="w: the destination's elements share memory"):
        olmo_chunks.load(sd, tmp_path / "c")


def _dcp_step_and_maybe_die(rank: int, path: str, step: str, victim: int, mark: str) -> str:
    import torch.distributed.checkpoint as dcp
    from olmo_chunks import dcp as door
    from olmo_chunks.session import SaveSession

    if rank == victim:
        def kill(*a: Any, **k: Any) -> None:
            Path(mark).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        if step == "save":
            SaveSession.write = kill
        else:
            door.ChunkStoreReader._read_items = kill
    sd = full_state(rank, 4, 2)
    if step == "save":
        dcp.save(sd, storage_writer=door.ChunkStoreWriter(path, peer_timeout=PEER_TIMEOUT))
    else:
        dcp.load(sd, storage_reader=door.ChunkStoreReader(path, peer_timeout=PEER_TIMEOUT))
    return "done"


@pytest.mark.parametrize(("step", "victim"), [("save", 2), ("load", 1)])
def test_a_dead_rank_never_hangs_the_dcp_door(tmp_path, step, victim):
    path, results, died = _kill_trial(tmp_path, _dcp_step_and_maybe_die, victim, step, victim)
    for r, res in enumerate(results):
        if r != victim:
            assert res[0] == "err", (r, res)
            # DCP's own collective after our step fails too, bounded by min(peer_timeout, 10 s).
            assert res[2] - died < 2 * PEER_TIMEOUT + 8, (r, res[2] - died, res)
    assert holds(path, 1, 4)


def _load_own_part(rank: int, path: str, victim: int) -> dict[str, str]:
    """Rank r loads tensor `t{r}` alone (directly or read once, as the default chooses), by each
    door; then every rank loads a tensor nobody corrupted. What each raised, and in how long."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks import dcp as door

    out = {}
    for name, load in [
        ("native", lambda sd: olmo_chunks.load(sd, path, partial=True, peer_timeout=60)),
        ("dcp", lambda sd: dcp.load(sd, storage_reader=door.ChunkStoreReader(path, peer_timeout=60))),
    ]:
        t0 = time.monotonic()
        try:
            load({f"t{rank}": torch.zeros(1 << 18)})
            out[name] = "ok"
        except BaseException as exc:  # torch's CheckpointException is one
            out[name] = f"{type(exc).__name__}: {exc}"
        out[f"{name} s"] = f"{time.monotonic() - t0:.1f}"
    healthy = {f"t{(victim + 1) % 3}": torch.zeros(1 << 18)}
    olmo_chunks.load(healthy, path, partial=True)
    out["healthy"] = str(torch.equal(next(iter(healthy.values())), torch.full((1 << 18,), float((victim + 1) % 3))))
    return out


@pytest.mark.parametrize("victim", [0, 2])
def test_a_failed_read_on_one_rank_fails_every_rank_at_once(tmp_path, victim):
    """A rank whose reads fail (a corrupted block only it reads) between steps: the others do not
    return a load that did not happen, nor wait for it until a timeout (the DCP door hung)."""
    path = str(tmp_path / "ckpt")
    olmo_chunks.save({f"t{r}": torch.full((1 << 18,), float(r)) for r in range(3)}, path)
    m = _core.Manifest.open(path)
    key = f"t{victim}"
    (c,) = m.chunks([t.key for t in m.tensors].index(key))
    data = Path(path) / m.files[c.file].path
    raw = bytearray(data.read_bytes())
    raw[c.offset + 12345] ^= 0x40
    data.write_bytes(bytes(raw))
    results = run_raw(3, _load_own_part, path, victim, timeout=120)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", (r, res)
        got = res[1]
        assert got["healthy"] == "True", (r, got)
        if r == victim:
            assert got["native"].startswith("ChecksumError") and f'tensor "{key}"' in got["native"], got
        else:
            assert got["native"].startswith(f"RankFailedError: rank {victim} failed: ChecksumError"), (r, got)
        # torch DCP gathers every rank's error after the read step and raises them all everywhere.
        assert got["dcp"].startswith("CheckpointException") and "ChecksumError" in got["dcp"], (r, got)
        assert float(got["native s"]) < 10 and float(got["dcp s"]) < 10, (r, got)  # not a 60 s timeout


def test_coordination_messages_are_data_not_code():
    import pickle

    from olmo_chunks import _dist

    chunk = _core.WrittenChunk("w", _core.Box([0], [4]), "data/x/rank-00000.bin", 64, 0, 16, [1])
    got = _dist._loads(pickle.dumps(("ok", [chunk, {"k": (1, 2.5, "s", b"b", None)}, _core.Flat(3, 4)])))
    assert got[1][0].key == "w" and got[1][0].region == _core.Box([0], [4])
    assert got[1][1] == {"k": (1, 2.5, "s", b"b", None)} and got[1][2] == _core.Flat(3, 4)
    with pytest.raises(olmo_chunks.OlmoChunksError, match=r"names posix\.system; refused"):
        _dist._loads(pickle.dumps(os.system))
