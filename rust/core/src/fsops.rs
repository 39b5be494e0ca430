//! Every operation by which a save changes a local filesystem, in one place: creating, writing,
//! truncating and fsyncing files, making and fsyncing directories, renames and removals. The
//! transaction (`txn.rs`) and the local storage (`storage.rs`) change the disk only through these.
//!
//! A [`Journal`] records them, in the order they were issued, for the operations under one
//! directory. The crash-state test (`tests/suite/crash_states.rs`) replays every crash state of a
//! save from that record: each prefix of it, with the not-yet-fsynced operations dropped or kept
//! as POSIX and ext4 allow. While no journal is open, recording costs one atomic load.

use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::error::{CoreError, Result};

/// One change to a filesystem, with paths relative to the journal's directory ("" is itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Mkdir(PathBuf),
    /// A new, empty file (or an existing one truncated to nothing).
    Create(PathBuf),
    Write {
        path: PathBuf,
        offset: u64,
        data: Vec<u8>,
    },
    SetLen(PathBuf, u64),
    Fsync(PathBuf),
    Rename(PathBuf, PathBuf),
    Unlink(PathBuf),
    Rmdir(PathBuf),
    FsyncDir(PathBuf),
}

static OPEN_JOURNALS: AtomicUsize = AtomicUsize::new(0);
static JOURNALS: Mutex<Vec<(u64, PathBuf, Vec<Op>)>> = Mutex::new(Vec::new());
static NEXT_JOURNAL: AtomicU64 = AtomicU64::new(0);

/// The open journals (a panic elsewhere while one was held leaves them usable).
fn journals() -> MutexGuard<'static, Vec<(u64, PathBuf, Vec<Op>)>> {
    JOURNALS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records the operations made under one directory until [`Journal::finish`].
pub struct Journal {
    id: u64,
}

impl Journal {
    /// Starts recording the operations on `root` and below it.
    pub fn start(root: &Path) -> Journal {
        let root = absolutise(root);
        let id = NEXT_JOURNAL.fetch_add(1, Ordering::Relaxed);
        journals().push((id, root, Vec::new()));
        OPEN_JOURNALS.fetch_add(1, Ordering::SeqCst);
        Journal { id }
    }

    /// The operations recorded, in the order they were issued.
    pub fn finish(self) -> Vec<Op> {
        let mut journals = journals();
        OPEN_JOURNALS.fetch_sub(1, Ordering::SeqCst);
        match journals.iter().position(|j| j.0 == self.id) {
            Some(at) => journals.swap_remove(at).2,
            None => Vec::new(),
        }
    }
}

/// Where paths of one operation are recorded: the journal whose directory holds them all, and
/// the paths relative to it. `None` (at the cost of one atomic load) while no journal is open.
/// Taken before the operation (a renamed or removed path cannot be resolved after it), used by
/// [`push`] once the operation succeeded.
fn watch(paths: &[&Path]) -> Option<(u64, Vec<PathBuf>)> {
    if OPEN_JOURNALS.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let absolute: Vec<PathBuf> = paths.iter().map(|p| absolutise(p)).collect();
    let journals = journals();
    let (id, root, _) = journals
        .iter()
        .find(|j| absolute.iter().all(|p| p.starts_with(&j.1)))?;
    let rel = absolute
        .iter()
        .map(|p| p.strip_prefix(root).unwrap().to_path_buf())
        .collect();
    Some((*id, rel))
}

/// Appends the operation `op` builds from the watched paths to their journal.
fn push(watched: Option<(u64, Vec<PathBuf>)>, op: impl FnOnce(Vec<PathBuf>) -> Op) {
    let Some((id, paths)) = watched else {
        return;
    };
    let mut journals = journals();
    if let Some(j) = journals.iter_mut().find(|j| j.0 == id) {
        j.2.push(op(paths));
    }
}

/// The one path of a single-path operation.
fn one(mut paths: Vec<PathBuf>) -> PathBuf {
    paths.pop().unwrap()
}

