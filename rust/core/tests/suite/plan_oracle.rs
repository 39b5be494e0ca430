//! The copy plan and the coverage check against brute force: random global shapes, random saved
//! partitions (grids, guillotines, flat ranges, mixes) and random strided / flat targets.

use crate::common::*;
use olmo_chunks_core::{
    check_coverage, plan_copies, plan_runs, CoreError, Manifest, Region, Run, Target, TensorPlanner,
};
use proptest::prelude::*;

fn shape_strategy() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(
        prop_oneof![1 => Just(0u64), 3 => Just(1u64), 16 => 2u64..=5],
        0..=4,
    )
}

/// Executes element runs into fresh destinations (sentinel-filled) and checks each run stays in
/// range and no destination element is written twice.
fn execute_runs(
    chunk_elems: &[Vec<u64>],
    runs: &[Run],
    dest_sizes: &[u64],
) -> std::result::Result<Vec<Vec<u64>>, String> {
    let mut dests: Vec<Vec<u64>> = dest_sizes
        .iter()
        .map(|&n| vec![u64::MAX; n as usize])
        .collect();
    let mut written: Vec<Vec<bool>> = dest_sizes
        .iter()
        .map(|&n| vec![false; n as usize])
        .collect();
    for r in runs {
        if r.len == 0 {
            return Err(format!("empty run {r:?}"));
        }
        let src = chunk_elems
            .get(r.src)
            .ok_or(format!("run {r:?}: no such chunk"))?;
        let dst = dests
            .get_mut(r.dst)
            .ok_or(format!("run {r:?}: no such target"))?;
        if r.src_elem + r.len > src.len() as u64 || r.dst_elem + r.len > dst.len() as u64 {
            return Err(format!("run {r:?} out of range"));
        }
        for k in 0..r.len {
            let d = (r.dst_elem + k) as usize;
            if written[r.dst][d] {
                return Err(format!("run {r:?} writes element {d} twice"));
            }
            written[r.dst][d] = true;
            dst[d] = src[(r.src_elem + k) as usize];
        }
    }
    Ok(dests)
}

/// Every wanted local element holds its global element; every other element is untouched.
fn check_dest(shape: &[u64], t: &WantedTarget, got: &[u64]) -> std::result::Result<(), String> {
    let mut want = vec![u64::MAX; t.dest_elems as usize];
    for (local, canon) in expected_locals(shape, &t.pieces) {
        want[local as usize] = canon;
    }
    if got != want.as_slice() {
        let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
        return Err(format!(
            "element {at}: got {} want {} (pieces {:?})",
            got[at], want[at], t.pieces
        ));
    }
    Ok(())
}

fn as_target(tensor: usize, dest: usize, t: &WantedTarget, item: u64) -> Target {
    Target {
        tensor,
        pieces: t.pieces.clone(),
        dest,
        dest_len: t.dest_elems * item,
    }
}

fn layout_error(r: olmo_chunks_core::Result<()>) -> bool {
    matches!(r, Err(CoreError::Layout { .. }))
}

