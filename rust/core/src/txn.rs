//! The save transaction: an exclusive lease on the checkpoint directory, the atomic commit of the
//! manifest, and cleanup limited to what provably belongs to this store's failed or superseded
//! saves. The invariant (docs/FORMAT.md, "Saves"): at every moment the directory holds one complete
//! checkpoint or none, and a save that returned success stays loadable until another save to the
//! same directory succeeds. Every door drives a save through [`Transaction`]; `object.rs` implements
//! it for object stores.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::error::{CoreError, Result};
use crate::fsops::{self, sync_dir};
use crate::load::check_manifest_coverage;
use crate::manifest::{Manifest, MANIFEST_NAME};
use crate::save::{assemble_manifest, SavedChunk, TensorSchema};
use serde_json::value::RawValue;

/// The lease file: present while a save of this directory is in progress.
pub const LEASE_NAME: &str = ".olmo_chunks.lease";
/// A lease holds a short JSON token; no more of one is ever read (a crafted lease cannot make a
/// save allocate more).
pub const MAX_LEASE_LEN: u64 = 4096;
/// Temporary manifests are `TMP_PREFIX + save_id` until renamed over the manifest.
pub const TMP_PREFIX: &str = ".olmo_chunks.manifest.tmp-";
/// A dead writer's lease, moved aside by the save breaking it, is `<this><breaker's save id>`
/// until removed (by that save, or by the next one if it died in between).
pub const STALE_LEASE_PREFIX: &str = ".olmo_chunks.lease.stale-";
/// Data of one save lives in `data/<save_id>/`.
pub const DATA_DIR: &str = "data";

/// How a save treats the directory it writes to.
#[derive(Clone, Copy, Debug)]
pub struct SaveOptions {
    /// Replace a checkpoint already committed at the path (otherwise refused).
    pub overwrite: bool,
    /// A lease whose heartbeat is older than this belongs to a dead writer and may be broken.
    pub lease_timeout: Duration,
}

/// A save in progress on some storage, from its lease to its commit or abort: [`SaveTxn`] on a
/// local filesystem, [`crate::object::ObjectSaveTxn`] on an object store.
pub trait Transaction: Send {
    /// The id data files go under (`data/<save_id>/`).
    fn save_id(&self) -> &str;
    /// What the checkpoint is called in errors.
    fn name(&self, rel: &str) -> PathBuf;
    /// Commits `m` (which must name only this save's data files) atomically, then removes the data
    /// of the saves it supersedes and releases the lease.
    fn commit(&mut self, m: &Manifest) -> Result<()>;
    /// Removes this save's data and releases the lease; the checkpoint that was committed before
    /// it is untouched.
    fn abort(&mut self);

    /// Assembles the manifest of this save from its parts, validates it as every reader does and
    /// commits it (see [`Transaction::commit`]).
    fn commit_parts(
        &mut self,
        block_size: u64,
        tensors: Vec<TensorSchema>,
        chunks: Vec<SavedChunk>,
        entries: Box<RawValue>,
        info: Box<RawValue>,
    ) -> Result<Manifest> {
        let m = assemble_manifest(self.save_id(), block_size, tensors, chunks, entries, info)?;
        let m = Manifest::decode(&m.encode(), &self.name(MANIFEST_NAME))?;
        self.commit(&m)?;
        Ok(m)
    }
}

/// Refuses a manifest that names another save or files outside `data/<save_id>/`, or does not
/// cover its tensors exactly.
pub(crate) fn check_commit(m: &Manifest, save_id: &str) -> Result<()> {
    let prefix = format!("{DATA_DIR}/{save_id}/");
    if m.save_id != save_id || m.files.iter().any(|f| !f.path.starts_with(&prefix)) {
        return Err(CoreError::InvalidArgument(format!(
            "the manifest must name save {save_id} and only files under {prefix}"
        )));
    }
    check_manifest_coverage(m)
}

