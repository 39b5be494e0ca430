"""A process at its limits (a file size limit, no file descriptor or thread left) and paths made
before their targets: clear errors, no lease left behind, the previous checkpoint intact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks.errors import InvalidArgumentError

from tests.test_failures import run_raw


def _run(script: str, *args: str) -> list[str]:
    """`script` run by a fresh interpreter (limits set there stay there); its printed lines."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


_SAVE_AT_A_LIMIT = """
    import os, resource, signal, sys, torch, olmo_chunks
    path, limit = sys.argv[1], sys.argv[2]
    sd = {"w": torch.arange(1000.0)}
    olmo_chunks.save(sd, path)
    held = []
    if limit == "fsize":  # no file may grow past 64 bytes (the lease, written first, has more)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    else:  # one descriptor left: the lease is taken, its data directory cannot be read
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        os.close(held.pop())
    try:
        olmo_chunks.save({"w": sd["w"] + 1}, path, overwrite=True)
    except olmo_chunks.OlmoChunksError as exc:
        print(type(exc).__name__, exc.errno)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for fd in held:
        os.close(fd)
    print("lease left:", os.path.exists(os.path.join(path, ".olmo_chunks.lease")))
    got = {"w": torch.zeros(1000)}
    olmo_chunks.load(got, path)
    print("previous kept:", torch.equal(got["w"], sd["w"]))
    olmo_chunks.save({"w": sd["w"] + 2}, path, overwrite=True)  # at once: no lease to wait out
    olmo_chunks.load(got, path)
    print("saved again:", torch.equal(got["w"], sd["w"] + 2))
"""


@pytest.mark.parametrize(("limit", "errno"), [("fsize", "27"), ("descriptors", "24")])
def test_a_save_failing_at_a_limit_of_the_process_leaves_no_lease(tmp_path: Path, limit: str, errno: str):
    # EFBIG while writing the lease left it empty, and EMFILE let the failed save not read (so not
    # release) its lease: the next save was refused for a lease timeout (45 s), named as another
    # save's, in the second case this very process's.
    lines = _run(_SAVE_AT_A_LIMIT, str(tmp_path / "ckpt"), limit)
    assert lines == [f"StorageError {errno}", "lease left: False", "previous kept: True", "saved again: True"], lines


def _out_of_descriptors(rank: int, path: str) -> str:
    """Rank 1 has no file descriptor left at its first save: it cannot connect to the store."""
    from olmo_chunks import checkpoint, fill  # noqa: F401  (imported lazily: an import needs a descriptor)

    held = []
    if rank == 1:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
    try:
        olmo_chunks.save({f"r{rank}": torch.full((100,), 1.0)}, path, overwrite=True, peer_timeout=20)
    except olmo_chunks.OlmoChunksError as exc:
        first = f"{type(exc).__name__}: {exc}"
    else:
        first = "ok"
    for fd in held:
        os.close(fd)
    olmo_chunks.save({f"r{rank}": torch.full((100,), 2.0)}, path, overwrite=True, peer_timeout=20)
    return first


def test_a_rank_out_of_descriptors_says_so_at_once_and_the_others_stop_with_it(tmp_path: Path):
    # It was "rank 0 died or stopped responding: the rendezvous store it hosts is gone" after
    # peer_timeout of connection retries, on a live rank 0.
    results = run_raw(2, _out_of_descriptors, str(tmp_path / "ckpt"), timeout=90)
    (s0, first0, _), (s1, first1, _) = results  # type: ignore[misc]
    assert (s0, s1) == ("ok", "ok"), results  # and the next save, in step again, committed
    own = ("could not reach the rendezvous store: Too many open files (os error 24): this process is out of file "
           "descriptors")
    assert first1.startswith("StorageError: olmo-chunks: ") and own in first1, results
    assert first0.startswith("RankFailedError: rank 1 gave up on this operation: ") and own in first0, results
    got = {f"r{r}": torch.zeros(100) for r in range(2)}
    olmo_chunks.load(got, tmp_path / "ckpt")
    assert all(torch.equal(t, torch.full((100,), 2.0)) for t in got.values())


