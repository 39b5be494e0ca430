//! Where checkpoints live: the few operations saves and loads need from a storage, so that an
//! object store is one more implementation rather than a rewrite. `LocalFs` implements them for
//! local and shared filesystems, `ObjectStorage` (`object.rs`) for S3-compatible and GCS buckets.
//! Byte counters live at this boundary: every byte read or written through a storage is counted in
//! its `IoCounters`, and so is every request an object store is sent.

use std::fs::{self, File};
use std::io::{ErrorKind, IoSliceMut, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use crate::error::{CoreError, Result};
use crate::fsops::{self, sync_dir};
use crate::fsutil::open_beneath;
use crate::fused::Copies;

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
    /// Counts `n` bytes read, here and in [`PROCESS_IO`].
    pub fn add_read(&self, n: u64) {
        self.read.fetch_add(n, Ordering::Relaxed);
        PROCESS_IO.read.fetch_add(n, Ordering::Relaxed);
    }
    /// Counts `n` bytes written, here and in [`PROCESS_IO`].
    pub fn add_written(&self, n: u64) {
        self.written.fetch_add(n, Ordering::Relaxed);
        PROCESS_IO.written.fetch_add(n, Ordering::Relaxed);
    }
}

/// Bytes of an object mapped in memory, every page of them in the page cache ([`Object::mapped`]).
pub struct Mapped<'a> {
    map: &'a crate::mapped::MappedFile,
    at: u64,
    counters: &'a IoCounters,
}

impl Mapped<'_> {
    /// Runs `copies` (offsets from the start of these bytes) out of the mapping
    /// ([`crate::fused`]). `UnexpectedEof` where they reach past the object's end or it was cut
    /// short under the mapping.
    pub fn copy(&self, copies: &mut Copies<'_>) -> std::io::Result<()> {
        self.map.copy(self.at, copies)?;
        self.counters.add_read(copies.bytes());
        Ok(())
    }
}

/// A data object open for positional I/O.
pub trait Object: Send + Sync {
    /// Size in bytes when opened.
    fn size(&self) -> u64;
    /// Fills `bufs`, in order, from bytes `offset..` (all of them, or an error; a short object is
    /// `UnexpectedEof`).
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()>;
    /// [`Object::read_exact_at`], handing `seen` every stretch of the bytes, in order, as soon as
    /// it has landed (while it is still in the CPU's cache: checksums in the same pass as the
    /// copy, not in a second one over memory).
    fn read_exact_at_seen(
        &self,
        bufs: &mut [&mut [u8]],
        offset: u64,
        seen: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
        self.read_exact_at(bufs, offset)?;
        bufs.iter().for_each(|b| seen(b));
        Ok(())
    }
    /// The most bytes a read may ask for and still cost about what a longer one does per byte
    /// (a local file's `preadv`, `Some`): a reader may then read a range window by window, with
    /// one window-sized buffer, kept in the CPU's cache, taking the bytes it only checks. `None`
    /// (an object store, one request per read): read a range in one go.
    fn window(&self) -> Option<usize> {
        None
    }
    /// Bytes `at..at + len` mapped in memory, where every page of them is in the page cache (a
    /// local file): copied out of there ([`Mapped::copy`]), not read. `None` where this object
    /// cannot or should not (the caller then reads the range).
    fn mapped(&self, _at: u64, _len: u64) -> Option<Mapped<'_>> {
        None
    }
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

/// An object's version: equal versions mean nobody replaced it in between (an object store's ETag
/// and version id; a local file's device, inode, modification time and size).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Version {
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// What [`Storage::head`] tells of an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub version: Version,
    pub size: u64,
    /// When it was last written (a lease's heartbeat).
    pub modified: SystemTime,
}

/// The condition of a conditional write.
#[derive(Clone, Copy, Debug)]
pub enum PutIf<'a> {
    /// The object must not exist.
    Absent,
    /// The object must still be at this version.
    Version(&'a Version),
}

/// What a listing finds below a prefix (relative to the storage's root, `/`-separated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A regular file, or an object.
    Object(String),
    /// A directory (local filesystems only; listed before what it holds).
    Dir(String),
    /// Anything else: a symbolic link (never followed), a FIFO, a device, a socket.
    Other(String),
}

impl Entry {
    pub fn rel(&self) -> &str {
        match self {
            Entry::Object(r) | Entry::Dir(r) | Entry::Other(r) => r,
        }
    }
}

/// A storage without the primitives of a save transaction (a test's, or a read-only one).
fn no_txn<T>(s: &(impl Storage + ?Sized), rel: &str) -> Result<T> {
    Err(CoreError::io(
        s.name(rel),
        std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this storage cannot hold a save transaction",
        ),
    ))
}

