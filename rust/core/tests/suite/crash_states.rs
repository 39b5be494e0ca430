//! Every crash state of a save, checked. A save's changes to the disk are recorded (`fsops`
//! journal: mkdir, create, write, truncate, fsync, rename, unlink, rmdir, directory fsync), then
//! each crash state is rebuilt from the directory as it was before the save: each prefix of the
//! operations, with the not-yet-durable ones among them kept or dropped as a filesystem may
//! after a power cut:
//! - POSIX: any subset of them (a file's data is durable once the file is fsynced, a name once
//!   its directory is); all subsets when there are at most 10, else a sample;
//! - ext4 `data=ordered`: the journal commits in order, so what survives is an in-order prefix,
//!   plus any of the later data writes (flushed on their own schedule).
//!
//! The invariant, on every state: the path opens as the checkpoint before the save or as the one
//! it committed, bit-exact (manifest, checksums and every chunk's bytes), never neither (unless
//! there was none before) and never a mix; files that are not the store's are never touched; and
//! the next save, run on the crash state, succeeds and leaves exactly its own checkpoint beside
//! those files (what the crashed save left is removed, nothing else is).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use olmo_chunks_core::fsops::{Journal, Op};
use olmo_chunks_core::txn::{DATA_DIR, LEASE_NAME, TMP_PREFIX};
use olmo_chunks_core::{
    verify_all, LocalFs, Manifest, Region, SaveOptions, SaveTxn, MANIFEST_NAME,
};

use crate::common::{salted_chunk_data, write_rolled, write_save, SavedTensor, Seeded};

/// Every path below a root: a directory (`None`) or a file's bytes.
type State = BTreeMap<PathBuf, Option<Vec<u8>>>;

const FOREIGN: &str = "README.md";
const BLOCK: u64 = 16;

fn tensors() -> Vec<SavedTensor> {
    let rows = |o: u64, n: u64| Region::Box {
        offsets: vec![o, 0],
        sizes: vec![n, 6],
    };
    vec![
        SavedTensor {
            key: "a".into(),
            dtype: "float32".into(),
            shape: vec![4, 6],
            regions: vec![rows(0, 2), rows(2, 2)],
        },
        SavedTensor {
            key: "b".into(),
            dtype: "int64".into(),
            shape: vec![3],
            regions: vec![Region::Box {
                offsets: vec![0],
                sizes: vec![3],
            }],
        },
    ]
}

/// A checkpoint's identity and the bytes of its chunks, in manifest order.
#[derive(Clone, Debug)]
struct Version {
    save_id: String,
    data: Vec<Vec<u8>>,
}

/// Saves the tensors with every byte xored by `salt` into 2 data files written together, or
/// (`rolled`) one file per chunk written one after another; commits, or aborts (as a failed save
/// does) when `commit` is false.
fn save_as(dir: &Path, salt: u8, commit: bool, rolled: bool) -> Version {
    let tensors = tensors();
    let data = salted_chunk_data(&tensors, salt);
    let opts = SaveOptions {
        overwrite: true,
        lease_timeout: Duration::from_secs(1),
    };
    let mut txn = SaveTxn::begin(dir, opts).unwrap();
    let m = if rolled {
        write_rolled(&LocalFs::new(dir), &txn, &tensors, &data, BLOCK)
    } else {
        write_save(&txn, dir, &tensors, &data, 2, BLOCK, 2)
    };
    if commit {
        txn.commit(&m).unwrap();
    } else {
        txn.abort();
    }
    Version {
        save_id: m.save_id,
        data,
    }
}

fn save(dir: &Path, salt: u8, commit: bool) -> Version {
    save_as(dir, salt, commit, false)
}

fn snapshot(root: &Path) -> State {
    fn walk(root: &Path, rel: &Path, out: &mut State) {
        for e in fs::read_dir(root.join(rel)).unwrap() {
            let e = e.unwrap();
            let r = rel.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                out.insert(r.clone(), None);
                walk(root, &r, out);
            } else {
                out.insert(r, Some(fs::read(e.path()).unwrap()));
            }
        }
    }
    let mut out = State::new();
    walk(root, Path::new(""), &mut out);
    out
}

/// Writes `state` into the empty directory `dir`; a lease left in it gets an old heartbeat (its
/// writer died with the crash).
fn materialize(state: &State, dir: &Path) {
    for (rel, node) in state {
        match node {
            None => fs::create_dir(dir.join(rel)).unwrap(),
            Some(bytes) => fs::write(dir.join(rel), bytes).unwrap(),
        }
    }
    let lease = dir.join(LEASE_NAME);
    if lease.is_file() {
        let old = SystemTime::now() - Duration::from_secs(3600);
        let f = fs::File::options().write(true).open(&lease).unwrap();
        f.set_modified(old).unwrap();
    }
}

