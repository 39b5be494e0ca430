"""Cooperative loads on real gloo worlds: every saved byte read from storage once per job (the
core's own byte counters), handed between ranks with collectives, bit-exact, within the budget."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import olmo_chunks
import pytest
import torch
import torch.distributed as dist
from olmo_chunks import _core, fill
from olmo_chunks.errors import ChecksumError, InvalidArgumentError, RankFailedError
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests import world

ROWS, COLS = 1024, 1024  # 4 MiB of float32 per tensor: 4 blocks of the default 1 MiB
KEYS = ("a", "b")


def full(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(ord(key))
    return torch.randn(ROWS, COLS, generator=g)


def placements(name: str):
    return {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}[name]


def save_as(path: str, layout: str) -> None:
    mesh = world.mesh((dist.get_world_size(),))
    olmo_chunks.save({k: distribute_tensor(full(k), mesh, placements(layout)) for k in KEYS}, path)


def load_as(path: str, layout: str, read: str, budget: int | None = None):
    """Loads into zeroed DTensors of `layout` on this world; returns (bytes read from storage by
    this rank, exact, report figures)."""
    mesh = world.mesh((dist.get_world_size(),))
    state = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements(layout)) for k in KEYS}
    old = fill.STAGING_BYTES
    if budget is not None:
        fill.STAGING_BYTES = budget
    try:
        before = _core.io_counters()[0]
        report = olmo_chunks.load(state, path, read=read)
        read_bytes = _core.io_counters()[0] - before
    finally:
        fill.STAGING_BYTES = old
    exact = all(
        torch.equal(state[k].to_local(), distribute_tensor(full(k), mesh, placements(layout)).to_local())
        for k in KEYS
    )
    return read_bytes, exact, (report.read, report.rounds, report.round_peak_bytes)


CHECKPOINT = len(KEYS) * ROWS * COLS * 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for layout in ("S0", "R"):
        paths[layout] = str(tmp_path_factory.mktemp(f"saved-{layout}"))
        world.run(4, save_as, paths[layout], layout)
    return paths


@pytest.mark.parametrize(
    ("src", "dst", "m", "direct_amplification"),
    [("S0", "S1", 4, 4.0), ("S0", "R", 4, 4.0), ("R", "S0", 4, 1.0), ("S0", "S0", 2, 1.0)],
)
def test_each_saved_byte_is_read_once_per_job(saved, src, dst, m, direct_amplification):
    manifest = len(_core.Manifest.read_bytes(saved[src]))
    once = world.run(m, load_as, saved[src], dst, "once")
    direct = world.run(m, load_as, saved[src], dst, "direct")
    assert all(exact for _, exact, _ in once + direct)
    # The manifest is read by rank 0 alone and broadcast.
    total_once = sum(n for n, _, _ in once)
    assert total_once - manifest <= 1.1 * CHECKPOINT, (src, dst, [n for n, _, _ in once])
    assert total_once >= CHECKPOINT
    total_direct = sum(n for n, _, _ in direct)
    assert total_direct == pytest.approx(direct_amplification * CHECKPOINT + m * manifest, rel=0.02)
    # Reading is spread over the ranks: none reads more than its share plus a block.
    if direct_amplification > 1:
        assert max(n for n, _, _ in once) <= CHECKPOINT / m + (1 << 20) + manifest
        assert {r[2][0] for r in once} == {"once"}


@contextlib.contextmanager
def _counting(method: str) -> Iterator[list[int]]:
    """Counts the calls of `Group.<method>` inside the block (in the one-item list it yields)."""
    from olmo_chunks._dist import Group

    calls = [0]
    original = getattr(Group, method)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    setattr(Group, method, counted)
    try:
        yield calls
    finally:
        setattr(Group, method, original)


def _broadcasts_of_a_load(path: str, inline: int) -> tuple[int, bool, int]:
    """(manifest broadcasts on the group's collectives, exact, bytes this rank read) of a direct
    load whose open step may carry `inline` bytes out of rank 0."""
    from olmo_chunks import checkpoint

    budget, checkpoint.INLINE_BYTES = checkpoint.INLINE_BYTES, inline
    try:
        with _counting("broadcast_bytes") as calls:
            read_bytes, exact, _ = load_as(path, "S0", "direct")
    finally:
        checkpoint.INLINE_BYTES = budget
    return calls[0], exact, read_bytes


def test_the_manifest_rides_in_the_open_step_unless_it_would_crowd_the_store(saved):
    # A manifest that all peers together fetch within the store's budget comes with the open
    # step's outcome; a larger one (or a larger group) is broadcast after it. Either way rank 0
    # alone reads it, and every rank loads the same bytes.
    manifest = len(_core.Manifest.read_bytes(saved["S0"]))
    for inline, broadcasts in ((3 * manifest, 0), (3 * manifest - 1, 1)):
        got = world.run(4, _broadcasts_of_a_load, saved["S0"], inline)
        assert [c for c, _, _ in got] == [broadcasts] * 4, (inline, got)
        assert all(exact for _, exact, _ in got)
        assert got[0][2] == CHECKPOINT // 4 + manifest
        assert [n for _, _, n in got[1:]] == [CHECKPOINT // 4] * 3


def load_auto(path: str, layout: str, gbps: str | None):
    """`load_as` with read="auto" and the storage rate `gbps` (None: learned or prior); returns
    (exact, what was chosen, predicted direct and once seconds, why)."""
    import os

    from olmo_chunks import rates

    if gbps is not None:
        os.environ["OLMO_CHUNKS_STORAGE_GBPS"] = gbps
    try:
        mesh = world.mesh((dist.get_world_size(),))
        state = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements(layout)) for k in KEYS}
        r = olmo_chunks.load(state, path).reading
        exact = all(torch.equal(state[k].to_local(), distribute_tensor(full(k), mesh, placements(layout)).to_local())
                    for k in KEYS)
        return exact, r.read, r.predicted_direct_s, r.predicted_once_s, r.why, rates.storage_rate(path)[1]
    finally:
        os.environ.pop("OLMO_CHUNKS_STORAGE_GBPS", None)


def test_auto_reads_once_from_slow_storage_and_directly_from_fast(saved):
    # S0 -> R on 4 ranks: reading directly reads every block 4 times, reading once moves 3/4 of
    # the bytes through the exchange. 10 MB/s storage makes the reads dominate; 1 TB/s the exchange.
    slow = world.run(4, load_auto, saved["S0"], "R", "0.01")
    fast = world.run(4, load_auto, saved["S0"], "R", "1000")
    for results, chosen in ((slow, "once"), (fast, "direct")):
        for exact, read, direct_s, once_s, why, _ in results:
            assert exact and read == chosen, (read, direct_s, once_s, why)
            assert (once_s < direct_s) == (chosen == "once") and "(env)" in why and "GB/s on cpu" in why
    # Each rank would read the whole 8 MiB checkpoint directly: 8 MiB at 10 MB/s.
    assert slow[0][2] == pytest.approx(CHECKPOINT / 1e7, rel=1e-6)
    # The read-once load was timed against its prediction: the next one's model is scaled by it.
    again = world.run(4, _two_slow_loads, saved["S0"])
    assert all(first != second and "its model (measured)" in why for first, second, why in again), again
    # Without the variable the rate is the prior, then what this process's loads measured.
    assert world.run(2, _two_auto_loads, saved["S0"]) == [("prior", "learned")] * 2


def _two_slow_loads(path: str) -> tuple[float, float, str]:
    """Two auto loads from 10 MB/s storage: each reads once; the second's prediction is scaled by
    how far the first's was off."""
    from olmo_chunks import rates

    rates._once_factor.clear()
    first = load_auto(path, "R", "0.01")
    second = load_auto(path, "R", "0.01")
    assert first[1] == second[1] == "once" and first[0] and second[0]
    return first[3], second[3], second[4]


def _save_blocks(path: str, block_size: int) -> None:
    mesh = world.mesh((dist.get_world_size(),))
    olmo_chunks.save({k: distribute_tensor(full(k), mesh, placements("S0")) for k in KEYS}, path,
                     block_size=block_size)


def _measured_exchanges(path: str, inline: int) -> list[tuple[str, str, int, bool]]:
    """Three auto loads on a group whose exchange is not measured yet, with needs of up to `inline`
    bytes in all in the store step: one sharing no block, one whose shared blocks its ranks check
    in part, then one whose every rank needs every block; after each, how it read, why, and how
    many exchanges this process has measured."""
    fill._EXCHANGE.clear()
    mesh = world.mesh((dist.get_world_size(),))
    out = []
    old, fill.INLINE_BYTES = fill.INLINE_BYTES, inline
    try:
        for layout in ("S0", "S1", "R"):
            state = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements(layout)) for k in KEYS}
            r = olmo_chunks.load(state, path).reading
            exact = all(torch.equal(state[k].to_local(),
                                    distribute_tensor(full(k), mesh, placements(layout)).to_local()) for k in KEYS)
            out.append((r.read, r.why, len(fill._EXCHANGE), exact))
    finally:
        fill.INLINE_BYTES = old
    return out