/// A place checkpoints live in, addressed by paths relative to its root (`/`-separated).
///
/// Besides reading and writing data objects, a storage has the primitives a save transaction
/// (`txn.rs`) is built from, as object stores have them: `head`, `list`, `delete`, a conditional
/// `put_if` (create-if-absent, replace-if-version), `publish` (the commit) and `touch_if` (a
/// lease's heartbeat). A local filesystem implements them with `O_EXCL`, `rename` and fsyncs of
/// files and directories (`fsops.rs`).
/// Which byte ranges of one object a load may read in one request ([`Storage::read_merge`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadMerge {
    /// The most unneeded bytes read between two needed ranges.
    pub gap: u64,
    /// The most bytes one request reads (0: ranges are never merged).
    pub max: u64,
}

pub trait Storage: Send + Sync {
    /// What `rel` is called in errors.
    fn name(&self, rel: &str) -> PathBuf;
    /// How a load may merge the ranges it reads of one object: never, for storages where a read
    /// costs no round trip (local files).
    fn read_merge(&self) -> ReadMerge {
        ReadMerge::default()
    }
    /// Whether a write whose request failed may still land afterwards (an object store's PUT
    /// sent before its client gave up): its outcome is then unknown however it reads back now.
    fn writes_land_late(&self) -> bool {
        false
    }
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

    /// What `rel` is, or `None` if it does not exist.
    fn head(&self, rel: &str) -> Result<Option<Head>> {
        no_txn(self, rel)
    }
    /// Small object `rel` whole with its head (`None` if it does not exist), `check` shown its
    /// size and first `peek` bytes before the rest is read, as [`Storage::get_checked`].
    fn get_with_head(
        &self,
        rel: &str,
        _peek: u64,
        _check: HeadCheck<'_>,
    ) -> Result<Option<(Vec<u8>, Head)>> {
        no_txn(self, rel)
    }
    /// What is below `prefix` ("" for the root): at any depth if `deep`, else its direct
    /// entries; in no particular order.
    fn list(&self, prefix: &str, _deep: bool) -> Result<Vec<Entry>> {
        no_txn(self, prefix)
    }
    /// Removes object `rel` (nothing if it does not exist).
    fn delete(&self, rel: &str) -> Result<()> {
        no_txn(self, rel)
    }
    /// Removes `prefix` and everything below it, never following a symbolic link.
    fn delete_all(&self, prefix: &str) -> Result<()> {
        for e in self.list(prefix, true)? {
            if !matches!(e, Entry::Dir(_)) {
                self.delete(e.rel())?;
            }
        }
        Ok(())
    }
    /// Writes small object `rel` holding `bytes` if `cond` holds; returns its new version, or
    /// `None` (nothing written) if it did not. Of writers racing on one condition at most one
    /// succeeds. A reader may find the object absent while a local filesystem replaces it, and a
    /// crash may leave it partly written: this is for leases, judged by their age.
    fn put_if(&self, rel: &str, _bytes: &[u8], _cond: PutIf<'_>) -> Result<Option<Version>> {
        no_txn(self, rel)
    }
    /// Makes `rel` hold `bytes` atomically and durably if `cond` holds (else `None`, nothing
    /// changed): a reader, and the storage after a crash, has the old object or the new one,
    /// whole. `ready` runs once the bytes are staged, just before the atomic step, and may veto
    /// it. An object store checks `cond` in the same request; a local filesystem just before its
    /// rename (between the two, the save's lease keeps other writers out).
    fn publish(
        &self,
        rel: &str,
        _bytes: &[u8],
        _cond: PutIf<'_>,
        _ready: &dyn Fn() -> Result<()>,
    ) -> Result<Option<Version>> {
        no_txn(self, rel)
    }
    /// Renews `rel` (holding `bytes`) if it is still at `version`: its modification time becomes
    /// now. Returns the new version, or `None` if another writer replaced or removed it.
    fn touch_if(&self, rel: &str, _bytes: &[u8], _version: &Version) -> Result<Option<Version>> {
        no_txn(self, rel)
    }
    /// Now, on the clock this storage stamps [`Head::modified`] with: this process's, for a
    /// storage whose times it writes itself.
    fn clock(&self) -> Result<SystemTime> {
        Ok(SystemTime::now())
    }
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

    /// Reads open file `f` (object `rel`, `size` bytes) whole, `check` shown its first `peek`.
    fn read_checked(
        &self,
        rel: &str,
        f: &mut File,
        size: u64,
        peek: u64,
        check: HeadCheck<'_>,
    ) -> Result<Vec<u8>> {
        let io = |e| CoreError::io(self.name(rel), e);
        let mut bytes = Vec::new();
        Read::by_ref(f)
            .take(peek.min(size))
            .read_to_end(&mut bytes)
            .map_err(io)?;
        check(&bytes, size)?;
        bytes.reserve_exact(size.saturating_sub(bytes.len() as u64) as usize);
        f.read_to_end(&mut bytes).map_err(io)?;
        self.counters.add_read(bytes.len() as u64);
        Ok(bytes)
    }

