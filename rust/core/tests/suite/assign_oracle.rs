//! The writer assignment against brute force: random ranks holding random replicas of random
//! chunks. Every distinct chunk is written exactly once, by a rank holding it; chunks held by the
//! same ranks end balanced within one chunk; with every chunk on every rank, the greedy order is
//! within 4/3 of the best split found by trying every one.

use std::collections::{BTreeMap, BTreeSet};

use olmo_chunks_core::assign::assign_writers;
use proptest::prelude::*;

/// A save: per rank, `(id, bytes)` of what it holds (an id's size is the same on every rank).
fn holdings() -> impl Strategy<Value = Vec<Vec<(u64, u64)>>> {
    (1usize..6, 0usize..14).prop_flat_map(|(ranks, chunks)| {
        (
            prop::collection::vec(1u64..1000, chunks),
            prop::collection::vec(prop::collection::btree_set(0..ranks, 1..=ranks), chunks),
            any::<u64>(),
        )
            .prop_map(move |(sizes, holders, shuffle)| {
                let mut held = vec![Vec::new(); ranks];
                for (id, (bytes, on)) in sizes.iter().zip(&holders).enumerate() {
                    for &r in on {
                        held[r].push((id as u64, *bytes));
                    }
                }
                for (r, items) in held.iter_mut().enumerate() {
                    let n = items.len();
                    if n > 1 {
                        items.rotate_left((shuffle as usize + r) % n); // ranks list in any order
                    }
                }
                held
            })
    })
}

/// Bytes each rank writes, checking exactly-once and holder validity on the way.
fn loads(held: &[Vec<(u64, u64)>], out: &[Vec<usize>]) -> Vec<u64> {
    assert_eq!(out.len(), held.len());
    let mut written = BTreeMap::new();
    let mut load = vec![0; held.len()];
    for (r, picks) in out.iter().enumerate() {
        for &i in picks {
            let (id, bytes) = held[r][i]; // a rank writes only what it holds
            assert!(written.insert(id, r).is_none(), "chunk {id} written twice");
            load[r] += bytes;
        }
    }
    let distinct: BTreeSet<u64> = held.iter().flatten().map(|&(id, _)| id).collect();
    assert_eq!(
        written.keys().copied().collect::<BTreeSet<_>>(),
        distinct,
        "a chunk nobody writes"
    );
    load
}

/// The smallest possible maximum load over every way to give each chunk to a holder.
fn best_max_load(sizes: &[u64], ranks: usize) -> u64 {
    fn go(sizes: &[u64], load: &mut [u64]) -> u64 {
        match sizes.split_first() {
            None => *load.iter().max().unwrap(),
            Some((&s, rest)) => (0..load.len())
                .map(|r| {
                    load[r] += s;
                    let m = go(rest, load);
                    load[r] -= s;
                    m
                })
                .min()
                .unwrap(),
        }
    }
    go(sizes, &mut vec![0; ranks])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_chunk_once_by_a_holder(held in holdings()) {
        loads(&held, &assign_writers(&held));
    }

    #[test]
    fn chunks_held_alike_end_within_one_chunk(
        groups in prop::collection::vec((prop::collection::vec(1u64..1000, 0..10), 1usize..4), 1..4)
    ) {
        // Disjoint groups of ranks, each holding every chunk of its group (DP replicas of shards).
        let mut held = Vec::new();
        let mut next_id = 0u64;
        let mut spans = Vec::new();
        for (sizes, ranks) in &groups {
            let first = held.len();
            let items: Vec<(u64, u64)> = sizes.iter().enumerate().map(|(k, &b)| (next_id + k as u64, b)).collect();
            next_id += sizes.len() as u64;
            held.extend(std::iter::repeat_n(items, *ranks));
            spans.push((first..held.len(), sizes.iter().copied().max().unwrap_or(0)));
        }
        let load = loads(&held, &assign_writers(&held));
        for (span, biggest) in spans {
            let g = &load[span];
            prop_assert!(g.iter().max().unwrap() - g.iter().min().unwrap() <= biggest, "{g:?} spread > {biggest}");
        }
    }

    #[test]
    fn fully_replicated_is_within_four_thirds_of_the_best(
        sizes in prop::collection::vec(1u64..1000, 0..8), ranks in 1usize..4
    ) {
        let items: Vec<(u64, u64)> = sizes.iter().enumerate().map(|(k, &b)| (k as u64, b)).collect();
        let held = vec![items; ranks];
        let got = *loads(&held, &assign_writers(&held)).iter().max().unwrap();
        let best = best_max_load(&sizes, ranks);
        prop_assert!(3 * got <= 4 * best, "greedy {got} vs best {best} for {sizes:?} on {ranks}");
    }
}
