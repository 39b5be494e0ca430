//! Hostile checkpoint directories: data files (or directories on their path) replaced by symbolic
//! links, FIFOs, sockets and directories. Loads and `verify` must refuse them with
//! `CoreError::UnsafePath`, promptly, and never read through a link. Also the writer's block-size
//! cap.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use crate::common::*;
use olmo_chunks_core::fsutil::{open_beneath, open_beneath_walk};
use olmo_chunks_core::manifest::MAX_BLOCK_SIZE;
use olmo_chunks_core::{
    plan_copies, read_into, verify_all, write_chunks, CoreError, Manifest, Region, Target,
    WriteItem,
};

/// Two tensors over two data files.
fn checkpoint() -> (tempfile::TempDir, Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![
        SavedTensor {
            key: "w".into(),
            dtype: "float32".into(),
            shape: vec![8, 4],
            regions: vec![
                Region::Box {
                    offsets: vec![0, 0],
                    sizes: vec![4, 4],
                },
                Region::Flat { start: 16, len: 16 },
            ],
        },
        SavedTensor {
            key: "b".into(),
            dtype: "int64".into(),
            shape: vec![3],
            regions: vec![Region::Flat { start: 0, len: 3 }],
        },
    ];
    save(dir.path(), &tensors, 2, 16, 2);
    let m = Manifest::open(dir.path()).unwrap();
    (dir, m)
}

/// Loads every tensor whole, verifying checksums.
fn load_all(dir: &Path, m: &Manifest) -> olmo_chunks_core::Result<()> {
    let mut bufs = Vec::new();
    let mut targets = Vec::new();
    for (t, meta) in m.tensors.iter().enumerate() {
        let n: u64 = meta.shape.iter().product();
        let item = olmo_chunks_core::dtype::itemsize(&meta.dtype).unwrap();
        targets.push(Target {
            tensor: t,
            pieces: Region::Flat { start: 0, len: n }.pieces(&meta.shape),
            dest: t,
            dest_len: n * item,
        });
        bufs.push(vec![0u8; (n * item) as usize]);
    }
    let copies = plan_copies(m, &targets)?;
    let dests = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    read_into(dir, m, copies, dests, true, 2)
}

/// Runs `f` on another thread and waits at most 20 s for it: a call that blocks (on a FIFO, say)
/// fails the test instead of hanging it.
fn within_time<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} blocked for 20 s"))
}

/// Load, verify and both open paths, each on its own thread with a timeout; all must fail with
/// `UnsafePath` whose reason mentions `needle`.
#[track_caller]
fn expect_refused(dir: &Path, m: &Manifest, file: u32, needle: &str) {
    let rel = m.files[file as usize].path.clone();
    let results = {
        let (d, m1, m2) = (dir.to_path_buf(), m.clone(), m.clone());
        let (d2, d3, d4, r3, r4) = (d.clone(), d.clone(), d.clone(), rel.clone(), rel.clone());
        vec![
            ("load", within_time("load", move || load_all(&d, &m1))),
            (
                "verify",
                within_time("verify", move || verify_all(&d2, &m2, 2, None).map(|_| ())),
            ),
            (
                "open_beneath",
                within_time("open", move || open_beneath(&d3, &r3).map(|_| ())),
            ),
            (
                "open_beneath_walk",
                within_time("walk", move || open_beneath_walk(&d4, &r4).map(|_| ())),
            ),
        ]
    };
    for (what, r) in results {
        match r {
            Err(CoreError::UnsafePath { path, reason }) => {
                assert_eq!(path, dir.join(&rel), "{what}");
                assert!(
                    reason.contains(needle),
                    "{what}: {reason:?} lacks {needle:?}"
                );
            }
            other => panic!("{what}: expected UnsafePath ({needle}), got {other:?}"),
        }
    }
}

/// A copy of data file `file` outside the checkpoint: same bytes, so the same checksums.
fn copy_outside(dir: &Path, m: &Manifest, file: u32) -> (tempfile::TempDir, PathBuf) {
    let elsewhere = tempfile::tempdir().unwrap();
    let target = elsewhere.path().join("lookalike.bin");
    std::fs::copy(m.file_path(dir, file), &target).unwrap();
    (elsewhere, target)
}

#[test]
fn intact_checkpoint_loads_through_both_open_paths() {
    let (dir, m) = checkpoint();
    load_all(dir.path(), &m).unwrap();
    verify_all(dir.path(), &m, 2, None).unwrap();
    for f in &m.files {
        open_beneath(dir.path(), &f.path).unwrap();
        open_beneath_walk(dir.path(), &f.path).unwrap();
    }
}

