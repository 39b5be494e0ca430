//! Every crash state of a save to an object store, checked. An object store has no fsync and no
//! reordering: each request that changes it (a PUT, a conditional PUT, the completion of a
//! multipart upload, a DELETE) is atomic, and a crash leaves the store as some prefix of the
//! requests left it. The save runs on an in-memory store (uploading in small parts, so data objects
//! go up as multipart uploads) through a recording [`Storage`]; each prefix of its requests is
//! replayed onto a fresh store from the objects that were there before, and the invariant of
//! `crash_states.rs` is checked on it: the prefix opens as the old checkpoint or the committed one,
//! bit-exact, a foreign object is never touched, and the next save leaves exactly its checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use olmo_chunks_core::object::ObjectStorage;
use olmo_chunks_core::storage::HeadCheck;
use olmo_chunks_core::txn::{data_file_name, LEASE_NAME};
use olmo_chunks_core::{
    verify_from, Entry, Head, IoCounters, Manifest, Object, PutIf, Result, SaveOptions, SaveTxn,
    Storage, Version, MANIFEST_NAME,
};

use crate::common::{salted_chunk_data, write_rolled, SavedTensor};

const FOREIGN: &str = "model.pt";
const BLOCK: u64 = 16;
/// Parts of this many bytes: every data object here is a multipart upload.
const PART: u64 = 64;

/// The objects of a store.
type Objects = BTreeMap<String, Vec<u8>>;

/// A request that changed the store.
#[derive(Clone, Debug)]
enum Req {
    Put(String, Vec<u8>),
    Delete(String),
}

/// A storage recording the requests that change it, in the order they completed.
struct Recorder {
    inner: ObjectStorage,
    log: Arc<Mutex<Vec<Req>>>,
}

impl Recorder {
    fn record(&self, r: Req) {
        self.log.lock().unwrap().push(r);
    }

    fn put(&self, rel: &str, bytes: &[u8], v: Result<Option<Version>>) -> Result<Option<Version>> {
        if let Ok(Some(_)) = &v {
            self.record(Req::Put(rel.into(), bytes.to_vec()));
        }
        v
    }
}

/// A data object being written: its bytes are recorded when its upload completes.
struct RecordedObject {
    inner: Box<dyn Object>,
    rel: String,
    bytes: Mutex<Vec<u8>>,
    log: Arc<Mutex<Vec<Req>>>,
}

impl Object for RecordedObject {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        self.inner.read_exact_at(bufs, offset)
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.bytes.lock().unwrap()[offset as usize..][..data.len()].copy_from_slice(data);
        self.inner.write_all_at(data, offset)
    }
    fn pad(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.pad(offset, len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()?;
        let bytes = self.bytes.lock().unwrap().clone();
        self.log
            .lock()
            .unwrap()
            .push(Req::Put(self.rel.clone(), bytes));
        Ok(())
    }
}

impl Storage for Recorder {
    fn name(&self, rel: &str) -> PathBuf {
        self.inner.name(rel)
    }
    fn open(&self, rel: &str) -> Result<Box<dyn Object>> {
        self.inner.open(rel)
    }
    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        self.inner.get(rel)
    }
    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        self.inner.get_checked(rel, peek, check)
    }
    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>> {
        Ok(Box::new(RecordedObject {
            inner: self.inner.create(rel, size)?,
            rel: rel.into(),
            bytes: Mutex::new(vec![0; size as usize]),
            log: self.log.clone(),
        }))
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
        self.inner.get_with_head(rel, peek, check)
    }
    fn list(&self, prefix: &str, deep: bool) -> Result<Vec<Entry>> {
        self.inner.list(prefix, deep)
    }
    fn delete(&self, rel: &str) -> Result<()> {
        self.inner.delete(rel)?;
        self.record(Req::Delete(rel.into()));
        Ok(())
    }
    fn put_if(&self, rel: &str, bytes: &[u8], cond: PutIf<'_>) -> Result<Option<Version>> {
        self.put(rel, bytes, self.inner.put_if(rel, bytes, cond))
    }
    fn publish(
        &self,
        rel: &str,
        bytes: &[u8],
        cond: PutIf<'_>,
        ready: &dyn Fn() -> Result<()>,
    ) -> Result<Option<Version>> {
        self.put(rel, bytes, self.inner.publish(rel, bytes, cond, ready))
    }
    fn touch_if(&self, rel: &str, bytes: &[u8], version: &Version) -> Result<Option<Version>> {
        self.put(rel, bytes, self.inner.touch_if(rel, bytes, version))
    }
}

