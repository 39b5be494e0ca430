//! Cooperative loads against the direct read as the oracle: random checkpoints, random ranks with
//! random targets, random budgets. The plan is run round by round with an in-process all-to-all;
//! every rank must end with exactly the bytes a direct read gives it, every needed block must be
//! read by exactly one rank that needs it, and the bytes a round moves between ranks must stay within
//! the budget.

use std::collections::{BTreeMap, BTreeSet};

use crate::common::*;
use olmo_chunks_core::coop::{self, ReadPlan};
use olmo_chunks_core::{plan_copies, read_into, ByteCopy, LocalFs, Manifest, Target};
use proptest::prelude::*;

fn random_tensors(rng: &mut Seeded) -> Vec<SavedTensor> {
    let dtypes = ["uint8", "float32", "int64"];
    (0..rng.range(1, 3))
        .map(|i| {
            let shape: Vec<u64> = (0..rng.range(1, 3)).map(|_| rng.range(1, 9)).collect();
            SavedTensor {
                key: format!("t{i}"),
                dtype: rng.pick(&dtypes).to_string(),
                regions: random_partition(rng, &shape),
                shape,
            }
        })
        .collect()
}

/// One rank's targets and the bytes a direct read puts in its buffers.
struct Rank {
    copies: Vec<ByteCopy>,
    lens: Vec<usize>,
    direct: Vec<Vec<u8>>,
}