#[test]
fn symlinked_data_file_is_refused() {
    let (dir, m) = checkpoint();
    let (_elsewhere, target) = copy_outside(dir.path(), &m, 0);
    let path = m.file_path(dir.path(), 0);
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    expect_refused(dir.path(), &m, 0, "symbolic link");
    // A relative link that stays inside the checkpoint is refused too.
    std::fs::remove_file(&path).unwrap();
    std::fs::copy(&target, dir.path().join("inside.bin")).unwrap();
    let depth = m.files[0].path.matches('/').count();
    let up = "../".repeat(depth);
    std::os::unix::fs::symlink(format!("{up}inside.bin"), &path).unwrap();
    expect_refused(dir.path(), &m, 0, "symbolic link");
}

#[test]
fn symlinked_directory_component_is_refused() {
    let (dir, m) = checkpoint();
    // `data` itself, moved out and linked back in.
    let elsewhere = tempfile::tempdir().unwrap();
    let moved = elsewhere.path().join("data");
    std::fs::rename(dir.path().join("data"), &moved).unwrap();
    std::os::unix::fs::symlink(&moved, dir.path().join("data")).unwrap();
    expect_refused(dir.path(), &m, 0, "\"data\" is a symbolic link");
    // The file's own directory, one level deeper.
    std::fs::remove_file(dir.path().join("data")).unwrap();
    std::fs::rename(&moved, dir.path().join("data")).unwrap();
    load_all(dir.path(), &m).unwrap();
    let rel = &m.files[0].path;
    let parent = Path::new(rel).parent().unwrap();
    let real = dir.path().join(format!("{}-real", parent.display()));
    std::fs::rename(dir.path().join(parent), &real).unwrap();
    std::os::unix::fs::symlink(&real, dir.path().join(parent)).unwrap();
    expect_refused(dir.path(), &m, 0, "is a symbolic link");
}

#[test]
fn checkpoint_directory_itself_may_be_a_symlink() {
    let (dir, m) = checkpoint();
    let links = tempfile::tempdir().unwrap();
    let link = links.path().join("ckpt");
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    load_all(&link, &m).unwrap();
    verify_all(&link, &m, 2, None).unwrap();
    open_beneath_walk(&link, &m.files[0].path).unwrap();
}

#[test]
fn fifo_data_file_is_refused_promptly() {
    let (dir, m) = checkpoint();
    let path = m.file_path(dir.path(), 1);
    std::fs::remove_file(&path).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    expect_refused(dir.path(), &m, 1, "FIFO");
}

#[test]
fn socket_and_directory_data_files_are_refused() {
    let (dir, m) = checkpoint();
    let path = m.file_path(dir.path(), 1);
    std::fs::remove_file(&path).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    expect_refused(dir.path(), &m, 1, "socket");
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    expect_refused(dir.path(), &m, 1, "directory");
}

#[test]
fn missing_file_and_bad_relative_paths() {
    let (dir, m) = checkpoint();
    for open in [open_beneath, open_beneath_walk] {
        match open(dir.path(), "data/nope.bin") {
            Err(CoreError::Io { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound)
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
        for bad in ["", "/etc/passwd", "../x.bin", "data/../../x.bin", "."] {
            assert!(
                matches!(open(dir.path(), bad), Err(CoreError::UnsafePath { .. })),
                "{bad:?}"
            );
        }
    }
    assert!(open_beneath(dir.path(), &m.files[0].path).is_ok());
}

#[test]
fn writer_refuses_block_sizes_above_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let data = vec![1u8; 100];
    let items = [WriteItem {
        file: 0,
        data: &data,
    }];
    let paths = ["data/x/a.bin".to_string()];
    for bs in [0, MAX_BLOCK_SIZE + 1, 1 << 30, u64::MAX] {
        match write_chunks(dir.path(), &paths, &items, bs, 1) {
            Err(CoreError::InvalidArgument(msg)) => assert!(msg.contains("block size"), "{msg}"),
            other => panic!("block size {bs}: expected InvalidArgument, got {other:?}"),
        }
    }
    let (written, _) = write_chunks(dir.path(), &paths, &items, MAX_BLOCK_SIZE, 1).unwrap();
    assert_eq!(written[0].checksums.len(), 1);
}
