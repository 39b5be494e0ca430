//! The manifest: a 64-byte header, a JSON metadata section, a binary chunk table, a checksum
//! table and (version 2) a block length table. `docs/FORMAT.md` is the normative description;
//! keep the two in step.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::codec::{Codec, SHUFFLES};
use crate::dtype::itemsize;
use crate::error::{CoreError, Result};
use crate::region::{checked_numel, Region, MAX_NDIM};

pub const MAGIC: &[u8; 8] = b"OCHUNKS\n";
/// The newest format version this crate reads and writes. A manifest without compressed chunks
/// is written as version 1, which every older reader reads; one with them as version 2.
pub const FORMAT_VERSION: u32 = 2;
pub const MANIFEST_NAME: &str = "olmo_chunks.manifest";
pub const HEADER_LEN: usize = 64;
/// Metadata sections larger than this are refused as corrupt.
pub const MAX_META_LEN: u64 = 1 << 30;
pub const DEFAULT_BLOCK_SIZE: u64 = 1 << 20;
/// Largest checksum block size a manifest may declare (and a writer may use). A reader holds up
/// to one block per worker in memory, so this bounds what a crafted manifest can make it allocate.
pub const MAX_BLOCK_SIZE: u64 = 64 << 20;

const KIND_BOX: u8 = 0;
const KIND_FLAT: u8 = 1;
const CODEC_RAW: u8 = 0;
const CODEC_ZSTD: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub key: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub role: String,
    pub order: String,
    pub chunks: usize,
}

/// Where one saved chunk lies in its tensor and in its data file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub region: Region,
    pub file: u32,
    pub offset: u64,
    pub len: u64,
    /// Index of the chunk's first block checksum (and block length) in the tables.
    pub crc_index: u64,
    pub codec: Codec,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Meta {
    format: String,
    version: u32,
    save_id: String,
    block_size: u64,
    checksum: String,
    files: Vec<FileEntry>,
    tensors: Vec<TensorEntry>,
    entries: Box<RawValue>,
    info: Box<RawValue>,
}

/// A decoded, validated manifest.
#[derive(Clone, Debug)]
pub struct Manifest {
    pub save_id: String,
    pub block_size: u64,
    pub files: Vec<FileEntry>,
    pub tensors: Vec<TensorEntry>,
    /// First chunk of each tensor in `chunks` (tensor `t` owns `chunk_start[t]..chunk_start[t+1]`).
    pub chunk_start: Vec<usize>,
    pub chunks: Vec<Chunk>,
    pub checksums: Vec<u32>,
    /// Stored length of every block, parallel to `checksums` (a raw block's is its raw length).
    pub block_lens: Vec<u32>,
    /// Plain (non-tensor) values: a JSON object owned by the Python layer, kept verbatim.
    pub entries: Box<RawValue>,
    /// Save topology and other information (a JSON object, verbatim); never needed to load.
    pub info: Box<RawValue>,
}

/// Number of checksum blocks of a chunk of `len` bytes.
pub fn block_count(len: u64, block_size: u64) -> u64 {
    len.div_ceil(block_size)
}

impl Manifest {
    pub fn tensor_chunks(&self, t: usize) -> &[Chunk] {
        &self.chunks[self.chunk_start[t]..self.chunk_start[t + 1]]
    }

    pub fn chunk_checksums(&self, c: &Chunk) -> &[u32] {
        let n = block_count(c.len, self.block_size) as usize;
        &self.checksums[c.crc_index as usize..c.crc_index as usize + n]
    }

    /// Stored lengths of the blocks of chunk `c`.
    pub fn chunk_block_lens(&self, c: &Chunk) -> &[u32] {
        let n = block_count(c.len, self.block_size) as usize;
        &self.block_lens[c.crc_index as usize..c.crc_index as usize + n]
    }