_PIDS = Path("/sys/fs/cgroup/pids")

_NO_THREADS = """
    import os, sys, torch, olmo_chunks
    path, cgroup, op = sys.argv[1:]
    sd = {f"t{i}": torch.full((10000,), float(i)) for i in range(20)}
    olmo_chunks.save(sd, path, overwrite=True)
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(cgroup, "pids.current")) as f:
        now = int(f.read())
    with open(os.path.join(cgroup, "pids.max"), "w") as f:
        f.write(str(now))  # no thread more
    try:
        if op == "save":
            olmo_chunks.save(sd, path, overwrite=True)
        elif op == "async_save":
            olmo_chunks.async_save(sd, path, overwrite=True).result()
        else:
            got = {k: torch.zeros(10000) for k in sd}
            olmo_chunks.load(got, path, workers=8)
            assert all(torch.equal(got[k], sd[k]) for k in sd)
        print("ok")
    except olmo_chunks.OlmoChunksError as exc:
        print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("op", ["save", "async_save", "load"])
def test_no_thread_left_is_a_storage_error_and_a_load_goes_on_without(tmp_path: Path, op: str):
    # Each was a PanicException of the core's worker threads or a RuntimeError of Python's (and
    # for async_save an error at interpreter exit, joining the thread that never started).
    cgroup = _PIDS / f"olmo-chunks-test-{os.getpid()}"
    try:
        cgroup.mkdir()
    except OSError as exc:
        pytest.skip(f"no cgroup v1 pids controller to limit threads with here ({exc})")
    try:
        lines = _run(_NO_THREADS, str(tmp_path / "ckpt"), str(cgroup), op)
    finally:
        (cgroup / "pids.max").write_text("max")
        cgroup.rmdir()
    if op == "load":  # the core's workers are threads the caller's own can stand in for
        assert lines == ["ok"], lines
    else:
        assert len(lines) == 1 and lines[0].startswith("StorageError olmo-chunks: could not start a thread ("), lines
        assert lines[0].endswith("the process is at a limit on threads or memory (ulimit -u, a container's pids.max, "
                                 "ulimit -v)"), lines


def test_a_checkpoint_path_linked_to_a_directory_not_made_yet_makes_it(tmp_path: Path):
    # `ln -s /scratch/run1 ckpt` before the run: "MissingDataFileError ... .olmo_chunks.lease: No
    # such file or directory", a corrupt-checkpoint error for a save.
    (tmp_path / "ckpt").symlink_to(tmp_path / "link2")
    (tmp_path / "link2").symlink_to("scratch/run1")  # relative: to the link's directory
    olmo_chunks.save({"w": torch.ones(3)}, tmp_path / "ckpt")
    assert (tmp_path / "scratch" / "run1" / olmo_chunks.MANIFEST_NAME).is_file()
    got = {"w": torch.zeros(3)}
    olmo_chunks.load(got, tmp_path / "ckpt")
    assert torch.equal(got["w"], torch.ones(3))
    (tmp_path / "gone").symlink_to(tmp_path / "no" / "such")  # `mkdir -p gone/ckpt` fails too
    with pytest.raises(InvalidArgumentError, match=r"gone/ckpt: cannot make the checkpoint directory: a symbolic "
                                                   r"link on its path leads nowhere"):
        olmo_chunks.save({"w": torch.ones(3)}, tmp_path / "gone" / "ckpt")
    # A directory that refuses new entries (procfs: ENOENT) has no link to blame (said it had, until 2026-12-07).
    with pytest.raises(InvalidArgumentError, match=r"^/proc/olmo-chunks-x: cannot make the checkpoint directory \(No "):
        olmo_chunks.save({"w": torch.ones(3)}, "/proc/olmo-chunks-x")
