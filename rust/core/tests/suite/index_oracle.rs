//! The band index against a brute-force overlap scan: grids, guillotine partitions and arbitrary
//! (overlapping, empty, repeated) box sets.

use crate::common::*;
use olmo_chunks_core::index::BoxIndex;
use olmo_chunks_core::Region;
use proptest::prelude::*;

type Boxes = Vec<(Vec<u64>, Vec<u64>)>;

fn overlaps(a: &(Vec<u64>, Vec<u64>), off: &[u64], size: &[u64]) -> bool {
    if a.1.contains(&0) || size.contains(&0) {
        return false;
    }
    (0..off.len()).all(|d| a.0[d] < off[d] + size[d] && off[d] < a.0[d] + a.1[d])
}

/// Queries the index with `(off, size)` and compares the hits with a scan of all boxes; every
/// hit must be reported once.
fn check_query(ndim: usize, boxes: &Boxes, idx: &BoxIndex, off: &[u64], size: &[u64]) {
    let mut got = Vec::new();
    idx.query(off, size, |i| got.push(i));
    let n = got.len();
    got.sort_unstable();
    got.dedup();
    assert_eq!(
        n,
        got.len(),
        "a box was reported twice for {off:?}+{size:?}"
    );
    let want: Vec<usize> = (0..boxes.len())
        .filter(|&i| overlaps(&boxes[i], off, size))
        .collect();
    assert_eq!(
        got, want,
        "ndim {ndim} query {off:?}+{size:?} boxes {boxes:?}"
    );
}

fn index_of(ndim: usize, boxes: &Boxes) -> BoxIndex {
    BoxIndex::new(
        ndim,
        boxes.iter().map(|(o, s)| (o.as_slice(), s.as_slice())),
    )
}

fn boxes_of(regions: Vec<Region>) -> Boxes {
    regions
        .into_iter()
        .map(|r| match r {
            Region::Box { offsets, sizes } => (offsets, sizes),
            Region::Flat { .. } => unreachable!("box partitions only"),
        })
        .collect()
}

/// Queries: random boxes inside a slightly enlarged extent (so some stick out), each saved box
/// itself, and single elements.
fn check_many_queries(rng: &mut Seeded, shape: &[u64], boxes: &Boxes, idx: &BoxIndex) {
    let ndim = shape.len();
    let grown: Vec<u64> = shape.iter().map(|n| n + 2).collect();
    for _ in 0..24 {
        let (o, s) = random_box(rng, &grown);
        check_query(ndim, boxes, idx, &o, &s);
    }
    for (o, s) in boxes.iter().take(16) {
        check_query(ndim, boxes, idx, o, s);
    }
    for _ in 0..8 {
        let o: Vec<u64> = shape.iter().map(|&n| rng.range(0, n)).collect();
        check_query(ndim, boxes, idx, &o, &vec![1; ndim]);
    }
}

fn shape_strategy() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..=9, 0..=4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn index_matches_scan_on_grids(shape in shape_strategy(), seed in any::<u64>()) {
        let mut rng = Seeded::new(seed);
        let boxes = boxes_of(grid_partition(&mut rng, &shape));
        let idx = index_of(shape.len(), &boxes);
        check_many_queries(&mut rng, &shape, &boxes, &idx);
    }

    #[test]
    fn index_matches_scan_on_guillotines(shape in shape_strategy(), seed in any::<u64>()) {
        let mut rng = Seeded::new(seed);
        let boxes = boxes_of(guillotine_partition(&mut rng, &shape));
        let idx = index_of(shape.len(), &boxes);
        check_many_queries(&mut rng, &shape, &boxes, &idx);
    }

    /// Overlapping, nested, repeated and empty boxes: bands are not disjoint here.
    #[test]
    fn index_matches_scan_on_arbitrary_boxes(
        shape in shape_strategy(),
        seed in any::<u64>(),
        count in 0usize..40,
    ) {
        let mut rng = Seeded::new(seed);
        let mut boxes: Boxes = (0..count).map(|_| random_box(&mut rng, &shape)).collect();
        if count > 0 && rng.chance(50) {
            let again = boxes[rng.below(count as u64) as usize].clone();
            boxes.push(again);
        }
        let idx = index_of(shape.len(), &boxes);
        check_many_queries(&mut rng, &shape, &boxes, &idx);
    }
}

#[test]
fn index_of_nothing_and_of_scalars() {
    let empty: Boxes = Vec::new();
    let idx = index_of(2, &empty);
    check_query(2, &empty, &idx, &[0, 0], &[5, 5]);
    let scalars: Boxes = vec![(vec![], vec![]), (vec![], vec![])];
    let idx = index_of(0, &scalars);
    check_query(0, &scalars, &idx, &[], &[]);
}