@pytest.mark.parametrize("inline", [fill.INLINE_BYTES, 0], ids=["needs-in-the-store-step", "needs-gathered"])
def test_the_exchange_is_measured_only_for_a_load_that_reading_once_may_speed_up(tmp_path, inline):
    # A load in the layout it was saved in shares no block, and one to Shard(1) has each rank read
    # a quarter of every row (the blocks checked in part, none read twice): reading once cannot pay
    # whatever the exchange costs, so the probe's all-to-alls (three of 8 MiB per rank here) are
    # not spent on them. Replicated, every rank reads every block directly, 4 times what reading
    # once would have each read: the exchange is measured. With no room in the store step (each
    # rank's needs of 4 KiB blocks take more than its 256 bytes there), the needs are gathered
    # before rank 0 says whether to measure.
    path = str(tmp_path)
    world.run(4, _save_blocks, path, 4096)
    for (first, split, replicated) in world.run(4, _measured_exchanges, path, inline):
        assert first == ("direct", fill.NOT_SHARED, 0, True)
        assert split[0] == "direct" and split[2:] == (0, True), split
        assert fill.UNMEASURED in split[1] and fill.DELEGATED in split[1], split
        assert replicated[2:] == (1, True) and "GB/s on cpu" in replicated[1], replicated