    /// Bytes chunk `c` takes in its data file.
    pub fn stored_len(&self, c: &Chunk) -> u64 {
        match c.codec {
            Codec::Raw => c.len,
            Codec::Zstd { .. } => self.chunk_block_lens(c).iter().map(|&n| n as u64).sum(),
        }
    }

    /// The version `encode` writes: 1 unless a chunk is compressed.
    pub fn format_version(&self) -> u32 {
        if self.chunks.iter().all(|c| c.codec == Codec::Raw) {
            1
        } else {
            2
        }
    }

    pub fn tensor_index(&self, key: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.key == key)
    }

    /// Encodes the manifest to bytes.
    pub fn encode(&self) -> Vec<u8> {
        let version = self.format_version();
        let meta = Meta {
            format: "olmo-chunks".into(),
            version,
            save_id: self.save_id.clone(),
            block_size: self.block_size,
            checksum: "crc32c".into(),
            files: self.files.clone(),
            tensors: self.tensors.clone(),
            entries: self.entries.clone(),
            info: self.info.clone(),
        };
        let meta = serde_json::to_vec(&meta).expect("manifest metadata is always serialisable");
        let mut table = Vec::new();
        for (t, tensor) in self.tensors.iter().enumerate() {
            for c in self.tensor_chunks(t) {
                let kind = match c.region {
                    Region::Box { .. } => KIND_BOX,
                    Region::Flat { .. } => KIND_FLAT,
                };
                let (codec, shuffle) = match c.codec {
                    Codec::Raw => (CODEC_RAW, 0),
                    Codec::Zstd { shuffle } => (CODEC_ZSTD, shuffle),
                };
                table.extend_from_slice(&[kind, codec, shuffle, 0]);
                table.extend_from_slice(&c.file.to_le_bytes());
                for v in [c.offset, c.len, c.crc_index] {
                    table.extend_from_slice(&v.to_le_bytes());
                }
                match &c.region {
                    Region::Box { offsets, sizes } => {
                        debug_assert_eq!(offsets.len(), tensor.shape.len());
                        for v in offsets.iter().chain(sizes) {
                            table.extend_from_slice(&v.to_le_bytes());
                        }
                    }
                    Region::Flat { start, len } => {
                        table.extend_from_slice(&start.to_le_bytes());
                        table.extend_from_slice(&len.to_le_bytes());
                    }
                }
            }
        }
        let mut crcs = Vec::with_capacity(self.checksums.len() * 4);
        for c in &self.checksums {
            crcs.extend_from_slice(&c.to_le_bytes());
        }
        let mut lens = Vec::new();
        if version >= 2 {
            lens.reserve(self.block_lens.len() * 4);
            for n in &self.block_lens {
                lens.extend_from_slice(&n.to_le_bytes());
            }
        }
        let mut out = vec![0u8; HEADER_LEN];
        out[0..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&version.to_le_bytes());
        out[16..24].copy_from_slice(&(meta.len() as u64).to_le_bytes());
        out[24..32].copy_from_slice(&(table.len() as u64).to_le_bytes());
        out[32..40].copy_from_slice(&(crcs.len() as u64).to_le_bytes());
        if version >= 2 {
            out[48..56].copy_from_slice(&(lens.len() as u64).to_le_bytes());
        }
        let mut body = crc32c::crc32c(&meta);
        body = crc32c::crc32c_append(body, &table);
        body = crc32c::crc32c_append(body, &crcs);
        body = crc32c::crc32c_append(body, &lens);
        out[40..44].copy_from_slice(&body.to_le_bytes());
        let head = crc32c::crc32c(&out[0..44]);
        out[44..48].copy_from_slice(&head.to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&table);
        out.extend_from_slice(&crcs);
        out.extend_from_slice(&lens);
        out
    }

    /// Decodes and validates manifest bytes; `path` only names the source in errors.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |reason: String| CoreError::CorruptManifest {
            path: path.to_path_buf(),
            reason,
        };
        let (meta_len, table_len, crc_len, version) =
            check_header(bytes, bytes.len() as u64, path)?;
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let body = &bytes[HEADER_LEN..];
        if crc32c::crc32c(body) != u32_at(40) {
            return Err(bad("body checksum mismatch".into()));
        }
        let (meta, rest) = body.split_at(meta_len as usize);
        let (table, rest) = rest.split_at(table_len as usize);
        let (crc_bytes, lens_bytes) = rest.split_at(crc_len as usize);
        let meta: Meta = serde_json::from_slice(meta).map_err(|e| bad(format!("metadata: {e}")))?;
        if meta.version != version {
            return Err(bad(format!(
                "metadata says version {} but header says {version}",
                meta.version
            )));
        }
        for (name, raw) in [("entries", &meta.entries), ("info", &meta.info)] {
            if !raw.get().starts_with('{') {
                return Err(bad(format!("{name} must be a JSON object")));
            }
        }
        if meta.checksum != "crc32c" {
            return Err(bad(format!(
                "unknown checksum algorithm {:?}",
                meta.checksum
            )));
        }
        if meta.block_size == 0 || meta.block_size > MAX_BLOCK_SIZE {
            return Err(bad(format!(
                "block size {} out of range 1..={MAX_BLOCK_SIZE}",
                meta.block_size
            )));
        }
        for f in &meta.files {
            if !is_contained(&f.path) {
                return Err(bad(format!(
                    "data file {:?} points outside the checkpoint directory",
                    f.path
                )));
            }
        }
        let checksums: Vec<u32> = crc_bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        // Stored lengths: read from the table (version 2), or raw lengths, filled in per chunk.
        let mut block_lens: Vec<u32> = lens_bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let lens_given = version >= 2;
        if !lens_given {
            block_lens = vec![0; checksums.len()];
        }
        let mut seen = std::collections::HashSet::with_capacity(meta.tensors.len());
        let mut chunks = Vec::new();
        let mut chunk_start = Vec::with_capacity(meta.tensors.len() + 1);
        let mut pos = 0usize;
        for t in &meta.tensors {
            let key = &t.key;
            if !seen.insert(key.as_str()) {
                return Err(bad(format!("tensor {key:?} is listed twice")));
            }
            if t.shape.len() > MAX_NDIM {
                return Err(bad(format!(
                    "tensor {key:?} has {} dimensions; at most {MAX_NDIM} are supported",
                    t.shape.len()
                )));
            }
            let item = itemsize(&t.dtype)
                .ok_or_else(|| bad(format!("tensor {key:?}: unknown dtype {:?}", t.dtype)))?;
            if t.order != "row-major" {
                return Err(bad(format!(
                    "tensor {key:?}: unknown element order {:?}",
                    t.order
                )));
            }
            let nbytes = checked_numel(&t.shape)
                .and_then(|n| n.checked_mul(item))
                .ok_or_else(|| {
                    bad(format!(
                        "tensor {key:?}: absurd shape {:?} overflows",
                        t.shape
                    ))
                })?;
            // The bytes its chunks hold: a committed tensor's chunks cover it exactly once, so
            // they add up to its size (overlaps are found where a load lays them out).
            let mut held = 0u64;
            chunk_start.push(chunks.len());
            for ci in 0..t.chunks {
                let what = |r: String| bad(format!("tensor {key:?} chunk {ci}: {r}"));
                let take = |pos: &mut usize, n: usize| -> Result<&[u8]> {
                    let end = pos.checked_add(n).filter(|&e| e <= table.len());
                    let end = end.ok_or_else(|| what("chunk table ends early".into()))?;
                    let s = &table[*pos..end];
                    *pos = end;
                    Ok(s)
                };
                let rd = |pos: &mut usize| -> Result<u64> {
                    Ok(u64::from_le_bytes(take(pos, 8)?.try_into().unwrap()))
                };
                let head = take(&mut pos, 8)?;
                let (kind, file) = (head[0], u32::from_le_bytes(head[4..8].try_into().unwrap()));
                let codec = match (head[1], head[2], head[3]) {
                    (CODEC_RAW, 0, 0) => Codec::Raw,
                    (CODEC_ZSTD, shuffle, 0) if version >= 2 && SHUFFLES.contains(&shuffle) => {
                        Codec::Zstd { shuffle }
                    }
                    (c, s, r) => {
                        return Err(what(format!(
                            "unknown encoding bytes {c} {s} {r} (format version {version})"
                        )))
                    }
                };
                let (offset, len, crc_index) = (rd(&mut pos)?, rd(&mut pos)?, rd(&mut pos)?);
                let region = match kind {
                    KIND_BOX => {
                        let n = t.shape.len();
                        let mut v = Vec::with_capacity(2 * n);
                        for _ in 0..2 * n {
                            v.push(rd(&mut pos)?);
                        }
                        let sizes = v.split_off(n);
                        Region::Box { offsets: v, sizes }
                    }
                    KIND_FLAT => Region::Flat {
                        start: rd(&mut pos)?,
                        len: rd(&mut pos)?,
                    },
                    k => return Err(what(format!("unknown region kind {k}"))),
                };
                region.check_bounds(&t.shape).map_err(what)?;
                let nbytes = region.numel().and_then(|n| n.checked_mul(item));
                if nbytes != Some(len) {
                    return Err(what(format!(
                        "byte length {len} does not match its region {region:?}"
                    )));
                }
                let fe = meta
                    .files
                    .get(file as usize)
                    .ok_or_else(|| what(format!("file index {file} out of range")))?;
                let nblocks = block_count(len, meta.block_size);
                if crc_index
                    .checked_add(nblocks)
                    .is_none_or(|e| e > checksums.len() as u64)
                {
                    return Err(what("checksum index out of range".into()));
                }
                // Every block's stored length: its raw length when raw, 1 up to it when zstd.
                let mut stored = 0u64;
                for k in 0..nblocks {
                    let raw = (len - k * meta.block_size).min(meta.block_size) as u32;
                    let slot = &mut block_lens[(crc_index + k) as usize];
                    if !lens_given {
                        *slot = raw;
                    }
                    let ok = match codec {
                        Codec::Raw => *slot == raw,
                        Codec::Zstd { .. } => (1..=raw).contains(slot),
                    };
                    if !ok {
                        return Err(what(format!(
                            "block {k} stored in {} bytes, raw {raw} ({codec:?})",
                            *slot
                        )));
                    }
                    stored += *slot as u64;
                }
                if offset.checked_add(stored).is_none_or(|e| e > fe.size) {
                    return Err(what(format!(
                        "bytes {offset}+{stored} lie outside its file {:?} of {} bytes",
                        fe.path, fe.size
                    )));
                }
                held = held.saturating_add(len);
                chunks.push(Chunk {
                    region,
                    file,
                    offset,
                    len,
                    crc_index,
                    codec,
                });
            }
            if held != nbytes {
                return Err(bad(format!(
                    "tensor {key:?}: its chunks hold {} of its {} elements",
                    held / item,
                    nbytes / item
                )));
            }
        }
        chunk_start.push(chunks.len());
        if pos != table.len() {
            return Err(bad(format!(
                "{} trailing bytes in the chunk table",
                table.len() - pos
            )));
        }
        Ok(Manifest {
            save_id: meta.save_id,
            block_size: meta.block_size,
            files: meta.files,
            tensors: meta.tensors,
            chunk_start,
            chunks,
            checksums,
            block_lens,
            entries: meta.entries,
            info: meta.info,
        })
    }

    /// Reads the committed manifest of checkpoint directory `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::decode(&Self::read_bytes(dir)?, &dir.join(MANIFEST_NAME))
    }

    /// The bytes of the committed manifest of checkpoint directory `dir`, not decoded.
    pub fn read_bytes(dir: &Path) -> Result<Vec<u8>> {
        let missing = |reason: String| CoreError::NotACheckpoint {
            path: dir.to_path_buf(),
            reason,
        };
        if !dir.exists() {
            return Err(missing("no such directory".into()));
        }
        if !dir.is_dir() {
            return Err(missing("not a directory".into()));
        }
        Self::get_from(&crate::storage::LocalFs::new(dir))
    }

    /// Reads the committed manifest at the root of `storage`: like a data object, only a regular
    /// object, never through a symlink or from a FIFO.
    pub fn open_from(storage: &dyn crate::storage::Storage) -> Result<Self> {
        Self::decode(&Self::get_from(storage)?, &storage.name(MANIFEST_NAME))
    }

    /// The bytes of the committed manifest at the root of `storage`, not decoded.
    pub fn get_from(storage: &dyn crate::storage::Storage) -> Result<Vec<u8>> {
        let name = storage.name(MANIFEST_NAME);
        let check = |header: &[u8], size: u64| check_header(header, size, &name).map(|_| ());
        match storage.get_checked(MANIFEST_NAME, HEADER_LEN as u64, &check) {
            Err(CoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Err(CoreError::NotACheckpoint {
                    path: storage.name(""),
                    reason: format!(
                        "no committed manifest {MANIFEST_NAME:?} (an interrupted save never commits one)"
                    ),
                })
            }
            other => other,
        }
    }

    /// Absolute path of data file `file`.
    pub fn file_path(&self, dir: &Path, file: u32) -> PathBuf {
        dir.join(&self.files[file as usize].path)
    }
}

