//! The block checksum (`checksum`, crc-fast's folding) against the `crc32c` crate's CRC-32C, whole
//! and fed in random pieces; and `Object::read_exact_at_seen` of a local file against its bytes:
//! every buffer filled and every byte handed to `seen`, in order, once, across its windows. And
//! a block's CRC-32C from shares folded by several readers (`checksum::Parts`), each holding some
//! of its bytes, against the CRC-32C of the whole block.

use std::io::Write;

use olmo_chunks_core::checksum::{crc32c, regs3, shift, update, zeros_constant, Crc32c, Parts};
use olmo_chunks_core::storage::SEEN_WINDOW;
use olmo_chunks_core::{LocalFs, Storage};
use proptest::prelude::*;

#[test]
fn the_standard_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
}

#[test]
fn zeros_shift_a_register_as_feeding_them_does() {
    for n in [0u64, 1, 2, 3, 7, 8, 64, 1000, 4096, 65_537] {
        for reg in [0u32, 1, 0x8000_0000, 0xDEAD_BEEF, !0] {
            assert_eq!(
                shift(reg, n),
                update(reg, &vec![0u8; n as usize]),
                "n {n} reg {reg:#x}"
            );
        }
        let d: Vec<u8> = (0..n).map(|i| (i * 31 + 7) as u8).collect();
        assert_eq!(
            update(0, &d) ^ zeros_constant(n),
            crc32c::crc32c(&d),
            "n {n}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The block cut into runs, each run given to one of `readers` (runs of one reader may also be
    /// fed twice, overlapping): the XOR of the readers' shares and the length's constant is the
    /// block's CRC-32C; and a changed byte changes it.
    #[test]
    fn shares_of_a_block_xor_to_its_crc(
        data in proptest::collection::vec(any::<u8>(), 1..20_000),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..40),
        owners in proptest::collection::vec(0usize..4, 41),
        again in proptest::collection::vec(any::<bool>(), 41),
        flip in any::<prop::sample::Index>(),
    ) {
        let n = data.len();
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(n + 1)).collect();
        at.push(0);
        at.push(n);
        at.sort_unstable();
        at.dedup();
        let runs: Vec<(usize, usize)> = at.windows(2).map(|w| (w[0], w[1])).collect();
        let fold = |data: &[u8]| {
            let mut readers: Vec<Parts> = (0..4).map(|_| Parts::new(n as u64)).collect();
            for (i, &(a, b)) in runs.iter().enumerate() {
                let r = &mut readers[owners[i]];
                r.feed(a as u64, &data[a..b]);
                if again[i] {
                    // a second destination of the same bytes, or the tail of them
                    let from = a + (b - a) / 2;
                    r.feed(from as u64, &data[from..b]);
                }
            }
            readers.into_iter().fold(zeros_constant(n as u64), |x, r| x ^ r.finish())
        };
        prop_assert_eq!(fold(&data), crc32c::crc32c(&data));
        let mut bad = data.clone();
        bad[flip.index(n)] ^= 0x10;
        prop_assert_ne!(fold(&bad), crc32c::crc32c(&data));
    }

    /// Three pieces' registers at once (interleaved where the CPU has the instruction), of any
    /// lengths, and a fold fed them by register, against feeding their bytes.
    #[test]
    fn three_registers_at_once_equal_one_at_a_time(
        data in proptest::collection::vec(any::<u8>(), 0..3000),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 5),
    ) {
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(data.len() + 1)).collect();
        at.sort_unstable();
        let pieces = [&data[at[0]..at[1]], &data[at[2]..at[3]], &data[at[3]..at[4]]];
        prop_assert_eq!(regs3(pieces), pieces.map(|p| update(0, p)));
        let n = data.len() as u64;
        let (mut by_reg, mut by_bytes) = (Parts::new(n), Parts::new(n));
        for (&(a, b), reg) in [(at[0], at[1]), (at[2], at[3]), (at[3], at[4])].iter().zip(regs3(pieces)) {
            if b > a {
                by_reg.feed_reg(a as u64, (b - a) as u64, reg);
                by_bytes.feed(a as u64, &data[a..b]);
            }
        }
        prop_assert_eq!(by_reg.finish(), by_bytes.finish());
    }

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