fn tensors() -> Vec<SavedTensor> {
    let rows = |o: u64, n: u64| olmo_chunks_core::Region::Box {
        offsets: vec![o, 0],
        sizes: vec![n, 6],
    };
    vec![SavedTensor {
        key: "a".into(),
        dtype: "float32".into(),
        shape: vec![6, 6],
        regions: vec![rows(0, 2), rows(2, 2), rows(4, 2)],
    }]
}

/// A committed checkpoint: its save id and the bytes of its chunks, in manifest order.
#[derive(Clone, Debug)]
struct Saved {
    save_id: String,
    data: Vec<Vec<u8>>,
}

/// Saves the tensors (bytes xored by `salt`) to `s`, one data object per chunk, written one
/// after another as a rank rolls its data files (`SaveSession`: import-dcp, import-hf); commits
/// or aborts.
fn save(s: Arc<dyn Storage>, salt: u8, commit: bool, lease_timeout: Duration) -> Saved {
    let tensors = tensors();
    let data = salted_chunk_data(&tensors, salt);
    let opts = SaveOptions {
        overwrite: true,
        lease_timeout,
    };
    let mut txn = SaveTxn::begin_on(s.clone(), opts).unwrap();
    let m = write_rolled(&*s, &txn, &tensors, &data, BLOCK);
    if commit {
        txn.commit(&m).unwrap();
    } else {
        txn.abort();
    }
    Saved {
        save_id: m.save_id,
        data,
    }
}

fn snapshot(s: &dyn Storage) -> Objects {
    s.list("", true)
        .unwrap()
        .into_iter()
        .map(|e| (e.rel().to_string(), s.get(e.rel()).unwrap()))
        .collect()
}

fn materialize(objects: &Objects) -> Arc<dyn Storage> {
    let s = ObjectStorage::in_memory(PART).unwrap();
    for (rel, bytes) in objects {
        s.put_if(rel, bytes, PutIf::Absent).unwrap().unwrap();
    }
    Arc::new(s)
}