/// What an operation depends on to be durable.
#[derive(Clone, Debug)]
enum Kind {
    /// A change of names: durable once every one of these directories is fsynced after it.
    Name(Vec<PathBuf>, Option<u64>),
    /// A change of this inode's bytes or size: durable once the file is fsynced after it.
    Data(u64),
    SyncFile(u64),
    SyncDir(PathBuf),
}

#[derive(Clone, Debug)]
enum Node {
    Dir,
    File(u64),
}

/// A filesystem of names and inodes, to replay operations on.
#[derive(Clone, Default)]
struct Sim {
    names: BTreeMap<PathBuf, Node>,
    bytes: HashMap<u64, Vec<u8>>,
    next: u64,
}

fn parent(p: &Path) -> PathBuf {
    p.parent().map(Path::to_path_buf).unwrap_or_default()
}

impl Sim {
    fn from_state(state: &State) -> Sim {
        let mut sim = Sim::default();
        for (rel, node) in state {
            let node = match node {
                None => Node::Dir,
                Some(b) => {
                    sim.next += 1;
                    sim.bytes.insert(sim.next, b.clone());
                    Node::File(sim.next)
                }
            };
            sim.names.insert(rel.clone(), node);
        }
        sim
    }

    fn is_dir(&self, p: &Path) -> bool {
        p.as_os_str().is_empty() || matches!(self.names.get(p), Some(Node::Dir))
    }

    fn inode(&self, p: &Path) -> u64 {
        match self.names.get(p) {
            Some(Node::File(n)) => *n,
            other => panic!("journal names {p:?}, which is {other:?} at that point"),
        }
    }

    /// What `op` depends on, as issued (on the state every earlier operation made), allocating
    /// the inode of a file it creates.
    fn classify(&mut self, op: &Op) -> Kind {
        match op {
            Op::Mkdir(p) | Op::Unlink(p) | Op::Rmdir(p) => Kind::Name(vec![parent(p)], None),
            Op::Create(p) => match self.names.get(p) {
                Some(Node::File(n)) => Kind::Data(*n),
                _ => {
                    self.next += 1;
                    Kind::Name(vec![parent(p)], Some(self.next))
                }
            },
            Op::Write { path, .. } | Op::SetLen(path, _) => Kind::Data(self.inode(path)),
            Op::Fsync(p) => Kind::SyncFile(self.inode(p)),
            Op::Rename(a, b) => Kind::Name(vec![parent(a), parent(b)], None),
            Op::FsyncDir(d) => Kind::SyncDir(d.clone()),
        }
    }

    /// Applies `op` if it can apply to this state (an operation whose subject did not survive
    /// the crash cannot).
    fn apply(&mut self, op: &Op, kind: &Kind) {
        match (op, kind) {
            (Op::Mkdir(p), _) => {
                if self.is_dir(&parent(p)) && !self.names.contains_key(p) {
                    self.names.insert(p.clone(), Node::Dir);
                }
            }
            (Op::Create(p), Kind::Name(_, Some(n))) => {
                if self.is_dir(&parent(p)) && !self.names.contains_key(p) {
                    self.names.insert(p.clone(), Node::File(*n));
                    self.bytes.entry(*n).or_default();
                }
            }
            (Op::Create(_), Kind::Data(n)) => self.bytes.entry(*n).or_default().clear(),
            (Op::Write { offset, data, .. }, Kind::Data(n)) => {
                let b = self.bytes.entry(*n).or_default();
                let end = *offset as usize + data.len();
                if b.len() < end {
                    b.resize(end, 0);
                }
                b[*offset as usize..end].copy_from_slice(data);
            }
            (Op::SetLen(_, len), Kind::Data(n)) => {
                self.bytes.entry(*n).or_default().resize(*len as usize, 0)
            }
            (Op::Rename(a, b), _) => {
                let movable = matches!(self.names.get(a), Some(Node::File(_)))
                    && self.is_dir(&parent(b))
                    && !self.is_dir(b);
                if movable {
                    let node = self.names.remove(a).unwrap();
                    self.names.insert(b.clone(), node);
                }
            }
            (Op::Unlink(p), _) => {
                if matches!(self.names.get(p), Some(Node::File(_))) {
                    self.names.remove(p);
                }
            }
            (Op::Rmdir(p), _) => {
                let empty = !self.names.keys().any(|k| k != p && k.starts_with(p));
                if matches!(self.names.get(p), Some(Node::Dir)) && empty {
                    self.names.remove(p);
                }
            }
            (Op::Fsync(_) | Op::FsyncDir(_), _) => {}
            (op, kind) => panic!("{op:?} classified as {kind:?}"),
        }
    }