    /// The head of `path` (not following a symbolic link), `None` if it does not exist.
    fn stat(&self, path: &Path) -> Result<Option<Head>> {
        match fs::symlink_metadata(path) {
            Ok(md) => Ok(Some(local_head(&md))),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CoreError::io(path, e)),
        }
    }

    fn list_into(&self, dir: &Path, rel: &str, deep: bool, out: &mut Vec<Entry>) -> Result<()> {
        let entries = match fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(CoreError::io(dir, e)),
        };
        for e in entries {
            let e = e.map_err(|e| CoreError::io(dir, e))?;
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                out.push(Entry::Other(join_rel(
                    rel,
                    &e.file_name().to_string_lossy(),
                )));
                continue;
            };
            let child = join_rel(rel, &name);
            let kind = e.file_type().map_err(|err| CoreError::io(e.path(), err))?;
            if kind.is_dir() {
                out.push(Entry::Dir(child.clone()));
                if deep {
                    self.list_into(&e.path(), &child, deep, out)?;
                }
            } else if kind.is_file() {
                out.push(Entry::Object(child));
            } else {
                out.push(Entry::Other(child));
            }
        }
        Ok(())
    }
}

fn join_rel(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// A local file's head: its version is its device, inode, modification time and size.
fn local_head(md: &fs::Metadata) -> Head {
    let modified = md.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Head {
        version: Version {
            e_tag: Some(format!(
                "{}:{}:{}.{:09}:{}",
                md.dev(),
                md.ino(),
                md.mtime(),
                md.mtime_nsec(),
                md.len()
            )),
            version: None,
        },
        size: md.len(),
        modified,
    }
}

/// `path` with `suffix` appended to its file name, in the same directory.
fn beside(path: &Path, prefix: &str, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    path.with_file_name(format!("{prefix}{name}{suffix}"))
}

struct LocalObject {
    file: File,
    /// Its name, for the journal of [`fsops`].
    path: PathBuf,
    size: u64,
    counters: Arc<IoCounters>,
    /// A mapping of its `size` bytes, made on the first `mapped` (`None`: it cannot be).
    map: std::sync::OnceLock<Option<crate::mapped::MappedFile>>,
}

/// Bytes a local read hands to its checksum at a time: within a core's L2 cache.
pub const SEEN_WINDOW: usize = 256 << 10;

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

    fn window(&self) -> Option<usize> {
        Some(SEEN_WINDOW)
    }

    fn mapped(&self, at: u64, len: u64) -> Option<Mapped<'_>> {
        if !crate::fused::available() {
            return None;
        }
        let map = self
            .map
            .get_or_init(|| crate::mapped::MappedFile::new(&self.file, self.size))
            .as_ref()?;
        // From a cold cache, faults would read the file a few pages at a time: read it instead.
        map.resident(&self.file, at, len).then_some(Mapped {
            map,
            at,
            counters: &self.counters,
        })
    }

    /// Reads in windows of [`SEEN_WINDOW`] bytes, each handed to `seen` before the next is read.
    fn read_exact_at_seen(
        &self,
        bufs: &mut [&mut [u8]],
        mut offset: u64,
        seen: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
        let mut window: Vec<&mut [u8]> = Vec::new();
        let mut filled = 0usize;
        let mut flush = |window: &mut Vec<&mut [u8]>, filled: &mut usize| {
            self.read_exact_at(window, offset)?;
            window.iter().for_each(|w| seen(w));
            offset += *filled as u64;
            window.clear();
            *filled = 0;
            Ok::<_, std::io::Error>(())
        };
        for buf in bufs.iter_mut() {
            let mut rest: &mut [u8] = buf;
            while !rest.is_empty() {
                let n = rest.len().min(SEEN_WINDOW - filled);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                window.push(head);
                filled += n;
                rest = tail;
                if filled == SEEN_WINDOW {
                    flush(&mut window, &mut filled)?;
                }
            }
        }
        if filled > 0 {
            flush(&mut window, &mut filled)?;
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
            map: Default::default(),
        }))
    }

    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        self.get_checked(rel, 0, &|_, _| Ok(()))
    }

    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        let mut f = open_beneath(&self.root, rel)?;
        let size = f
            .metadata()
            .map_err(|e| CoreError::io(self.name(rel), e))?
            .len();
        self.read_checked(rel, &mut f, size, peek, check)
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
            map: Default::default(),
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

    fn head(&self, rel: &str) -> Result<Option<Head>> {
        self.stat(&self.name(rel))
    }

    fn get_with_head(
        &self,
        rel: &str,
        peek: u64,
        check: HeadCheck<'_>,
    ) -> Result<Option<(Vec<u8>, Head)>> {
        let mut f = match open_beneath(&self.root, rel) {
            Ok(f) => f,
            Err(CoreError::Io { source, .. }) if source.kind() == ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let head = local_head(&f.metadata().map_err(|e| CoreError::io(self.name(rel), e))?);
        let bytes = self.read_checked(rel, &mut f, head.size, peek, check)?;
        Ok(Some((bytes, head)))
    }

    /// Lists without following symbolic links: a linked directory is an [`Entry::Other`], and
    /// so is `prefix` itself when it is not a real directory.
    fn list(&self, prefix: &str, deep: bool) -> Result<Vec<Entry>> {
        let dir = self.name(prefix);
        let mut out = Vec::new();
        match fs::symlink_metadata(&dir) {
            Ok(md) if md.is_dir() => self.list_into(&dir, prefix, deep, &mut out)?,
            Ok(md) if md.is_file() => out.push(Entry::Object(prefix.to_string())),
            Ok(_) => out.push(Entry::Other(prefix.to_string())),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(CoreError::io(dir, e)),
        }
        Ok(out)
    }

    fn delete(&self, rel: &str) -> Result<()> {
        let path = self.name(rel);
        match fsops::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(CoreError::io(path, e)),
            _ => Ok(()),
        }
    }

    fn delete_all(&self, prefix: &str) -> Result<()> {
        let path = self.name(prefix);
        let removed = match fs::symlink_metadata(&path) {
            Ok(md) if md.is_dir() => fsops::remove_dir_all(&path),
            Ok(_) => fsops::remove_file(&path),
            Err(e) => Err(e),
        };
        match removed {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(CoreError::io(path, e)),
            _ => Ok(()),
        }
    }

    /// Creates with `O_EXCL`; replaces by moving the object aside first (an atomic claim: of
    /// two replacers only one moves it), then creating it afresh with `O_EXCL`.
    fn put_if(&self, rel: &str, bytes: &[u8], cond: PutIf<'_>) -> Result<Option<Version>> {
        let path = self.name(rel);
        let io = |e| CoreError::io(&path, e);
        if let PutIf::Version(want) = cond {
            let aside = beside(&path, "", &format!(".stale-{}", crate::txn::new_save_id()?));
            match fsops::rename(&path, &aside) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(io(e)),
            }
            let moved = self.stat(&aside)?.map(|h| h.version);
            if moved.as_ref() != Some(want) {
                // Another writer replaced it after it was read: put theirs back.
                if self.stat(&path)?.is_none() {
                    let _ = fsops::rename(&aside, &path);
                }
                let _ = fsops::remove_file(&aside);
                return Ok(None);
            }
            let _ = fsops::remove_file(&aside);
        }
        // The version of the file written, from its own handle: a racing writer may move the
        // name aside for a moment (and put it back) right after.
        match fsops::write_new(&path, bytes) {
            Ok(f) => Ok(Some(local_head(&f.metadata().map_err(io)?).version)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(io(e)),
        }
    }

    /// Writes `.<name>.tmp-<random id>` beside `rel` and fsyncs it, checks `cond` and `ready`,
    /// renames it over `rel` and fsyncs the directory.
    fn publish(
        &self,
        rel: &str,
        bytes: &[u8],
        cond: PutIf<'_>,
        ready: &dyn Fn() -> Result<()>,
    ) -> Result<Option<Version>> {
        let path = self.name(rel);
        let tmp = beside(&path, ".", &format!(".tmp-{}", crate::txn::new_save_id()?));
        let renamed = (|| {
            fsops::write_new(&tmp, bytes).map_err(|e| CoreError::io(&tmp, e))?;
            ready()?;
            let now = self.stat(&path)?.map(|h| h.version);
            let holds = match cond {
                PutIf::Absent => now.is_none(),
                PutIf::Version(want) => now.as_ref() == Some(want),
            };
            if holds {
                fsops::rename(&tmp, &path).map_err(|e| CoreError::io(&path, e))?;
            }
            Ok(holds)
        })();
        if !matches!(renamed, Ok(true)) {
            let _ = fsops::remove_file(&tmp);
            return renamed.map(|_| None);
        }
        sync_dir(path.parent().unwrap_or(&self.root))?;
        Ok(self.stat(&path)?.map(|h| h.version))
    }

    fn touch_if(&self, rel: &str, _bytes: &[u8], version: &Version) -> Result<Option<Version>> {
        let path = self.name(rel);
        if self.stat(&path)?.map(|h| h.version).as_ref() != Some(version) {
            return Ok(None);
        }
        File::options()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&path)
            .and_then(|f| f.set_modified(SystemTime::now()))
            .map_err(|e| CoreError::io(&path, e))?;
        Ok(self.stat(&path)?.map(|h| h.version))
    }
}
