//! Hostile bytes for the manifest decoder: flips, truncations, garbage, absurd lengths, and
//! semantically bad manifests with valid checksums. Every input must give the right `CoreError`
//! variant; nothing may panic, in the decoder or in what runs on a manifest it accepts.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::common::*;
use olmo_chunks_core::manifest::HEADER_LEN;
use olmo_chunks_core::{
    check_manifest_coverage, plan_runs, CoreError, FileEntry, Manifest, Region, Target,
    TensorEntry, FORMAT_VERSION,
};
use proptest::prelude::*;

const SRC: &str = "ckpt/olmo_chunks.manifest";

/// A small valid manifest: boxes, flat ranges, a scalar, an empty tensor, two files.
fn sample() -> Manifest {
    let tensors = vec![
        SavedTensor {
            key: "model.embed".into(),
            dtype: "bfloat16".into(),
            shape: vec![4, 3],
            regions: vec![
                Region::Box {
                    offsets: vec![0, 0],
                    sizes: vec![2, 3],
                },
                Region::Box {
                    offsets: vec![2, 0],
                    sizes: vec![2, 3],
                },
            ],
        },
        SavedTensor {
            key: "optim.exp_avg".into(),
            dtype: "float32".into(),
            shape: vec![2, 2, 5],
            regions: vec![
                Region::Flat { start: 0, len: 7 },
                Region::Flat { start: 7, len: 13 },
            ],
        },
        SavedTensor {
            key: "step".into(),
            dtype: "int64".into(),
            shape: vec![],
            regions: vec![Region::Flat { start: 0, len: 1 }],
        },
        SavedTensor {
            key: "empty".into(),
            dtype: "float16".into(),
            shape: vec![0, 3],
            regions: vec![],
        },
    ];
    let mut m = in_memory_manifest(&tensors, 8);
    // Spread the chunks over two files.
    let size0 = m.files[0].size;
    m.files.push(FileEntry {
        path: "data/rank1/part-0.bin".into(),
        size: size0,
    });
    m.chunks[1].file = 1;
    m.chunks[4].file = 1;
    m.checksums = (0..m.checksums.len() as u32)
        .map(|i| i.wrapping_mul(0x0101_0101))
        .collect();
    m
}

/// Decodes `bytes`, turning a panic into an error that shows the input.
fn decode(bytes: &[u8]) -> olmo_chunks_core::Result<Manifest> {
    match catch_unwind(AssertUnwindSafe(|| Manifest::decode(bytes, Path::new(SRC)))) {
        Ok(r) => r,
        Err(_) => panic!(
            "decoder panicked on {} bytes: {:02x?}",
            bytes.len(),
            &bytes[..bytes.len().min(512)]
        ),
    }
}

/// Runs what a loader runs on an accepted manifest (coverage check, a whole-tensor plan per
/// tensor of modest size, checksum lookups); none of it may panic.
fn exercise(m: &Manifest, bytes: &[u8]) {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = check_manifest_coverage(m);
        for (t, meta) in m.tensors.iter().enumerate() {
            let n: u64 = meta.shape.iter().product();
            if n > 1 << 16 {
                continue;
            }
            let target = Target {
                tensor: t,
                pieces: Region::Flat { start: 0, len: n }.pieces(&meta.shape),
                dest: 0,
                dest_len: n * 16,
            };
            let _ = plan_runs(m, &[target]);
            for c in m.tensor_chunks(t) {
                let _ = m.chunk_checksums(c);
            }
        }
        let _ = Manifest::decode(&m.encode(), Path::new(SRC)).unwrap();
    }));
    assert!(
        r.is_ok(),
        "use of an accepted manifest panicked; input {:02x?}",
        &bytes[..bytes.len().min(512)]
    );
}

/// The three sections of a well-formed manifest.
fn sections(bytes: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let len = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()) as usize;
    let (m, t) = (len(16), len(24));
    let body = &bytes[HEADER_LEN..];
    (
        body[..m].to_vec(),
        body[m..m + t].to_vec(),
        body[m + t..].to_vec(),
    )
}

