//! The one backend test suite: what every [`Storage`] must do for the save transaction and the
//! readers to be correct on it. It runs in `cargo test` against a local directory and an
//! in-memory object store (`tests/suite/backends.rs`), and from pytest against the S3 server the
//! tests start (`_core.check_storage`, `tests/test_object_store.py`), so that one set of
//! expectations judges every backend.
//!
//! [`check`] runs on an empty storage and returns what failed, each with what was expected (an
//! empty list: the backend conforms).

use std::sync::{Arc, Barrier};
use std::time::{Duration, SystemTime};

use serde_json::value::RawValue;

use crate::codec::Codec;
use crate::error::{CoreError, Result};
use crate::io::{write_chunks_to, WriteItem};
use crate::manifest::{Manifest, MANIFEST_NAME};
use crate::region::Region;
use crate::save::{SavedChunk, TensorSchema};
use crate::storage::{Entry, PutIf, Storage, Version};
use crate::txn::{SaveOptions, SaveTxn, LEASE_NAME};

/// Threads racing on one condition in the race checks.
const RACERS: usize = 8;

struct Report(Vec<String>);

impl Report {
    fn expect(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.0.push(what.into());
        }
    }

    fn ok<T>(&mut self, r: Result<T>, what: &str) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.0.push(format!("{what}: unexpected error: {e}"));
                None
            }
        }
    }
}

/// Runs the whole suite on `storage`, which must be empty; returns the failed expectations.
pub fn check(storage: Arc<dyn Storage>) -> Vec<String> {
    let mut r = Report(Vec::new());
    objects(&*storage, &mut r);
    conditional_puts(&*storage, &mut r);
    publish(&*storage, &mut r);
    listing_and_removal(&*storage, &mut r);
    races(&storage, &mut r);
    transaction(&storage, &mut r);
    r.0
}

fn get(s: &dyn Storage, rel: &str) -> Result<Option<Vec<u8>>> {
    Ok(s.get_with_head(rel, 0, &|_, _| Ok(()))?.map(|(b, _)| b))
}

fn objects(s: &dyn Storage, r: &mut Report) {
    r.expect(
        matches!(s.head("none"), Ok(None)),
        "head of a missing object is None",
    );
    r.expect(
        matches!(get(s, "none"), Ok(None)),
        "get_with_head of a missing object is None",
    );
    let before = SystemTime::now() - Duration::from_secs(5);
    let Some(Some(v)) = r.ok(
        s.put_if("a", b"one", PutIf::Absent),
        "put_if(Absent) of a new object",
    ) else {
        r.expect(false, "put_if(Absent) of a new object returns its version");
        return;
    };
    let head = r.ok(s.head("a"), "head").flatten();
    r.expect(
        head.as_ref().is_some_and(|h| h.version == v && h.size == 3),
        format!("head after a put has its version and size ({head:?}, put {v:?})"),
    );
    r.expect(
        head.as_ref().is_some_and(|h| h.modified >= before),
        "head's modification time is now",
    );
    let got = r
        .ok(s.get_with_head("a", 0, &|_, _| Ok(())), "get_with_head")
        .flatten();
    r.expect(
        got.as_ref()
            .is_some_and(|(b, h)| b == b"one" && h.version == v),
        "get_with_head returns the bytes and the version put",
    );
    let refused = s.get_with_head("a", 2, &|first, size| {
        if first == b"on" && size == 3 {
            Err(CoreError::InvalidArgument("refused by its check".into()))
        } else {
            Ok(())
        }
    });
    r.expect(
        matches!(refused, Err(CoreError::InvalidArgument(_))),
        format!("get_with_head shows the check the first bytes and the size, and fails with its error ({refused:?})"),
    );
    r.expect(
        s.get("a").is_ok_and(|b| b == b"one"),
        "get reads the object whole",
    );
}