    fn state(&self) -> State {
        self.names
            .iter()
            .map(|(p, node)| match node {
                Node::Dir => (p.clone(), None),
                Node::File(n) => (p.clone(), Some(self.bytes[n].clone())),
            })
            .collect()
    }
}

/// The crash states of `ops` run on `initial`: the distinct states, and how many were enumerated.
fn crash_states(initial: &State, ops: &[Op]) -> (Vec<State>, usize) {
    let mut sim = Sim::from_state(initial);
    let kinds: Vec<Kind> = ops
        .iter()
        .map(|op| {
            let k = sim.classify(op);
            sim.apply(op, &k);
            k
        })
        .collect();
    let durable = |i: usize, k: usize| match &kinds[i] {
        Kind::Data(n) => kinds[i + 1..k]
            .iter()
            .any(|x| matches!(x, Kind::SyncFile(m) if m == n)),
        Kind::Name(dirs, _) => dirs.iter().all(|d| {
            kinds[i + 1..k]
                .iter()
                .any(|x| matches!(x, Kind::SyncDir(e) if e == d))
        }),
        Kind::SyncFile(_) | Kind::SyncDir(_) => true,
    };
    let replay = |kept: &[usize]| {
        let mut s = Sim::from_state(initial);
        for &i in kept {
            s.apply(&ops[i], &kinds[i]);
        }
        s.state()
    };
    let mut rng = Seeded::new(0xc4a5);
    let mut seen: HashSet<State> = HashSet::new();
    let mut enumerated = 0;
    for k in 0..=ops.len() {
        let (fixed, volatile): (Vec<usize>, Vec<usize>) = (0..k).partition(|&i| durable(i, k));
        let mut subsets: Vec<Vec<bool>> = Vec::new();
        // POSIX: any subset of what is not yet durable.
        let v = volatile.len();
        if v <= 10 {
            subsets.extend((0..1u32 << v).map(|m| (0..v).map(|b| m >> b & 1 == 1).collect()));
        } else {
            subsets.push(vec![false; v]);
            subsets.push(vec![true; v]);
            for j in 0..v {
                subsets.push((0..v).map(|b| b != j).collect());
                subsets.push((0..v).map(|b| b == j).collect());
            }
            subsets.extend((0..64).map(|_| (0..v).map(|_| rng.chance(50)).collect()));
        }
        // ext4 data=ordered: an in-order prefix of them, then any of the later data writes.
        for cut in 0..=v {
            let later: Vec<usize> = (cut..v)
                .filter(|&j| matches!(kinds[volatile[j]], Kind::Data(_)))
                .collect();
            let picks: Vec<Vec<bool>> = if later.len() <= 6 {
                (0..1u32 << later.len())
                    .map(|m| (0..later.len()).map(|b| m >> b & 1 == 1).collect())
                    .collect()
            } else {
                (0..16)
                    .map(|_| later.iter().map(|_| rng.chance(50)).collect())
                    .collect()
            };
            for pick in picks {
                let mut keep: Vec<bool> = (0..v).map(|j| j < cut).collect();
                for (&j, on) in later.iter().zip(pick) {
                    keep[j] = on;
                }
                subsets.push(keep);
            }
        }
        for keep in subsets {
            let mut kept: Vec<usize> = fixed.clone();
            kept.extend(
                volatile
                    .iter()
                    .zip(&keep)
                    .filter(|(_, &on)| on)
                    .map(|(&i, _)| i),
            );
            kept.sort_unstable();
            enumerated += 1;
            seen.insert(replay(&kept));
        }
    }
    let mut states: Vec<State> = seen.into_iter().collect();
    states.sort();
    (states, enumerated)
}