/// Assembles a manifest from raw sections with correct checksums, as a careful forger would.
fn reseal(version: u32, meta: &[u8], table: &[u8], crcs: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    out[0..8].copy_from_slice(b"OCHUNKS\n");
    out[8..12].copy_from_slice(&version.to_le_bytes());
    out[16..24].copy_from_slice(&(meta.len() as u64).to_le_bytes());
    out[24..32].copy_from_slice(&(table.len() as u64).to_le_bytes());
    out[32..40].copy_from_slice(&(crcs.len() as u64).to_le_bytes());
    let body = crc32c::crc32c_append(crc32c::crc32c_append(crc32c::crc32c(meta), table), crcs);
    out[40..44].copy_from_slice(&body.to_le_bytes());
    let head = crc32c::crc32c(&out[0..44]);
    out[44..48].copy_from_slice(&head.to_le_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(table);
    out.extend_from_slice(crcs);
    out
}

/// Recomputes both checksums of `bytes` (a header plus body whose lengths are unchanged).
fn fix_checksums(bytes: &mut [u8]) {
    let body = crc32c::crc32c(&bytes[HEADER_LEN..]);
    bytes[40..44].copy_from_slice(&body.to_le_bytes());
    let head = crc32c::crc32c(&bytes[0..44]);
    bytes[44..48].copy_from_slice(&head.to_le_bytes());
}

#[track_caller]
fn expect_corrupt(r: olmo_chunks_core::Result<Manifest>, needle: &str) {
    match r {
        Err(CoreError::CorruptManifest { path, reason }) => {
            assert_eq!(path, Path::new(SRC));
            assert!(
                reason.contains(needle),
                "reason {reason:?} does not mention {needle:?}"
            );
        }
        Err(e) => panic!("expected CorruptManifest ({needle}), got {e:?}"),
        Ok(_) => panic!("expected CorruptManifest ({needle}), but it decoded"),
    }
}

#[track_caller]
fn expect_version(r: olmo_chunks_core::Result<Manifest>, version: u32) {
    match r {
        Err(CoreError::UnsupportedVersion {
            path,
            found,
            supported,
        }) => {
            assert_eq!(path, Path::new(SRC));
            assert_eq!((found, supported), (version, FORMAT_VERSION));
        }
        other => panic!(
            "expected UnsupportedVersion({version}), got {:?}",
            other.err()
        ),
    }
}

/// The error a decoder must give for bytes that are not the valid manifest.
fn expect_rejected(bytes: &[u8]) {
    let r = decode(bytes);
    if bytes.len() >= 12 && &bytes[0..8] == b"OCHUNKS\n" {
        let v = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if !(1..=FORMAT_VERSION).contains(&v) && bytes.len() >= HEADER_LEN {
            return expect_version(r, v);
        }
    }
    expect_corrupt(r, "");
}

#[test]
fn sample_round_trips() {
    let m = sample();
    let bytes = m.encode();
    let back = decode(&bytes).unwrap();
    assert_eq!(back.encode(), bytes);
    assert_eq!(back.chunks, m.chunks);
    assert_eq!(back.tensors, m.tensors);
    assert_eq!(back.checksums, m.checksums);
    exercise(&back, &bytes);
}

#[test]
fn every_single_byte_flip_is_rejected() {
    let bytes = sample().encode();
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x10, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            if (8..12).contains(&i) {
                let v = u32::from_le_bytes(b[8..12].try_into().unwrap());
                expect_version(decode(&b), v);
            } else {
                expect_corrupt(decode(&b), "");
            }
        }
    }
}

