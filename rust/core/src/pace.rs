//! A benchmark's model of slower shared storage: a cap on the bytes per second this process reads.
//! While a cap is set ([`set_read_pace`]), storages opened through [`crate::storage_at`] are
//! wrapped in [`Paced`], whose reads wait as long as the cap makes them; readers outside the core
//! (the benchmark's DCP and raw-read rows) share the cap through [`pace_read`]. With no cap set
//! nothing is wrapped: the storages every other caller opens, and their reads, are not touched.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::error::Result;
use crate::storage::{
    Entry, Head, HeadCheck, IoCounters, Object, PutIf, ReadMerge, Storage, Version,
};

/// The cap in bytes per second (0: none), and when the bytes read so far are allowed to have
/// arrived.
static RATE: AtomicU64 = AtomicU64::new(0);
static DUE: Mutex<Option<Instant>> = Mutex::new(None);

/// Caps this process's storage reads at `bytes_per_s` (0 lifts the cap) for the storages opened
/// from now on, and for [`pace_read`].
pub fn set_read_pace(bytes_per_s: u64) {
    let mut due = DUE.lock().unwrap_or_else(|p| p.into_inner());
    *due = None;
    RATE.store(bytes_per_s, Ordering::Relaxed);
}

/// The cap set by [`set_read_pace`] in bytes per second (0: none).
pub fn read_pace() -> u64 {
    RATE.load(Ordering::Relaxed)
}

/// Waits as long as `n` more bytes take at the capped rate, behind the bytes already read.
pub fn pace_read(n: u64) {
    let rate = RATE.load(Ordering::Relaxed);
    if rate == 0 {
        return;
    }
    let wait = {
        let mut next = DUE.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let due =
            next.map_or(now, |t| t.max(now)) + Duration::from_secs_f64(n as f64 / rate as f64);
        *next = Some(due);
        due - now
    };
    std::thread::sleep(wait);
}

/// `storage`, paced if a cap is set.
pub fn paced(storage: Arc<dyn Storage>) -> Arc<dyn Storage> {
    if RATE.load(Ordering::Relaxed) == 0 {
        storage
    } else {
        Arc::new(Paced { inner: storage })
    }
}

/// A storage whose reads take as long as the cap makes them; everything else passes through.
pub struct Paced {
    inner: Arc<dyn Storage>,
}

struct PacedObject {
    inner: Box<dyn Object>,
}

impl Object for PacedObject {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        self.inner.read_exact_at(bufs, offset)?;
        pace_read(bufs.iter().map(|b| b.len() as u64).sum());
        Ok(())
    }
    fn read_exact_at_seen(
        &self,
        bufs: &mut [&mut [u8]],
        offset: u64,
        seen: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
        self.inner.read_exact_at_seen(bufs, offset, seen)?;
        pace_read(bufs.iter().map(|b| b.len() as u64).sum());
        Ok(())
    }
    fn window(&self) -> Option<usize> {
        self.inner.window()
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_all_at(data, offset)
    }
    fn pad(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.pad(offset, len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
}

fn paced_bytes(bytes: Vec<u8>) -> Vec<u8> {
    pace_read(bytes.len() as u64);
    bytes
}

impl Storage for Paced {
    fn name(&self, rel: &str) -> PathBuf {
        self.inner.name(rel)
    }
    fn read_merge(&self) -> ReadMerge {
        self.inner.read_merge()
    }
    fn writes_land_late(&self) -> bool {
        self.inner.writes_land_late()
    }
    fn open(&self, rel: &str) -> Result<Box<dyn Object>> {
        Ok(Box::new(PacedObject {
            inner: self.inner.open(rel)?,
        }))
    }
    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        self.inner.get(rel).map(paced_bytes)
    }
    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        self.inner.get_checked(rel, peek, check).map(paced_bytes)
    }
    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>> {
        self.inner.create(rel, size)
    }
    fn persist(&self, rels: &[&str]) -> Result<()> {
        self.inner.persist(rels)
    }
    fn counters(&self) -> &Arc<IoCounters> {
        self.inner.counters()
    }
    fn head(&self, rel: &str) -> Result<Option<Head>> {
        self.inner.head(rel)
    }
    fn get_with_head(
        &self,
        rel: &str,
        peek: u64,
        check: HeadCheck<'_>,
    ) -> Result<Option<(Vec<u8>, Head)>> {
        let got = self.inner.get_with_head(rel, peek, check)?;
        Ok(got.map(|(b, h)| (paced_bytes(b), h)))
    }
    fn list(&self, prefix: &str, deep: bool) -> Result<Vec<Entry>> {
        self.inner.list(prefix, deep)
    }
    fn delete(&self, rel: &str) -> Result<()> {
        self.inner.delete(rel)
    }
    fn delete_all(&self, prefix: &str) -> Result<()> {
        self.inner.delete_all(prefix)
    }
    fn put_if(&self, rel: &str, bytes: &[u8], cond: PutIf<'_>) -> Result<Option<Version>> {
        self.inner.put_if(rel, bytes, cond)
    }
    fn publish(
        &self,
        rel: &str,
        bytes: &[u8],
        cond: PutIf<'_>,
        ready: &dyn Fn() -> Result<()>,
    ) -> Result<Option<Version>> {
        self.inner.publish(rel, bytes, cond, ready)
    }
    fn touch_if(&self, rel: &str, bytes: &[u8], version: &Version) -> Result<Option<Version>> {
        self.inner.touch_if(rel, bytes, version)
    }
    fn clock(&self) -> Result<SystemTime> {
        self.inner.clock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_storages_opened_under_a_cap_are_paced_and_their_reads_wait() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x"), vec![1u8; 100_000]).unwrap();
        let local = || Arc::new(crate::storage::LocalFs::new(dir.path())) as Arc<dyn Storage>;
        let plain = paced(local());
        set_read_pace(1_000_000); // 1 MB/s: 100 kB take 0.1 s
        let capped = paced(local());
        let t = Instant::now();
        let mut buf = vec![0u8; 100_000];
        capped
            .open("x")
            .unwrap()
            .read_exact_at(&mut [&mut buf], 0)
            .unwrap();
        let waited = t.elapsed();
        set_read_pace(0);
        assert!(buf.iter().all(|&b| b == 1));
        assert!(waited >= Duration::from_millis(95), "{waited:?}"); // a sleep's lower bound
        assert!(Arc::ptr_eq(&paced(plain.clone()), &plain)); // no cap: not wrapped
    }
}