/// The invariant on one crash state; `Err` says how it is broken.
fn check(
    state: &State,
    versions: &[Version],
    none_allowed: bool,
    foreign: &[u8],
) -> Result<(), String> {
    if state.get(Path::new(FOREIGN)) != Some(&Some(foreign.to_vec())) {
        return Err(format!("{FOREIGN} was changed or removed"));
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    materialize(state, dir);
    match Manifest::open(dir) {
        Ok(m) => {
            let Some(v) = versions.iter().find(|v| v.save_id == m.save_id) else {
                return Err(format!(
                    "a manifest of save {}, which never committed",
                    m.save_id
                ));
            };
            verify_all(dir, &m, 1, None).map_err(|e| format!("opens as {}: {e}", m.save_id))?;
            for (c, ch) in m.chunks.iter().enumerate() {
                let file = fs::read(dir.join(&m.files[ch.file as usize].path)).unwrap();
                let got = &file[ch.offset as usize..(ch.offset + ch.len) as usize];
                if got != v.data[c] {
                    return Err(format!("chunk {c} of {} is not the bytes saved", m.save_id));
                }
            }
        }
        Err(_) if none_allowed && !state.contains_key(Path::new(MANIFEST_NAME)) => {}
        Err(e) => return Err(format!("the checkpoint was lost: {e}")),
    }
    // The next save, on the crash state, cleans up after it and leaves only its own checkpoint.
    let next = save(dir, 0x5a, true);
    let after = snapshot(dir);
    let mine = Path::new(DATA_DIR).join(&next.save_id);
    let expected: HashSet<PathBuf> = [
        PathBuf::from(FOREIGN),
        PathBuf::from(MANIFEST_NAME),
        PathBuf::from(DATA_DIR),
        mine.clone(),
        mine.join("rank-00000.bin"),
        mine.join("rank-00001.bin"),
    ]
    .into();
    let found: HashSet<PathBuf> = after.keys().cloned().collect();
    if found != expected {
        return Err(format!(
            "after the next save: left {:?}, missing {:?}",
            found.difference(&expected).collect::<Vec<_>>(),
            expected.difference(&found).collect::<Vec<_>>()
        ));
    }
    if after[Path::new(FOREIGN)].as_deref() != Some(foreign) {
        return Err(format!("the next save changed {FOREIGN}"));
    }
    let m = Manifest::open(dir).map_err(|e| format!("the next save: {e}"))?;
    verify_all(dir, &m, 1, None).map_err(|e| format!("the next save: {e}"))?;
    Ok(())
}

/// Records the save `run` makes on `dir` (prepared by `setup`), checks every crash state, and
/// returns (operations, states enumerated, distinct states checked).
fn scenario(
    name: &str,
    setup: impl FnOnce(&Path) -> Vec<Version>,
    run: impl FnOnce(&Path) -> Option<Version>,
) -> (usize, usize, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    fs::create_dir(&dir).unwrap();
    let foreign = b"not the store's: never touched\n".to_vec();
    fs::write(dir.join(FOREIGN), &foreign).unwrap();
    let mut versions = setup(&dir);
    let none_allowed = versions.is_empty();
    let initial = snapshot(&dir);
    let journal = Journal::start(&dir);
    let new = run(&dir);
    let ops = journal.finish();
    versions.extend(new);
    assert!(
        ops.iter().any(|o| matches!(o, Op::FsyncDir(_))),
        "{name}: nothing recorded"
    );
    let (states, enumerated) = crash_states(&initial, &ops);
    let violations: Vec<String> = states
        .iter()
        .filter_map(|s| check(s, &versions, none_allowed, &foreign).err())
        .collect();
    println!(
        "crash states, {name}: {} operations, {enumerated} states enumerated, {} distinct checked, {} violations",
        ops.len(),
        states.len(),
        violations.len()
    );
    assert!(violations.is_empty(), "{name}: {violations:#?}");
    (ops.len(), enumerated, states.len())
}

#[test]
fn first_save() {
    let (_, _, checked) = scenario("first save", |_| Vec::new(), |d| Some(save(d, 1, true)));
    assert!(checked > 10);
}

#[test]
fn overwrite_save() {
    scenario(
        "overwrite",
        |d| vec![save(d, 1, true)],
        |d| Some(save(d, 2, true)),
    );
}

#[test]
fn failed_save() {
    scenario(
        "failed save",
        |d| vec![save(d, 1, true)],
        |d| {
            save(d, 2, false);
            None
        },
    );
}

#[test]
fn save_over_a_killed_writers_leftovers() {
    scenario(
        "killed writer's leftovers",
        |d| {
            let old = save(d, 1, true);
            // What a writer killed mid-save leaves: its lease, data, and temp manifest.
            let dead = "0123456789abcdef0123456789abcdef";
            let data = d.join(DATA_DIR).join(dead);
            fs::create_dir_all(&data).unwrap();
            fs::write(data.join("rank-00000.bin"), vec![7u8; 100]).unwrap();
            fs::write(d.join(format!("{TMP_PREFIX}{dead}")), b"{\"torn").unwrap();
            fs::write(d.join(LEASE_NAME), format!("{{\"save_id\": \"{dead}\"}}")).unwrap();
            let f = fs::File::options()
                .write(true)
                .open(d.join(LEASE_NAME))
                .unwrap();
            f.set_modified(SystemTime::now() - Duration::from_secs(3600))
                .unwrap();
            vec![old]
        },
        |d| Some(save(d, 2, true)),
    );
}

#[test]
fn save_in_rolled_data_files() {
    scenario(
        "data files rolled one after another (import-dcp, import-hf)",
        |d| vec![save(d, 1, true)],
        |d| Some(save_as(d, 2, true, true)),
    );
}