#[test]
fn every_truncation_is_rejected() {
    let bytes = sample().encode();
    for n in 0..bytes.len() {
        expect_corrupt(decode(&bytes[..n]), "");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    expect_corrupt(decode(&longer), "section lengths");
}

#[test]
fn garbage_is_rejected() {
    let mut rng = Seeded::new(42);
    for n in [0usize, 1, 7, 8, 11, 12, 63, 64, 65, 100, 1000, 5000] {
        for _ in 0..50 {
            let b = rng.bytes(n);
            expect_rejected(&b);
            let mut with_magic = b"OCHUNKS\n".to_vec();
            with_magic.extend(&b);
            expect_rejected(&with_magic);
            // Magic and the current version, then garbage.
            let mut v1 = b"OCHUNKS\n\x01\0\0\0".to_vec();
            v1.extend(&b);
            expect_rejected(&v1);
        }
    }
}

#[test]
fn huge_section_lengths_with_valid_header_checksum() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    let real = [meta.len() as u64, table.len() as u64, crcs.len() as u64];
    let extremes = [
        0,
        1,
        u64::MAX,
        u64::MAX - 63,
        1 << 30,
        (1 << 30) + 1,
        1 << 63,
        u32::MAX as u64,
    ];
    for field in 0..3 {
        for &v in &extremes {
            let mut lens = real;
            lens[field] = v;
            let mut b = bytes.clone();
            for (k, l) in lens.iter().enumerate() {
                b[16 + 8 * k..24 + 8 * k].copy_from_slice(&l.to_le_bytes());
            }
            fix_checksums(&mut b);
            expect_corrupt(decode(&b), "");
        }
    }
    // Lengths that sum to the file size only through overflow.
    let mut b = bytes.clone();
    b[24..32].copy_from_slice(&(real[1].wrapping_add(1 << 63)).to_le_bytes());
    b[32..40].copy_from_slice(&(real[2].wrapping_add(1 << 63)).to_le_bytes());
    fix_checksums(&mut b);
    expect_corrupt(decode(&b), "section lengths");
}

#[test]
fn newer_versions_are_unsupported() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    for v in [0u32, FORMAT_VERSION + 1, u32::MAX] {
        // With the header checksum fixed up, and without.
        expect_version(decode(&reseal(v, &meta, &table, &crcs)), v);
        let mut b = bytes.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        expect_version(decode(&b), v);
    }
    // A version-2 body behind a version-1 header.
    let text = String::from_utf8(meta).unwrap();
    let bumped = text.replacen("\"version\":1", "\"version\":2", 1);
    assert_ne!(bumped, text);
    expect_corrupt(
        decode(&reseal(1, bumped.as_bytes(), &table, &crcs)),
        "metadata says version 2",
    );
}

#[test]
fn data_paths_outside_the_directory_are_refused() {
    for bad in [
        "../escape.bin",
        "/etc/passwd",
        "data/../../x.bin",
        "data/..",
        "",
    ] {
        let mut m = sample();
        m.files[1].path = bad.into();
        expect_corrupt(decode(&m.encode()), "outside the checkpoint directory");
    }
    let mut m = sample();
    m.files[1].path = "data/rank1/..hidden".into();
    decode(&m.encode()).unwrap();
}

/// A bad manifest built as a struct and encoded with correct checksums, so the decoder's
/// semantic checks (not its checksums) must catch it.
fn with(f: impl FnOnce(&mut Manifest)) -> Vec<u8> {
    let mut m = sample();
    f(&mut m);
    m.encode()
}