/// Checks a manifest's header (its first [`HEADER_LEN`] bytes, or fewer if the file is shorter)
/// against the file's `size`, before the rest is read: magic, version, header checksum, reserved
/// bytes, and section lengths that add up to `size`. Returns the metadata, chunk table and
/// checksum table lengths and the version.
fn check_header(header: &[u8], size: u64, path: &Path) -> Result<(u64, u64, u64, u32)> {
    let bad = |reason: String| CoreError::CorruptManifest {
        path: path.to_path_buf(),
        reason,
    };
    if header.len() < HEADER_LEN || &header[0..8] != MAGIC {
        return Err(bad(
            "not an olmo-chunks manifest (bad magic or too short)".into()
        ));
    }
    let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().unwrap());
    let version = u32_at(8);
    if !(1..=FORMAT_VERSION).contains(&version) {
        return Err(CoreError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if crc32c::crc32c(&header[0..44]) != u32_at(44) {
        return Err(bad("header checksum mismatch".into()));
    }
    // Version 2 keeps its block length table's length in the first reserved field.
    let reserved_from = if version >= 2 { 56 } else { 48 };
    if u32_at(12) != 0 || header[reserved_from..HEADER_LEN].iter().any(|&b| b != 0) {
        return Err(bad("unknown flags or non-zero reserved header bytes".into()));
    }
    let (meta_len, table_len, crc_len) = (u64_at(16), u64_at(24), u64_at(32));
    let lens_len = if version >= 2 { u64_at(48) } else { 0 };
    let expected = [meta_len, table_len, crc_len, lens_len]
        .iter()
        .try_fold(HEADER_LEN as u64, |a, &b| a.checked_add(b));
    if meta_len > MAX_META_LEN || expected != Some(size) || crc_len % 4 != 0 {
        return Err(bad(format!(
                "section lengths {meta_len}+{table_len}+{crc_len}+{lens_len} do not match the file size {size}"
            )));
    }
    if version >= 2 && lens_len != crc_len {
        return Err(bad(format!(
            "block length table of {lens_len} bytes for a checksum table of {crc_len}"
        )));
    }
    Ok((meta_len, table_len, crc_len, version))
}

/// True if `rel` is a relative path that stays inside its base directory.
fn is_contained(rel: &str) -> bool {
    let p = Path::new(rel);
    !rel.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)))
}