/// True for the names of save ids: 32 lowercase hex digits.
pub(crate) fn is_save_id(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The path, below the checkpoint, of data file `part` of `rank` in save `save_id`: the one place
/// data files are named, so what [`is_data_file`] and the cleanup recognise is what saves write.
pub fn data_file_name(save_id: &str, rank: usize, part: usize) -> String {
    let part = if part == 0 {
        String::new()
    } else {
        format!("-{part:03}")
    };
    format!("{DATA_DIR}/{save_id}/rank-{rank:05}{part}.bin")
}

/// True for the names of data files a save writes: `<word>-<digits>[-<digits>].bin`.
pub(crate) fn is_data_file(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".bin") else {
        return false;
    };
    let Some((word, num)) = stem.split_once('-') else {
        return false;
    };
    !word.is_empty()
        && word.bytes().all(|b| b.is_ascii_lowercase())
        && !num.is_empty()
        && num.bytes().all(|b| b.is_ascii_digit() || b == b'-')
}

/// True if `path` is (without following symlinks) a directory named by a save id that holds only
/// regular files named as data files: data this store wrote, and nothing else.
fn is_our_save_dir(path: &Path) -> bool {
    let ok_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_save_id);
    if !ok_name || !fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return false;
    }
    let Ok(entries) = fs::read_dir(path) else {
        return false;
    };
    entries.into_iter().all(|e| {
        e.is_ok_and(|e| {
            e.file_type().is_ok_and(|t| t.is_file())
                && e.file_name().to_str().is_some_and(is_data_file)
        })
    })
}

/// What in `dir` conflicts with the store's own names, relative to `dir`: a `data/` that is not a
/// real directory (a symlinked `data/` is never written through) and, without a committed
/// manifest, entries of `data/` that are not this store's save directories. Anything else may sit
/// beside a checkpoint (a `model.pt` converted into it, a README) and is never touched.
fn foreign_entries(dir: &Path, committed: bool) -> Result<Vec<String>> {
    let mut foreign = Vec::new();
    let data = dir.join(DATA_DIR);
    let Ok(meta) = fs::symlink_metadata(&data) else {
        return Ok(foreign);
    };
    if !meta.is_dir() {
        foreign.push(format!("{DATA_DIR} (not a directory)"));
    } else if !committed {
        for d in fs::read_dir(&data).map_err(|e| CoreError::io(&data, e))? {
            let d = d.map_err(|e| CoreError::io(&data, e))?;
            if !is_our_save_dir(&d.path()) {
                foreign.push(format!("{DATA_DIR}/{}", d.file_name().to_string_lossy()));
            }
        }
    }
    foreign.sort();
    Ok(foreign)
}

/// A fresh save id from the kernel's random source.
pub(crate) fn new_save_id() -> Result<String> {
    let mut b = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| CoreError::io("/dev/urandom", e))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Who holds a lease: enough to tell a dead local writer from a live one.
pub(crate) fn owner_token(save_id: &str) -> String {
    let read = |p: &str| fs::read_to_string(p).map(|s| s.trim().to_string());
    let host = read("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let pidns = fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    serde_json::json!({
        "save_id": save_id, "host": host, "boot_id": boot, "pid_ns": pidns,
        "pid": std::process::id(), "started_unix": now,
    })
    .to_string()
}

/// True if the lease `token` was written by a process of this machine and pid namespace that no
/// longer exists.
pub(crate) fn owner_is_dead_here(token: &str) -> bool {
    let (Ok(theirs), Ok(ours)) = (
        serde_json::from_str::<serde_json::Value>(token),
        serde_json::from_str::<serde_json::Value>(&owner_token("")),
    ) else {
        return false;
    };
    let same = ["host", "boot_id", "pid_ns"]
        .iter()
        .all(|k| theirs.get(k).is_some() && theirs.get(k) == ours.get(k));
    let pid = theirs.get("pid").and_then(|p| p.as_u64()).unwrap_or(0);
    same && pid > 0 && !Path::new(&format!("/proc/{pid}")).exists()
}

