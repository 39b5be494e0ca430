//! End-to-end I/O through a temporary directory: `write_chunks` + `Manifest::commit`, then
//! `read_into` with random copy plans, bit-exact; unit and block boundaries; data-file faults.

use std::path::Path;

use crate::common::*;
use olmo_chunks_core::io::MAX_UNIT;
use olmo_chunks_core::{
    plan_copies, read_into, verify_all, ByteCopy, CoreError, Manifest, Region, Target,
};
use proptest::prelude::*;

const BLOCK_SIZES: [u64; 7] = [1, 3, 8, 64, 100, 1000, 4096];

fn random_tensors(rng: &mut Seeded) -> Vec<SavedTensor> {
    let dtypes = ["uint8", "bfloat16", "float32", "int64", "complex128"];
    (0..rng.range(1, 3))
        .map(|i| {
            let shape: Vec<u64> = (0..rng.range(0, 3)).map(|_| rng.range(0, 9)).collect();
            SavedTensor {
                key: format!("layers.{i}.w"),
                dtype: rng.pick(&dtypes).to_string(),
                regions: random_partition(rng, &shape),
                shape,
            }
        })
        .collect()
}

/// Bytes that a target must hold: the saved element at each wanted local offset, `fill` elsewhere.
fn expected_dest(t: &SavedTensor, salt: u64, w: &WantedTarget, item: u64, fill: u8) -> Vec<u8> {
    let mut want = vec![fill; (w.dest_elems * item) as usize];
    for (local, canon) in expected_locals(&t.shape, &w.pieces) {
        let elem = chunk_bytes(
            t,
            &Region::Flat {
                start: canon,
                len: 1,
            },
            item,
            salt,
        );
        let at = (local * item) as usize;
        want[at..at + item as usize].copy_from_slice(&elem);
    }
    want
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random tensors saved over several files with odd block sizes, read back into random
    /// strided / flat targets through `plan_copies` + `read_into`.
    #[test]
    fn saved_tensors_read_back_bit_exact(
        seed in any::<u64>(),
        block in prop::sample::select(BLOCK_SIZES.to_vec()),
        nfiles in 1usize..=3,
        workers in 1usize..=4,
        verify in any::<bool>(),
    ) {
        let mut rng = Seeded::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let tensors = random_tensors(&mut rng);
        save(dir.path(), &tensors, nfiles, block, workers);
        let m = Manifest::open(dir.path()).unwrap();
        prop_assert_eq!(m.block_size, block);
        olmo_chunks_core::check_manifest_coverage(&m).unwrap();
        let mut targets = Vec::new();
        let mut wanted = Vec::new();
        for _ in 0..rng.range(1, 5) {
            let ti = rng.below(tensors.len() as u64) as usize;
            let item = olmo_chunks_core::dtype::itemsize(&tensors[ti].dtype).unwrap();
            let w = random_target(&mut rng, &tensors[ti].shape);
            targets.push(Target { tensor: ti, pieces: w.pieces.clone(), dest: wanted.len(), dest_len: w.dest_elems * item });
            wanted.push((ti, item, w));
        }
        let copies = plan_copies(&m, &targets).unwrap();
        let mut bufs: Vec<Vec<u8>> = wanted.iter().map(|(_, item, w)| vec![0x5C; (w.dest_elems * item) as usize]).collect();
        read_into(dir.path(), &m, copies, bufs.iter_mut().map(|b| b.as_mut_slice()).collect(), verify, workers).unwrap();
        for ((ti, item, w), got) in wanted.iter().zip(&bufs) {
            let want = expected_dest(&tensors[*ti], *ti as u64 * 0x1_0000_0001, w, *item, 0x5C);
            prop_assert!(got == &want, "tensor {} target {:?}", ti, w.pieces);
        }
    }

    /// Arbitrary byte copies (overlapping sources, many tiny ones, whole chunks) into a few
    /// buffers at disjoint places; bytes between copies stay untouched.
    #[test]
    fn random_byte_copies_read_back_bit_exact(
        seed in any::<u64>(),
        block in prop::sample::select(BLOCK_SIZES.to_vec()),
        workers in 1usize..=4,
        verify in any::<bool>(),
    ) {
        let mut rng = Seeded::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let tensors = vec![SavedTensor {
            key: "flat".into(),
            dtype: "uint8".into(),
            shape: vec![rng.range(1, 3000)],
            regions: Vec::new(),
        }];
        let total = tensors[0].shape[0];
        let mut tensors = tensors;
        tensors[0].regions = flat_partition(&mut rng, 0, total);
        let data: Vec<Vec<u8>> = tensors[0].regions.iter().map(|r| rng.bytes(r.numel().unwrap() as usize)).collect();
        save_bytes(dir.path(), &tensors, &data, 2, block, workers);
        let m = Manifest::open(dir.path()).unwrap();
        let nbufs = rng.range(1, 3) as usize;
        let mut at = vec![0u64; nbufs];
        let mut copies = Vec::new();
        for _ in 0..rng.range(0, 60) {
            let chunk = rng.below(data.len() as u64) as usize;
            let clen = data[chunk].len() as u64;
            if clen == 0 {
                continue;
            }
            let src = rng.range(0, clen - 1);
            let len = if rng.chance(70) { rng.range(1, (clen - src).min(9)) } else { rng.range(1, clen - src) };
            let dst = rng.below(nbufs as u64) as usize;
            let dst_off = at[dst] + if rng.chance(40) { rng.range(1, 5) } else { 0 };
            at[dst] = dst_off + len;
            copies.push(ByteCopy { chunk, src, dst, dst_off, len });
        }
        rng.shuffle(&mut copies);
        let mut want: Vec<Vec<u8>> = at.iter().map(|&n| vec![0xEE; n as usize + 3]).collect();
        for c in &copies {
            want[c.dst][c.dst_off as usize..(c.dst_off + c.len) as usize]
                .copy_from_slice(&data[c.chunk][c.src as usize..(c.src + c.len) as usize]);
        }
        let mut bufs: Vec<Vec<u8>> = want.iter().map(|w| vec![0xEE; w.len()]).collect();
        read_into(dir.path(), &m, copies, bufs.iter_mut().map(|b| b.as_mut_slice()).collect(), verify, workers).unwrap();
        prop_assert!(bufs == want);
    }

    /// A byte flipped anywhere inside a chunk is reported as a checksum mismatch of that chunk,
    /// by `read_into` (reading the whole tensor) and by `verify_all`.
    #[test]
    fn flipped_data_byte_is_caught(
        seed in any::<u64>(),
        block in prop::sample::select(BLOCK_SIZES.to_vec()),
    ) {
        let mut rng = Seeded::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let shape = vec![rng.range(1, 6), rng.range(1, 7)];
        let tensors = vec![
            SavedTensor { key: "a".into(), dtype: "float32".into(), shape: vec![5], regions: vec![Region::Flat { start: 0, len: 5 }] },
            SavedTensor { key: "b".into(), dtype: "int16".into(), regions: random_partition(&mut rng, &shape), shape: shape.clone() },
        ];
        save(dir.path(), &tensors, 2, block, 2);
        let m = Manifest::open(dir.path()).unwrap();
        let nonempty: Vec<usize> = (0..m.chunks.len()).filter(|&c| m.chunks[c].len > 0).collect();
        let c = *rng.pick(&nonempty);
        let ch = m.chunks[c].clone();
        let at = ch.offset + rng.below(ch.len);
        let path = m.file_path(dir.path(), ch.file);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[at as usize] ^= 1 << rng.below(8);
        std::fs::write(&path, &bytes).unwrap();
        let t = m.chunk_start.partition_point(|&s| s <= c) - 1;
        let (key, chunk) = (m.tensors[t].key.clone(), c - m.chunk_start[t]);
        let check = |e: CoreError| -> std::result::Result<(), TestCaseError> {
            match e {
                CoreError::ChecksumMismatch { path: p, key: k, chunk: ci, start, end, expected, found } => {
                    prop_assert_eq!(&p, &path);
                    prop_assert_eq!(&k, &key);
                    prop_assert_eq!(ci, chunk);
                    prop_assert!(start <= at && at < end && end - start <= block, "{}..{} vs {}", start, end, at);
                    prop_assert_ne!(expected, found);
                    Ok(())
                }
                e => Err(TestCaseError::fail(format!("wrong error {e:?}"))),
            }
        };
        check(verify_all(dir.path(), &m, 2, None).unwrap_err())?;
        let item = olmo_chunks_core::dtype::itemsize(&m.tensors[t].dtype).unwrap();
        let numel: u64 = m.tensors[t].shape.iter().product();
        let whole = Target { tensor: t, pieces: Region::Flat { start: 0, len: numel }.pieces(&m.tensors[t].shape), dest: 0, dest_len: numel * item };
        let copies = plan_copies(&m, &[whole]).unwrap();
        let mut buf = vec![0u8; (numel * item) as usize];
        check(read_into(dir.path(), &m, copies.clone(), vec![&mut buf], true, 3).unwrap_err())?;
        // Unverified reads do not look at checksums.
        read_into(dir.path(), &m, copies, vec![&mut buf], false, 3).unwrap();
    }
}

