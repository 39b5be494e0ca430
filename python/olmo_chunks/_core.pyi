"""Native core of olmo-chunks (Rust). Private: use `olmo_chunks.save` / `load` and the CLI."""

from collections.abc import Callable

FORMAT_VERSION: int
MANIFEST_NAME: str
DEFAULT_BLOCK_SIZE: int

# (offsets, sizes, local_start, strides): a box of the global tensor and its affine map to local
# element offsets.
Piece = tuple[list[int], list[int], int, list[int]]

class Manifest:
    @staticmethod
    def open(path: str) -> Manifest: ...
    @property
    def format_version(self) -> int: ...
    @property
    def save_id(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def files(self) -> list[tuple[str, int]]: ...
    @property
    def tensors(self) -> list[tuple[str, str, list[int], str, int, int]]: ...
    @property
    def entries_json(self) -> str: ...
    @property
    def info_json(self) -> str: ...
    def chunks(self, t: int) -> list[tuple[str, list[int], list[int], int, int, int]]: ...
    def check_coverage(self) -> None: ...
    def verify_data(self, workers: int | None = None, progress: Callable[[int], object] | None = None) -> int: ...
    def plan_runs(self, targets: list[tuple[int, list[Piece]]]) -> list[tuple[int, int, int, int, int]]: ...
    def load(
        self,
        targets: list[tuple[int, list[Piece], int]],
        buffers: list[tuple[int, int]],
        verify: bool = True,
        workers: int | None = None,
    ) -> None: ...

def flat_pieces(shape: list[int], start: int, len: int) -> list[Piece]: ...
def box_overlaps(
    tensors: list[tuple[int, list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]],
) -> list[list[tuple[int, int, list[int], list[int]]]]: ...
class TensorSchema:
    """A global tensor as a save describes it."""

    key: str
    dtype: str
    shape: list[int]
    role: str
    def __init__(self, key: str, dtype: str, shape: list[int], role: str) -> None: ...

class WrittenChunk:
    """One chunk a rank wrote: its region of tensor `key` and where its bytes lie (picklable)."""

    key: str
    kind: str
    offsets: list[int]
    sizes: list[int]
    file: str
    file_size: int
    offset: int
    nbytes: int
    checksums: list[int]
    def __init__(
        self,
        key: str,
        kind: str,
        offsets: list[int],
        sizes: list[int],
        file: str,
        file_size: int,
        offset: int,
        nbytes: int,
        checksums: list[int],
    ) -> None: ...

def write_chunks(
    dir: str,
    rel_path: str,
    items: list[tuple[str, str, list[int], list[int], int, int]],
    block_size: int,
    workers: int | None = None,
) -> list[WrittenChunk]: ...

class SaveTransaction:
    """One save into a checkpoint directory: its lease, the save id, then commit or abort."""

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