fn read_lease(path: &Path) -> std::io::Result<(String, fs::Metadata)> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)?;
    let md = f.metadata()?;
    let mut s = String::new();
    Read::by_ref(&mut f)
        .take(MAX_LEASE_LEN)
        .read_to_string(&mut s)?;
    Ok((s, md))
}

/// Renews a lease from a thread every `every` until stopped; `lost` once a renewal finds that the
/// lease is no longer ours (the thread then stops renewing).
pub(crate) struct Heartbeat {
    stop: Arc<(Mutex<bool>, Condvar)>,
    pub(crate) lost: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// `renew` renews the lease and returns whether it is still ours.
    pub(crate) fn start(every: Duration, mut renew: impl FnMut() -> bool + Send + 'static) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let lost = Arc::new(AtomicBool::new(false));
        let (s, l) = (stop.clone(), lost.clone());
        let thread = std::thread::Builder::new()
            .name("olmo-chunks-lease".into())
            .spawn(move || loop {
                let (lock, cv) = &*s;
                let guard = lock.lock().unwrap();
                let (guard, _) = cv.wait_timeout_while(guard, every, |stop| !*stop).unwrap();
                if *guard {
                    return;
                }
                drop(guard);
                if !renew() {
                    l.store(true, Ordering::Relaxed);
                    return;
                }
            })
            .ok();
        Heartbeat { stop, lost, thread }
    }

    pub(crate) fn stop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap() = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Renews the lease file at `path` (its modification time) while it holds `token`.
fn renew_lease_file(path: &Path, token: &str) -> bool {
    read_lease(path).is_ok_and(|(t, _)| t == token)
        && File::options()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)
            .and_then(|f| f.set_modified(SystemTime::now()))
            .is_ok()
}

/// One save into a checkpoint directory, from the lease to the commit (or the abort).
pub struct SaveTxn {
    dir: PathBuf,
    save_id: String,
    token: String,
    heartbeat: Heartbeat,
    finished: bool,
}

impl SaveTxn {
    /// Takes the directory's lease and prepares `data/<save_id>/`. Refuses a directory that holds
    /// anything that is not an olmo-chunks store, a committed checkpoint unless `overwrite`, and a
    /// lease held by a live writer (`CoreError::Locked`). Removes what failed saves left.
    pub fn begin(dir: &Path, opts: SaveOptions) -> Result<Self> {
        match fs::metadata(dir) {
            Ok(md) if !md.is_dir() => {
                return Err(CoreError::InvalidArgument(format!(
                    "{}: exists and is not a directory",
                    dir.display()
                )))
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsops::create_dir_all(dir).map_err(|e| CoreError::io(dir, e))?
            }
            Err(e) => return Err(CoreError::io(dir, e)),
        }
        let save_id = new_save_id()?;
        let token = owner_token(&save_id);
        let lease = dir.join(LEASE_NAME);
        acquire(&lease, &token, &save_id, opts.lease_timeout)?;
        let every = (opts.lease_timeout / 4).max(Duration::from_millis(100));
        let mut txn = SaveTxn {
            dir: dir.to_path_buf(),
            save_id,
            token: token.clone(),
            heartbeat: Heartbeat::start(every, move || renew_lease_file(&lease, &token)),
            finished: false,
        };
        txn.prepare(opts.overwrite)?;
        Ok(txn)
    }