fn rank_targets(
    rng: &mut Seeded,
    m: &Manifest,
    tensors: &[SavedTensor],
    dir: &std::path::Path,
) -> Rank {
    let mut targets = Vec::new();
    let mut lens = Vec::new();
    for _ in 0..rng.range(0, 3) {
        let ti = rng.below(tensors.len() as u64) as usize;
        let item = olmo_chunks_core::dtype::itemsize(&tensors[ti].dtype).unwrap();
        let w = random_target(rng, &tensors[ti].shape);
        targets.push(Target {
            tensor: ti,
            pieces: w.pieces,
            dest: lens.len(),
            dest_len: w.dest_elems * item,
        });
        lens.push((w.dest_elems * item) as usize);
    }
    let copies = plan_copies(m, &targets).unwrap();
    let mut direct: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0xA5; n]).collect();
    read_into(
        dir,
        m,
        copies.clone(),
        direct.iter_mut().map(|b| b.as_mut_slice()).collect(),
        true,
        2,
    )
    .unwrap();
    Rank {
        copies,
        lens,
        direct,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn cooperative_loads_equal_direct_reads(
        seed in any::<u64>(),
        block in prop::sample::select(vec![1u64, 3, 8, 64, 100]),
        world in 1usize..=5,
        budget in prop::sample::select(vec![1u64, 7, 64, 500, 1 << 20]),
    ) {
        let mut rng = Seeded::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let tensors = random_tensors(&mut rng);
        save(dir.path(), &tensors, 2, block, 2);
        let m = Manifest::open(dir.path()).unwrap();
        let ranks: Vec<Rank> = (0..world).map(|_| rank_targets(&mut rng, &m, &tensors, dir.path())).collect();

        // Needs travel in their wire form, as between processes.
        let needs: Vec<Vec<coop::Need>> = ranks
            .iter()
            .map(|r| coop::decode_needs(&coop::encode_needs(&coop::needs(&m, &r.copies))).unwrap())
            .collect();
        let plans: Vec<ReadPlan> = coop::plan(&m, &needs, budget)
            .unwrap()
            .iter()
            .map(|p| ReadPlan::decode(&p.encode()).unwrap())
            .collect();
        let rounds = plans[0].rounds.len();
        prop_assert!(plans.iter().all(|p| p.rounds.len() == rounds && p.world as usize == world));

        // Oracle for the reads: every needed block once, by a rank that needs it.
        let mut wanted: BTreeMap<(u64, u64), BTreeSet<usize>> = BTreeMap::new();
        for (r, list) in needs.iter().enumerate() {
            for n in list {
                wanted.entry((n.span.chunk, n.block)).or_default().insert(r);
            }
        }
        let mut read_by: BTreeMap<(u64, u64), usize> = BTreeMap::new();
        for (r, p) in plans.iter().enumerate() {
            for round in &p.rounds {
                for s in &round.reads {
                    prop_assert!(s.lo % block == 0 && s.count == 1);
                    let mut b = s.lo / block;
                    while b * block < s.lo + s.len {
                        prop_assert!(read_by.insert((s.chunk, b), r).is_none(), "block read twice");
                        prop_assert!(wanted[&(s.chunk, b)].contains(&r), "read by a rank that does not need it");
                        b += 1;
                    }
                }
            }
        }
        prop_assert_eq!(read_by.keys().collect::<Vec<_>>(), wanted.keys().collect::<Vec<_>>());
        // Exactly the needed bytes move: what a rank receives is what it needs of blocks others read.
        for (r, p) in plans.iter().enumerate() {
            let received: u64 = p.rounds.iter().flat_map(|k| &k.recvs).flat_map(|x| &x.1).map(|s| s.bytes()).sum();
            let needed: u64 = needs[r].iter().filter(|n| read_by[&(n.span.chunk, n.block)] != r).map(|n| n.span.bytes()).sum();
            prop_assert_eq!(received, needed);
        }

        // The cost model's inputs against a brute-force count: a direct load reads each block a
        // rank needs, whole; reading once reads each needed block once in all.
        let block_len = |(c, b): (u64, u64)| (m.chunks[c as usize].len - b * block).min(block);
        let direct: Vec<u64> = needs.iter().map(|list| {
            list.iter().map(|n| (n.span.chunk, n.block)).collect::<BTreeSet<_>>().into_iter().map(block_len).sum()
        }).collect();
        prop_assert_eq!(&coop::direct_bytes(&m, &needs), &direct);
        let once_reads: u64 = plans.iter().flat_map(|p| &p.rounds).map(|k| k.read_len()).sum();
        prop_assert_eq!(once_reads, wanted.keys().copied().map(block_len).sum::<u64>());
        prop_assert!(once_reads <= direct.iter().sum::<u64>());
        let rates = coop::Rates { storage: 1e3, exchange: 4e3, round: 0.5, copy: 8e3 };
        // Pipelined: round k+1's reads overlap round k's exchange; the first round's reads do not.
        let mut reads_s = vec![0.0; rounds + 1];
        let mut moves_s = vec![0.0; rounds];
        let mut copies_s = vec![0.0; rounds];
        for k in 0..rounds {
            for p in &plans {
                let bytes = |peers: &[(u32, Vec<coop::Span>)]| peers.iter().flat_map(|x| &x.1).map(|s| s.bytes()).sum::<u64>();
                reads_s[k] = f64::max(reads_s[k], p.rounds[k].read_len() as f64 / 1e3);
                moves_s[k] = f64::max(moves_s[k], bytes(&p.rounds[k].sends).max(bytes(&p.rounds[k].recvs)) as f64 / 4e3);
                copies_s[k] = f64::max(copies_s[k], (bytes(&p.rounds[k].sends) + bytes(&p.rounds[k].recvs)) as f64 / 8e3);
            }
        }
        let once_s = if rounds == 0 { 0.0 } else {
            reads_s[0] + (0..rounds).map(|k| f64::max(moves_s[k] + copies_s[k] + 0.5, reads_s[k + 1])).sum::<f64>()
        };
        let got = coop::predict(&direct, &plans, &rates);
        prop_assert!((got.once - once_s).abs() < 1e-9 && (got.direct - *direct.iter().max().unwrap() as f64 / 1e3).abs() < 1e-9);

        // Run the rounds with an in-process all-to-all.
        let storage = LocalFs::new(dir.path());
        let mut bufs: Vec<Vec<Vec<u8>>> = ranks.iter().map(|r| r.lens.iter().map(|&n| vec![0xA5; n]).collect()).collect();
        let mut copied = vec![0u64; world];
        for k in 0..rounds {
            let mut sent: Vec<BTreeMap<usize, Vec<u8>>> = vec![BTreeMap::new(); world];
            for (r, p) in plans.iter().enumerate() {
                let round = &p.rounds[k];
                let total: u64 = round.sends.iter().flat_map(|s| &s.1).map(|s| s.bytes()).sum();
                let mut send = vec![0u8; total as usize];
                let by_round = p.copies_by_round(&m, &ranks[r].copies);
                let dests = bufs[r].iter_mut().map(|b| b.as_mut_slice()).collect();
                copied[r] += coop::read_round(&storage, &m, round, &by_round[k], &mut send, dests, true, 2).unwrap().1;
                // Only what moves between ranks is staged. A rank goes over the budget in a round
                // only for one block that alone does (a block it shares with another rank).
                let cost = send.len()
                    + round.recvs.iter().flat_map(|s| &s.1).map(|s| s.bytes() as usize).sum::<usize>();
                let start = p.starts[k];
                let end = p.starts.get(k + 1).copied().unwrap_or((u64::MAX, 0));
                let moving = needs[r].iter().map(|n| (n.span.chunk, n.block))
                    .filter(|b| *b >= start && *b < end && wanted[b].len() > 1)
                    .collect::<BTreeSet<_>>().len();
                prop_assert!(cost as u64 <= budget || moving == 1, "rank {} round {} stages {} > {}", r, k, cost, budget);
                let mut at = 0usize;
                for (peer, spans) in &round.sends {
                    let n: usize = spans.iter().map(|s| s.bytes() as usize).sum();
                    sent[*peer as usize].insert(r, send[at..at + n].to_vec());
                    at += n;
                }
            }
            for (r, p) in plans.iter().enumerate() {
                let round = &p.rounds[k];
                let recv: Vec<u8> = round.recvs.iter().flat_map(|(peer, _)| sent[r][&(*peer as usize)].clone()).collect();
                let by_round = p.copies_by_round(&m, &ranks[r].copies);
                copied[r] += coop::fill_round(
                    round, &recv, &by_round[k],
                    bufs[r].iter_mut().map(|b| b.as_mut_slice()).collect(), 2,
                ).unwrap();
            }
        }
        for (r, rank) in ranks.iter().enumerate() {
            prop_assert_eq!(copied[r], rank.copies.iter().map(|c| c.len).sum::<u64>());
            prop_assert!(bufs[r] == rank.direct, "rank {} differs from the direct read", r);
        }
    }
}

