//! olmo-chunks core: the checkpoint format, chunk indexing and intersection, copy planning and
//! parallel positional I/O, on local filesystems and object stores. No Python here: it works on
//! byte slices, locations and plans.

pub mod assign;
pub mod checksum;
pub mod codec;
#[doc(hidden)]
pub mod conformance;
pub mod coop;
pub mod dtype;
pub mod error;
pub mod fsops;
pub mod fsutil;
pub mod fused;
pub mod index;
pub mod io;
pub mod load;
pub mod location;
pub mod manifest;
mod mapped;
pub mod object;
pub mod pace;
pub mod plan;
pub mod region;
pub mod rendezvous;
pub mod save;
pub mod storage;
pub mod txn;

pub use codec::Codec;
pub use error::{CoreError, Result};
pub use io::{
    default_workers, read_from, read_into, verify_all, verify_from, write_chunks, write_chunks_to,
    write_chunks_with, ByteCopy, WriteItem, Written,
};
pub use load::{check_manifest_coverage, plan_copies, plan_runs, Target};
pub use location::{begin_save, checkpoint_bytes, open_checkpoint, storage_at};
pub use manifest::{Chunk, FileEntry, Manifest, TensorEntry, FORMAT_VERSION, MANIFEST_NAME};
pub use plan::{box_overlaps, check_coverage, Overlap, Run, TensorPlanner};
pub use region::{Piece, Region};
pub use save::{assemble_manifest, SavedChunk, TensorSchema};
pub use storage::{Entry, Head, IoCounters, LocalFs, Object, PutIf, ReadMerge, Storage, Version};
pub use txn::{SaveOptions, SaveTxn};
