//! Cooperative loads against the direct read as the oracle: random checkpoints, random ranks with
//! random targets, random budgets. The plan is run round by round with an in-process all-to-all;
//! every rank must end with exactly the bytes a direct read gives it, every needed block must be
//! read by exactly one rank that needs it, and the bytes a round moves between ranks must stay within
//! the budget.

use std::collections::{BTreeMap, BTreeSet};

use crate::common::*;
use olmo_chunks_core::coop::{self, ReadPlan};
use olmo_chunks_core::io::read_from_trusting;
use olmo_chunks_core::{plan_copies, read_into, ByteCopy, CoreError, LocalFs, Manifest, Target};
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
    for _ in 0..rng.range(0, 3) {
        let ti = rng.below(tensors.len() as u64) as usize;
        let w = random_target(rng, &tensors[ti].shape);
        targets.push((ti, w.pieces, w.dest_elems));
    }
    rank_of(m, tensors, dir, targets)
}

/// Ranks whose targets partition every tensor between them (a reshard): each box of a random
/// partition of each tensor goes to a random rank, the boxes of one rank and tensor packed into
/// one buffer with random local layouts.
fn partition_ranks(
    rng: &mut Seeded,
    m: &Manifest,
    tensors: &[SavedTensor],
    dir: &std::path::Path,
    world: usize,
) -> Vec<Rank> {
    let mut targets: Vec<Vec<(usize, Vec<olmo_chunks_core::Piece>, u64)>> = vec![Vec::new(); world];
    for (ti, t) in tensors.iter().enumerate() {
        let mut mine: Vec<(Vec<olmo_chunks_core::Piece>, u64)> = vec![(Vec::new(), 0); world];
        for r in random_partition(rng, &t.shape) {
            let boxes = match r {
                olmo_chunks_core::Region::Box { offsets, sizes } => vec![(offsets, sizes)],
                olmo_chunks_core::Region::Flat { start, len } => {
                    olmo_chunks_core::region::flat_boxes(&t.shape, start, start + len)
                }
            };
            let owner = &mut mine[rng.below(world as u64) as usize];
            for (o, s) in boxes {
                let (p, e) = strided_piece(rng, o, s, owner.1);
                owner.0.push(p);
                owner.1 = e;
            }
        }
        for (r, (pieces, extent)) in mine.into_iter().enumerate() {
            if !pieces.is_empty() {
                targets[r].push((ti, pieces, extent));
            }
        }
    }
    targets
        .into_iter()
        .map(|t| rank_of(m, tensors, dir, t))
        .collect()
}

