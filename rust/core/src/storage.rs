//! Where checkpoints live: the few operations saves and loads need from a storage, so that an
//! object store is one more implementation rather than a rewrite. `LocalFs` implements them for
//! local and shared filesystems, `ObjectStorage` (`object.rs`) for S3-compatible and GCS buckets.
//! Byte counters live at this boundary: every byte read or written through a storage is counted in
//! its `IoCounters`, and so is every request an object store is sent.

use std::fs::File;
use std::io::{IoSliceMut, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CoreError, Result};
use crate::fsops::{self, sync_dir};
use crate::fsutil::open_beneath;

/// What [`Storage::get_checked`] asks of an object before reading it whole: given its size and
/// first bytes, refuse it or let it through.
pub type HeadCheck<'a> = &'a dyn Fn(&[u8], u64) -> Result<()>;

/// Bytes moved through a storage, counted as they move.
#[derive(Debug, Default)]
pub struct IoCounters {
    pub read: AtomicU64,
    pub written: AtomicU64,
    /// Requests sent to an object store (retries of one request not counted; 0 for local files).
    pub requests: AtomicU64,
}

/// Bytes moved through every storage of this process.
pub static PROCESS_IO: IoCounters = IoCounters {
    read: AtomicU64::new(0),
    written: AtomicU64::new(0),
    requests: AtomicU64::new(0),
};

impl IoCounters {
    /// Counts `n` bytes read, here and in [`PROCESS_IO`], and paces them ([`set_read_pace`]).
    pub fn add_read(&self, n: u64) {
        self.read.fetch_add(n, Ordering::Relaxed);
        PROCESS_IO.read.fetch_add(n, Ordering::Relaxed);
        pace_read(n);
    }
    /// Counts `n` bytes written, here and in [`PROCESS_IO`].
    pub fn add_written(&self, n: u64) {
        self.written.fetch_add(n, Ordering::Relaxed);
        PROCESS_IO.written.fetch_add(n, Ordering::Relaxed);
    }
}

/// Bytes per second this process may read from storage (0: unbounded; the only state a read
/// looks at unless a benchmark set a cap), and when the bytes read so far are allowed to have
/// arrived.
static PACE_RATE: AtomicU64 = AtomicU64::new(0);
static PACE_DUE: Mutex<Option<Instant>> = Mutex::new(None);

/// Caps this process's storage reads at `bytes_per_s` (0 lifts the cap): a benchmark's model of
/// slower shared storage. Reads through every storage, and [`pace_read`] callers, share the cap.
pub fn set_read_pace(bytes_per_s: u64) {
    let mut due = PACE_DUE.lock().unwrap();
    *due = None;
    PACE_RATE.store(bytes_per_s, Ordering::Relaxed);
}

/// Waits as long as `n` more bytes take at the paced rate, behind the bytes already read.
pub fn pace_read(n: u64) {
    let rate = PACE_RATE.load(Ordering::Relaxed);
    if rate == 0 {
        return; // no cap: one atomic load, no lock
    }
    let wait = {
        let mut next = PACE_DUE.lock().unwrap();
        let now = Instant::now();
        let due =
            next.map_or(now, |t| t.max(now)) + Duration::from_secs_f64(n as f64 / rate as f64);
        *next = Some(due);
        due - now
    };
    std::thread::sleep(wait);
}

/// A data object open for positional I/O.
pub trait Object: Send + Sync {
    /// Size in bytes when opened.
    fn size(&self) -> u64;
    /// Fills `bufs`, in order, from bytes `offset..` (all of them, or an error; a short object is
    /// `UnexpectedEof`).
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()>;
    /// Writes all of `data` at `offset`.
    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()>;
    /// Declares that bytes `offset..offset + len` are never written and stay zero (alignment
    /// padding), so that an object uploaded in parts knows when a part is complete.
    fn pad(&self, _offset: u64, _len: u64) -> std::io::Result<()> {
        Ok(())
    }
    /// Makes what was written durable.
    fn sync(&self) -> std::io::Result<()>;
}

