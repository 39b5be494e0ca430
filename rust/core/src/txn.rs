//! The save transaction, one for every storage: an exclusive lease on the checkpoint, the atomic
//! commit of the manifest, and cleanup limited to what provably belongs to this store's failed or
//! superseded saves. The invariant (docs/FORMAT.md, "Saves"): at every moment the checkpoint's
//! location holds one complete checkpoint or none, and a save that returned success stays loadable
//! until another save to the same location succeeds. [`SaveTxn`] is built from the primitives of
//! [`Storage`] (head, list, delete, conditional put, publish), which a local filesystem and an
//! object store each implement; every door drives its save through it.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::error::{is_own_shortage, CoreError, Result};
use crate::fsops;
use crate::load::check_manifest_coverage;
use crate::manifest::{Manifest, MANIFEST_NAME};
use crate::save::{assemble_manifest, SavedChunk, TensorSchema};
use crate::storage::{Entry, Head, LocalFs, PutIf, Storage, Version};
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
/// While data object `<name>` is a multipart upload in progress, `<name>` + this holds the
/// upload's id (object stores only), so that the cleanup of a writer killed mid-upload can abort
/// it: object stores keep an incomplete upload's parts (and bill them) until it is aborted.
pub const UPLOAD_SUFFIX: &str = ".upload";
/// A probe object `<this><save_id>`, written and removed to read the storage's clock (the time it
/// stamps objects with), against which a lease's age is judged.
pub const CLOCK_PREFIX: &str = ".olmo_chunks.clock-";

/// How a save treats the directory it writes to.
#[derive(Clone, Copy, Debug)]
pub struct SaveOptions {
    /// Replace a checkpoint already committed at the path (otherwise refused).
    pub overwrite: bool,
    /// A lease whose heartbeat is older than this belongs to a dead writer and may be broken.
    pub lease_timeout: Duration,
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

/// True for the names of the markers of uploads in progress: a data file's name + [`UPLOAD_SUFFIX`].
pub(crate) fn is_upload_marker(name: &str) -> bool {
    name.strip_suffix(UPLOAD_SUFFIX).is_some_and(is_data_file)
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
pub(crate) fn owner_token(save_id: &str, lease_timeout: Duration) -> String {
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
        "lease_timeout_s": lease_timeout.as_secs_f64(),
    })
    .to_string()
}

/// The lease timeout the holder of lease `token` keeps its heartbeat within (the owner JSON's
/// `lease_timeout_s`, at most a day; zero when absent, as in leases of older writers).
fn holder_timeout(token: &str) -> Duration {
    let theirs = serde_json::from_str::<serde_json::Value>(token).ok();
    let secs = theirs.as_ref().and_then(|v| v["lease_timeout_s"].as_f64());
    secs.and_then(|s| Duration::try_from_secs_f64(s.min(86_400.0)).ok())
        .unwrap_or(Duration::ZERO)
}

