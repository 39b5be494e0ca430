//! Turning wanted regions into byte copies, and whole-manifest checks.

use std::collections::HashMap;

use crate::dtype::itemsize;
use crate::error::{CoreError, Result};
use crate::io::ByteCopy;
use crate::manifest::Manifest;
use crate::plan::{box_overlaps, check_coverage, plan_scan, Overlap, Run, TensorPlanner};
use crate::region::{intersect_boxes, Piece, Region, MAX_NDIM};

/// What one destination buffer wants from one tensor: pieces of the global tensor and where each
/// element goes in the buffer (element offsets through the pieces' affine maps).
#[derive(Clone, Debug)]
pub struct Target {
    pub tensor: usize,
    pub pieces: Vec<Piece>,
    pub dest: usize,
    /// Size of the destination buffer in bytes.
    pub dest_len: u64,
}

/// Up to this many target pieces per tensor, planning scans the saved chunks instead of indexing
/// them: `pieces x chunks` box tests beat building the index once per load.
const SCAN_LIMIT: usize = 8;

/// Element runs per target, computed with one planner per tensor. Fails if a target lies outside
/// its tensor, overflows its buffer, or is not fully covered by saved chunks.
pub fn plan_runs(m: &Manifest, targets: &[Target]) -> Result<Vec<Run>> {
    let mut by_tensor: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, t) in targets.iter().enumerate() {
        if t.tensor >= m.tensors.len() {
            return Err(CoreError::InvalidArgument(format!(
                "tensor index {} out of range",
                t.tensor
            )));
        }
        by_tensor.entry(t.tensor).or_default().push(i);
    }
    let mut runs = Vec::new();
    let mut tensors: Vec<_> = by_tensor.into_iter().collect();
    tensors.sort_unstable();
    for (ti, ids) in tensors {
        let meta = &m.tensors[ti];
        let item = itemsize(&meta.dtype).expect("validated at decode");
        let regions = m.tensor_chunks(ti).iter().map(|c| &c.region);
        // A few target pieces (one rank's share) scan the chunks; many build the band index.
        let target_pieces: usize = ids.iter().map(|&i| targets[i].pieces.len()).sum();
        let planner =
            (target_pieces > SCAN_LIMIT).then(|| TensorPlanner::new(&meta.shape, regions.clone()));
        let base = m.chunk_start[ti];
        for i in ids {
            let t = &targets[i];
            let mut want = 0u64;
            for p in &t.pieces {
                let inside = p.offsets.len() == meta.shape.len()
                    && p.sizes.len() == meta.shape.len()
                    && p.strides.len() == meta.shape.len()
                    && p.offsets
                        .iter()
                        .zip(&p.sizes)
                        .zip(&meta.shape)
                        .all(|((o, s), n)| o.checked_add(*s).is_some_and(|e| e <= *n));
                if !inside {
                    return Err(CoreError::layout(
                        &meta.key,
                        format!(
                            "target piece {:?}+{:?} lies outside shape {:?}",
                            p.offsets, p.sizes, meta.shape
                        ),
                    ));
                }
                if p.local_extent()
                    .and_then(|e| e.checked_mul(item))
                    .is_none_or(|e| e > t.dest_len)
                {
                    return Err(CoreError::InvalidArgument(format!(
                        "tensor {:?}: destination of {} bytes is too small for its region",
                        meta.key, t.dest_len
                    )));
                }
                want += p.numel();
            }
            let before = runs.len();
            match &planner {
                Some(planner) => planner.plan(i, &t.pieces, &mut runs),
                None => plan_scan(&meta.shape, regions.clone(), i, &t.pieces, &mut runs),
            }
            let got: u64 = runs[before..].iter().map(|r| r.len).sum();
            if got != want {
                return Err(CoreError::layout(
                    &meta.key,
                    format!("saved chunks cover {got} of the {want} wanted elements"),
                ));
            }
            for r in &mut runs[before..] {
                r.src += base;
            }
        }
    }
    Ok(runs)
}

/// Byte copies for `targets` (element runs scaled by the tensors' item sizes).
pub fn plan_copies(m: &Manifest, targets: &[Target]) -> Result<Vec<ByteCopy>> {
    let runs = plan_runs(m, targets)?;
    Ok(runs
        .into_iter()
        .map(|r| {
            let item = itemsize(&m.tensors[targets[r.dst].tensor].dtype).unwrap();
            ByteCopy {
                chunk: r.src,
                src: r.src_elem * item,
                dst: targets[r.dst].dest,
                dst_off: r.dst_elem * item,
                len: r.len * item,
            }
        })
        .collect())
}

/// Checks that every tensor's chunks cover it exactly once.
pub fn check_manifest_coverage(m: &Manifest) -> Result<()> {
    for (t, meta) in m.tensors.iter().enumerate() {
        let regions: Vec<_> = m
            .tensor_chunks(t)
            .iter()
            .map(|c| c.region.clone())
            .collect();
        check_coverage(&meta.key, &meta.shape, &regions)?;
    }
    Ok(())
}

/// Calls `f(offsets, sizes)` for each saved chunk of tensor `t` as torch DCP lists chunks: empty
/// boxes left out, a flat range as the boxes it decomposes into.
pub fn for_each_saved_box(m: &Manifest, t: usize, mut f: impl FnMut(&[u64], &[u64])) {
    let shape = &m.tensors[t].shape;
    for c in m.tensor_chunks(t) {
        match &c.region {
            Region::Box { offsets, sizes } => {
                if !sizes.contains(&0) {
                    f(offsets, sizes)
                }
            }
            flat => flat
                .pieces(shape)
                .iter()
                .for_each(|p| f(&p.offsets, &p.sizes)),
        }
    }
}

/// [`box_overlaps`] of `wanted` boxes against the saved boxes of tensor `t` (as
/// [`for_each_saved_box`] lists them), each hit with its saved box's offsets. A few wanted boxes
/// (one rank's share) scan the saved boxes; more build the band index.
pub fn tensor_overlaps(
    m: &Manifest,
    t: usize,
    wanted: &[(Vec<u64>, Vec<u64>)],
) -> Result<Vec<(Overlap, Vec<u64>)>> {
    let meta = m
        .tensors
        .get(t)
        .ok_or_else(|| CoreError::InvalidArgument(format!("tensor index {t} out of range")))?;
    let ndim = meta.shape.len();
    if wanted.len() > SCAN_LIMIT {
        let mut saved = Vec::new();
        for_each_saved_box(m, t, |o, s| saved.push((o.to_vec(), s.to_vec())));
        let hits = box_overlaps(ndim, &saved, wanted)?;
        return Ok(hits
            .into_iter()
            .map(|o| {
                let at = saved[o.saved].0.clone();
                (o, at)
            })
            .collect());
    }
    if ndim > MAX_NDIM
        || wanted
            .iter()
            .any(|(o, s)| o.len() != ndim || s.len() != ndim)
    {
        return Err(CoreError::InvalidArgument(format!(
            "wanted boxes of tensor {:?} are not {ndim}-d boxes",
            meta.key
        )));
    }
    let mut out = Vec::new();
    for (w, (wo, ws)) in wanted.iter().enumerate() {
        let mut s = 0;
        for_each_saved_box(m, t, |so, ss| {
            if let Some((offsets, sizes)) = intersect_boxes(so, ss, wo, ws) {
                let hit = Overlap {
                    saved: s,
                    wanted: w,
                    offsets,
                    sizes,
                };
                out.push((hit, so.to_vec()));
            }
            s += 1;
        });
    }
    Ok(out)
}