/// `p` made absolute through its canonical parent, its last component as it is (so neither a
/// symbolic link nor a path not created yet is resolved).
fn absolutise(p: &Path) -> PathBuf {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    match (p.parent(), p.file_name()) {
        (Some(parent), Some(name)) => parent
            .canonicalize()
            .unwrap_or_else(|_| absolutise(parent))
            .join(name),
        _ => p,
    }
}

/// `fs::create_dir_all`, recording each directory it makes.
pub fn create_dir_all(dir: &Path) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut d = Some(dir);
    while let Some(x) = d.filter(|x| !x.as_os_str().is_empty()) {
        match fs::symlink_metadata(x) {
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::NotFound => missing.push(x),
            Err(e) => return Err(e),
        }
        d = x.parent();
    }
    for x in missing.into_iter().rev() {
        let w = watch(&[x]);
        match fs::create_dir(x) {
            Ok(()) => push(w, |p| Op::Mkdir(one(p))),
            Err(e) if e.kind() == ErrorKind::AlreadyExists && x.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Creates `path` for writing: fresh (`O_EXCL`) when `exclusive`, else created or truncated.
pub fn create(path: &Path, exclusive: bool) -> std::io::Result<File> {
    let w = watch(&[path]);
    let mut o = OpenOptions::new();
    o.write(true);
    if exclusive {
        o.create_new(true);
    } else {
        o.create(true).truncate(true);
    }
    let f = o.open(path)?;
    push(w, |p| Op::Create(one(p)));
    Ok(f)
}

/// A new file `path` (`O_EXCL`) holding `bytes`, fsynced; the open file (its metadata is the
/// new file's, whatever `path` names by then). Removed again if it could not be written whole.
pub fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<File> {
    let f = create(path, true)?;
    if let Err(e) = write_at(&f, path, bytes, 0).and_then(|()| sync(&f, path)) {
        // Created here and never whole (a full disk): an empty lease left behind locked the
        // checkpoint for a lease timeout.
        drop(f);
        let _ = remove_file(path);
        return Err(e);
    }
    Ok(f)
}

/// `pwrite` of all of `data` at `offset` into `file` (which is `path`).
pub fn write_at(file: &File, path: &Path, data: &[u8], offset: u64) -> std::io::Result<()> {
    let w = watch(&[path]);
    file.write_all_at(data, offset)?;
    push(w, |p| Op::Write {
        path: one(p),
        offset,
        data: data.to_vec(),
    });
    Ok(())
}

/// Sets the length of `file` (which is `path`).
pub fn set_len(file: &File, path: &Path, len: u64) -> std::io::Result<()> {
    let w = watch(&[path]);
    file.set_len(len)?;
    push(w, |p| Op::SetLen(one(p), len));
    Ok(())
}

/// fsyncs `file` (which is `path`): its data and size are durable.
pub fn sync(file: &File, path: &Path) -> std::io::Result<()> {
    let w = watch(&[path]);
    file.sync_all()?;
    push(w, |p| Op::Fsync(one(p)));
    Ok(())
}

/// fsyncs a directory so the creates, renames and removals inside it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let w = watch(&[dir]);
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CoreError::io(dir, e))?;
    push(w, |p| Op::FsyncDir(one(p)));
    Ok(())
}

/// Renames `from` to `to` (atomically replacing `to`).
pub fn rename(from: &Path, to: &Path) -> std::io::Result<()> {
    let w = watch(&[from, to]);
    fs::rename(from, to)?;
    push(w, |mut p| {
        let to = p.pop().unwrap();
        Op::Rename(p.pop().unwrap(), to)
    });
    Ok(())
}

/// Removes file `path`.
pub fn remove_file(path: &Path) -> std::io::Result<()> {
    let w = watch(&[path]);
    fs::remove_file(path)?;
    push(w, |p| Op::Unlink(one(p)));
    Ok(())
}

/// Removes directory `dir` and everything in it, never following a symbolic link (a link is
/// removed, not what it points to), one unlink or rmdir at a time.
pub fn remove_dir_all(dir: &Path) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            remove_dir_all(&e.path())?;
        } else {
            remove_file(&e.path())?;
        }
    }
    let w = watch(&[dir]);
    fs::remove_dir(dir)?;
    push(w, |p| Op::Rmdir(one(p)));
    Ok(())
}