/// The invariant on one crash state; `Err` says how it is broken.
fn check(
    objects: &Objects,
    saves: &[Saved],
    none_allowed: bool,
    foreign: &[u8],
) -> std::result::Result<(), String> {
    if objects.get(FOREIGN).map(Vec::as_slice) != Some(foreign) {
        return Err(format!("{FOREIGN} was changed or removed"));
    }
    let s = materialize(objects);
    match Manifest::open_from(&*s) {
        Ok(m) => {
            let Some(v) = saves.iter().find(|v| v.save_id == m.save_id) else {
                return Err(format!(
                    "a manifest of save {}, which never committed",
                    m.save_id
                ));
            };
            verify_from(&*s, &m, 1, None).map_err(|e| format!("opens as {}: {e}", m.save_id))?;
            for (c, ch) in m.chunks.iter().enumerate() {
                let file = &objects[&m.files[ch.file as usize].path];
                if file[ch.offset as usize..][..ch.len as usize] != v.data[c][..] {
                    return Err(format!("chunk {c} of {} is not the bytes saved", m.save_id));
                }
            }
        }
        Err(_) if none_allowed && !objects.contains_key(MANIFEST_NAME) => {}
        Err(e) => return Err(format!("the checkpoint was lost: {e}")),
    }
    // The next save (a crashed writer's lease is stale to it) leaves only its own checkpoint.
    // The lease as the next save finds it once its holder's own timeout has passed (this store's
    // clock cannot be moved forward): that timeout lowered to the next save's.
    if let Some(lease) = objects.get(LEASE_NAME) {
        if let Ok(mut owner) = serde_json::from_slice::<serde_json::Value>(lease) {
            owner["lease_timeout_s"] = 0.001.into();
            s.delete(LEASE_NAME).unwrap();
            s.put_if(LEASE_NAME, owner.to_string().as_bytes(), PutIf::Absent)
                .unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(2));
    let next = save(s.clone(), 0x5a, true, Duration::from_millis(1));
    let mut expected: Vec<String> = (0..3)
        .map(|p| data_file_name(&next.save_id, 0, p))
        .collect();
    expected.extend([FOREIGN.to_string(), MANIFEST_NAME.to_string()]);
    expected.sort();
    let found: Vec<String> = snapshot(&*s).into_keys().collect();
    if found != expected {
        return Err(format!("after the next save: {found:?}, not {expected:?}"));
    }
    if snapshot(&*s)[FOREIGN] != foreign {
        return Err(format!("the next save changed {FOREIGN}"));
    }
    Ok(())
}

/// Records the save `run` makes on a store prepared by `setup`, checks the state after every
/// prefix of its requests; returns (requests, states checked).
fn scenario(
    name: &str,
    setup: impl FnOnce(Arc<dyn Storage>) -> Vec<Saved>,
    run: impl FnOnce(Arc<dyn Storage>) -> Option<Saved>,
) -> (usize, usize) {
    let foreign = b"torch.save bytes: never touched".to_vec();
    let base: Arc<dyn Storage> = Arc::new(ObjectStorage::in_memory(PART).unwrap());
    base.put_if(FOREIGN, &foreign, PutIf::Absent).unwrap();
    let mut saves = setup(base.clone());
    let none_allowed = saves.is_empty();
    let initial = snapshot(&*base);
    let log = Arc::new(Mutex::new(Vec::new()));
    let recorder = Arc::new(Recorder {
        inner: ObjectStorage::in_memory(PART).unwrap(),
        log: log.clone(),
    });
    for (rel, bytes) in &initial {
        recorder.inner.put_if(rel, bytes, PutIf::Absent).unwrap();
    }
    saves.extend(run(recorder));
    let reqs = log.lock().unwrap().clone();
    let mut state = initial;
    let mut violations = Vec::new();
    for k in 0..=reqs.len() {
        if k > 0 {
            match &reqs[k - 1] {
                Req::Put(rel, bytes) => state.insert(rel.clone(), bytes.clone()),
                Req::Delete(rel) => state.remove(rel),
            };
        }
        if let Err(e) = check(&state, &saves, none_allowed, &foreign) {
            violations.push(format!("after {k} requests: {e}"));
        }
    }
    println!(
        "object-store crash states, {name}: {} requests, {} states checked, {} violations",
        reqs.len(),
        reqs.len() + 1,
        violations.len()
    );
    assert!(violations.is_empty(), "{name}: {violations:#?}");
    (reqs.len(), reqs.len() + 1)
}

const LEASE: Duration = Duration::from_secs(30);

#[test]
fn first_save() {
    let (requests, _) = scenario(
        "first save",
        |_| Vec::new(),
        |s| Some(save(s, 1, true, LEASE)),
    );
    assert!(requests >= 6, "{requests}");
}

#[test]
fn overwrite_save() {
    scenario(
        "overwrite",
        |s| vec![save(s, 1, true, LEASE)],
        |s| Some(save(s, 2, true, LEASE)),
    );
}

#[test]
fn failed_save() {
    scenario(
        "failed save",
        |s| vec![save(s, 1, true, LEASE)],
        |s| {
            save(s, 2, false, LEASE);
            None
        },
    );
}

#[test]
fn save_over_a_killed_writers_leftovers() {
    scenario(
        "killed writer's leftovers",
        |s| {
            let old = save(s.clone(), 1, true, LEASE);
            // What a writer killed mid-save leaves: its lease and some of its data objects.
            let dead = "0123456789abcdef0123456789abcdef";
            s.put_if(&data_file_name(dead, 0, 0), &[7u8; 100], PutIf::Absent)
                .unwrap();
            s.put_if(
                LEASE_NAME,
                format!("{{\"save_id\": \"{dead}\"}}").as_bytes(),
                PutIf::Absent,
            )
            .unwrap();
            vec![old]
        },
        |s| {
            std::thread::sleep(Duration::from_millis(2));
            Some(save(s, 2, true, Duration::from_millis(1)))
        },
    );
}