#[test]
fn semantically_bad_manifests_are_corrupt() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "outside its file",
            with(|m| m.chunks[0].offset = m.files[0].size),
        ),
        ("outside its file", with(|m| m.chunks[2].offset = u64::MAX)),
        ("outside its file", with(|m| m.files[1].size = 3)),
        (
            "overflows",
            with(|m| {
                m.tensors[3].shape = vec![1 << 32, 1 << 32, 2];
            }),
        ),
        (
            "overflows",
            // Elements fit in u64, bytes (float16) do not.
            with(|m| m.tensors[3].shape = vec![1 << 63]),
        ),
        (
            "exceeds dim",
            with(|m| {
                m.chunks[1].region = Region::Box {
                    offsets: vec![3, 0],
                    sizes: vec![2, 3],
                }
            }),
        ),
        (
            "exceeds dim",
            with(|m| {
                m.chunks[1].region = Region::Box {
                    offsets: vec![u64::MAX, 0],
                    sizes: vec![2, 3],
                }
            }),
        ),
        (
            "exceeds the tensor",
            with(|m| m.chunks[3].region = Region::Flat { start: 7, len: 14 }),
        ),
        (
            "exceeds the tensor",
            with(|m| {
                m.chunks[3].region = Region::Flat {
                    start: u64::MAX,
                    len: 13,
                }
            }),
        ),
        ("does not match its region", with(|m| m.chunks[3].len -= 4)),
        (
            "checksum index out of range",
            with(|m| m.chunks[4].crc_index = m.checksums.len() as u64),
        ),
        (
            "checksum index out of range",
            with(|m| m.chunks[4].crc_index = u64::MAX),
        ),
        (
            "checksum index out of range",
            with(|m| {
                m.checksums.pop();
            }),
        ),
        (
            "listed twice",
            with(|m| m.tensors[2].key = "model.embed".into()),
        ),
        (
            "unknown dtype",
            with(|m| m.tensors[1].dtype = "float33".into()),
        ),
        (
            "unknown element order",
            with(|m| m.tensors[1].order = "column-major".into()),
        ),
        ("block size", with(|m| m.block_size = 0)),
        ("block size", with(|m| m.block_size = u64::MAX)),
        ("file index", with(|m| m.chunks[0].file = 2)),
        ("file index", with(|m| m.chunks[0].file = u32::MAX)),
        ("ends early", with(|m| m.tensors[3].chunks = 1)),
        ("ends early", with(|m| m.tensors[3].chunks = usize::MAX)),
        (
            "trailing bytes",
            with(|m| {
                m.tensors[2].chunks = 0;
                m.tensors[2].shape = vec![0];
            }),
        ),
        (
            "\"step\": its chunks hold 1 of its 2 elements",
            with(|m| m.tensors[2].shape = vec![2]),
        ),
        (
            "\"optim.exp_avg\": its chunks hold 20 of its 24 elements",
            with(|m| m.tensors[1].shape = vec![2, 2, 6]),
        ),
    ];
    for (needle, bytes) in cases {
        expect_corrupt(decode(&bytes), needle);
    }
}

#[test]
fn bad_raw_sections_are_corrupt() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    let text = String::from_utf8(meta.clone()).unwrap();
    let edit = |from: &str, to: &str| {
        let t = text.replacen(from, to, 1);
        assert_ne!(t, text, "{from} not in metadata");
        reseal(1, t.as_bytes(), &table, &crcs)
    };
    expect_corrupt(decode(&edit("\"crc32c\"", "\"md5\"")), "checksum algorithm");
    expect_corrupt(decode(&edit("{", "[")), "metadata");
    expect_corrupt(
        decode(&edit("\"shape\":[4,3]", "\"shape\":[4,-3]")),
        "metadata",
    );
    expect_corrupt(
        decode(&edit(
            "\"shape\":[4,3]",
            "\"shape\":[4,18446744073709551616]",
        )),
        "metadata",
    );
    expect_corrupt(decode(&edit("\"save_id\"", "\"save_idx\"")), "metadata");
    expect_corrupt(decode(&reseal(1, b"", &table, &crcs)), "metadata");
    expect_corrupt(
        decode(&reseal(1, &meta[..meta.len() - 1], &table, &crcs)),
        "metadata",
    );
    // Unknown region kind.
    let mut t2 = table.clone();
    t2[0] = 7;
    expect_corrupt(decode(&reseal(1, &meta, &t2, &crcs)), "unknown region kind");
    // Checksum table not a whole number of u32s.
    let mut c2 = crcs.clone();
    c2.push(0);
    expect_corrupt(decode(&reseal(1, &meta, &table, &c2)), "section lengths");
    // Nonzero reserved header bytes.
    for at in (12..16).chain(48..64) {
        let mut b = bytes.clone();
        b[at] = 1;
        fix_checksums(&mut b);
        expect_corrupt(decode(&b), "");
    }
}

/// Every 8-byte word of the chunk table set to extreme values, checksums fixed up: the decoder
/// either refuses the manifest or accepts one that is safe to use.
#[test]
fn extreme_table_words_never_panic() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    let mut accepted = 0;
    for w in 0..table.len() / 4 {
        let at = 4 * w;
        let orig = u32::from_le_bytes(table[at..at + 4].try_into().unwrap()) as u64;
        for v in [
            0u64,
            1,
            orig.wrapping_add(1),
            orig.wrapping_sub(1),
            u32::MAX as u64,
            1 << 31,
            u64::MAX,
            1 << 63,
            (1 << 32) + orig,
        ] {
            let mut t = table.clone();
            let n = (table.len() - at).min(8);
            t[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
            let b = reseal(1, &meta, &t, &crcs);
            if let Ok(m) = decode(&b) {
                accepted += 1;
                exercise(&m, &b);
            }
        }
    }
    assert!(
        accepted > 0,
        "no mutation was accepted: the oracle exercised nothing"
    );
}