/// True if the lease `token` was written by a process of this machine and pid namespace that no
/// longer exists.
pub(crate) fn owner_is_dead_here(token: &str) -> bool {
    let (Ok(theirs), Ok(ours)) = (
        serde_json::from_str::<serde_json::Value>(token),
        serde_json::from_str::<serde_json::Value>(&owner_token("", Duration::ZERO)),
    ) else {
        return false;
    };
    let same = ["host", "boot_id", "pid_ns"]
        .iter()
        .all(|k| theirs.get(k).is_some() && theirs.get(k) == ours.get(k));
    let pid = theirs.get("pid").and_then(|p| p.as_u64()).unwrap_or(0);
    same && pid > 0 && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Renews a lease from a thread every `every` until stopped; `lost` once a renewal finds that the
/// lease is no longer ours (the thread then stops renewing).
pub(crate) struct Heartbeat {
    stop: Arc<(Mutex<bool>, Condvar)>,
    pub(crate) lost: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// `renew` renews the lease and returns whether it is still ours. Fails where no thread can
    /// be started (a limit on threads or memory).
    pub(crate) fn start(
        every: Duration,
        mut renew: impl FnMut() -> bool + Send + 'static,
    ) -> Result<Self> {
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
            .map_err(CoreError::no_thread)?;
        Ok(Heartbeat {
            stop,
            lost,
            thread: Some(thread),
        })
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

/// Where `path` leads: itself, or what the symbolic link at `path` names (followed through at
/// most 40 links, as the kernel does).
fn link_target(path: &Path) -> PathBuf {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match fs::read_link(&p) {
            Ok(next) => p = p.parent().unwrap_or(Path::new("")).join(next),
            Err(_) => break,
        }
    }
    p
}

/// Whether `path` or a directory above it is a symbolic link whose target does not exist.
fn dangling_link_on(path: &Path) -> bool {
    path.ancestors().any(|p| {
        fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
            && fs::metadata(p).is_err()
    })
}

/// One save into a checkpoint on some storage, from the lease to the commit (or the abort).
pub struct SaveTxn {
    storage: Arc<dyn Storage>,
    save_id: String,
    token: String,
    /// The committed manifest's version when the save began (`None`: there was none).
    replaces: Option<Version>,
    /// The lease's version as this save last wrote it.
    lease: Arc<Mutex<Version>>,
    heartbeat: Heartbeat,
    finished: bool,
    /// Its manifest was published.
    committed: bool,
}

impl SaveTxn {
    /// Begins a save into directory `dir` (made if missing; anything else at that path is
    /// refused). See [`SaveTxn::begin_on`].
    pub fn begin(dir: &Path, opts: SaveOptions) -> Result<Self> {
        let found = match fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A symbolic link made before its target (`ln -s /scratch/run1 ckpt`): the
                // target is made.
                fsops::create_dir_all(&link_target(dir)).and_then(|()| fs::metadata(dir))
            }
            found => found,
        };
        match found {
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(CoreError::InvalidArgument(format!(
                    "{}: exists and is not a directory",
                    dir.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Where no link dangles, a directory on the path refuses new entries (/proc).
                let why = if dangling_link_on(dir) {
                    ": a symbolic link on its path leads nowhere"
                } else {
                    ""
                };
                return Err(CoreError::InvalidArgument(format!(
                    "{}: cannot make the checkpoint directory{why} ({e})",
                    dir.display()
                )));
            }
            Err(e) => return Err(CoreError::io(dir, e)),
        }
        Self::begin_on(Arc::new(LocalFs::new(dir)), opts)
    }

    /// Takes the lease of the checkpoint in `storage` and checks what is there: refuses a
    /// committed checkpoint unless `overwrite`, a lease held by a live writer
    /// (`CoreError::Locked`), and a `data/` that is not this store's; removes what failed saves
    /// left.
    pub fn begin_on(storage: Arc<dyn Storage>, opts: SaveOptions) -> Result<Self> {
        let save_id = new_save_id()?;
        let token = owner_token(&save_id, opts.lease_timeout);
        let lease = Arc::new(Mutex::new(acquire(&*storage, &token, opts.lease_timeout)?));
        let every = (opts.lease_timeout / 4).max(Duration::from_millis(100));
        let heartbeat = {
            let (storage, token, lease) = (storage.clone(), token.clone(), lease.clone());
            Heartbeat::start(every, move || {
                let version = lease.lock().unwrap().clone();
                match storage.touch_if(LEASE_NAME, token.as_bytes(), &version) {
                    Ok(Some(v)) => *lease.lock().unwrap() = v,
                    Ok(None) => return false,
                    Err(_) => {} // tried again next beat
                }
                true
            })
        };
        let heartbeat = match heartbeat {
            Ok(h) => h,
            Err(e) => {
                let _ = storage.delete(LEASE_NAME);
                return Err(e);
            }
        };
        let mut txn = SaveTxn {
            storage,
            save_id,
            token,
            replaces: None,
            lease,
            heartbeat,
            finished: false,
            committed: false,
        };
        txn.prepare(opts.overwrite)?;
        Ok(txn)
    }

    fn prepare(&mut self, overwrite: bool) -> Result<()> {
        let s = &*self.storage;
        self.replaces = s.head(MANIFEST_NAME)?.map(|h| h.version);
        let committed = self.replaces.is_some();
        if committed && !overwrite {
            return Err(CoreError::Exists { path: s.name("") });
        }
        let saves = Saves::list(s)?;
        let foreign = saves.foreign(committed);
        if !foreign.is_empty() {
            return Err(CoreError::InvalidArgument(format!(
                "{}: refusing to save there: its data/ holds entries this store did not write \
                 (found {}); nothing was changed",
                s.name("").display(),
                foreign.join(", ")
            )));
        }
        // What earlier saves left: data no committed manifest names, temp manifests, moved-aside
        // leases. If the manifest cannot be read, keep all data (it may be what it names).
        let live = if committed {
            Manifest::open_from(s).ok().map(|m| live_save_ids(&m))
        } else {
            Some(Vec::new())
        };
        if let Some(live) = live {
            saves.remove(s, |id| !live.iter().any(|l| l == id));
        }
        remove_leftover_files(s);
        Ok(())
    }

    /// Whether this save's manifest was published (by [`SaveTxn::commit`], whatever befell
    /// its caller after).
    pub fn is_committed(&self) -> bool {
        self.committed
    }

    pub fn save_id(&self) -> &str {
        &self.save_id
    }

    /// What `rel` of the checkpoint is called in errors.
    pub fn name(&self, rel: &str) -> PathBuf {
        self.storage.name(rel)
    }

    /// `data/<save_id>`, relative to the checkpoint: where this save's files go.
    pub fn data_prefix(&self) -> String {
        format!("{DATA_DIR}/{}", self.save_id)
    }

    /// Commits `m` (which must name only this save's data files) atomically, then removes the data
    /// of the saves it supersedes and releases the lease. The manifest is published only while
    /// the lease is still this save's and the committed manifest is still the one the save began
    /// over: of two saves racing to one location, at most one commits.
    pub fn commit(&mut self, m: &Manifest) -> Result<()> {
        check_commit(m, &self.save_id)?;
        self.publish(m, &|| Ok(()))
    }

    /// [`SaveTxn::commit`] of a manifest `check_commit` has passed, once `ready()`, asked last
    /// before the manifest is published, did not fail.
    fn publish(&mut self, m: &Manifest, ready: &dyn Fn() -> Result<()>) -> Result<()> {
        if self.finished {
            return Err(CoreError::InvalidArgument(
                "this save transaction has already ended".into(),
            ));
        }
        let cond = match &self.replaces {
            Some(v) => PutIf::Version(v),
            None => PutIf::Absent,
        };
        let published = self.storage.publish(MANIFEST_NAME, &m.encode(), cond, &|| {
            self.check_lease()?;
            ready()
        });
        // A failure after the manifest became visible (a directory fsync, a lost response) is a
        // commit; so is a refused condition after a retry of a PUT that had landed. One whose
        // outcome is unknown (the check failed too, or an object store's PUT failed without an
        // answer and may still land) keeps the data and leaves the lease to lapse, so that no
        // save removes the data before that PUT can no longer land; the next save removes it if
        // no manifest names it.
        match published {
            Ok(Some(_)) => {}
            Ok(None) => match self.committed() {
                Ok(true) => {}
                Ok(false) => {
                    return Err(CoreError::Locked {
                        path: self.storage.name(""),
                        reason: "another save committed a checkpoint here while this one ran; \
                                 nothing was committed"
                            .into(),
                    })
                }
                Err(e) => return Err(self.unknown_outcome(e)),
            },
            Err(e) => {
                let late = self.storage.writes_land_late() && crate::object::indefinite(&e);
                match self.committed() {
                    Ok(true) => {}
                    Ok(false) if !late => return Err(e),
                    _ => return Err(self.unknown_outcome(e)),
                }
            }
        }
        (self.finished, self.committed) = (true, true);
        let id = self.save_id.clone();
        if let Ok(saves) = Saves::list(&*self.storage) {
            saves.remove(&*self.storage, |other| other != id);
        }
        self.release();
        Ok(())
    }

    /// Assembles the manifest of this save from its parts, validates it as every reader does and
    /// commits it (see [`SaveTxn::commit`]) once `ready()` did not fail: it is asked after
    /// everything else, right before the manifest is renamed into place or PUT (a coordinator
    /// checks there that it was not frozen while the others gave up on it).
    pub fn commit_parts(
        &mut self,
        block_size: u64,
        tensors: Vec<TensorSchema>,
        chunks: Vec<SavedChunk>,
        entries: Box<RawValue>,
        info: Box<RawValue>,
        ready: &dyn Fn() -> Result<()>,
    ) -> Result<Manifest> {
        let m = assemble_manifest(&self.save_id, block_size, tensors, chunks, entries, info)?;
        // Checked first: what the decoder refuses as a corrupt file is the parts' error here.
        check_commit(&m, &self.save_id)?;
        let m = Manifest::decode(&m.encode(), &self.name(MANIFEST_NAME))?;
        self.publish(&m, ready)?;
        Ok(m)
    }

    /// Removes this save's data and releases the lease; the checkpoint that was committed before
    /// it is untouched.
    pub fn abort(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let _ = self.storage.delete_all(&self.data_prefix());
        self.release();
    }

    /// Whether this save's manifest is the one committed, asked with the full retry budget (an
    /// object store's recent failure cuts other requests short: `object::with_full_budget`).
    fn committed(&self) -> Result<bool> {
        match crate::object::with_full_budget(|| Manifest::open_from(&*self.storage)) {
            Ok(m) => Ok(m.save_id == self.save_id),
            Err(CoreError::NotACheckpoint { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn holds_lease(&self) -> Result<bool> {
        Ok(read_lease(&*self.storage)?.is_some_and(|(t, _)| t == self.token.as_bytes()))
    }

    /// `CoreError::Locked` where another save took this one's lease over (its heartbeat stalled past
    /// the lease timeout): whatever this save does after that fails, for that reason.
    pub fn check_lease(&self) -> Result<()> {
        if self.holds_lease()? && !self.heartbeat.lost.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(CoreError::Locked {
            path: self.storage.name(""),
            reason: "this save's lease was taken over by another writer (its heartbeat stalled \
                     past the lease timeout); nothing was committed"
                .into(),
        })
    }

    /// Ends a save whose commit may or may not have happened: its data is kept, and its lease
    /// left to lapse (its heartbeat stopped) rather than released.
    fn unknown_outcome(&mut self, e: CoreError) -> CoreError {
        self.finished = true;
        self.heartbeat.stop();
        may_have_committed(e)
    }

    fn release(&mut self) {
        self.heartbeat.stop();
        let ours = match self.holds_lease() {
            Ok(ours) => ours,
            // No file descriptor left to read it: its version tells whether it is still the one
            // this save wrote (a `stat` needs none).
            Err(CoreError::Io { source, .. }) if is_own_shortage(&source) => {
                let version = self.lease.lock().unwrap();
                matches!(self.storage.head(LEASE_NAME), Ok(Some(h)) if h.version == *version)
            }
            Err(_) => false,
        };
        if ours {
            let _ = self.storage.delete(LEASE_NAME);
        }
    }
}

impl Drop for SaveTxn {
    fn drop(&mut self) {
        self.abort();
    }
}

/// `e` of a manifest write, saying that the save may have committed.
fn may_have_committed(e: CoreError) -> CoreError {
    match e {
        CoreError::Io { path, source } => CoreError::Io {
            path,
            source: io::Error::new(
                source.kind(),
                format!(
                    "{source}; the save may have committed (the manifest write failed without a \
                     definite answer): its data is kept, and a load tells which save the \
                     checkpoint holds"
                ),
            ),
        },
        other => other,
    }
}

/// The lease's token and head (`None` if there is none); one larger than a lease can be is
/// refused unread.
fn read_lease(s: &dyn Storage) -> Result<Option<(Vec<u8>, Head)>> {
    s.get_with_head(LEASE_NAME, 0, &|_, size| {
        if size <= MAX_LEASE_LEN {
            return Ok(());
        }
        Err(CoreError::InvalidArgument(format!(
            "{}: {size} bytes, not an olmo-chunks lease (at most {MAX_LEASE_LEN}); refusing to \
             save there",
            s.name(LEASE_NAME).display()
        )))
    })
}

/// Creates the lease (only if absent), taking it over from a dead writer (no heartbeat for
/// `timeout`, or a local process that no longer exists) with a write conditional on the version
/// that writer left, so that two savers cannot both take it. Returns the lease's version.
fn acquire(s: &dyn Storage, token: &str, timeout: Duration) -> Result<Version> {
    for _ in 0..3 {
        if let Some(v) = s.put_if(LEASE_NAME, token.as_bytes(), PutIf::Absent)? {
            return Ok(v);
        }
        let Some((held, head)) = read_lease(s)? else {
            continue;
        };
        let held = String::from_utf8_lossy(&held).into_owned();
        // The heartbeat's age on the clock that stamped it: a writer whose clock runs ahead of
        // the server's must not break a live lease.
        let age = s
            .clock()?
            .duration_since(head.modified)
            .unwrap_or(Duration::ZERO);
        // A holder with a longer timeout than ours beats less often: judged by its own.
        let timeout = timeout.max(holder_timeout(&held));
        if age <= timeout && !owner_is_dead_here(&held) {
            return Err(CoreError::Locked {
                path: s.name(""),
                reason: format!(
                    "another save holds its lease ({held}, heartbeat {}s ago); a lease without a \
                     heartbeat for {}s belongs to a dead writer and is taken over",
                    age.as_secs(),
                    timeout.as_secs()
                ),
            });
        }
        if let Some(v) = s.put_if(LEASE_NAME, token.as_bytes(), PutIf::Version(&head.version))? {
            return Ok(v);
        }
    }
    Err(CoreError::Locked {
        path: s.name(""),
        reason: "could not take the save lease (contended)".into(),
    })
}

/// What `data/` holds, by save: the saves whose entries are all this store's (a real directory
/// named by a save id holding only data files, or on an object store only objects so named), and
/// the entries that are not.
struct Saves {
    ours: Vec<String>,
    foreign: Vec<String>,
    /// `data` itself is not a real directory (a symbolic link, a file): never written through.
    not_a_dir: bool,
}

impl Saves {
    fn list(s: &dyn Storage) -> Result<Saves> {
        let mut ours: Vec<String> = Vec::new();
        let mut bad: Vec<String> = Vec::new();
        let mut not_a_dir = false;
        let prefix = format!("{DATA_DIR}/");
        for e in s.list(DATA_DIR, true)? {
            let Some(rest) = e.rel().strip_prefix(&prefix) else {
                not_a_dir |= e.rel() == DATA_DIR;
                continue;
            };
            let (id, file) = match rest.split_once('/') {
                Some((id, file)) => (id, Some(file)),
                None => (rest, None),
            };
            let good = is_save_id(id)
                && match (&e, file) {
                    (Entry::Dir(_), None) => true,
                    (Entry::Object(_), Some(f)) => is_data_file(f) || is_upload_marker(f),
                    _ => false,
                };
            let id = id.to_string();
            if !good {
                bad.push(id.clone());
            }
            if !ours.contains(&id) {
                ours.push(id);
            }
        }
        ours.retain(|id| !bad.contains(id));
        bad.sort();
        bad.dedup();
        Ok(Saves {
            ours,
            foreign: bad.into_iter().map(|n| format!("{DATA_DIR}/{n}")).collect(),
            not_a_dir,
        })
    }

    /// What conflicts with the store's own names: a `data/` that is not a real directory and,
    /// without a committed manifest, entries of `data/` that are not this store's saves.
    /// Anything else may sit beside a checkpoint (a `model.pt` converted into it, a README) and
    /// is never touched.
    fn foreign(&self, committed: bool) -> Vec<String> {
        if self.not_a_dir {
            return vec![format!("{DATA_DIR} (not a directory)")];
        }
        if committed {
            Vec::new()
        } else {
            self.foreign.clone()
        }
    }

    /// Removes the data of every save of this store's that `doomed` selects. Best effort: what
    /// cannot be removed stays for the next save.
    fn remove(&self, s: &dyn Storage, doomed: impl Fn(&str) -> bool) {
        if self.not_a_dir {
            return;
        }
        for id in self.ours.iter().filter(|id| doomed(id)) {
            let _ = s.delete_all(&format!("{DATA_DIR}/{id}"));
        }
    }
}

/// Removes the temp manifests, moved-aside leases and clock probes that saves which died left.
fn remove_leftover_files(s: &dyn Storage) {
    let Ok(entries) = s.list("", false) else {
        return;
    };
    for e in entries {
        let Entry::Object(name) = e else {
            continue;
        };
        let leftover = [TMP_PREFIX, STALE_LEASE_PREFIX, CLOCK_PREFIX]
            .iter()
            .any(|prefix| name.strip_prefix(prefix).is_some_and(is_save_id));
        if leftover {
            let _ = s.delete(&name);
        }
    }
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
        assert!(is_upload_marker("rank-00003-001.bin.upload"));
        assert!(!is_upload_marker("rank-00003.bin"));
        assert!(!is_upload_marker("notes.upload"));
    }
}