/// A rank with targets `(tensor, pieces, elements of its buffer)`, and what a direct read gives it.
fn rank_of(
    m: &Manifest,
    tensors: &[SavedTensor],
    dir: &std::path::Path,
    wanted: Vec<(usize, Vec<olmo_chunks_core::Piece>, u64)>,
) -> Rank {
    let mut targets = Vec::new();
    let mut lens = Vec::new();
    for (ti, pieces, elems) in wanted {
        let item = olmo_chunks_core::dtype::itemsize(&tensors[ti].dtype).unwrap();
        targets.push(Target {
            tensor: ti,
            pieces,
            dest: lens.len(),
            dest_len: elems * item,
        });
        lens.push((elems * item) as usize);
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

/// A random checkpoint saved with blocks of `block` bytes and `world` ranks' random targets in it.
fn random_job(
    seed: u64,
    block: u64,
    world: usize,
) -> (Seeded, tempfile::TempDir, Manifest, Vec<Rank>) {
    let mut rng = Seeded::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let tensors = random_tensors(&mut rng);
    save(dir.path(), &tensors, 2, block, 2);
    let m = Manifest::open(dir.path()).unwrap();
    let ranks = (0..world)
        .map(|_| rank_targets(&mut rng, &m, &tensors, dir.path()))
        .collect();
    (rng, dir, m, ranks)
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
        let (_, dir, m, ranks) = random_job(seed, block, world);

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
        prop_assert_eq!(&coop::direct_bytes(&m, &needs, &[]), &direct);
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
fn crafted_lists_of_trusted_blocks_are_refused() {
    let tensors = vec![SavedTensor {
        key: "w".into(),
        dtype: "uint8".into(),
        shape: vec![100],
        regions: vec![olmo_chunks_core::Region::Box {
            offsets: vec![0],
            sizes: vec![100],
        }],
    }];
    let m = in_memory_manifest(&tensors, 30); // one chunk of 4 blocks
    let wire = |w: &[u64]| -> Vec<u8> { w.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let checks = coop::Checks {
        trusted: vec![(0, 0), (0, 1), (0, 2), (0, 3)],
        split: vec![(0, 2), (0, 3)],
    };
    assert_eq!(
        coop::decode_checks(&m, &wire(&[0, 1, 3, 0]))
            .unwrap()
            .trusted,
        vec![(0, 1), (0, 2), (0, 3)]
    );
    assert_eq!(
        coop::encode_checks(&checks),
        wire(&[0, 0, 2, 0, 0, 2, 2, 1])
    );
    assert_eq!(
        coop::decode_checks(&m, &coop::encode_checks(&checks)).unwrap(),
        checks
    );
    for bad in [
        vec![0u8; 12],              // not whole words
        wire(&[0, 1, 1]),           // not whole runs
        wire(&[0, 2, 3, 0]),        // past the chunk's last block
        wire(&[1, 0, 1, 0]),        // no such chunk
        wire(&[0, u64::MAX, 2, 0]), // overflows
        wire(&[0, 0, 1, 2]),        // neither split nor not
    ] {
        let e = coop::decode_checks(&m, &bad).unwrap_err();
        assert!(
            matches!(e, olmo_chunks_core::CoreError::InvalidArgument(_)),
            "{e}"
        );
    }
    for bad in [wire(&[0, 1]), wire(&[0, 1, 1 << 32])] {
        let e = coop::decode_shares(&bad).unwrap_err();
        assert!(
            matches!(e, olmo_chunks_core::CoreError::InvalidArgument(_)),
            "{e}"
        );
    }
    let e = coop::check_shares(&m, &[(0, 4, 0)], &|p| p.into()).unwrap_err();
    assert!(
        matches!(e, olmo_chunks_core::CoreError::InvalidArgument(_)),
        "{e}"
    );
}

/// A Shard(0) -> Shard(1) reshard: rows saved whole, each of 4 ranks wanting a quarter of every
/// row. Every block is split between them, on one host or several.
#[test]
fn column_quarters_of_row_blocks_are_split() {
    let tensors = vec![SavedTensor {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![64, 32],
        regions: vec![olmo_chunks_core::Region::Box {
            offsets: vec![0, 0],
            sizes: vec![64, 32],
        }],
    }];
    let m = in_memory_manifest(&tensors, 1000); // rows of 128 bytes, blocks of 1000
    let needs: Vec<Vec<coop::Need>> = (0..4u64)
        .map(|r| {
            let pieces = vec![olmo_chunks_core::Piece {
                offsets: vec![0, 8 * r],
                sizes: vec![64, 8],
                local_start: 0,
                strides: vec![8, 1],
            }];
            let t = Target {
                tensor: 0,
                pieces,
                dest: 0,
                dest_len: 64 * 8 * 4,
            };
            coop::needs(&m, &plan_copies(&m, &[t]).unwrap())
        })
        .collect();
    let blocks: Vec<(u64, u64)> = (0..9).map(|b| (0, b)).collect();
    for hosts in [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 2, 3]] {
        for c in coop::delegate_checks(&m, &needs, &hosts) {
            assert_eq!(c.split, blocks, "hosts {hosts:?}");
        }
    }
    // Two ranks wanting the same half of each row: checked whole by one of them.
    let halves = vec![needs[0].clone(), needs[0].clone()];
    assert!(coop::delegate_checks(&m, &halves, &[0, 0])
        .iter()
        .all(|c| c.split.is_empty()));
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

    /// Read directly with checks delegated: every block is split, its ranks holding every byte of
    /// it once between them (a brute-force count) and each folding a share of its checksum, or on
    /// each host that needs it checked by exactly one rank there (one that needs it whole where
    /// there is one). Each rank ends with the bytes a checked read gives it, the shares add up
    /// (`split_sum`, `check_shares`), and a block corrupted on disk is caught on every host that
    /// reads it (by its checker there), or by its shares. The cost model counts a trusted block at
    /// the rank's own bytes of it.
    #[test]
    fn delegated_checks_catch_every_bad_block_once_per_host(
        seed in any::<u64>(),
        block in prop::sample::select(vec![1u64, 3, 8, 64, 100]),
        world in 1usize..=5,
        host_count in 1u64..=3,
        reshard in any::<bool>(),
    ) {
        let (mut rng, dir, m, mut ranks) = random_job(seed, block, world);
        if reshard {
            let tensors: Vec<SavedTensor> = random_tensors(&mut Seeded::new(seed)); // random_job's
            ranks = partition_ranks(&mut rng, &m, &tensors, dir.path(), world);
        }
        let hosts: Vec<u64> = (0..world).map(|_| rng.below(host_count)).collect();
        let needs: Vec<Vec<coop::Need>> = ranks.iter().map(|r| coop::needs(&m, &r.copies)).collect();
        let checks: Vec<coop::Checks> = coop::delegate_checks(&m, &needs, &hosts)
            .iter()
            .map(|c| coop::decode_checks(&m, &coop::encode_checks(c)).unwrap())
            .collect();
        let trusted: Vec<&Vec<(u64, u64)>> = checks.iter().map(|c| &c.trusted).collect();

        let block_len = |(c, b): (u64, u64)| (m.chunks[c as usize].len - b * block).min(block);
        let mut own: BTreeMap<(u64, u64, usize), u64> = BTreeMap::new(); // (chunk, block, rank) -> bytes
        // (chunk, block) -> how many ranks need each byte of the block
        let mut cover: BTreeMap<(u64, u64), Vec<u32>> = BTreeMap::new();
        for (r, list) in needs.iter().enumerate() {
            for n in list {
                *own.entry((n.span.chunk, n.block, r)).or_default() += n.span.bytes();
                let len = block_len((n.span.chunk, n.block)) as usize;
                let counts = cover.entry((n.span.chunk, n.block)).or_insert_with(|| vec![0; len]);
                for (lo, hi) in n.span.pieces() {
                    for x in lo..hi {
                        counts[(x - n.block * block) as usize] += 1;
                    }
                }
            }
        }
        let mut checkers: BTreeMap<(u64, u64, u64), Vec<usize>> = BTreeMap::new();
        let mut needers: BTreeMap<(u64, u64, u64), Vec<usize>> = BTreeMap::new();
        let mut splitters: BTreeMap<(u64, u64), Vec<usize>> = BTreeMap::new();
        for &(c, b, r) in own.keys() {
            needers.entry((c, b, hosts[r])).or_default().push(r);
            if !trusted[r].contains(&(c, b)) {
                checkers.entry((c, b, hosts[r])).or_default().push(r);
            }
            if checks[r].split.contains(&(c, b)) {
                splitters.entry((c, b)).or_default().push(r);
            }
        }
        for (r, c) in checks.iter().enumerate() {
            for &(ch, b) in &c.trusted {
                prop_assert!(own.contains_key(&(ch, b, r)), "rank {} trusts a block it does not need", r);
            }
            prop_assert!(c.split.iter().all(|b| c.trusted.contains(b)), "split blocks are trusted");
        }
        for (&(c, b), split) in &splitters {
            let all: Vec<usize> = own.keys().filter(|k| (k.0, k.1) == (c, b)).map(|k| k.2).collect();
            prop_assert_eq!(split, &all, "block {:?}: split by some of its ranks only", (c, b));
            prop_assert!(all.len() > 1);
            prop_assert!(cover[&(c, b)].iter().all(|&n| n == 1), "block {:?} split but not a partition", (c, b));
        }
        for (key, rs) in &needers {
            if splitters.contains_key(&(key.0, key.1)) {
                prop_assert!(!checkers.contains_key(key), "block {:?}: split and checked", key);
                continue;
            }
            let checked_by = checkers.get(key).cloned().unwrap_or_default();
            prop_assert_eq!(checked_by.len(), 1, "block {:?} checked by {:?} of {:?}", key, checked_by, rs);
            let whole = |r: usize| own[&(key.0, key.1, r)] >= block_len((key.0, key.1));
            if rs.iter().any(|&r| whole(r)) {
                prop_assert!(whole(checked_by[0]));
            }
        }
        let direct: Vec<u64> = (0..world).map(|r| {
            own.iter().filter(|(k, _)| k.2 == r).map(|(&(c, b, _), &n)| {
                if trusted[r].contains(&(c, b)) { n.min(block_len((c, b))) } else { block_len((c, b)) }
            }).sum()
        }).collect();
        prop_assert_eq!(coop::direct_bytes(&m, &needs, &checks), direct);

        type Shares = Vec<(u64, u64, u32)>;
        let read = |r: usize| -> (Vec<Vec<u8>>, olmo_chunks_core::Result<Shares>) {
            let mut bufs: Vec<Vec<u8>> = ranks[r].lens.iter().map(|&n| vec![0xA5; n]).collect();
            let done = read_from_trusting(
                &LocalFs::new(dir.path()),
                &m,
                ranks[r].copies.clone(),
                bufs.iter_mut().map(|b| b.as_mut_slice()).collect(),
                true,
                &checks[r],
                2,
            );
            (bufs, done)
        };
        let name = |rel: &str| dir.path().join(rel);
        // The shares: checked block by block, and by the one word per rank the last step sums.
        let add_up = |shares: &[Shares]| -> (olmo_chunks_core::Result<()>, bool) {
            let all: Shares = shares.concat();
            let split: Vec<(u64, u64)> = splitters.keys().copied().collect();
            let words = shares.iter().fold(0, |x, s| x ^ coop::share_sum(s));
            (coop::check_shares(&m, &all, &name), words == coop::split_sum(&m, &split))
        };
        let mut shares: Vec<Shares> = Vec::new();
        for (r, rank) in ranks.iter().enumerate() {
            let (bufs, done) = read(r);
            prop_assert_eq!(&bufs, &rank.direct);
            let mine = done.unwrap();
            let blocks: Vec<(u64, u64)> = mine.iter().map(|s| (s.0, s.1)).collect();
            prop_assert_eq!(&blocks, &checks[r].split, "one share per split block");
            shares.push(mine);
        }
        let (each, words) = add_up(&shares);
        prop_assert!(each.is_ok() && words, "{:?}", each);

        // One flipped byte in a needed block: each host reading it has a rank that fails, or its
        // shares do not add up.
        if own.is_empty() {
            return Ok(());
        }
        let keys: Vec<_> = own.keys().collect();
        let &&(c, b, _) = rng.pick(&keys);
        let ch = &m.chunks[c as usize];
        let at = ch.offset + b * block + rng.below(block_len((c, b)));
        let path = dir.path().join(&m.files[ch.file as usize].path);
        let mut data = std::fs::read(&path).unwrap();
        data[at as usize] ^= 0x40;
        std::fs::write(&path, &data).unwrap();
        let reads: Vec<_> = (0..world).map(read).collect();
        if splitters.contains_key(&(c, b)) {
            let shares: Vec<Shares> = reads.iter().map(|(_, d)| d.as_ref().cloned().unwrap_or_default()).collect();
            let (each, words) = add_up(&shares);
            prop_assert!(!words, "the words still add up");
            match each {
                Err(CoreError::ChecksumMismatch { start, path: p, .. }) => {
                    prop_assert_eq!(start, ch.offset + b * block);
                    prop_assert_eq!(p, path.clone());
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }
        for ((_, _, host), rs) in needers.range((c, b, 0)..=(c, b, u64::MAX)) {
            let failed: Vec<usize> = rs.iter().copied().filter(|&r| {
                matches!(reads[r].1, Err(CoreError::ChecksumMismatch { .. }))
            }).collect();
            if splitters.contains_key(&(c, b)) {
                prop_assert!(failed.is_empty(), "host {}: a split block fails no read", host);
            } else {
                prop_assert_eq!(&failed, &checkers[&(c, b, *host)], "host {}", host);
            }
        }
    }
}