#[test]
fn crafted_plans_and_needs_are_refused() {
    assert!(coop::decode_needs(&[0u8; 12]).is_err());
    assert!(ReadPlan::decode(&[0u8; 7]).is_err());
    // world 1, one round that ends early
    let words: Vec<u8> = [1u64, 1, 0, 0]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    assert!(ReadPlan::decode(&words).is_err());
    // a send to a rank outside the world
    let words: Vec<u8> = [1u64, 1, 0, 0, 0, 1, 5, 0, 0]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    assert!(ReadPlan::decode(&words).is_err());
}

#[test]
fn a_column_of_a_block_is_one_strided_span() {
    let tensors = vec![SavedTensor {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![8, 8],
        regions: vec![olmo_chunks_core::Region::Box {
            offsets: vec![0, 0],
            sizes: vec![8, 8],
        }],
    }];
    let m = in_memory_manifest(&tensors, 64); // 4 rows of 16 bytes per block
    let piece = olmo_chunks_core::Piece {
        offsets: vec![0, 2],
        sizes: vec![8, 2],
        local_start: 0,
        strides: vec![2, 1],
    };
    let copies = plan_copies(
        &m,
        &[Target {
            tensor: 0,
            pieces: vec![piece],
            dest: 0,
            dest_len: 64,
        }],
    )
    .unwrap();
    let needs = coop::needs(&m, &copies);
    assert_eq!(needs.len(), 4, "{needs:?}"); // one per block
    for (b, n) in needs.iter().enumerate() {
        let want = coop::Span {
            chunk: 0,
            lo: b as u64 * 64 + 8,
            len: 8,
            stride: 32,
            count: 2,
        };
        assert_eq!((n.block, n.span), (b as u64, want));
    }
}

