"""Native core of olmo-chunks (Rust). Private: use `olmo_chunks.save` / `load` and the CLI."""

from collections.abc import Callable
from typing import Self, final

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkInfo",
    "FileInfo",
    "Manifest",
    "ReadOnce",
    "SaveTransaction",
    "TensorInfo",
    "TensorSchema",
    "WrittenChunk",
    "box_overlaps",
    "box_runs",
    "flat_pieces",
    "io_counters",
    "object_store_counters",
    "pace_read",
    "plan_read_once",
    "set_read_pace",
    "write_chunks",
]

FORMAT_VERSION: int
MANIFEST_NAME: str
DEFAULT_BLOCK_SIZE: int

# (offsets, sizes, local_start, strides): a box of the global tensor and its affine map to local
# element offsets.
_Piece = tuple[list[int], list[int], int, list[int]]

@final
class FileInfo:
    """A data file of a checkpoint: its path below the checkpoint and its size."""

    def __new__(cls, path: str, size: int) -> Self: ...
    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...

@final
class TensorInfo:
    """A saved tensor: its schema, how many chunks hold it and their bytes."""

    def __new__(
        cls, key: str, dtype: str, shape: list[int], role: str, chunks: int, nbytes: int,
        stored_nbytes: int | None = None,
    ) -> Self: ...
    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def role(self) -> str: ...
    @property
    def chunks(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def stored_nbytes(self) -> int: ...

@final
class ChunkInfo:
    """A saved chunk: its region (kind "box" with offsets/sizes, or "flat" with [start]/[len]) and
    `nbytes` bytes at `offset` of data file `file` (an index into `Manifest.files`), stored in
    `stored_nbytes` bytes encoded by `codec` ("raw" or "zstd")."""

    def __new__(
        cls, kind: str, offsets: list[int], sizes: list[int], file: int, offset: int, nbytes: int,
        codec: str = ..., stored_nbytes: int | None = None,
    ) -> Self: ...
    @property
    def kind(self) -> str: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def sizes(self) -> list[int]: ...
    @property
    def file(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def codec(self) -> str: ...
    @property
    def stored_nbytes(self) -> int: ...

@final
class Manifest:
    @staticmethod
    def open(path: str) -> Manifest: ...
    @staticmethod
    def from_bytes(path: str, data: bytes) -> Manifest: ...
    @staticmethod
    def read_bytes(path: str) -> bytes: ...
    @property
    def format_version(self) -> int: ...
    @property
    def save_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def files(self) -> list[FileInfo]: ...
    @property
    def tensors(self) -> list[TensorInfo]: ...
    @property
    def entries_json(self) -> str: ...
    @property
    def info_json(self) -> str: ...
    def chunks(self, t: int) -> list[ChunkInfo]: ...
    def saved_boxes(self, t: int) -> list[tuple[list[int], list[int]]]: ...
    def overlaps(
        self, items: list[tuple[int, list[tuple[list[int], list[int]]]]]
    ) -> list[list[tuple[int, int, list[int], list[int], list[int]]]]: ...
    def check_coverage(self) -> None: ...
    def verify_data(self, workers: int | None = None, progress: Callable[[int], object] | None = None) -> int: ...
    def plan_runs(self, targets: list[tuple[int, list[_Piece]]]) -> list[tuple[int, int, int, int, int]]: ...
    def load(
        self,
        targets: list[tuple[int, list[_Piece], int]],
        buffers: list[tuple[int, int]],
        verify: bool = True,
        workers: int | None = None,
    ) -> None: ...

@final
class ReadOnce:
    def __new__(
        cls, manifest: Manifest, targets: list[tuple[int, list[_Piece], int]], buffer_lens: list[int]
    ) -> Self: ...
    @property
    def total(self) -> int: ...
    @property
    def rounds(self) -> int: ...
    def needs(self) -> bytes: ...
    def start(self, plan: bytes) -> None: ...
    def round_sizes(self, k: int) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]: ...
    def buffer_rounds(self) -> list[tuple[int, int] | None]: ...
    def read(
        self,
        k: int,
        read: tuple[int, int],
        send: tuple[int, int],
        verify: bool = True,
        workers: int | None = None,
    ) -> None: ...
    def fill(
        self,
        k: int,
        read: tuple[int, int],
        recv: tuple[int, int],
        buffers: list[tuple[int, int]],
        workers: int | None = None,
    ) -> int: ...

def plan_read_once(manifest: Manifest, needs: list[bytes], budget: int, force: bool = False) -> list[bytes] | None: ...
def io_counters() -> tuple[int, int]: ...
def set_read_pace(bytes_per_s: int) -> None: ...
def pace_read(n: int) -> None: ...
def box_runs(shape: list[int], offsets: list[int], sizes: list[int]) -> list[tuple[int, int, int]]: ...
def flat_pieces(shape: list[int], start: int, len: int) -> list[_Piece]: ...
def box_overlaps(
    tensors: list[tuple[int, list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]],
) -> list[list[tuple[int, int, list[int], list[int]]]]: ...

@final
class TensorSchema:
    """A global tensor as a save describes it."""

    def __new__(cls, key: str, dtype: str, shape: list[int], role: str) -> Self: ...
    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def role(self) -> str: ...

@final
class WrittenChunk:
    """One chunk a rank wrote: its region of tensor `key` and where its bytes lie (picklable)."""

    def __new__(
        cls,
        key: str,
        kind: str,
        offsets: list[int],
        sizes: list[int],
        file: str,
        file_size: int,
        offset: int,
        nbytes: int,
        checksums: list[int],
        codec: str = ...,
        shuffle: int = 0,
        block_lens: list[int] = ...,
    ) -> Self: ...
    @property
    def key(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def sizes(self) -> list[int]: ...
    @property
    def file(self) -> str: ...
    @property
    def file_size(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def checksums(self) -> list[int]: ...
    @property
    def codec(self) -> str: ...
    @property
    def shuffle(self) -> int: ...
    @property
    def block_lens(self) -> list[int]: ...

def write_chunks(
    dir: str,
    rel_path: str,
    items: list[tuple[str, str, list[int], list[int], int, int]],
    block_size: int,
    workers: int | None = None,
    zstd_level: int | None = None,
) -> list[WrittenChunk]: ...
def object_store_counters(url: str) -> tuple[int, int, int]:
    """`(bytes_read, bytes_written, requests)` this process moved to and from the bucket of `url`."""

@final
class SaveTransaction:
    """One save into a checkpoint (a directory or an `s3://` / `gs://` URL): its lease, the save
    id, then commit or abort."""

    @staticmethod
    def begin(path: str, overwrite: bool = False, lease_timeout: float = 45.0) -> SaveTransaction: ...
    @property
    def save_id(self) -> str: ...
    def commit(
        self,
        block_size: int,
        tensors: list[TensorSchema],
        chunks: list[WrittenChunk],
        entries_json: str,
        info_json: str,
    ) -> Manifest: ...
    def abort(self) -> None: ...
