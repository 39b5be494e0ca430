//! The storage layer: a second implementation (in memory, as an object store would be) carries
//! writes, resharded reads and verification unchanged, and every byte is counted at the boundary.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use olmo_chunks_core::{
    assemble_manifest, plan_copies, read_from, verify_from, write_chunks_to, CoreError, IoCounters,
    Manifest, Object, Piece, Region, SavedChunk, Storage, Target, TensorSchema, WriteItem,
};
use serde_json::value::RawValue;

type Blob = Arc<Mutex<Vec<u8>>>;

#[derive(Default)]
struct MemStorage {
    objects: Mutex<HashMap<String, Blob>>,
    counters: Arc<IoCounters>,
}

struct MemObject {
    blob: Blob,
    counters: Arc<IoCounters>,
}

impl Object for MemObject {
    fn size(&self) -> u64 {
        self.blob.lock().unwrap().len() as u64
    }
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
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
            blob,
            counters: self.counters.clone(),
        }))
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
            blob,
            counters: self.counters.clone(),
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