#[test]
fn readers_read_runs_of_adjacent_blocks_and_stay_balanced() {
    // 64 blocks of 1 MiB, needed whole by 4 ranks: each reads 16 of them, in runs of at least 8
    // (one I/O unit), not every fourth block (which would split an object store's requests at each).
    let (rows, cols) = (64u64, 1u64 << 18);
    let tensors = vec![SavedTensor {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![rows, cols],
        regions: vec![olmo_chunks_core::Region::Box {
            offsets: vec![0, 0],
            sizes: vec![rows, cols],
        }],
    }];
    let m = in_memory_manifest(&tensors, 1 << 20);
    let whole = olmo_chunks_core::Piece {
        offsets: vec![0, 0],
        sizes: vec![rows, cols],
        local_start: 0,
        strides: vec![cols, 1],
    };
    let target = Target {
        tensor: 0,
        pieces: vec![whole],
        dest: 0,
        dest_len: rows * cols * 4,
    };
    let copies = plan_copies(&m, &[target]).unwrap();
    let needs = vec![coop::needs(&m, &copies); 4];
    let plans = coop::plan(&m, &needs, u64::MAX).unwrap();
    for (r, p) in plans.iter().enumerate() {
        let reads: Vec<(u64, u64)> = p
            .rounds
            .iter()
            .flat_map(|k| &k.reads)
            .map(|s| (s.lo, s.len))
            .collect();
        let total: u64 = reads.iter().map(|&(_, len)| len).sum();
        assert_eq!(total, 16 << 20, "rank {r}: {reads:?}");
        assert!(
            reads.len() <= 2 && reads.iter().all(|&(_, len)| len >= 8 << 20),
            "rank {r}: {reads:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `needs` against byte coverage: per block, its spans expand to exactly the maximal runs of
    /// bytes the copies read (in order, inside the block), whatever the copies' order and overlaps.
    #[test]
    fn needs_are_the_bytes_copies_read(
        seed in any::<u64>(),
        block in prop::sample::select(vec![1u64, 3, 8, 64]),
    ) {
        let mut rng = Seeded::new(seed);
        let tensors = vec![SavedTensor {
            key: "w".into(),
            dtype: "uint8".into(),
            shape: vec![4, 50],
            regions: random_partition(&mut rng, &[4, 50]),
        }];
        let m = in_memory_manifest(&tensors, block);
        let mut copies = Vec::new();
        for _ in 0..rng.range(0, 40) {
            let chunk = rng.below(m.chunks.len() as u64) as usize;
            let len = m.chunks[chunk].len;
            let src = rng.below(len + 1);
            let n = if rng.below(4) == 0 { rng.below(len - src + 1) } else { rng.below(3.min(len - src) + 1) };
            copies.push(ByteCopy { chunk, src, dst: 0, dst_off: 0, len: n });
        }
        let mut covered: BTreeSet<(u64, u64)> = BTreeSet::new(); // (chunk, byte)
        for c in &copies {
            covered.extend((c.src..c.src + c.len).map(|b| (c.chunk as u64, b)));
        }
        let mut runs: Vec<(u64, u64, u64, u64)> = Vec::new(); // (chunk, block, lo, hi)
        for &(chunk, b) in &covered {
            match runs.last_mut() {
                Some(r) if r.0 == chunk && r.1 == b / block && r.3 == b => r.3 += 1,
                _ => runs.push((chunk, b / block, b, b + 1)),
            }
        }
        let got: Vec<(u64, u64, u64, u64)> = coop::needs(&m, &copies)
            .iter()
            .flat_map(|n| n.span.pieces().map(move |(lo, hi)| (n.span.chunk, n.block, lo, hi)).collect::<Vec<_>>())
            .collect();
        prop_assert_eq!(got, runs);
    }
}