def test_rates_take_a_free_exchange_and_refuse_what_no_machine_measures():
    inf, nan = float("inf"), float("nan")
    free = _core.Rates(2e9, inf, 0.0, inf)  # what reading once could gain at most
    assert (free.exchange, free.copy, free.round) == (inf, inf, 0.0)
    for bad in [(0, 1, 0, 1), (inf, 1, 0, 1), (nan, 1, 0, 1), (1, nan, 0, 1), (1, 0, 0, 1),
                (1, -inf, 0, 1), (1, 1, -1e-9, 1), (1, 1, inf, 1), (1, 1, nan, 1), (1, 1, 0, 0)]:
        with pytest.raises(InvalidArgumentError, match="rates must be positive"):
            _core.Rates(*bad)


def test_the_once_factor_moves_halfway_and_stays_bounded():
    from olmo_chunks import rates

    key = (-1, "cpu")
    rates._once_factor.pop(key, None)
    assert rates.once_factor(key) == 1.0
    rates.learn_once(key, seconds=4.0, predicted=1.0)
    assert rates.once_factor(key) == pytest.approx(2.0)
    rates.learn_once(key, seconds=1.0, predicted=4.0)  # predicted with the factor: 2 x (1/4) ** 0.5
    assert rates.once_factor(key) == pytest.approx(1.0)
    for _ in range(20):
        rates.learn_once(key, seconds=1e6, predicted=1e-3)
    assert rates.once_factor(key) == 20.0
    rates.learn_once(key, seconds=0.0, predicted=1.0)  # nothing measured: unchanged
    assert rates.once_factor(key) == 20.0
    rates._once_factor.pop(key)


