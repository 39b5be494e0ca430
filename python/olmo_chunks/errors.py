"""The exceptions olmo-chunks raises (all derive from `OlmoChunksError`), and the checks of
arguments, settings and thread starts that raise them."""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", int, float)

__all__ = [
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ConversionError",
    "CorruptCheckpointError",
    "CorruptManifestError",
    "InvalidArgumentError",
    "LayoutError",
    "MismatchError",
    "MissingDataFileError",
    "OlmoChunksError",
    "RankFailedError",
    "StorageError",
    "TruncatedDataError",
    "UnsafePathError",
    "UnsupportedFormatError",
]


class OlmoChunksError(Exception):
    """Base class of every olmo-chunks error."""


class CheckpointNotFoundError(OlmoChunksError, FileNotFoundError):
    """The path is not a committed checkpoint (missing, not a directory, or no manifest)."""


class UnsupportedFormatError(OlmoChunksError):
    """The checkpoint was written in a format version this reader does not support."""


class CorruptCheckpointError(OlmoChunksError):
    """The checkpoint's bytes are damaged or contradict its manifest."""


class CorruptManifestError(CorruptCheckpointError):
    """The manifest cannot be decoded or is inconsistent."""


class ChecksumError(CorruptCheckpointError):
    """Data bytes do not match their recorded checksum."""


class TruncatedDataError(CorruptCheckpointError):
    """A data file is shorter than the manifest says."""


class MissingDataFileError(CorruptCheckpointError, FileNotFoundError):
    """A data file named by the manifest does not exist."""


class UnsafePathError(CorruptCheckpointError):
    """A file the manifest names is refused unread: a symbolic link lies on its path below the
    checkpoint directory, or it is not a regular file (a FIFO, device, socket or directory)."""


class StorageError(OlmoChunksError, OSError):
    """An operating-system or object-store error while reading or writing a checkpoint (an object
    store's after its bounded retries)."""


class LayoutError(OlmoChunksError, ValueError):
    """Chunks lie outside their tensor, overlap, or do not cover it exactly once."""


class InvalidArgumentError(OlmoChunksError, ValueError):
    """An argument cannot be checkpointed as given (unsupported value, aliasing buffers, ...)."""


class MismatchError(OlmoChunksError, ValueError):
    """The state dict and the checkpoint describe different models (a conversion, not a reshard).

    `mismatches` lists every difference, one line each.
    """

    def __init__(self, mismatches: list[str], *, header: str = "checkpoint does not match the state dict") -> None:
        self.mismatches = list(mismatches)
        self.header = header
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        super().__init__(f"{header} ({len(self.mismatches)} mismatch(es)):\n{lines}")


class ConversionError(MismatchError):
    """An export or import between the native checkpoint and another layout (e.g. Hugging Face)
    cannot be done faithfully: unmapped, missing or nonfinite tensors, inconsistent shapes."""

    def __init__(self, mismatches: list[str], *, header: str = "conversion refused") -> None:
        super().__init__(mismatches, header=header)


class RankFailedError(OlmoChunksError):
    """Another rank of the process group failed during a collective save or load. `rank` is that
    rank (when known); `dead` says it stopped responding rather than reporting an error."""

    def __init__(self, message: str, *, rank: int | None = None, dead: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.dead = dead

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `rank` and `dead` through pickling
        return (_rank_failed, (str(self), self.rank, self.dead))


def _rank_failed(message: str, rank: int | None, dead: bool) -> RankFailedError:
    return RankFailedError(message, rank=rank, dead=dead)


class CheckpointExistsError(InvalidArgumentError):
    """A checkpoint is already committed at the path and the save was not asked to overwrite it."""


class CheckpointLockedError(OlmoChunksError):
    """Another save to the same path is in progress (it holds the path's lease), or took this save's
    lease over after this save stopped beating."""


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """Argument `name`, if it is a whole number from `lo` to `hi`; else `InvalidArgumentError`
    (never the `OverflowError` or `TypeError` the core's conversion of it would raise)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{name}={value!r}: expected a whole number from {lo} to {hi}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Argument `name`, if it is a bool; else `InvalidArgumentError` (a string such as "no" is
    truthy: read as a flag it would mean yes)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name}={value!r}: expected True or False")
    return value


def parse_bytes(text: str | int) -> int:
    """`1073741824`, `512M`, `1G`, `64MiB` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise InvalidArgumentError(f"cannot read {text!r} as a byte count")
    scale = 1024 ** ("KMGT".find(m.group(2).upper()) + 1) if m.group(2) else 1
    n = float(m.group(1)) * scale
    if n >= 2**63:
        raise InvalidArgumentError(f"{text!r} is too many bytes (at most 8 EiB)")
    return int(n)


def env_setting(name: str, default: T, read: Callable[[str], T]) -> T:
    """Environment variable `name` read by `read` (`parse_bytes`, `float`), `default` where it is
    unset or empty; `InvalidArgumentError` naming it where it is not positive and finite."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = read(raw)
    except (ValueError, OverflowError):  # InvalidArgumentError too
        value = None
    if value is None or not 0 < value < math.inf:
        what = "a byte count (1073741824, 512M, 1GiB)" if read is parse_bytes else "a positive number"
        raise InvalidArgumentError(f"{name}={raw!r}: expected {what}")
    return value


def _by_name(name: str) -> type[OlmoChunksError] | None:
    """The error class `name` of this module if it is made from its message alone (not a
    `MismatchError` or `RankFailedError`)."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, OlmoChunksError) and not issubclass(
            cls, MismatchError | RankFailedError):
        return cls
    return None


def shared_form(exc: BaseException) -> tuple[str, str, list[str] | None] | None:
    """How `named_error` makes `exc` again on another rank: its class name, its message (a
    `MismatchError`'s header) and a `MismatchError`'s list; None if it cannot."""
    name = type(exc).__name__
    if isinstance(exc, MismatchError) and globals().get(name) is type(exc):
        return (name, exc.header, list(exc.mismatches))
    return (name, str(exc), None) if _by_name(name) is type(exc) else None


def named_error(name: str, message: str, mismatches: list[str] | None = None) -> OlmoChunksError:
    """The error of class `name` (see `shared_form`) with `message`, else an `OlmoChunksError`: how
    an error raised on one rank is raised as itself on the others (`name` came through the job's
    store)."""
    cls = globals().get(name)
    if (mismatches is not None and isinstance(cls, type) and cls in (MismatchError, ConversionError)
            and all(isinstance(m, str) for m in mismatches)):
        return cls(mismatches, header=message)
    cls = _by_name(name)
    return cls(message) if cls is not None else OlmoChunksError(message)


def no_thread(exc: RuntimeError) -> StorageError:
    """The error for a thread that could not be started (`exc`, as `threading` raises it), as the
    core's."""
    return StorageError(f"olmo-chunks: could not start a thread ({exc}): the process is at a limit on "
                        "threads or memory (ulimit -u, a container's pids.max, ulimit -v)")


def start_thread(thread: threading.Thread) -> None:
    """Starts `thread`, or raises `no_thread`'s error."""
    try:
        thread.start()
    except RuntimeError as exc:
        raise no_thread(exc) from exc