/// One big `uint8` chunk of random bytes over more than two units, saved with `block` sized
/// checksum blocks; returns the directory, the manifest and the bytes.
fn big_chunk(block: u64, len: u64) -> (tempfile::TempDir, Manifest, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Seeded::new(block ^ len);
    let tensors = vec![
        SavedTensor {
            key: "small".into(),
            dtype: "uint8".into(),
            shape: vec![10],
            regions: vec![Region::Flat { start: 0, len: 10 }],
        },
        SavedTensor {
            key: "big".into(),
            dtype: "uint8".into(),
            shape: vec![len],
            regions: vec![Region::Flat { start: 0, len }],
        },
    ];
    let data = vec![rng.bytes(10), rng.bytes(len as usize)];
    save_bytes(dir.path(), &tensors, &data, 1, block, 4);
    let m = Manifest::open(dir.path()).unwrap();
    let big = data.into_iter().nth(1).unwrap();
    (dir, m, big)
}

/// Runs `copies` of chunk 1 (the big one) into one buffer each and checks every byte: all in
/// one call (their edges cut each other's units), then each alone (units cut only by size).
fn read_big(dir: &Path, m: &Manifest, big: &[u8], copies: &[(u64, u64)], workers: usize) {
    read_big_once(dir, m, big, copies, workers);
    if copies.len() > 1 && copies.len() < 10 {
        for c in copies {
            read_big_once(dir, m, big, std::slice::from_ref(c), workers);
        }
    }
}

