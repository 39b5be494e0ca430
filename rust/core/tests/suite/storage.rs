//! The storage layer: a second implementation (in memory, as an object store would be) carries
//! writes, resharded reads and verification unchanged, and every byte is counted at the boundary.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use olmo_chunks_core::{
    assemble_manifest, plan_copies, read_from, verify_from, write_chunks_to, ByteCopy, CoreError,
    IoCounters, Manifest, Object, Piece, ReadMerge, Region, SavedChunk, Storage, Target,
    TensorSchema, WriteItem,
};
use proptest::prelude::*;
use serde_json::value::RawValue;

type Blob = Arc<Mutex<Vec<u8>>>;

/// Every read of a data object: (object, offset, length).
type ReadLog = Arc<Mutex<Vec<(String, u64, u64)>>>;

#[derive(Default)]
struct MemStorage {
    objects: Mutex<HashMap<String, Blob>>,
    counters: Arc<IoCounters>,
    merge: ReadMerge,
    reads: ReadLog,
}

struct MemObject {
    rel: String,
    blob: Blob,
    counters: Arc<IoCounters>,
    reads: ReadLog,
}

impl Object for MemObject {
    fn size(&self) -> u64 {
        self.blob.lock().unwrap().len() as u64
    }
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        self.reads
            .lock()
            .unwrap()
            .push((self.rel.clone(), offset, len));
        let blob = self.blob.lock().unwrap();
        let mut at = offset as usize;
        for b in bufs.iter_mut() {
            let src = blob
                .get(at..at + b.len())
                .ok_or(std::io::ErrorKind::UnexpectedEof)?;
            b.copy_from_slice(src);
            at += b.len();
            self.counters
                .read
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        let mut blob = self.blob.lock().unwrap();
        blob[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        self.counters
            .written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Storage for MemStorage {
    fn name(&self, rel: &str) -> PathBuf {
        PathBuf::from(format!("mem://{rel}"))
    }
    fn open(&self, rel: &str) -> olmo_chunks_core::Result<Box<dyn Object>> {
        let blob = self.objects.lock().unwrap().get(rel).cloned();
        let blob = blob.ok_or_else(|| CoreError::InvalidArgument(format!("no object {rel}")))?;
        Ok(Box::new(MemObject {
            rel: rel.to_string(),
            blob,
            counters: self.counters.clone(),
            reads: self.reads.clone(),
        }))
    }
    fn read_merge(&self) -> ReadMerge {
        self.merge
    }
    fn get(&self, rel: &str) -> olmo_chunks_core::Result<Vec<u8>> {
        let obj = self.open(rel)?;
        let mut out = vec![0; obj.size() as usize];
        obj.read_exact_at(&mut [&mut out[..]], 0).unwrap();
        Ok(out)
    }
    fn create(&self, rel: &str, size: u64) -> olmo_chunks_core::Result<Box<dyn Object>> {
        let blob: Blob = Arc::new(Mutex::new(vec![0; size as usize]));
        self.objects
            .lock()
            .unwrap()
            .insert(rel.to_string(), blob.clone());
        Ok(Box::new(MemObject {
            rel: rel.to_string(),
            blob,
            counters: self.counters.clone(),
            reads: self.reads.clone(),
        }))
    }
    fn persist(&self, _rels: &[&str]) -> olmo_chunks_core::Result<()> {
        Ok(())
    }
    fn counters(&self) -> &Arc<IoCounters> {
        &self.counters
    }
}

fn raw(s: &str) -> Box<RawValue> {
    RawValue::from_string(s.to_string()).unwrap()
}

#[test]
fn another_storage_carries_writes_resharded_reads_and_verification() {
    let mem = MemStorage::default();
    // A 6x4 f32 tensor saved as two row blocks in two objects.
    let all: Vec<u8> = (0..24u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let (top, bottom) = all.split_at(48);
    let rels = vec![
        "data/a/rank-00000.bin".to_string(),
        "data/a/rank-00001.bin".to_string(),
    ];
    let items = [
        WriteItem { file: 0, data: top },
        WriteItem {
            file: 1,
            data: bottom,
        },
    ];
    let (written, files) = write_chunks_to(&mem, &rels, &items, 16, 2).unwrap();
    assert_eq!(mem.counters.written.load(Ordering::Relaxed), 96);
    let chunks = written
        .iter()
        .zip([0u64, 3])
        .map(|(w, row)| SavedChunk {
            key: "w".into(),
            region: Region::Box {
                offsets: vec![row, 0],
                sizes: vec![3, 4],
            },
            file: files[w.file as usize].path.clone(),
            file_size: files[w.file as usize].size,
            offset: w.offset,
            len: w.len,
            checksums: w.checksums.clone(),
            codec: w.codec,
            block_lens: w.block_lens.clone(),
        })
        .collect();
    let schema = vec![TensorSchema {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![6, 4],
        role: "main_weight".into(),
    }];
    let m = assemble_manifest("a", 16, schema, chunks, raw("{}"), raw("{}")).unwrap();
    let m = Manifest::decode(&m.encode(), &mem.name("olmo_chunks.manifest")).unwrap();
    // Column 1 of every row, across both objects.
    let target = Target {
        tensor: 0,
        pieces: vec![Piece {
            offsets: vec![0, 1],
            sizes: vec![6, 1],
            local_start: 0,
            strides: vec![1, 1],
        }],
        dest: 0,
        dest_len: 24,
    };
    let mut out = [0u8; 24];
    let copies = plan_copies(&m, &[target]).unwrap();
    read_from(&mem, &m, copies, vec![&mut out[..]], true, 2).unwrap();
    let col: Vec<f32> = out
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(col, vec![1.0, 5.0, 9.0, 13.0, 17.0, 21.0]);
    assert!(mem.counters.read.load(Ordering::Relaxed) >= 24);
    let before = mem.counters.read.load(Ordering::Relaxed);
    assert_eq!(verify_from(&mem, &m, 2, None).unwrap(), 96);
    assert_eq!(mem.counters.read.load(Ordering::Relaxed) - before, 96);
    // A flipped byte in an object is caught through this storage too.
    mem.objects.lock().unwrap()["data/a/rank-00001.bin"]
        .lock()
        .unwrap()[5] ^= 1;
    assert!(matches!(
        verify_from(&mem, &m, 2, None),
        Err(CoreError::ChecksumMismatch { .. })
    ));
}

#[test]
fn local_reads_are_counted_at_the_boundary() {
    use olmo_chunks_core::LocalFs;
    let dir = tempfile::tempdir().unwrap();
    let fs = LocalFs::new(dir.path());
    let rels = vec!["data/x/rank-00000.bin".to_string()];
    let data = vec![7u8; 1000];
    write_chunks_to(
        &fs,
        &rels,
        &[WriteItem {
            file: 0,
            data: &data,
        }],
        64,
        1,
    )
    .unwrap();
    assert_eq!(fs.counters().written.load(Ordering::Relaxed), 1000);
    let obj = fs.open(&rels[0]).unwrap();
    let mut buf = vec![0u8; 300];
    let (a, b) = buf.split_at_mut(100);
    obj.read_exact_at(&mut [a, b], 500).unwrap();
    assert_eq!(fs.counters().read.load(Ordering::Relaxed), 300);
    assert!(buf.iter().all(|&b| b == 7));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Ranged reads merged as a storage allows (any gap and request size) fill the destinations
    /// bit-exact, checksums verified, with no more requests than unmerged; no two of the requests
    /// could have been one; and a flipped byte in a needed block is still caught.
    #[test]
    fn merged_ranged_reads_are_exact_maximal_and_checked(
        chunks in prop::collection::vec((0usize..2, 1usize..3000, any::<prop::sample::Index>(),
                                         any::<prop::sample::Index>(), any::<bool>()), 1..12),
        block in prop::sample::select(vec![64u64, 100, 1000, 4096]),
        gap in prop::sample::select(vec![0u64, 1, 50, 5000, 1 << 40]),
        max in prop::sample::select(vec![1u64, 100, 4096, 1 << 20]),
    ) {
        let data: Vec<Vec<u8>> = chunks
            .iter()
            .enumerate()
            .map(|(i, &(_, n, ..))| (0..n).map(|j| (i * 131 + j * 7 + j / 97) as u8).collect())
            .collect();
        let rels = vec!["data/a/rank-00000.bin".to_string(), "data/a/rank-00001.bin".to_string()];
        let items: Vec<WriteItem<'_>> = chunks.iter().zip(&data).map(|(c, d)| WriteItem { file: c.0, data: d }).collect();
        let merged = MemStorage { merge: ReadMerge { gap, max }, ..Default::default() };
        let (written, files) = write_chunks_to(&merged, &rels, &items, block, 2).unwrap();
        let schema = (0..data.len())
            .map(|i| TensorSchema { key: format!("t{i:02}"), dtype: "uint8".into(), shape: vec![data[i].len() as u64], role: "tensor".into() })
            .collect();
        let saved = written.iter().enumerate().map(|(i, w)| SavedChunk {
            key: format!("t{i:02}"),
            region: Region::Flat { start: 0, len: w.len },
            file: files[w.file as usize].path.clone(),
            file_size: files[w.file as usize].size,
            offset: w.offset,
            len: w.len,
            checksums: w.checksums.clone(),
            codec: w.codec,
            block_lens: w.block_lens.clone(),
        }).collect();
        let m = assemble_manifest("a", block, schema, saved, raw("{}"), raw("{}")).unwrap();
        // A random part of each chosen tensor, each into its own destination.
        let wanted: Vec<(usize, u64, u64)> = chunks.iter().enumerate().filter(|(_, c)| c.4).map(|(i, c)| {
            let n = data[i].len();
            let (a, b) = (c.2.index(n), c.3.index(n));
            (i, a.min(b) as u64, (a.max(b) + 1) as u64)
        }).collect();
        let copies = || wanted.iter().enumerate().map(|(d, &(i, a, b))| ByteCopy {
            chunk: m.chunk_start[i], src: a, dst: d, dst_off: 0, len: b - a,
        }).collect::<Vec<_>>();
        let expected: Vec<Vec<u8>> = wanted.iter().map(|&(i, a, b)| data[i][a as usize..b as usize].to_vec()).collect();
        let read = |s: &MemStorage| {
            let mut out: Vec<Vec<u8>> = expected.iter().map(|e| vec![0xA5; e.len()]).collect();
            s.reads.lock().unwrap().clear();
            let r = read_from(s, &m, copies(), out.iter_mut().map(|v| &mut v[..]).collect(), true, 3);
            (r, out, std::mem::take(&mut *s.reads.lock().unwrap()))
        };
        let (r, out, mut log) = read(&merged);
        r.unwrap();
        prop_assert_eq!(&out, &expected);
        let alone = MemStorage { objects: Mutex::new(merged.objects.lock().unwrap().clone()), ..Default::default() };
        let (r, out, unmerged) = read(&alone);
        r.unwrap();
        prop_assert_eq!(&out, &expected);
        prop_assert!(log.len() <= unmerged.len(), "{} merged requests, {} unmerged", log.len(), unmerged.len());
        if gap == 1 << 40 && max == 1 << 20 {
            // Any gap, and every object is smaller than a request: one request per object read.
            let objects: std::collections::BTreeSet<&String> = log.iter().map(|r| &r.0).collect();
            prop_assert_eq!(log.len(), objects.len());
        }
        log.sort();
        for w in log.windows(2) {
            let ((f1, s1, n1), (f2, s2, n2)) = (&w[0], &w[1]);
            if f1 == f2 {
                prop_assert!(s1 + n1 <= *s2, "requests overlap: {:?}", w);
                prop_assert!(s2 - (s1 + n1) > gap || s2 + n2 - s1 > max, "{:?} could have been one request", w);
            }
        }
        // A flipped byte at the start of a needed range fails the merged read too.
        if let Some(&(i, a, _)) = wanted.first() {
            let ch = &m.chunks[m.chunk_start[i]];
            let rel = &m.files[ch.file as usize].path;
            merged.objects.lock().unwrap()[rel].lock().unwrap()[(ch.offset + a) as usize] ^= 0x10;
            let (r, _, _) = read(&merged);
            prop_assert!(matches!(r, Err(CoreError::ChecksumMismatch { .. })), "{:?}", r);
        }
    }
}