/// A decoy tensor saved before the one under test, so chunk indices must be offset correctly.
fn decoy() -> SavedTensor {
    SavedTensor {
        key: "decoy".into(),
        dtype: "int64".into(),
        shape: vec![3, 2],
        regions: vec![
            Region::Flat { start: 0, len: 5 },
            Region::Box {
                offsets: vec![2, 1],
                sizes: vec![1, 1],
            },
        ],
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// `TensorPlanner::plan` runs, executed element by element, fill every target exactly.
    #[test]
    fn planner_runs_fill_targets_exactly(shape in shape_strategy(), seed in any::<u64>()) {
        let mut rng = Seeded::new(seed);
        let saved = random_partition(&mut rng, &shape);
        prop_assert!(oracle_exact_cover(&shape, &saved), "generator bug: {saved:?}");
        prop_assert!(check_coverage("t", &shape, &saved).is_ok(), "{:?}", check_coverage("t", &shape, &saved));
        let chunk_elems: Vec<Vec<u64>> = saved.iter().map(|r| region_elements(&shape, r)).collect();
        let targets: Vec<WantedTarget> =
            (0..rng.range(1, 4)).map(|_| random_target(&mut rng, &shape)).collect();
        let planner = TensorPlanner::new(&shape, &saved);
        let mut runs = Vec::new();
        for (i, t) in targets.iter().enumerate() {
            planner.plan(i, &t.pieces, &mut runs);
        }
        let sizes: Vec<u64> = targets.iter().map(|t| t.dest_elems).collect();
        let dests = execute_runs(&chunk_elems, &runs, &sizes).map_err(TestCaseError::fail)?;
        for (t, got) in targets.iter().zip(&dests) {
            check_dest(&shape, t, got).map_err(|e| TestCaseError::fail(format!("{e}; saved {saved:?}")))?;
        }
    }

    /// `plan_runs` / `plan_copies` through a decoded manifest: chunk indices offset by earlier
    /// tensors, byte copies scaled by the item size, executed on real chunk bytes.
    #[test]
    fn manifest_plan_copies_are_bit_exact(
        shape in shape_strategy(),
        seed in any::<u64>(),
        dtype in prop::sample::select(vec!["int16", "float32", "int64", "complex128"]),
    ) {
        let mut rng = Seeded::new(seed);
        let tensor = SavedTensor {
            key: "w".into(),
            dtype: dtype.into(),
            shape: shape.clone(),
            regions: random_partition(&mut rng, &shape),
        };
        let tensors = vec![decoy(), tensor.clone()];
        let m = in_memory_manifest(&tensors, 64);
        let m = Manifest::decode(&m.encode(), "mem".as_ref()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        olmo_chunks_core::check_manifest_coverage(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let item = olmo_chunks_core::dtype::itemsize(dtype).unwrap();
        let mut chunk_data: Vec<Vec<u8>> = Vec::new();
        for (ti, t) in tensors.iter().enumerate() {
            let it = olmo_chunks_core::dtype::itemsize(&t.dtype).unwrap();
            for r in &t.regions {
                chunk_data.push(chunk_bytes(t, r, it, ti as u64));
            }
        }
        let wanted: Vec<WantedTarget> =
            (0..rng.range(1, 3)).map(|_| random_target(&mut rng, &shape)).collect();
        let targets: Vec<Target> = wanted.iter().enumerate().map(|(i, w)| as_target(1, i, w, item)).collect();
        let runs = plan_runs(&m, &targets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let base = m.chunk_start[1];
        prop_assert!(runs.iter().all(|r| r.src >= base && r.src < m.chunk_start[2]));
        let copies = plan_copies(&m, &targets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut dests: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0xA5; (w.dest_elems * item) as usize]).collect();
        for c in &copies {
            let src = &chunk_data[c.chunk][c.src as usize..(c.src + c.len) as usize];
            dests[c.dst][c.dst_off as usize..(c.dst_off + c.len) as usize].copy_from_slice(src);
        }
        for (w, got) in wanted.iter().zip(&dests) {
            let mut want = vec![0xA5u8; got.len()];
            for (local, canon) in expected_locals(&shape, &w.pieces) {
                let elem = chunk_bytes(&tensor, &Region::Flat { start: canon, len: 1 }, item, 1);
                let at = (local * item) as usize;
                want[at..at + item as usize].copy_from_slice(&elem);
            }
            prop_assert!(got == &want, "target {:?}", w.pieces);
        }
    }

    /// `check_coverage` accepts exactly the layouts that a count-per-element oracle accepts, and
    /// rejects the others with `CoreError::Layout`.
    #[test]
    fn coverage_check_matches_count_oracle(shape in shape_strategy(), seed in any::<u64>()) {
        let mut rng = Seeded::new(seed);
        let mut regions = random_partition(&mut rng, &shape);
        prop_assert!(check_coverage("t", &shape, &regions).is_ok());
        for _ in 0..rng.range(1, 2) {
            perturb(&mut rng, &shape, &mut regions);
        }
        let want = oracle_exact_cover(&shape, &regions);
        let got = check_coverage("t", &shape, &regions);
        if want {
            prop_assert!(got.is_ok(), "oracle accepts {regions:?} but got {got:?}");
        } else {
            prop_assert!(layout_error(got), "oracle rejects {regions:?}");
        }
    }

    /// With gaps in the saved layout, `plan_runs` succeeds exactly when every wanted element is
    /// saved, and fails with `CoreError::Layout` otherwise.
    #[test]
    fn plan_runs_refuses_uncovered_targets(shape in shape_strategy(), seed in any::<u64>()) {
        let mut rng = Seeded::new(seed);
        let mut regions = random_partition(&mut rng, &shape);
        if !regions.is_empty() {
            regions.remove(rng.below(regions.len() as u64) as usize);
        }
        let strides = canon_strides(&shape);
        let mut saved = vec![false; numel(&shape) as usize];
        for r in &regions {
            for e in region_elements(&shape, r) {
                saved[e as usize] = true;
            }
        }
        let tensor = SavedTensor { key: "w".into(), dtype: "int32".into(), shape: shape.clone(), regions };
        let m = in_memory_manifest(std::slice::from_ref(&tensor), 4096);
        let w = random_target(&mut rng, &shape);
        let mut covered = true;
        for p in &w.pieces {
            for_each_coord(&p.offsets, &p.sizes, |g| covered &= saved[canon_index(&strides, g) as usize]);
        }
        let got = plan_runs(&m, &[as_target(0, 0, &w, 4)]);
        if covered {
            prop_assert!(got.is_ok(), "{got:?}");
        } else {
            prop_assert!(matches!(got, Err(CoreError::Layout { .. })), "{got:?}");
        }
    }
}

/// Breaks (or sometimes keeps) an exact partition: drops, duplicates, grows, shrinks, shifts or
/// adds chunks, including out-of-bounds and overflowing ones.
fn perturb(rng: &mut Seeded, shape: &[u64], regions: &mut Vec<Region>) {
    let n = regions.len() as u64;
    match rng.below(8) {
        0 if n > 0 => {
            regions.remove(rng.below(n) as usize);
        }
        1 if n > 0 => {
            let r = regions[rng.below(n) as usize].clone();
            regions.push(r);
        }
        2 | 3 if n > 0 => {
            let i = rng.below(n) as usize;
            let grow = rng.chance(50);
            match &mut regions[i] {
                Region::Box { offsets, sizes } if !sizes.is_empty() => {
                    let d = rng.below(sizes.len() as u64) as usize;
                    match (grow, rng.chance(50)) {
                        (true, true) => sizes[d] = sizes[d].wrapping_add(1),
                        (true, false) if offsets[d] > 0 => {
                            offsets[d] -= 1;
                            sizes[d] = sizes[d].wrapping_add(1);
                        }
                        (false, _) if sizes[d] > 0 => sizes[d] -= 1,
                        _ => offsets[d] = offsets[d].wrapping_add(1),
                    }
                }
                Region::Flat { start, len } => match (grow, rng.chance(50)) {
                    (true, _) => *len = len.wrapping_add(1),
                    (false, true) if *len > 0 => *len -= 1,
                    _ => *start = start.wrapping_add(1),
                },
                _ => {}
            }
        }
        4 => {
            let (o, s) = random_box(rng, shape);
            regions.push(Region::Box {
                offsets: o,
                sizes: s,
            });
        }
        5 => {
            let total = numel(shape);
            let a = rng.range(0, total + 1);
            regions.push(Region::Flat {
                start: a,
                len: rng.range(0, 2),
            });
        }
        6 => regions.push(match rng.below(3) {
            0 => Region::Box {
                offsets: vec![u64::MAX; shape.len()],
                sizes: vec![2; shape.len()],
            },
            1 => Region::Flat {
                start: u64::MAX,
                len: 1,
            },
            _ => Region::Box {
                offsets: vec![0; shape.len() + 1],
                sizes: vec![0; shape.len() + 1],
            },
        }),
        _ => {}
    }
    rng.shuffle(regions);
}

#[test]
fn plan_runs_rejects_bad_targets() {
    let tensor = SavedTensor {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![4, 6],
        regions: vec![Region::Flat { start: 0, len: 24 }],
    };
    let m = in_memory_manifest(std::slice::from_ref(&tensor), 64);
    let mut rng = Seeded::new(7);
    let (piece, extent) = strided_piece(&mut rng, vec![1, 2], vec![3, 4], 0);
    let good = Target {
        tensor: 0,
        pieces: vec![piece.clone()],
        dest: 0,
        dest_len: extent * 4,
    };
    assert!(plan_runs(&m, std::slice::from_ref(&good)).is_ok());
    let small = Target {
        dest_len: extent * 4 - 1,
        ..good.clone()
    };
    assert!(matches!(
        plan_runs(&m, &[small]),
        Err(CoreError::InvalidArgument(_))
    ));
    let mut outside = good.clone();
    outside.pieces[0].sizes = vec![4, 4];
    assert!(matches!(
        plan_runs(&m, &[outside]),
        Err(CoreError::Layout { ref key, .. }) if key == "w"
    ));
    let mut wrong_rank = good.clone();
    wrong_rank.pieces[0].offsets = vec![1];
    assert!(matches!(
        plan_runs(&m, &[wrong_rank]),
        Err(CoreError::Layout { .. })
    ));
    let no_tensor = Target {
        tensor: 1,
        ..good.clone()
    };
    assert!(matches!(
        plan_runs(&m, &[no_tensor]),
        Err(CoreError::InvalidArgument(_))
    ));
    // Strides so large that the local extent overflows u64 must not wrap into a small buffer.
    let mut huge = good.clone();
    huge.pieces[0].strides = vec![1 << 63, 1];
    huge.dest_len = 64;
    assert!(matches!(
        plan_runs(&m, &[huge]),
        Err(CoreError::InvalidArgument(_))
    ));
}

#[test]
fn coverage_of_empty_and_scalar_tensors() {
    assert!(check_coverage("s", &[], &[Region::Flat { start: 0, len: 1 }]).is_ok());
    let scalar_box = Region::Box {
        offsets: vec![],
        sizes: vec![],
    };
    assert!(check_coverage("s", &[], std::slice::from_ref(&scalar_box)).is_ok());
    assert!(layout_error(check_coverage("s", &[], &[])));
    assert!(layout_error(check_coverage(
        "s",
        &[],
        &[scalar_box.clone(), scalar_box]
    )));
    // A tensor with no elements is covered by nothing at all, and by empty chunks.
    assert!(check_coverage("z", &[3, 0], &[]).is_ok());
    assert!(check_coverage("z", &[3, 0], &[Region::Flat { start: 0, len: 0 }]).is_ok());
    assert!(layout_error(check_coverage(
        "z",
        &[3, 0],
        &[Region::Flat { start: 0, len: 1 }]
    )));
    // Dimensions whose partial products overflow although the total is zero.
    let wide = [0u64, 1 << 40, 1 << 40];
    assert!(check_coverage("z", &wide, &[Region::Flat { start: 0, len: 0 }]).is_ok());
    assert!(check_coverage(
        "z",
        &wide,
        &[Region::Box {
            offsets: vec![0, 0, 0],
            sizes: vec![0, 1 << 40, 1 << 40]
        }]
    )
    .is_ok());
    assert!(layout_error(check_coverage(
        "big",
        &[1 << 40, 1 << 40],
        &[]
    )));
}

/// An uneven shard can be empty (e.g. 3 rows over 4 ranks) and still be listed as a chunk;
/// planning must skip it, whether it scans the chunks (few pieces) or indexes them (many).
#[test]
fn empty_saved_boxes_are_skipped() {
    let tensor = SavedTensor {
        key: "w".into(),
        dtype: "float32".into(),
        shape: vec![4, 3],
        regions: vec![
            Region::Box {
                offsets: vec![2, 0],
                sizes: vec![0, 3],
            },
            Region::Box {
                offsets: vec![0, 0],
                sizes: vec![4, 3],
            },
            Region::Flat { start: 5, len: 0 },
        ],
    };
    assert!(check_coverage("w", &tensor.shape, &tensor.regions).is_ok());
    let m = in_memory_manifest(std::slice::from_ref(&tensor), 64);
    let whole = Target {
        tensor: 0,
        pieces: Region::Flat { start: 0, len: 12 }.pieces(&tensor.shape),
        dest: 0,
        dest_len: 48,
    };
    let mut rng = Seeded::new(1);
    let mut singles = Vec::new();
    for i in 0..4 {
        for j in 0..3 {
            let (p, _) = strided_piece(&mut rng, vec![i, j], vec![1, 1], i * 3 + j);
            singles.push(p);
        }
    }
    let many = Target {
        pieces: singles,
        ..whole.clone()
    };
    for t in [whole, many] {
        let runs = plan_runs(&m, &[t]).unwrap();
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 12);
        assert!(runs.iter().all(|r| r.src == 1));
    }
}