def test_a_read_that_faulted_in_its_destinations_does_not_teach_the_storage_rate(tmp_path):
    from olmo_chunks import rates

    source = str(tmp_path)
    rates._learned.clear()
    rates.learn_storage(source, 64 << 20, 0.5, faulted=48 << 20)  # fresh tensors: the faults timed
    assert rates.storage_rate(source)[1] == "prior"
    rates.learn_storage(source, 64 << 20, 0.5, faulted=8 << 20)  # a few fresh pages: counted
    assert rates.storage_rate(source) == (pytest.approx((64 << 20) / 0.5), "learned")
    rates._learned.clear()
    # 32 MiB of fresh pages written (a new mapping: no allocator hands back memory it holds) grow
    # this process by about that much.
    import mmap

    fresh = mmap.mmap(-1, 32 << 20)
    before = rates.resident_bytes()
    for at in range(0, len(fresh), 4096):
        fresh[at] = 1
    assert rates.resident_bytes() - before >= 31 << 20 or before == 0
    fresh.close()


def test_a_probe_whose_tiny_all_to_all_was_slow_does_not_make_the_exchange_free():
    from olmo_chunks import rates

    # 6 MB moved in 0.1 s after a 0.02 s tiny one: the latency comes off.
    r = rates.ExchangeRates.probed(6_000_000, small_s=0.02, big_s=0.1, copy_s=0.004)
    assert r.bps == pytest.approx(6e6 / 0.08) and r.round_s == pytest.approx(0.04)
    assert r.copy_bps == pytest.approx(rates.PROBE_BYTES / 0.004)
    # The tiny one as slow as the big one, or slower: at most half the big one comes off.
    for small in (0.1, 0.5):
        assert rates.ExchangeRates.probed(6_000_000, small_s=small, big_s=0.1, copy_s=0.004).bps == pytest.approx(1.2e8)


def _two_auto_loads(path: str) -> tuple[str, str]:
    from olmo_chunks import rates

    rates._learned.clear()  # this world's earlier tests loaded from this filesystem too
    before = rates.storage_rate(path)[1]
    exact, *_ = load_auto(path, "R", None)
    assert exact
    return before, rates.storage_rate(path)[1]


def load_through_dcp(path: str, layout: str, read: str) -> tuple[int, bool]:
    """`load_as` through torch DCP with `ChunkStoreReader` + `FastLoadPlanner`."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreReader, FastLoadPlanner

    mesh = world.mesh((dist.get_world_size(),))
    state = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements(layout)) for k in KEYS}
    before = _core.io_counters()[0]
    dcp.load(state, storage_reader=ChunkStoreReader(path, read=read), planner=FastLoadPlanner())
    read_bytes = _core.io_counters()[0] - before
    exact = all(
        torch.equal(state[k].to_local(), distribute_tensor(full(k), mesh, placements(layout)).to_local())
        for k in KEYS
    )
    return read_bytes, exact


def test_the_dcp_door_reads_once_too(saved):
    manifest = len(_core.Manifest.read_bytes(saved["S0"]))
    once = world.run(4, load_through_dcp, saved["S0"], "S1", "once")
    direct = world.run(4, load_through_dcp, saved["S0"], "S1", "direct")
    assert all(exact for _, exact in once + direct)
    # DCP asks every rank for the metadata: each reads the manifest itself.
    assert sum(n for n, _ in once) - 4 * manifest <= 1.1 * CHECKPOINT
    assert sum(n for n, _ in direct) - 4 * manifest == pytest.approx(4 * CHECKPOINT, rel=0.02)


def _warm(path: str) -> None:
    """Reads the checkpoint's files through the page cache: a rank copies its pieces of a block out
    of a mapping only where the block is resident (else it reads whole windows), and the suite's
    other I/O may have evicted a checkpoint saved minutes ago."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(1 << 20):
                    pass