    fn prepare(&mut self, overwrite: bool) -> Result<()> {
        let manifest = self.dir.join(MANIFEST_NAME);
        let committed = fs::symlink_metadata(&manifest).is_ok();
        if committed && !overwrite {
            return Err(CoreError::Exists {
                path: self.dir.clone(),
            });
        }
        let foreign = foreign_entries(&self.dir, committed)?;
        if !foreign.is_empty() {
            return Err(CoreError::InvalidArgument(format!(
                "{}: refusing to save there: its data/ is not this store's (found {}); nothing was changed",
                self.dir.display(),
                foreign.join(", ")
            )));
        }
        // What earlier saves left: data no committed manifest names, temp manifests. If the
        // manifest cannot be read, keep all data (it may be what it names).
        let live = match Manifest::open(&self.dir) {
            Ok(m) => Some(live_save_ids(&m)),
            Err(_) if !committed => Some(Vec::new()),
            Err(_) => None,
        };
        if let Some(live) = live {
            remove_saves(&self.dir, |id| !live.iter().any(|l| l == id));
        }
        remove_leftover_files(&self.dir);
        let data = self.dir.join(DATA_DIR);
        let mine = data.join(&self.save_id);
        fsops::create_dir_all(&mine).map_err(|e| CoreError::io(&mine, e))?;
        sync_dir(&data)?;
        sync_dir(&self.dir)
    }

    pub fn save_id(&self) -> &str {
        &self.save_id
    }

    /// `data/<save_id>`, relative to the checkpoint directory: where this save's files go.
    pub fn data_prefix(&self) -> String {
        format!("{DATA_DIR}/{}", self.save_id)
    }

    /// Commits `m` (which must name only this save's data files) atomically, then removes the data
    /// of the saves it supersedes and releases the lease.
    pub fn commit(&mut self, m: &Manifest) -> Result<()> {
        if self.finished {
            return Err(CoreError::InvalidArgument(
                "this save transaction has already ended".into(),
            ));
        }
        check_commit(m, &self.save_id)?;
        self.check_lease()?;
        let tmp = self.dir.join(format!("{TMP_PREFIX}{}", self.save_id));
        let bytes = m.encode();
        if let Err(e) = fsops::write_new(&tmp, &bytes) {
            let _ = fsops::remove_file(&tmp);
            return Err(CoreError::io(&tmp, e));
        }
        self.check_lease()?;
        let dst = self.dir.join(MANIFEST_NAME);
        fsops::rename(&tmp, &dst).map_err(|e| CoreError::io(&dst, e))?;
        self.finished = true;
        sync_dir(&self.dir)?;
        let id = self.save_id.clone();
        remove_saves(&self.dir, |other| other != id);
        self.release();
        Ok(())
    }

    /// Removes this save's data and temp manifest and releases the lease; the checkpoint that was
    /// committed before it is untouched.
    pub fn abort(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let id = self.save_id.clone();
        remove_saves(&self.dir, |other| other == id);
        let _ = fsops::remove_file(&self.dir.join(format!("{TMP_PREFIX}{}", self.save_id)));
        self.release();
    }

    fn check_lease(&self) -> Result<()> {
        let lease = self.dir.join(LEASE_NAME);
        let ours = read_lease(&lease).is_ok_and(|(t, _)| t == self.token);
        if ours && !self.heartbeat.lost.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(CoreError::Locked {
            path: self.dir.clone(),
            reason: "this save's lease was broken by another writer (its heartbeat stalled past \
                     the lease timeout); nothing was committed"
                .into(),
        })
    }

    fn release(&mut self) {
        self.heartbeat.stop();
        let lease = self.dir.join(LEASE_NAME);
        if read_lease(&lease).is_ok_and(|(t, _)| t == self.token) {
            let _ = fsops::remove_file(&lease);
        }
    }
}

impl Transaction for SaveTxn {
    fn save_id(&self) -> &str {
        &self.save_id
    }
    fn name(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }
    fn commit(&mut self, m: &Manifest) -> Result<()> {
        SaveTxn::commit(self, m)
    }
    fn abort(&mut self) {
        SaveTxn::abort(self)
    }
}

