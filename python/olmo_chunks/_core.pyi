"""Native core of olmo-chunks (Rust). Private: use `olmo_chunks.save` / `load` and the CLI."""

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
    def verify_data(self, workers: int | None = None) -> int: ...
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
def write_chunks(
    dir: str,
    rel_paths: list[str],
    items: list[tuple[int, int, int]],
    block_size: int,
    workers: int | None = None,
) -> tuple[list[tuple[int, int, int, bytes]], list[tuple[str, int]]]: ...
def commit(
    dir: str,
    save_id: str,
    block_size: int,
    files: list[tuple[str, int]],
    tensors: list[tuple[str, str, list[int], str, list[tuple[str, list[int], list[int], int, int, int, bytes]]]],
    entries_json: str,
    info_json: str,
) -> Manifest: ...