fn read_big_once(dir: &Path, m: &Manifest, big: &[u8], copies: &[(u64, u64)], workers: usize) {
    let plan: Vec<ByteCopy> = copies
        .iter()
        .enumerate()
        .map(|(i, &(src, len))| ByteCopy {
            chunk: 1,
            src,
            dst: i,
            dst_off: 1,
            len,
        })
        .collect();
    let mut bufs: Vec<Vec<u8>> = copies.iter().map(|c| vec![7u8; c.1 as usize + 2]).collect();
    read_into(
        dir,
        m,
        plan,
        bufs.iter_mut().map(|b| b.as_mut_slice()).collect(),
        true,
        workers,
    )
    .unwrap();
    for (&(src, len), got) in copies.iter().zip(&bufs) {
        assert_eq!(got[0], 7);
        assert_eq!(got[got.len() - 1], 7);
        assert!(
            got[1..=len as usize] == big[src as usize..(src + len) as usize],
            "copy {src}+{len}"
        );
    }
}

#[test]
fn big_copies_split_across_units() {
    // 1000 does not divide MAX_UNIT, 4096 does; either way units are whole blocks.
    for block in [1000u64, 4096] {
        let len = 2 * MAX_UNIT + 12_345;
        let (dir, m, big) = big_chunk(block, len);
        let done = std::sync::atomic::AtomicU64::new(0);
        assert_eq!(
            verify_all(dir.path(), &m, 3, Some(&done)).unwrap(),
            len + 10
        );
        assert_eq!(done.into_inner(), len + 10);
        let unit = MAX_UNIT.next_multiple_of(block);
        read_big(
            dir.path(),
            &m,
            &big,
            &[
                (0, len),                           // everything
                (block / 2, len - block),           // mid-block start and end
                (unit - 17, 34),                    // across one unit boundary
                (unit - block, 2 * block),          // whole blocks around the boundary
                (len - 5, 5),                       // the short last block
                (3, unit),                          // one unit long, misaligned
                (2 * unit - 1, len - 2 * unit + 1), // tail across the last boundary
            ],
            4,
        );
    }
}