impl Drop for SaveTxn {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Takes the lease at `path` with `O_EXCL`, breaking it first if its holder is dead (no heartbeat
/// for `timeout`, or a local process that no longer exists).
fn acquire(path: &Path, token: &str, save_id: &str, timeout: Duration) -> Result<()> {
    for _ in 0..3 {
        match fsops::write_new(path, token.as_bytes()) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(CoreError::io(path, e)),
        }
        let (held_by, md) = match read_lease(path) {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(CoreError::io(path, e)),
        };
        if !md.is_file() {
            return Err(CoreError::InvalidArgument(format!(
                "{}: not a regular file; refusing to save there",
                path.display()
            )));
        }
        let mtime = SystemTime::UNIX_EPOCH + Duration::from_secs(md.mtime().max(0) as u64);
        let age = SystemTime::now()
            .duration_since(mtime)
            .unwrap_or(Duration::ZERO);
        if age <= timeout && !owner_is_dead_here(&held_by) {
            return Err(CoreError::Locked {
                path: path.parent().unwrap_or(path).to_path_buf(),
                reason: format!(
                    "another save holds its lease ({held_by}, heartbeat {}s ago); a lease \
                     without a heartbeat for {}s belongs to a dead writer and is taken over",
                    age.as_secs(),
                    timeout.as_secs()
                ),
            });
        }
        // Break the dead writer's lease: move it aside (atomic), then try again.
        let aside = path.with_file_name(format!("{STALE_LEASE_PREFIX}{save_id}"));
        if fsops::rename(path, &aside).is_ok() {
            let _ = fsops::remove_file(&aside);
        }
    }
    Err(CoreError::Locked {
        path: path.parent().unwrap_or(path).to_path_buf(),
        reason: "could not take the save lease (contended)".into(),
    })
}

/// The save ids whose data directories `m` names.
fn live_save_ids(m: &Manifest) -> Vec<String> {
    let mut ids: Vec<String> = m
        .files
        .iter()
        .filter_map(|f| f.path.strip_prefix("data/")?.split('/').next())
        .map(str::to_string)
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Removes `data/<id>` for every id `doomed` selects whose directory provably holds only data
/// this store wrote. Best effort: what cannot be removed stays for the next save.
fn remove_saves(dir: &Path, doomed: impl Fn(&str) -> bool) {
    let data = dir.join(DATA_DIR);
    if !fs::symlink_metadata(&data).is_ok_and(|m| m.is_dir()) {
        return;
    }
    let Ok(entries) = fs::read_dir(&data) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if e.file_name().to_str().is_some_and(&doomed) && is_our_save_dir(&p) {
            let _ = fsops::remove_dir_all(&p);
        }
    }
}

/// Removes the temp manifests and moved-aside leases that saves which died left in `dir`.
fn remove_leftover_files(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let leftover = name.to_str().is_some_and(|n| {
            [TMP_PREFIX, STALE_LEASE_PREFIX]
                .iter()
                .any(|prefix| n.strip_prefix(prefix).is_some_and(is_save_id))
        });
        if leftover && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = fsops::remove_file(&e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_save_id("0123456789abcdef0123456789abcdef"));
        assert!(!is_save_id("0123456789ABCDEF0123456789abcdef"));
        assert!(!is_save_id("sim"));
        assert!(is_data_file("rank-00003.bin"));
        assert!(is_data_file("rank-00003-001.bin"));
        assert!(is_data_file("import-00000.bin"));
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            data_file_name(id, 3, 0),
            format!("data/{id}/rank-00003.bin")
        );
        assert_eq!(
            data_file_name(id, 3, 1),
            format!("data/{id}/rank-00003-001.bin")
        );
        for (rank, part) in [(0, 0), (7, 2), (123_456, 1000)] {
            let name = data_file_name(id, rank, part);
            let (dir, file) = name.rsplit_once('/').unwrap();
            assert!(
                dir == format!("data/{id}") && is_save_id(id) && is_data_file(file),
                "{name}"
            );
        }
        assert!(!is_data_file("train.jsonl"));
        assert!(!is_data_file("rank.bin"));
        assert!(!is_data_file("-1.bin"));
    }
}