/// Numbers in the metadata replaced by extreme ones, checksums fixed up.
#[test]
fn extreme_metadata_numbers_never_panic() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    let text = String::from_utf8(meta).unwrap();
    let numbers: Vec<(usize, usize)> = {
        let b = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
                let s = i;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                out.push((s, i));
            } else {
                i += 1;
            }
        }
        out
    };
    assert!(numbers.len() > 10);
    for &(s, e) in &numbers {
        for v in [
            "0",
            "1",
            "-1",
            "1e3",
            "0.5",
            "4294967295",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "9223372036854775808",
        ] {
            let t = format!("{}{}{}", &text[..s], v, &text[e..]);
            let b = reseal(1, t.as_bytes(), &table, &crcs);
            if let Ok(m) = decode(&b) {
                exercise(&m, &b);
            }
        }
    }
}

fn mutate(rng: &mut Seeded, bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for _ in 0..rng.range(1, 4) {
        match rng.below(5) {
            0 | 1 if !b.is_empty() => {
                let i = rng.below(b.len() as u64) as usize;
                b[i] = rng.next() as u8;
            }
            2 if !b.is_empty() => {
                let i = rng.below(b.len() as u64) as usize;
                b.remove(i);
            }
            3 => {
                let i = rng.range(0, b.len() as u64) as usize;
                b.insert(i, rng.next() as u8);
            }
            _ => {
                // An 8-byte field somewhere in the body set to an extreme value.
                if b.len() >= HEADER_LEN + 8 {
                    let i = rng.range(HEADER_LEN as u64, b.len() as u64 - 8) as usize;
                    let v = *rng.pick(&[0u64, u64::MAX, 1 << 63, u32::MAX as u64 + 1]);
                    b[i..i + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10000))]

    /// Random mutations of a valid manifest, sometimes with both checksums recomputed (when the
    /// lengths still parse) so that the structural checks are reached: never a panic, and
    /// without the fix-up never an accepted manifest.
    #[test]
    fn random_mutations_never_panic(seed in any::<u64>(), resealed in any::<bool>()) {
        let mut rng = Seeded::new(seed);
        let bytes = sample().encode();
        let mut b = mutate(&mut rng, &bytes);
        if resealed {
            if b.len() >= HEADER_LEN {
                // Keep the header's lengths consistent with a body edited in place.
                let (meta, table, crcs) = sections(&bytes);
                let delta = b.len() as i64 - bytes.len() as i64;
                let table_len = (table.len() as i64 + delta).max(0) as usize;
                let body = b[HEADER_LEN..].to_vec();
                if meta.len() + crcs.len() <= body.len() {
                    let (m2, rest) = body.split_at(meta.len());
                    let (t2, c2) = rest.split_at(table_len.min(rest.len() - crcs.len()));
                    b = reseal(1, m2, t2, c2);
                }
            }
            if let Ok(m) = decode(&b) {
                exercise(&m, &b);
            }
        } else if b != bytes {
            prop_assert!(decode(&b).is_err());
        }
    }
}

#[test]
fn tensor_without_its_chunks_is_corrupt() {
    let mut m = sample();
    m.tensors.push(TensorEntry {
        key: "ghost".into(),
        dtype: "float32".into(),
        shape: vec![2],
        role: "param".into(),
        order: "row-major".into(),
        chunks: 1,
    });
    m.chunk_start.push(m.chunks.len());
    expect_corrupt(decode(&m.encode()), "ends early");
}

/// One tensor of `ndim` dims of size 1 (a flat chunk and, for `boxed`, a box chunk too).
fn many_dims(ndim: usize, boxed: bool) -> Manifest {
    let mut tensors = vec![SavedTensor {
        key: "deep.flat".into(),
        dtype: "float32".into(),
        shape: vec![1; ndim],
        regions: vec![Region::Flat { start: 0, len: 1 }],
    }];
    if boxed {
        tensors.push(SavedTensor {
            key: "deep.box".into(),
            dtype: "float32".into(),
            shape: vec![1; ndim],
            regions: vec![Region::Box {
                offsets: vec![0; ndim],
                sizes: vec![1; ndim],
            }],
        });
    }
    in_memory_manifest(&tensors, 8)
}

#[test]
fn too_many_dimensions_are_refused_without_recursing() {
    use olmo_chunks_core::region::MAX_NDIM;
    // At the cap: accepted and usable.
    let bytes = many_dims(MAX_NDIM, true).encode();
    let m = decode(&bytes).unwrap();
    check_manifest_coverage(&m).unwrap();
    exercise(&m, &bytes);
    // Above it, up to the 30,000 dims that used to overflow the stack in `verify`.
    for (ndim, boxed) in [(MAX_NDIM + 1, true), (30_000, false), (30_000, true)] {
        let bytes = many_dims(ndim, boxed).encode();
        match decode(&bytes) {
            Ok(m) => {
                // What `verify` runs next; before the cap this overflowed the stack.
                exercise(&m, &bytes);
                panic!("{ndim}-d manifest accepted");
            }
            Err(e) => expect_corrupt(Err(e), "dimensions; at most 64"),
        }
    }
}

#[test]
fn block_sizes_above_the_cap_are_refused() {
    use olmo_chunks_core::manifest::MAX_BLOCK_SIZE;
    assert_eq!(MAX_BLOCK_SIZE, 64 << 20);
    let at_cap = with(|m| m.block_size = MAX_BLOCK_SIZE);
    decode(&at_cap).unwrap();
    for bs in [MAX_BLOCK_SIZE + 1, 1 << 30, 1 << 40] {
        // A crafted manifest with a 1 GiB block size made `verify` allocate 1 GiB per worker.
        expect_corrupt(decode(&with(|m| m.block_size = bs)), "block size");
    }
}

#[test]
fn deeply_nested_entries_do_not_overflow_the_stack() {
    let bytes = sample().encode();
    let (meta, table, crcs) = sections(&bytes);
    let text = String::from_utf8(meta).unwrap();
    for depth in [200usize, 100_000] {
        let nested = format!("{{\"x\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
        let t = text.replacen("\"entries\":{}", &format!("\"entries\":{nested}"), 1);
        assert_ne!(t, text);
        // Kept verbatim (entries are the Python layer's) or refused; never a crash.
        match decode(&reseal(1, t.as_bytes(), &table, &crcs)) {
            Ok(m) => assert!(m.entries.get().starts_with("{\"x\":[[")),
            Err(e) => expect_corrupt(Err(e), "metadata"),
        }
    }
}

#[test]
fn a_large_junk_manifest_is_refused_from_its_header_without_being_read() {
    use olmo_chunks_core::{LocalFs, Storage, MANIFEST_NAME};
    let dir = tempfile::tempdir().unwrap();
    let junk = vec![b'x'; 8 << 20];
    std::fs::write(dir.path().join(MANIFEST_NAME), &junk).unwrap();
    let storage = LocalFs::new(dir.path());
    let refused = |needle: &str| match Manifest::open_from(&storage) {
        Err(CoreError::CorruptManifest { reason, .. }) => {
            assert!(reason.contains(needle), "{reason}")
        }
        other => panic!(
            "expected CorruptManifest ({needle}), got {:?}",
            other.map(|_| ())
        ),
    };
    refused("bad magic");
    // A valid header whose sections do not add up to the file's size: refused from the header.
    let mut grown = sample().encode();
    grown.resize(8 << 20, 0);
    std::fs::write(dir.path().join(MANIFEST_NAME), &grown).unwrap();
    refused("do not match the file size 8388608");
    assert_eq!(
        storage
            .counters()
            .read
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The real one still opens, and is read once.
    let good = sample().encode();
    std::fs::write(dir.path().join(MANIFEST_NAME), &good).unwrap();
    assert_eq!(Manifest::open_from(&storage).unwrap().encode(), good);
    assert_eq!(
        storage
            .counters()
            .read
            .load(std::sync::atomic::Ordering::Relaxed),
        good.len() as u64
    );
}