fn conditional_puts(s: &dyn Storage, r: &mut Report) {
    let v1 = r
        .ok(s.put_if("c", b"v1", PutIf::Absent), "put_if(Absent)")
        .flatten();
    r.expect(
        matches!(s.put_if("c", b"no", PutIf::Absent), Ok(None)),
        "put_if(Absent) over an existing object writes nothing and returns None",
    );
    let Some(v1) = v1 else {
        r.expect(false, "put_if(Absent) of a new object returns its version");
        return;
    };
    let v2 = r
        .ok(s.put_if("c", b"v2", PutIf::Version(&v1)), "put_if(Version)")
        .flatten();
    r.expect(
        v2.as_ref().is_some_and(|v2| *v2 != v1),
        "put_if(Version) of the current version replaces it with a new version",
    );
    r.expect(
        matches!(s.put_if("c", b"no", PutIf::Version(&v1)), Ok(None)),
        "put_if(Version) of a stale version writes nothing and returns None",
    );
    r.expect(
        matches!(get(s, "c"), Ok(Some(b)) if b == b"v2"),
        "after a refused put the object holds the last accepted bytes",
    );
    r.expect(
        matches!(s.put_if("gone", b"x", PutIf::Version(&v1)), Ok(None)),
        "put_if(Version) of a missing object returns None",
    );
    let Some(v2) = v2 else { return };
    std::thread::sleep(Duration::from_millis(20));
    let before = s.head("c").ok().flatten().map(|h| h.modified);
    let v3 = r.ok(s.touch_if("c", b"v2", &v2), "touch_if").flatten();
    let after = s.head("c").ok().flatten();
    // An object store's ETag of the same bytes, and its time to the second, may not change.
    r.expect(
        v3.is_some()
            && after
                .as_ref()
                .is_some_and(|h| Some(&h.version) == v3.as_ref() && Some(h.modified) >= before),
        format!("touch_if of the current version renews it and returns its version ({after:?})"),
    );
    r.expect(
        matches!(s.touch_if("c", b"v2", &v1), Ok(None)),
        "touch_if of a stale version returns None",
    );
    r.expect(
        matches!(get(s, "c"), Ok(Some(b)) if b == b"v2"),
        "touch_if keeps the bytes",
    );
}

fn publish(s: &dyn Storage, r: &mut Report) {
    let ok = || Ok(());
    let v1 = r
        .ok(
            s.publish("m", b"first", PutIf::Absent, &ok),
            "publish(Absent)",
        )
        .flatten();
    r.expect(
        v1.is_some(),
        "publish(Absent) of a new object returns its version",
    );
    r.expect(
        matches!(s.publish("m", b"no", PutIf::Absent, &ok), Ok(None)),
        "publish(Absent) over an existing object returns None",
    );
    let Some(v1) = v1 else { return };
    let vetoed = s.publish("m", b"vetoed", PutIf::Version(&v1), &|| {
        Err(CoreError::Locked {
            path: "m".into(),
            reason: "vetoed".into(),
        })
    });
    r.expect(
        matches!(vetoed, Err(CoreError::Locked { .. })),
        "publish fails with the error its ready() returns",
    );
    r.expect(
        matches!(get(s, "m"), Ok(Some(b)) if b == b"first"),
        "a vetoed or refused publish leaves the object as it was",
    );
    let v2 = r
        .ok(
            s.publish("m", b"second", PutIf::Version(&v1), &ok),
            "publish(Version)",
        )
        .flatten();
    r.expect(
        v2.is_some() && matches!(get(s, "m"), Ok(Some(b)) if b == b"second"),
        "publish(Version) of the current version replaces the object",
    );
    r.expect(
        matches!(s.publish("m", b"no", PutIf::Version(&v1), &ok), Ok(None)),
        "publish(Version) of a stale version returns None",
    );
    let names: Vec<String> = s
        .list("", false)
        .unwrap_or_default()
        .iter()
        .map(|e| e.rel().to_string())
        .collect();
    r.expect(
        names.iter().all(|n| !n.starts_with('.')),
        format!("publish leaves nothing staged behind ({names:?})"),
    );
}

