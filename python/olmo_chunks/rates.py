"""The measured rates `read="auto"` chooses a load's read strategy from.

A load can read directly (every rank reads the blocks it needs) or read once (each needed block
read by one rank and handed to the others, in rounds). Which is faster depends on three rates,
all measured on the job's own machines (the model itself is `_core.plan_read_once`'s, see
`docs/READ_MODEL.md`):

- **storage**: bytes per second one rank reads from the checkpoint's storage, checksums verified,
  with the other ranks reading too. `OLMO_CHUNKS_STORAGE_GBPS` sets it; otherwise it is learned
  from this process's own loads of that storage (an average over the last loads, weighted to the
  recent ones); before the first load it is the benchmark's pace cap where one is set, else a
  prior for the kind of storage (`PRIORS`).
- **exchange**: bytes per second one rank moves in an all-to-all of the group, measured once per
  group and device by two timed all-to-alls (a tiny one, and one of `PROBE_BYTES` per rank) and
  cached; rank 0's figures speak for the group.
- **round**: the fixed seconds of a read-once round: twice the tiny all-to-all's time.
- **copy**: bytes per second one rank copies into a fresh buffer (page faults included) while
  the others do too: the packing for peers and the copies into place that only reading once
  does, measured with the exchange.

Reading once is also measured against its prediction: later predictions of the group's
read-once loads are scaled by how far off they were (`once_factor`), so a model that leaves out
what a machine makes slow corrects itself after one load.

The choice is made on rank 0, which holds every rank's needs; it is sent to every rank with the
plans, so all ranks take the same path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _core
from .errors import env_setting
from .location import is_url

__all__ = [
    "PRIORS",
    "PROBE_BYTES",
    "ExchangeRates",
    "learn_once",
    "learn_storage",
    "once_factor",
    "resident_bytes",
    "storage_rate",
]

# Bytes per second per rank assumed for a storage this process has not read yet: a node's own
# disk or page cache, or an object store through one client.
PRIORS = {"file": 2e9, "object": 2e8}
# Bytes each rank sends in the exchange probe (spread over its peers).
PROBE_BYTES = 8 << 20
# Weight of the newest load in the learned storage rate.
_WEIGHT = 0.5

_learned: dict[str, float] = {}


@dataclass(frozen=True)
class ExchangeRates:
    """A group's measured exchange: bytes per second per rank, the fixed seconds of a round, and
    bytes per second a rank copies into fresh buffers (all ranks at once)."""

    bps: float
    round_s: float
    copy_bps: float

    @staticmethod
    def probed(moved: int, small_s: float, big_s: float, copy_s: float) -> ExchangeRates:
        """The rates of a probe in which each rank moved `moved` bytes in `big_s` seconds and
        nothing in `small_s`, and copied `PROBE_BYTES` in `copy_s`. The latency taken off the big
        all-to-all is at most half of it: a tiny one that happened to be slow must not make the
        exchange look free."""
        return ExchangeRates(moved / max(big_s - small_s, big_s / 2, 1e-9), 2 * small_s,
                             PROBE_BYTES / max(copy_s, 1e-9))


def _key(source: str) -> str:
    """What storage `source` (a checkpoint's location) is, for the learned rates: its bucket, or
    the local filesystem it lies on; and the pace cap, which changes the rate."""
    pace = f"@{_core.read_pace()}" if _core.read_pace() else ""
    if is_url(source):
        scheme, _, rest = source.partition("://")
        return f"{scheme}://{rest.split('/', 1)[0]}{pace}"
    try:
        return f"file:{os.stat(source).st_dev}{pace}"
    except OSError:
        return f"file:?{pace}"


def storage_rate(source: str) -> tuple[float, str]:
    """Bytes per second one rank reads from `source`'s storage, and where the figure comes from
    ("env", "learned", "pace" or "prior")."""
    env = env_setting("OLMO_CHUNKS_STORAGE_GBPS", 0.0, float)
    if env:
        return env * 1e9, "env"
    learned = _learned.get(_key(source))
    if learned is not None:
        return learned, "learned"
    if _core.read_pace():
        return float(_core.read_pace()), "pace"
    return PRIORS["object" if is_url(source) else "file"], "prior"


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory, in bytes (0 where `/proc` does not say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def learn_storage(source: str, nbytes: int, seconds: float, faulted: int = 0) -> None:
    """Records that this rank read `nbytes` of `source`'s storage in `seconds`, while its resident
    memory grew by `faulted` bytes of pages touched for the first time. Not counted: small reads,
    whose time is mostly latency, and reads that faulted in more than a quarter of their bytes
    (destinations written for the first time). Those timed the kernel's page faults, which both
    read strategies pay alike, as much as the storage: on this project's VM a first load into
    fresh tensors measured 0.30 GB/s from a page cache that the next load read at 2.4-4.5."""
    if nbytes < (1 << 20) or seconds <= 0 or faulted > nbytes // 4:
        return
    key, rate = _key(source), nbytes / seconds
    old = _learned.get(key)
    _learned[key] = rate if old is None else _WEIGHT * rate + (1 - _WEIGHT) * old



# How much slower than its model reading once turned out, per process group and device.
_once_factor: dict[tuple[int, str], float] = {}


def once_factor(key: tuple[int, str]) -> float:
    """How many times its model's prediction a read-once load of this group and device took (1
    before one was measured): the parts the model leaves out (contention for the cores, cache
    misses of buffers larger than the probe's) scale with the exchange."""
    return _once_factor.get(key, 1.0)


def learn_once(key: tuple[int, str], seconds: float, predicted: float) -> None:
    """Records that a read-once load predicted to take `predicted` seconds (with the current
    factor) took `seconds`; the factor moves halfway there (geometrically), within 1/4..20."""
    if seconds <= 0 or predicted <= 0:
        return
    old = once_factor(key)
    _once_factor[key] = min(20.0, max(0.25, old * (seconds / predicted) ** _WEIGHT))
