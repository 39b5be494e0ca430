//! Building the manifest of a save from what its ranks wrote: the one place a manifest is
//! assembled, whichever front door saved.

use std::collections::HashMap;

use serde_json::value::RawValue;

use crate::codec::Codec;
use crate::error::{CoreError, Result};
use crate::manifest::{block_count, Chunk, FileEntry, Manifest, TensorEntry};
use crate::region::Region;

/// What a save says about one global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSchema {
    pub key: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub role: String,
}

/// One chunk as a rank wrote it: where it lies in its tensor and in its data file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedChunk {
    pub key: String,
    pub region: Region,
    /// Data file path, relative to the checkpoint directory.
    pub file: String,
    pub file_size: u64,
    pub offset: u64,
    /// Raw bytes of the chunk (its region's).
    pub len: u64,
    pub checksums: Vec<u32>,
    pub codec: Codec,
    /// Stored length of each block when compressed; empty when raw.
    pub block_lens: Vec<u32>,
}

/// The manifest of save `save_id`: tensors sorted by key, each with its chunks in the order
/// given, files in order of first use. Fails on a chunk of a tensor the schema lacks, a key listed
/// twice, or one file given two sizes. Validation of the result is the decoder's (see
/// `Transaction::commit_parts`).
pub fn assemble_manifest(
    save_id: &str,
    block_size: u64,
    mut tensors: Vec<TensorSchema>,
    chunks: Vec<SavedChunk>,
    entries: Box<RawValue>,
    info: Box<RawValue>,
) -> Result<Manifest> {
    tensors.sort_by(|a, b| a.key.cmp(&b.key));
    if let Some(w) = tensors.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(CoreError::InvalidArgument(format!(
            "tensor {:?} is described twice",
            w[0].key
        )));
    }
    let mut per_tensor: Vec<Vec<SavedChunk>> = vec![Vec::new(); tensors.len()];
    let index: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.key.as_str(), i))
        .collect();
    for c in chunks {
        let Some(&t) = index.get(c.key.as_str()) else {
            return Err(CoreError::InvalidArgument(format!(
                "a chunk of {:?}, which the save does not describe",
                c.key
            )));
        };
        per_tensor[t].push(c);
    }
    let mut files: Vec<FileEntry> = Vec::new();
    let mut file_index: HashMap<String, u32> = HashMap::new();
    let mut m = Manifest {
        save_id: save_id.to_string(),
        block_size,
        files: Vec::new(),
        tensors: Vec::with_capacity(tensors.len()),
        chunk_start: vec![0],
        chunks: Vec::new(),
        checksums: Vec::new(),
        block_lens: Vec::new(),
        entries,
        info,
    };
    for (t, chunks) in tensors.into_iter().zip(per_tensor) {
        let n = chunks.len();
        for c in chunks {
            let file = match file_index.get(&c.file) {
                Some(&i) if files[i as usize].size == c.file_size => i,
                Some(_) => {
                    return Err(CoreError::InvalidArgument(format!(
                        "data file {:?} is given two sizes",
                        c.file
                    )))
                }
                None => {
                    let i = files.len() as u32;
                    file_index.insert(c.file.clone(), i);
                    files.push(FileEntry {
                        path: c.file,
                        size: c.file_size,
                    });
                    i
                }
            };
            let crc_index = m.checksums.len() as u64;
            let n = c.checksums.len();
            let lens_ok = match c.codec {
                Codec::Raw => c.block_lens.is_empty(),
                Codec::Zstd { .. } => c.block_lens.len() == n,
            };
            if block_size == 0 || n as u64 != block_count(c.len, block_size) || !lens_ok {
                return Err(CoreError::InvalidArgument(format!(
                    "a chunk of {:?} of {} bytes has {n} checksums and {} block lengths",
                    c.key,
                    c.len,
                    c.block_lens.len()
                )));
            }
            if c.codec == Codec::Raw {
                let raw = |k: u64| (c.len - k * block_size).min(block_size) as u32;
                m.block_lens.extend((0..n as u64).map(raw));
            } else {
                m.block_lens.extend(c.block_lens);
            }
            m.checksums.extend(c.checksums);
            m.chunks.push(Chunk {
                region: c.region,
                file,
                offset: c.offset,
                len: c.len,
                crc_index,
                codec: c.codec,
            });
        }
        m.chunk_start.push(m.chunks.len());
        m.tensors.push(TensorEntry {
            key: t.key,
            dtype: t.dtype,
            shape: t.shape,
            role: t.role,
            order: "row-major".into(),
            chunks: n,
        });
    }
    m.files = files;
    Ok(m)
}