#[test]
fn many_small_copies_into_one_unit() {
    let block = 64;
    let (dir, m, big) = big_chunk(block, MAX_UNIT + 4096);
    // 2000 tiny copies, some overlapping in the source, scattered over the first unit and
    // straddling block and unit edges.
    let mut rng = Seeded::new(3);
    let mut copies = Vec::new();
    for _ in 0..2000 {
        let src = rng.range(0, MAX_UNIT + 4000);
        copies.push((src, rng.range(1, 90)));
    }
    copies.push((MAX_UNIT - 1, 2));
    read_big(dir.path(), &m, &big, &copies, 3);
    // The same copies, all into one buffer back to back.
    let mut at = 0;
    let mut plan = Vec::new();
    for &(src, len) in &copies {
        plan.push(ByteCopy {
            chunk: 1,
            src,
            dst: 0,
            dst_off: at,
            len,
        });
        at += len;
    }
    let mut buf = vec![0u8; at as usize];
    read_into(dir.path(), &m, plan, vec![&mut buf], true, 4).unwrap();
    let mut want = Vec::new();
    for &(src, len) in &copies {
        want.extend_from_slice(&big[src as usize..(src + len) as usize]);
    }
    assert!(buf == want);
}

#[test]
fn block_size_larger_than_a_unit() {
    let block = MAX_UNIT + 100;
    let len = MAX_UNIT + 300;
    let (dir, m, big) = big_chunk(block, len);
    assert_eq!(m.chunk_checksums(&m.chunks[1]).len(), 2);
    read_big(
        dir.path(),
        &m,
        &big,
        &[(0, len), (block - 5, 10), (50, 10), (len - 1, 1)],
        2,
    );
}

/// A small checkpoint with two tensors over two files.
fn small_checkpoint() -> (tempfile::TempDir, Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![
        SavedTensor {
            key: "embed".into(),
            dtype: "float32".into(),
            shape: vec![6, 4],
            regions: vec![
                Region::Box {
                    offsets: vec![0, 0],
                    sizes: vec![3, 4],
                },
                Region::Flat { start: 12, len: 12 },
            ],
        },
        SavedTensor {
            key: "head".into(),
            dtype: "int64".into(),
            shape: vec![5],
            regions: vec![
                Region::Flat { start: 0, len: 2 },
                Region::Flat { start: 2, len: 3 },
            ],
        },
    ];
    save(dir.path(), &tensors, 2, 16, 2);
    let m = Manifest::open(dir.path()).unwrap();
    (dir, m)
}

fn read_all(dir: &Path, m: &Manifest) -> olmo_chunks_core::Result<()> {
    let mut bufs: Vec<Vec<u8>> = Vec::new();
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
        bufs.push(vec![0; (n * item) as usize]);
    }
    let copies = plan_copies(m, &targets)?;
    read_into(
        dir,
        m,
        copies,
        bufs.iter_mut().map(|b| b.as_mut_slice()).collect(),
        true,
        2,
    )
}