def load_through_dcp_fast(path: str, layout: str) -> tuple[int, bool]:
    """`load_through_dcp` with `read="auto"` from storage said to be fast (so read directly), the
    checkpoint warm."""
    os.environ["OLMO_CHUNKS_STORAGE_GBPS"] = "1000"
    _warm(path)
    try:
        return load_through_dcp(path, layout, "auto")
    finally:
        os.environ.pop("OLMO_CHUNKS_STORAGE_GBPS", None)


def test_the_dcp_door_checks_blocks_in_part_too(saved, tmp_path):
    # S0 -> S1 read directly through DCP: each rank folds its share of every block (no rank reads
    # one whole), and a flipped byte fails every rank in the fill's last step.
    manifest = len(_core.Manifest.read_bytes(saved["S0"]))
    got = world.run(4, load_through_dcp_fast, saved["S0"], "S1")
    assert all(exact for _, exact in got)
    assert sum(n for n, _ in got) - 4 * manifest == CHECKPOINT
    path = str(tmp_path / "corrupt")
    _flip_a_byte(saved["S0"], path)
    with pytest.raises(world.WorldError) as err:
        world.run(4, load_through_dcp_fast, path, "S1")
    # DCP wraps each rank's failure in its own exception; rank 0's names the block.
    assert [f.type_name for f in err.value.failures] == ["CheckpointException"] * 4
    assert "ChecksumError" in err.value.failures[0].message
    assert "checksum mismatch in tensor" in err.value.failures[0].message


