//! Where a checkpoint is: a local directory, or a URL (`s3://bucket/prefix`, `gs://bucket/prefix`)
//! of an object store. Every entry point takes a location string and gets its storage, manifest
//! or save transaction here.

use std::path::Path;
use std::sync::Arc;

use crate::error::{CoreError, Result};
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
        Manifest::get_from(&*storage).map_err(|e| point_to_encoded(location, e))?
    } else {
        Manifest::read_bytes(Path::new(location))?
    };
    Ok((bytes, storage))
}

/// `e`, or where no checkpoint is at the URL `location` but one is at the prefix an earlier
/// release would have saved it at ([`ObjectStorage::encoded_url`]), an error that says where: it
/// is not read from there unasked, for a checkpoint saved at that prefix as written is another.
fn point_to_encoded(location: &str, e: CoreError) -> CoreError {
    let CoreError::NotACheckpoint { path, reason } = e else {
        return e;
    };
    let there = ObjectStorage::open(location)
        .ok()
        .and_then(|s| s.encoded_url())
        .filter(|url| {
            ObjectStorage::open(url).is_ok_and(|s| matches!(s.head(MANIFEST_NAME), Ok(Some(_))))
        });
    let reason = match there {
        Some(url) => format!(
            "{reason}; a checkpoint lies at {url}, where releases before 2026-12-07 saved one \
             named {location} (they percent-encoded its prefix): load it from there, or move it \
             here"
        ),
        None => reason,
    };
    CoreError::NotACheckpoint { path, reason }
}

/// Begins a save to `location` (see [`SaveTxn::begin`] and [`SaveTxn::begin_on`]).
pub fn begin_save(location: &str, opts: SaveOptions) -> Result<SaveTxn> {
    if is_url(location) {
        SaveTxn::begin_on(Arc::new(ObjectStorage::open(location)?), opts)
    } else {
        SaveTxn::begin(Path::new(location), opts)
    }
}