/// A place checkpoints live in, addressed by paths relative to its root (`/`-separated).
pub trait Storage: Send + Sync {
    /// What `rel` is called in errors.
    fn name(&self, rel: &str) -> PathBuf;
    /// Opens object `rel` for reading. Refuses anything but a regular object strictly below the
    /// root (no symbolic links, FIFOs or devices).
    fn open(&self, rel: &str) -> Result<Box<dyn Object>>;
    /// Reads small object `rel` whole (a manifest).
    fn get(&self, rel: &str) -> Result<Vec<u8>>;
    /// [`Storage::get`], with `check` shown the object's size and its first `peek` bytes (all of
    /// it if shorter) before the rest is read: an object it refuses is never read whole.
    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        let bytes = self.get(rel)?;
        check(&bytes[..bytes.len().min(peek as usize)], bytes.len() as u64)?;
        Ok(bytes)
    }
    /// Creates object `rel` of `size` bytes, fresh, for writing.
    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>>;
    /// Makes the created objects `rels` durable, with whatever names them (their directories).
    fn persist(&self, rels: &[&str]) -> Result<()>;
    /// The counters of bytes moved through this storage.
    fn counters(&self) -> &Arc<IoCounters>;
}

/// A directory of a local or shared filesystem.
pub struct LocalFs {
    root: PathBuf,
    counters: Arc<IoCounters>,
}

impl LocalFs {
    pub fn new(root: &Path) -> Self {
        LocalFs {
            root: root.to_path_buf(),
            counters: Arc::default(),
        }
    }
}

struct LocalObject {
    file: File,
    /// Its name, for the journal of [`fsops`].
    path: PathBuf,
    size: u64,
    counters: Arc<IoCounters>,
}

impl Object for LocalObject {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, bufs: &mut [&mut [u8]], mut offset: u64) -> std::io::Result<()> {
        const IOV_MAX: usize = 1024;
        let mut iov: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|s| IoSliceMut::new(s)).collect();
        let mut rest: &mut [IoSliceMut<'_>] = &mut iov;
        while !rest.is_empty() {
            let k = rest.len().min(IOV_MAX);
            let n = match rustix::io::preadv(&self.file, &mut rest[..k], offset) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            self.counters.add_read(n as u64);
            offset += n as u64;
            IoSliceMut::advance_slices(&mut rest, n);
        }
        Ok(())
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        fsops::write_at(&self.file, &self.path, data, offset)?;
        self.counters.add_written(data.len() as u64);
        Ok(())
    }

    fn sync(&self) -> std::io::Result<()> {
        fsops::sync(&self.file, &self.path)
    }
}

impl Storage for LocalFs {
    fn name(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn open(&self, rel: &str) -> Result<Box<dyn Object>> {
        let file = open_beneath(&self.root, rel)?;
        let size = file
            .metadata()
            .map_err(|e| CoreError::io(self.name(rel), e))?
            .len();
        Ok(Box::new(LocalObject {
            file,
            path: self.name(rel),
            size,
            counters: self.counters.clone(),
        }))
    }

    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        self.get_checked(rel, 0, &|_, _| Ok(()))
    }

    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        let mut f = open_beneath(&self.root, rel)?;
        let io = |e| CoreError::io(self.name(rel), e);
        let size = f.metadata().map_err(io)?.len();
        let mut bytes = Vec::new();
        Read::by_ref(&mut f)
            .take(peek.min(size))
            .read_to_end(&mut bytes)
            .map_err(io)?;
        check(&bytes, size)?;
        bytes.reserve_exact(size.saturating_sub(bytes.len() as u64) as usize);
        f.read_to_end(&mut bytes).map_err(io)?;
        self.counters.add_read(bytes.len() as u64);
        Ok(bytes)
    }

    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>> {
        let path = self.name(rel);
        if let Some(parent) = path.parent() {
            fsops::create_dir_all(parent).map_err(|e| CoreError::io(parent, e))?;
        }
        let file = fsops::create(&path, false).map_err(|e| CoreError::io(&path, e))?;
        fsops::set_len(&file, &path, size).map_err(|e| CoreError::io(&path, e))?;
        Ok(Box::new(LocalObject {
            file,
            path,
            size,
            counters: self.counters.clone(),
        }))
    }

    fn persist(&self, rels: &[&str]) -> Result<()> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for rel in rels {
            let mut d = self.name(rel).parent().map(Path::to_path_buf);
            while let Some(x) = d {
                if !x.starts_with(&self.root) || dirs.contains(&x) {
                    break;
                }
                d = x.parent().map(Path::to_path_buf);
                dirs.push(x);
            }
        }
        dirs.iter().try_for_each(|d| sync_dir(d))
    }

    fn counters(&self) -> &Arc<IoCounters> {
        &self.counters
    }
}
