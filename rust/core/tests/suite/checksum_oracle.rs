//! The block checksum (`checksum`, crc-fast's folding) against the `crc32c` crate's CRC-32C, whole
//! and fed in random pieces; and `Object::read_exact_at_seen` of a local file against its bytes:
//! every buffer filled and every byte handed to `seen`, in order, once, across its windows.

use std::io::Write;

use olmo_chunks_core::checksum::{crc32c, Crc32c};
use olmo_chunks_core::storage::SEEN_WINDOW;
use olmo_chunks_core::{LocalFs, Storage};
use proptest::prelude::*;

#[test]
fn the_standard_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn equals_the_crc32c_crate_whole_and_in_pieces(
        data in proptest::collection::vec(any::<u8>(), 0..70_000),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        prop_assert_eq!(crc32c(&data), crc32c::crc32c(&data));
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(data.len() + 1)).collect();
        at.sort_unstable();
        let mut fed = Crc32c::default();
        let mut from = 0;
        for &to in at.iter().chain([&data.len()]) {
            fed.update(&data[from..to]);
            from = to;
        }
        prop_assert_eq!(fed.take(), crc32c::crc32c(&data));
        fed.update(&data);
        prop_assert_eq!(fed.take(), crc32c::crc32c(&data), "take starts afresh");
    }

    #[test]
    fn a_local_read_hands_every_byte_to_seen_in_order(
        lens in proptest::collection::vec(0usize..(SEEN_WINDOW + 999), 1..6),
        offset in 0u64..5000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let total: usize = lens.iter().sum();
        let bytes: Vec<u8> = (0..offset as usize + total).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::File::create(dir.path().join("f")).unwrap().write_all(&bytes).unwrap();
        let f = LocalFs::new(dir.path()).open("f").unwrap();
        let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0; n]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let mut seen = Vec::new();
        let mut calls = 0usize;
        f.read_exact_at_seen(&mut slices, offset, &mut |b| { seen.extend_from_slice(b); calls += 1; }).unwrap();
        let want = &bytes[offset as usize..];
        prop_assert_eq!(&bufs.concat()[..], want);
        prop_assert_eq!(&seen[..], want);
        // At most one call per buffer piece of each window.
        prop_assert!(calls <= total.div_ceil(SEEN_WINDOW) + lens.len());
    }
}