def test_rounds_stay_within_the_staging_budget(saved):
    budget = 6 << 20
    results = world.run(4, load_as, saved["S0"], "R", "once", budget)
    # Each of 4 ranks needs all 8 MiB: it reads 2 (straight into place), sends 3 x 2 and receives
    # 6 MiB, which it stages.
    per_rank = (6 + 6) << 20
    for _, exact, (mode, rounds, peak) in results:
        assert exact and mode == "once"
        assert rounds >= -(-per_rank // budget)
        assert 0 < peak <= budget


def _agreements_of_a_load(path: str, budget: int, read: str = "once", layout: str = "R") -> tuple[int, int, bool, int]:
    """(rounds, store agreements the load made, exact, bytes held at once) of a load (read once,
    into `Replicate()`, unless told)."""
    with _counting("exchange") as calls:
        _, exact, (_, rounds, peak) = load_as(path, layout, read, budget)
    return rounds, calls[0], exact, peak


def _agreements_by_read_mode(path: str) -> dict[str, int]:
    load_as(path, "S1", "auto")  # the group's first auto load measures its exchange
    return {read: _agreements_of_a_load(path, 64 << 20, read, "S1")[1] for read in ("auto", "direct", "once")}


def test_deciding_how_to_read_takes_no_store_step_of_its_own(saved):
    # read="auto" decides in the step that agrees on what to load: once the group's exchange is
    # measured, an auto load makes as many store steps as a direct one, and as one read once.
    counts = world.run(4, _agreements_by_read_mode, saved["S0"])
    assert all(len(set(c.values())) == 1 for c in counts), counts


def test_rounds_are_pipelined_without_an_agreement_each(saved):
    # The same load in 1 round and in many: the store agreements do not grow with the rounds
    # (ranks stop together on a one-flag all-reduce instead), and two rounds in flight at once
    # still hold at most the budget.
    one = world.run(4, _agreements_of_a_load, saved["S0"], 64 << 20)
    many = world.run(4, _agreements_of_a_load, saved["S0"], 6 << 20)
    assert all(exact for _, _, exact, _ in one + many)
    assert {r for r, *_ in one} == {1} and min(r for r, *_ in many) >= 5
    assert {c for _, c, _, _ in many} == {c for _, c, _, _ in one}
    assert all(0 < peak <= 6 << 20 for *_, peak in many)


def test_a_corrupt_block_read_ahead_in_a_later_round_fails_every_rank(saved, tmp_path):
    import shutil

    path = str(tmp_path / "corrupt-late")
    shutil.copytree(saved["S0"], path)
    m = _core.Manifest.open(path)
    last = m.chunks(1)[-1]  # tensor "b"'s last chunk: read in the last rounds
    info = m.files[last.file]
    with open(f"{path}/{info.path}", "r+b") as f:
        f.seek(last.offset + last.nbytes - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(world.WorldError) as err:
        world.run(4, load_as, path, "R", "once", 6 << 20)
    kinds = [f.type_name for f in err.value.failures]
    assert len(kinds) == 4 and kinds.count(ChecksumError.__name__) == 1, kinds
    assert set(kinds) == {ChecksumError.__name__, RankFailedError.__name__}


def test_one_rank_alone_reads_directly_unless_told(saved, monkeypatch):
    state = {k: torch.zeros(ROWS, COLS) for k in KEYS}
    assert olmo_chunks.load(state, saved["R"]).read == "direct"
    monkeypatch.setenv("OLMO_CHUNKS_READ_ONCE", "always")
    for k in KEYS:
        state[k].zero_()
    report = olmo_chunks.load(state, saved["R"])
    assert (report.read, report.rounds) == ("once", 1)
    assert all(torch.equal(state[k], full(k)) for k in KEYS)


def load_mixed(path: str) -> bool:
    """Staged destinations (two keys' views interleaved in one storage) and a column-major one."""
    both = torch.zeros(ROWS, 2 * COLS)
    c = torch.zeros(COLS, ROWS).t()
    state = {"a": both[:, :COLS], "b": both[:, COLS:], "c": c}
    report = olmo_chunks.load(state, path, read="once")
    return report.read == "once" and all(torch.equal(state[k], full(k)) for k in ("a", "b", "c"))


def test_staged_destinations_on_every_rank(saved, tmp_path):
    path = str(tmp_path / "plain")
    olmo_chunks.save({k: full(k) for k in ("a", "b", "c")}, path)
    assert world.run(3, load_mixed, path) == [True] * 3


def load_tied(path: str) -> bool:
    shared = torch.zeros(ROWS, COLS)
    olmo_chunks.load({"a": shared, "a2": shared}, path)
    return torch.equal(shared, full("a"))


def test_tied_destinations_are_checked(tmp_path):
    same, differ = str(tmp_path / "same"), str(tmp_path / "differ")
    olmo_chunks.save({"a": full("a"), "a2": full("a")}, same)
    olmo_chunks.save({"a": full("a"), "a2": full("b")}, differ)
    assert world.run(2, load_tied, same) == [True, True]
    with pytest.raises(world.WorldError, match="different values"):
        world.run(2, load_tied, differ)


def test_a_corrupt_block_fails_every_rank(saved, tmp_path):
    path = str(tmp_path / "corrupt")
    _flip_a_byte(saved["S0"], path)
    with pytest.raises(world.WorldError) as err:
        world.run(4, load_as, path, "R", "once")
    kinds = {f.type_name for f in err.value.failures}
    assert len(err.value.failures) == 4 and kinds <= {ChecksumError.__name__, RankFailedError.__name__}
    assert ChecksumError.__name__ in kinds


def _flip_a_byte(saved: str, path: str) -> None:
    import shutil

    shutil.copytree(saved, path)
    m = _core.Manifest.open(path)
    info = m.files[m.chunks(0)[0].file]
    with open(f"{path}/{info.path}", "r+b") as f:
        f.seek(m.chunks(0)[0].offset + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def load_delegated(path: str, layout: str, own_host: bool):
    """An auto load from fast storage (so read directly) on this world, every rank on this machine
    or (`own_host`) each claiming a host of its own, the checkpoint warm; returns (exact, read
    mode, why, bytes this rank read from storage)."""
    os.environ["OLMO_CHUNKS_STORAGE_GBPS"] = "1000"
    _warm(path)
    if own_host:
        os.environ["OLMO_CHUNKS_HOST"] = f"host-{dist.get_rank()}"
    try:
        mesh = world.mesh((dist.get_world_size(),))
        state = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, placements(layout)) for k in KEYS}
        before = _core.io_counters()[0]
        r = olmo_chunks.load(state, path).reading
        nbytes = _core.io_counters()[0] - before
        exact = all(torch.equal(state[k].to_local(), distribute_tensor(full(k), mesh, placements(layout)).to_local())
                    for k in KEYS)
        return exact, r.read, r.why, nbytes
    finally:
        os.environ.pop("OLMO_CHUNKS_STORAGE_GBPS", None)
        os.environ.pop("OLMO_CHUNKS_HOST", None)


def test_a_block_ranks_need_in_part_is_checked_once(saved, tmp_path):
    # S0 -> S1 on 4 ranks, read directly: each rank needs a quarter of every row of every 1 MiB
    # block. Each rank used to read every block whole to check it (4x the checkpoint in all), then
    # one rank of the host did (7/4). Now each folds the checksum of its own quarter as it copies
    # it and the last step checks the shares: the checkpoint is read once, whatever the hosts.
    manifest = os.path.getsize(os.path.join(saved["S0"], _core.MANIFEST_NAME))  # rank 0 reads it
    for own_host in (False, True):
        got = world.run(4, load_delegated, saved["S0"], "S1", own_host)
        for exact, read, why, _ in got:
            assert exact and read == "direct" and fill.DELEGATED in why, why
        assert sum(n for *_, n in got) == CHECKPOINT + manifest
    # A flipped byte: every read succeeds, the shares do not add up, and the last step (rank 0's
    # sum) fails every rank with the ChecksumError naming the block.
    path = str(tmp_path / "corrupt")
    _flip_a_byte(saved["S0"], path)
    with pytest.raises(world.WorldError) as err:
        world.run(4, load_delegated, path, "S1", True)
    kinds = [f.type_name for f in err.value.failures]
    assert kinds == [ChecksumError.__name__] * 4, kinds
    m = _core.Manifest.open(path)
    first = m.chunks(0)[0]
    for failure in err.value.failures:
        assert f"{m.files[first.file].path}" in failure.message
        assert f"file bytes {first.offset}..{first.offset + (1 << 20)}" in failure.message, err.value


def test_read_mode_is_checked(saved):
    with pytest.raises(InvalidArgumentError, match="read must be one of"):
        olmo_chunks.load({k: torch.zeros(ROWS, COLS) for k in KEYS}, saved["R"], read="twice")


def test_a_missing_checkpoint_is_the_same_error_on_every_rank(tmp_path):
    with pytest.raises(world.WorldError) as err:
        world.run(2, load_as, str(tmp_path / "nothing"), "R", "once")
    assert [f.type_name for f in err.value.failures] == ["CheckpointNotFoundError"] * 2


def test_ranks_share_a_page_cache_only_through_the_same_directory(tmp_path, monkeypatch):
    # Containers on one machine share its kernel; each may still hold its own copy of a checkpoint
    # at one path. Only ranks that see the same directory (device and inode) share checks.
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "x").write_bytes(b"1")
    shutil.copytree(a, b)
    (tmp_path / "link").symlink_to(a)
    assert fill.page_cache(str(a)) == fill.page_cache(str(tmp_path / "link"))
    assert fill.page_cache(str(a)) != fill.page_cache(str(b))
    here = fill.page_cache(str(a))
    monkeypatch.setenv("OLMO_CHUNKS_HOST", "elsewhere")
    assert fill.page_cache(str(a)) != here