#[test]
fn truncated_data_file_is_reported() {
    let (dir, m) = small_checkpoint();
    read_all(dir.path(), &m).unwrap();
    // Chunk 1 of "head" is the last chunk in file 1 (chunks go round-robin over the files).
    let last = m.chunk_start[1] + 1;
    let ch = m.chunks[last].clone();
    let path = m.file_path(dir.path(), ch.file);
    let cut = ch.offset + ch.len - 3;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    for err in [
        read_all(dir.path(), &m).unwrap_err(),
        verify_all(dir.path(), &m, 2, None).unwrap_err(),
    ] {
        match err {
            CoreError::Truncated {
                path: p,
                key,
                chunk,
                needed,
                ..
            } => {
                assert_eq!(p, path);
                assert_eq!(key, "head");
                assert_eq!(chunk, 1);
                assert_eq!(needed, ch.offset + ch.len);
            }
            e => panic!("wrong error {e:?}"),
        }
    }
    // Reading only what is still there works.
    let head_first = Target {
        tensor: 1,
        pieces: Region::Flat { start: 0, len: 2 }.pieces(&[5]),
        dest: 0,
        dest_len: 16,
    };
    let mut buf = vec![0u8; 16];
    let copies = plan_copies(&m, &[head_first]).unwrap();
    read_into(dir.path(), &m, copies, vec![&mut buf], true, 1).unwrap();
}

#[test]
fn missing_data_file_is_not_found() {
    let (dir, m) = small_checkpoint();
    let path = m.file_path(dir.path(), 0);
    std::fs::remove_file(&path).unwrap();
    for err in [
        read_all(dir.path(), &m).unwrap_err(),
        verify_all(dir.path(), &m, 2, None).unwrap_err(),
    ] {
        match err {
            CoreError::Io { path: p, source } => {
                assert_eq!(p, path);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            e => panic!("wrong error {e:?}"),
        }
    }
}

#[test]
fn checksum_error_names_tensor_and_chunk() {
    let (dir, m) = small_checkpoint();
    // Flip the first byte of "embed" chunk 1.
    let c = m.chunk_start[0] + 1;
    let ch = m.chunks[c].clone();
    let path = m.file_path(dir.path(), ch.file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[ch.offset as usize] ^= 0x80;
    std::fs::write(&path, bytes).unwrap();
    let err = read_all(dir.path(), &m).unwrap_err();
    let msg = err.to_string();
    match err {
        CoreError::ChecksumMismatch {
            key, chunk, start, ..
        } => {
            assert_eq!((key.as_str(), chunk, start), ("embed", 1, ch.offset));
            assert!(
                msg.contains("\"embed\"") && msg.contains("chunk 1"),
                "{msg}"
            );
        }
        e => panic!("wrong error {e:?}"),
    }
}

#[test]
fn read_into_rejects_bad_copies() {
    let (dir, m) = small_checkpoint();
    let mut buf = vec![0u8; 64];
    let bad = |copies: Vec<ByteCopy>, buf: &mut [u8]| {
        read_into(dir.path(), &m, copies, vec![buf], true, 1)
    };
    let ok = ByteCopy {
        chunk: 0,
        src: 0,
        dst: 0,
        dst_off: 0,
        len: 8,
    };
    assert!(bad(vec![ok], &mut buf).is_ok());
    for c in [
        ByteCopy { chunk: 99, ..ok },
        ByteCopy { dst: 1, ..ok },
        ByteCopy { src: 45, ..ok },
        ByteCopy { dst_off: 60, ..ok },
        ByteCopy {
            src: u64::MAX,
            ..ok
        },
        ByteCopy {
            dst_off: u64::MAX - 2,
            ..ok
        },
    ] {
        assert!(
            matches!(bad(vec![c], &mut buf), Err(CoreError::InvalidArgument(_))),
            "{c:?}"
        );
    }
    let overlap = vec![ok, ByteCopy { dst_off: 7, ..ok }];
    assert!(matches!(
        bad(overlap, &mut buf),
        Err(CoreError::InvalidArgument(_))
    ));
}
