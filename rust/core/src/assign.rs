//! Who writes what: every distinct chunk of a save is written by exactly one of the ranks holding
//! it (replicas are written once), balancing bytes across ranks.
//!
//! Greedy by size, largest first (longest-processing-time order): each chunk goes to the holder
//! with the fewest bytes assigned so far, ties to the lowest rank, then to that rank's first copy.
//! When a set of chunks is held by the same ranks (DP replicas of a shard, a replicated tensor),
//! their loads end within one chunk of each other.

use std::cmp::Reverse;
use std::collections::HashMap;

/// `held[r]` lists rank `r`'s chunks as `(id, bytes)`: equal ids are replicas of one chunk (the
/// same region of the same tensor). Returns, per rank, the indices into `held[r]` of the chunks it
/// writes, largest first.
pub fn assign_writers(held: &[Vec<(u64, u64)>]) -> Vec<Vec<usize>> {
    // Distinct chunks in first-seen order, each with its size and holders (rank, index).
    let mut seen: HashMap<u64, usize> = HashMap::new();
    let mut chunks: Vec<(u64, Vec<(usize, usize)>)> = Vec::new();
    for (rank, items) in held.iter().enumerate() {
        for (i, &(id, bytes)) in items.iter().enumerate() {
            let j = *seen.entry(id).or_insert_with(|| {
                chunks.push((bytes, Vec::new()));
                chunks.len() - 1
            });
            chunks[j].1.push((rank, i));
        }
    }
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    order.sort_by_key(|&j| Reverse(chunks[j].0)); // stable: equal sizes keep first-seen order
    let mut load = vec![0u64; held.len()];
    let mut out = vec![Vec::new(); held.len()];
    for j in order {
        let (bytes, holders) = &chunks[j];
        let &(rank, i) = holders
            .iter()
            .min_by_key(|&&(r, i)| (load[r], r, i))
            .expect("every chunk has a holder");
        load[rank] += bytes;
        out[rank].push(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_are_written_once_and_balanced() {
        // Two ranks both hold chunks 1 (8 bytes) and 2 (4 bytes); rank 1 also holds 3 (4 bytes).
        let held = vec![vec![(1, 8), (2, 4)], vec![(2, 4), (1, 8), (3, 4)]];
        assert_eq!(assign_writers(&held), vec![vec![0], vec![0, 2]]);
    }

    #[test]
    fn nothing_to_write() {
        assert_eq!(
            assign_writers(&[vec![], vec![]]),
            vec![Vec::<usize>::new(); 2]
        );
    }
}