fn listing_and_removal(s: &dyn Storage, r: &mut Report) {
    let rels: Vec<String> = ["data/x/a.bin", "data/x/b.bin", "data/y/c.bin"]
        .map(String::from)
        .to_vec();
    let payload = [7u8; 100];
    let items: Vec<WriteItem<'_>> = (0..rels.len())
        .map(|file| WriteItem {
            file,
            data: &payload,
        })
        .collect();
    if r.ok(write_chunks_to(s, &rels, &items, 64, 2), "write_chunks_to")
        .is_none()
    {
        return;
    }
    let objects = |prefix: &str, deep: bool| -> Vec<String> {
        let mut v: Vec<String> = s
            .list(prefix, deep)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|e| match e {
                Entry::Object(rel) => Some(rel),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    r.expect(
        objects("data", true) == rels,
        format!(
            "a deep list finds every object below the prefix ({:?})",
            objects("data", true)
        ),
    );
    let top = s.list("", false).unwrap_or_default();
    r.expect(
        top.contains(&Entry::Dir("data".into()))
            && !top.iter().any(|e| e.rel().starts_with("data/")),
        format!("a shallow list shows data/ as one directory and nothing below it ({top:?})"),
    );
    r.expect(
        ["a", "c", "m"]
            .iter()
            .all(|n| top.contains(&Entry::Object(n.to_string()))),
        "a shallow list shows the top-level objects",
    );
    r.expect(
        s.list("nothing", true).is_ok_and(|v| v.is_empty()),
        "the list of a missing prefix is empty",
    );
    r.ok(s.delete("a"), "delete");
    r.expect(matches!(s.head("a"), Ok(None)), "a deleted object is gone");
    r.expect(
        s.delete("a").is_ok(),
        "deleting a missing object is not an error",
    );
    r.ok(s.delete_all("data/x"), "delete_all");
    r.expect(
        objects("data", true) == ["data/y/c.bin"],
        "delete_all removes everything below its prefix and nothing else",
    );
    r.expect(
        !s.list("data", true)
            .unwrap_or_default()
            .contains(&Entry::Dir("data/x".into())),
        "delete_all leaves no empty directory behind",
    );
    r.ok(s.delete_all("data"), "delete_all");
    r.expect(
        s.list("", true)
            .is_ok_and(|v| !v.iter().any(|e| e.rel().starts_with("data"))),
        "delete_all of a prefix with subdirectories removes them all",
    );
}

/// `RACERS` threads run `f` at once; returns how many succeeded.
fn race(f: impl Fn(usize) -> bool + Sync) -> usize {
    let start = Barrier::new(RACERS);
    std::thread::scope(|scope| {
        let hs: Vec<_> = (0..RACERS)
            .map(|i| {
                let (f, start) = (&f, &start);
                scope.spawn(move || {
                    start.wait();
                    f(i)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(false) as usize)
            .sum()
    })
}

fn races(s: &Arc<dyn Storage>, r: &mut Report) {
    let won = race(|i| {
        matches!(
            s.put_if("race", format!("{i}").as_bytes(), PutIf::Absent),
            Ok(Some(_))
        )
    });
    r.expect(
        won == 1,
        format!("of {RACERS} racing put_if(Absent), exactly one wins ({won} did)"),
    );
    let Some(head) = s.head("race").ok().flatten() else {
        r.expect(false, "the winner's object exists");
        return;
    };
    let v: Version = head.version;
    let won = race(|i| {
        matches!(
            s.put_if("race", format!("r{i}").as_bytes(), PutIf::Version(&v)),
            Ok(Some(_))
        )
    });
    r.expect(
        won == 1,
        format!("of {RACERS} racing put_if(Version) of one version, exactly one wins ({won} did)"),
    );
    r.expect(
        s.head("race").is_ok_and(|h| h.is_some()),
        "after racing replacements the object exists",
    );
}

fn one_chunk_save(s: &Arc<dyn Storage>, opts: SaveOptions, data: &[u8]) -> Result<SaveTxn> {
    let mut txn = SaveTxn::begin_on(s.clone(), opts)?;
    let rel = format!("{}/rank-00000.bin", txn.data_prefix());
    let (w, files) = write_chunks_to(
        &**s,
        std::slice::from_ref(&rel),
        &[WriteItem { file: 0, data }],
        64,
        1,
    )?;
    let chunk = SavedChunk {
        key: "w".into(),
        region: Region::Flat {
            start: 0,
            len: data.len() as u64,
        },
        file: rel,
        file_size: files[0].size,
        offset: w[0].offset,
        len: w[0].len,
        checksums: w[0].checksums.clone(),
        codec: Codec::Raw,
        block_lens: vec![],
    };
    let schema = TensorSchema {
        key: "w".into(),
        dtype: "uint8".into(),
        shape: vec![data.len() as u64],
        role: "tensor".into(),
    };
    let raw = || RawValue::from_string("{}".into()).unwrap();
    txn.commit_parts(64, vec![schema], vec![chunk], raw(), raw(), &|| Ok(()))?;
    Ok(txn)
}

fn transaction(s: &Arc<dyn Storage>, r: &mut Report) {
    let opts = |overwrite| SaveOptions {
        overwrite,
        lease_timeout: Duration::from_secs(30),
    };
    let held = r.ok(SaveTxn::begin_on(s.clone(), opts(false)), "begin_on");
    r.expect(
        matches!(
            SaveTxn::begin_on(s.clone(), opts(false)),
            Err(CoreError::Locked { .. })
        ),
        "a second save while one holds the lease is refused as locked",
    );
    drop(held);
    r.expect(
        matches!(s.head(LEASE_NAME), Ok(None)),
        "an abandoned save releases its lease",
    );
    let Some(first) = r.ok(one_chunk_save(s, opts(false), &[1; 300]), "a first save") else {
        return;
    };
    let id = first.save_id().to_string();
    let m = Manifest::open_from(&**s);
    r.expect(
        m.as_ref()
            .is_ok_and(|m| m.save_id == id && m.files.len() == 1),
        "the committed manifest is the save's",
    );
    r.expect(
        m.as_ref()
            .is_ok_and(|m| crate::io::verify_from(&**s, m, 1, None).is_ok()),
        "the committed checkpoint verifies",
    );
    r.expect(
        matches!(
            SaveTxn::begin_on(s.clone(), opts(false)),
            Err(CoreError::Exists { .. })
        ),
        "a save over a committed checkpoint without overwrite is refused",
    );
    let abandoned = SaveTxn::begin_on(s.clone(), opts(true)).map(|t| t.save_id().to_string());
    r.expect(
        Manifest::open_from(&**s).is_ok_and(|m| m.save_id == id),
        "an abandoned overwrite leaves the committed checkpoint",
    );
    if let Ok(gone) = abandoned {
        r.expect(
            s.list(&format!("data/{gone}"), true)
                .is_ok_and(|v| v.is_empty()),
            "an abandoned save leaves none of its data",
        );
    }
    let Some(second) = r.ok(one_chunk_save(s, opts(true), &[2; 200]), "an overwrite") else {
        return;
    };
    r.expect(
        Manifest::open_from(&**s).is_ok_and(|m| m.save_id == second.save_id()),
        "an overwrite commits the new checkpoint",
    );
    r.expect(
        s.list(&format!("data/{id}"), true)
            .is_ok_and(|v| v.is_empty()),
        "an overwrite removes the superseded save's data",
    );
    r.expect(
        matches!(s.head(LEASE_NAME), Ok(None)) && s.head(MANIFEST_NAME).is_ok_and(|h| h.is_some()),
        "a committed save releases its lease",
    );
}
