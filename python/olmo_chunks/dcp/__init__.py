"""torch.distributed.checkpoint (DCP) front door: a storage writer, a storage reader and a fast
load planner that write and read the same checkpoint format as `olmo_chunks.save` / `load`.

- `ChunkStoreWriter`: `dcp.save(sd, storage_writer=ChunkStoreWriter(path))` (and `dcp.async_save`)
  writes each rank's chunks from native code in parallel, one data file per rank, with block
  checksums, and commits our manifest last. Tensor keys are DCP's flattened FQNs; roles are
  inferred by `olmo_chunks.roles` (override with `roles=`).
- `ChunkStoreReader`: `dcp.load(sd, storage_reader=ChunkStoreReader(path))` rebuilds DCP's
  `Metadata` from our manifest (flat-range chunks are presented as the boxes they decompose into)
  and serves all of a rank's read items in one batch through the Rust core: parallel reads, each
  needed saved byte read once, copied straight into the tensors the planner resolves.
- `FastLoadPlanner`: a drop-in `DefaultLoadPlanner` whose read items come from the Rust band index
  instead of DCP's sweep line (which degrades to all-pairs on 2-D layouts).

Non-tensor values. DCP's save planner pickles every non-tensor value into a BytesIO. The writer
reads it back with `torch.load(weights_only=True)` (a restricted unpickler that also allows numpy
arrays and scalars of numeric and bool dtypes, and io.BytesIO) and stores the value as tagged JSON
data, grouped the way `olmo_chunks.save` groups plain values, so the native door loads it too.
Values that are not plain data (arbitrary objects) are refused on save with `InvalidArgumentError`.
On load the reader hands the planner a BytesIO that it serialises itself from that JSON data;
nothing pickled in the checkpoint is ever unpickled.
"""

from .importer import import_dcp, read_dcp_metadata
from .planner import FastLoadPlanner, read_items_for_chunk_lists
from .reader import ChunkStoreReader
from .values import dcp_leaves, group_entries
from .writer import ChunkStoreWriter

__all__ = [
    "ChunkStoreReader",
    "ChunkStoreWriter",
    "FastLoadPlanner",
    "dcp_leaves",
    "group_entries",
    "import_dcp",
    "read_dcp_metadata",
    "read_items_for_chunk_lists",
]
