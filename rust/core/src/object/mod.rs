//! Checkpoints in object stores (`s3://bucket/prefix` on S3 and S3-compatible servers,
//! `gs://bucket/prefix` on Google Cloud Storage), through Apache Arrow's `object_store`.
//!
//! [`ObjectStorage`] is a [`Storage`](crate::storage::Storage): data objects are read with ranged
//! GETs, the block-aligned units of `io.rs` that lie close together in one object merged into one
//! request of up to [`REQUEST_BYTES`], several in flight, and
//! written as multipart uploads whose parts go up, in parallel, as soon as the writers have filled
//! them. Its transaction primitives are conditional PUTs (`If-None-Match: *`, `If-Match`), on
//! which the one save transaction (`txn.rs`, docs/FORMAT.md "Object stores") runs.
//!
//! - `client.rs`: URLs, the per-process runtime and the bucket clients, the retry policy;
//! - `storage.rs`: [`ObjectStorage`], its requests and their errors;
//! - `transfer.rs`: ranged reads and multipart uploads of data objects.
//!
//! Credentials, region and endpoint come from the standard environment variables
//! (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ... or `GOOGLE_*`). Requests are retried with
//! backoff on throttling, 5xx and dropped connections, bounded in count and time
//! (`OLMO_CHUNKS_RETRY_TIMEOUT` seconds, default 120, also each request's deadline), then fail
//! with an I/O error; the requests that follow such a failure get 1 s each (`client::Breaker`).

mod client;
mod storage;
mod transfer;

pub use client::bucket_counters;
pub(crate) use client::with_full_budget;
pub(crate) use storage::indefinite;
pub use storage::ObjectStorage;

/// Parts of a multipart upload are this large (the last one smaller), or larger where a file
/// would otherwise need more than `MAX_PARTS`.
pub const PART_SIZE: u64 = 8 << 20;
/// Two needed ranges of one object at most this far apart are read by one request (the bytes
/// between are read and dropped), as object_store's `get_ranges` merges them.
pub const MERGE_GAP: u64 = 1 << 20;
/// The most bytes one merged ranged read asks for, unless `OLMO_CHUNKS_REQUEST_MIB` says.
pub const REQUEST_BYTES: u64 = 32 << 20;
/// S3's limit on the parts of one upload.
const MAX_PARTS: u64 = 10_000;

/// True if `location` is a URL (`scheme://...`) rather than a local path.
pub fn is_url(location: &str) -> bool {
    location.contains("://")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{read_from, write_chunks, write_chunks_to, ByteCopy, WriteItem};
    use crate::storage::Storage;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Objects written in parts (any part size, block size, item sizes and files) hold the
        /// same bytes as the files a local write makes, and read back through ranged GETs.
        #[test]
        fn uploads_in_parts_equal_local_files(
            sizes in prop::collection::vec((0usize..2, 0usize..700), 0..8),
            part in prop::sample::select(vec![1u64, 64, 100, 1000, 1 << 20]),
            block in prop::sample::select(vec![1u64, 64, 100, 4096]),
        ) {
            let data: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &(_, n))| (0..n).map(|j| (i * 31 + j * 7) as u8 | 1).collect())
                .collect();
            let items: Vec<WriteItem<'_>> = sizes
                .iter()
                .zip(&data)
                .map(|(&(file, _), d)| WriteItem { file, data: d })
                .collect();
            let rels = vec!["data/a/rank-00000.bin".to_string(), "data/a/rank-00001.bin".to_string()];
            let dir = tempfile::tempdir().unwrap();
            let (w_local, f_local) = write_chunks(dir.path(), &rels, &items, block, 3).unwrap();
            let store = ObjectStorage::in_memory(part).unwrap();
            let (w_obj, f_obj) = write_chunks_to(&store, &rels, &items, block, 3).unwrap();
            prop_assert_eq!(&w_local, &w_obj);
            prop_assert_eq!(&f_local, &f_obj);
            for rel in &rels {
                let local = std::fs::read(dir.path().join(rel)).unwrap();
                prop_assert_eq!(local, store.get(rel).unwrap());
            }
            // Every non-empty chunk back through the reader, its checksums verified.
            let keep: Vec<usize> = (0..data.len()).filter(|&i| !data[i].is_empty()).collect();
            let raw = |s: &str| serde_json::value::RawValue::from_string(s.into()).unwrap();
            let m = crate::save::assemble_manifest(
                &"a".repeat(32),
                block,
                keep.iter()
                    .map(|&i| crate::save::TensorSchema {
                        key: format!("t{i}"),
                        dtype: "uint8".into(),
                        shape: vec![data[i].len() as u64],
                        role: "tensor".into(),
                    })
                    .collect(),
                keep.iter()
                    .map(|&i| {
                        let w = &w_obj[i];
                        crate::save::SavedChunk {
                            key: format!("t{i}"),
                            region: crate::region::Region::Flat { start: 0, len: w.len },
                            file: rels[w.file as usize].clone(),
                            file_size: f_obj[w.file as usize].size,
                            offset: w.offset,
                            len: w.len,
                            checksums: w.checksums.clone(),
                            codec: w.codec,
                            block_lens: w.block_lens.clone(),
                        }
                    })
                    .collect(),
                raw("{}"),
                raw("{}"),
            )
            .unwrap();
            let mut out: Vec<Vec<u8>> = data.iter().map(|d| vec![0; d.len()]).collect();
            let copies = keep
                .iter()
                .enumerate()
                .map(|(t, &i)| ByteCopy {
                    chunk: m.chunk_start[t],
                    src: 0,
                    dst: i,
                    dst_off: 0,
                    len: data[i].len() as u64,
                })
                .collect();
            let dests = out.iter_mut().map(|v| &mut v[..]).collect();
            read_from(&store, &m, copies, dests, true, 3).unwrap();
            prop_assert_eq!(out, data);
        }
    }

    #[test]
    fn urls() {
        assert!(is_url("s3://b/x") && !is_url("/tmp/x"));
        let s = |u: &str| client::split_url(u).map(|(a, b, c)| format!("{a}|{b}|{c}"));
        assert_eq!(s("s3://b/x/y/").unwrap(), "s3|b|x/y");
        assert_eq!(s("gs://b").unwrap(), "gs|b|");
        assert!(s("s3:///x").is_err());
        assert!(s("s3://b/../x").is_err());
        assert!(s("ftp://b/x").is_err());
    }
}
