//! Where a checkpoint is: a local directory, or a URL (`s3://bucket/prefix`, `gs://bucket/prefix`)
//! of an object store. Every entry point takes a location string and gets its storage, manifest
//! or save transaction here.

use std::path::Path;
use std::sync::Arc;

use crate::error::Result;
use crate::manifest::{Manifest, MANIFEST_NAME};
use crate::object::{is_url, ObjectStorage};
use crate::storage::{LocalFs, Storage};
use crate::txn::{SaveOptions, SaveTxn};

/// The storage holding the checkpoint at `location` (paced while a benchmark caps reads:
/// [`crate::pace`]).
pub fn storage_at(location: &str) -> Result<Arc<dyn Storage>> {
    let storage: Arc<dyn Storage> = if is_url(location) {
        Arc::new(ObjectStorage::open(location)?)
    } else {
        Arc::new(LocalFs::new(Path::new(location)))
    };
    Ok(crate::pace::paced(storage))
}

/// The committed manifest of the checkpoint at `location`, with the storage its data is read from.
pub fn open_checkpoint(location: &str) -> Result<(Manifest, Arc<dyn Storage>)> {
    let (bytes, storage) = checkpoint_bytes(location)?;
    Ok((
        Manifest::decode(&bytes, &storage.name(MANIFEST_NAME))?,
        storage,
    ))
}

/// The committed manifest's bytes at `location`, not decoded (one rank reads them for a job),
/// with the checkpoint's storage.
pub fn checkpoint_bytes(location: &str) -> Result<(Vec<u8>, Arc<dyn Storage>)> {
    let storage = storage_at(location)?;
    let bytes = if is_url(location) {
        Manifest::get_from(&*storage)?
    } else {
        Manifest::read_bytes(Path::new(location))?
    };
    Ok((bytes, storage))
}

/// Begins a save to `location` (see [`SaveTxn::begin`] and [`SaveTxn::begin_on`]).
pub fn begin_save(location: &str, opts: SaveOptions) -> Result<SaveTxn> {
    if is_url(location) {
        SaveTxn::begin_on(Arc::new(ObjectStorage::open(location)?), opts)
    } else {
        SaveTxn::begin(Path::new(location), opts)
    }
}
