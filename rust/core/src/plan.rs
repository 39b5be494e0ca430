//! Intersecting wanted regions with saved chunks, and the exact-once coverage check.

use crate::error::{CoreError, Result};
use crate::index::BoxIndex;
use crate::region::{checked_numel, for_each_run, intersect_boxes, Piece, Region, MAX_NDIM};

/// One copy: `len` elements at element `src_elem` of saved chunk `src` go to element `dst_elem`
/// of target `dst`. Contiguous on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Run {
    pub src: usize,
    pub src_elem: u64,
    pub dst: usize,
    pub dst_elem: u64,
    pub len: u64,
}

/// The saved chunks of one tensor, indexed for intersection queries.
pub struct TensorPlanner {
    pieces: Vec<Piece>,
    piece_chunk: Vec<usize>,
    index: BoxIndex,
}

impl TensorPlanner {
    /// `chunks` must already be bounds-checked against `shape`, which has at most [`MAX_NDIM`]
    /// dims (the index nests one level per dim).
    pub fn new<'a>(shape: &[u64], chunks: impl IntoIterator<Item = &'a Region>) -> Self {
        let mut pieces = Vec::new();
        let mut piece_chunk = Vec::new();
        for (c, region) in chunks.into_iter().enumerate() {
            for p in region.pieces(shape) {
                pieces.push(p);
                piece_chunk.push(c);
            }
        }
        let index = BoxIndex::new(
            shape.len(),
            pieces
                .iter()
                .map(|p| (p.offsets.as_slice(), p.sizes.as_slice())),
        );
        TensorPlanner {
            pieces,
            piece_chunk,
            index,
        }
    }

    /// Appends the runs that fill target `dst` (given as pieces of the global tensor with their
    /// local map) from the saved chunks. Adjacent runs are merged.
    pub fn plan(&self, dst: usize, target: &[Piece], out: &mut Vec<Run>) {
        for t in target {
            let mut hits = Vec::new();
            self.index.query(&t.offsets, &t.sizes, |i| hits.push(i));
            hits.sort_unstable();
            for i in hits {
                emit_runs(self.piece_chunk[i], &self.pieces[i], dst, t, out);
            }
        }
    }
}

/// Appends the runs copying the overlap of saved piece `s` (of chunk `src`) into target piece `t`.
fn emit_runs(src: usize, s: &Piece, dst: usize, t: &Piece, out: &mut Vec<Run>) {
    if let Some((off, size)) = intersect_boxes(&s.offsets, &s.sizes, &t.offsets, &t.sizes) {
        for_each_run(&off, &size, s, t, |src_elem, dst_elem, len| {
            push_merged(
                out,
                Run {
                    src,
                    src_elem,
                    dst,
                    dst_elem,
                    len,
                },
            )
        });
    }
}

/// Plans like [`TensorPlanner::plan`] by scanning every saved chunk, without building an index.
/// Cheaper when a tensor has only a few target pieces (one rank's load of a many-rank save);
/// the runs come out in the same order.
pub fn plan_scan<'a>(
    shape: &[u64],
    chunks: impl IntoIterator<Item = &'a Region> + Clone,
    dst: usize,
    target: &[Piece],
    out: &mut Vec<Run>,
) {
    let global = crate::region::row_major_strides(shape);
    let canon = |g: &[u64]| -> u64 { g.iter().zip(&global).map(|(a, b)| a * b).sum() };
    for t in target {
        if t.sizes.contains(&0) {
            continue;
        }
        let last: Vec<u64> = t
            .offsets
            .iter()
            .zip(&t.sizes)
            .map(|(o, n)| o + n - 1)
            .collect();
        let span = (canon(&t.offsets), canon(&last) + 1);
        for (src, region) in chunks.clone().into_iter().enumerate() {
            match region {
                Region::Box { offsets, sizes } => {
                    let overlaps = (0..offsets.len()).all(|d| {
                        offsets[d] < t.offsets[d] + t.sizes[d]
                            && t.offsets[d] < offsets[d] + sizes[d]
                    });
                    if overlaps {
                        // Empty boxes have no pieces.
                        for p in region.pieces(shape) {
                            emit_runs(src, &p, dst, t, out);
                        }
                    }
                }
                Region::Flat { start, len } => {
                    if *start < span.1 && start + len > span.0 {
                        for p in region.pieces(shape) {
                            emit_runs(src, &p, dst, t, out);
                        }
                    }
                }
            }
        }
    }
}

fn push_merged(out: &mut Vec<Run>, r: Run) {
    if let Some(last) = out.last_mut() {
        if last.src == r.src
            && last.dst == r.dst
            && last.src_elem + last.len == r.src_elem
            && last.dst_elem + last.len == r.dst_elem
        {
            last.len += r.len;
            return;
        }
    }
    out.push(r);
}

/// Checks that `chunks` lie inside `shape` and cover every element exactly once.
pub fn check_coverage(key: &str, shape: &[u64], chunks: &[Region]) -> Result<()> {
    if shape.len() > MAX_NDIM {
        return Err(CoreError::layout(
            key,
            format!(
                "{} dimensions; at most {MAX_NDIM} are supported",
                shape.len()
            ),
        ));
    }
    let total = checked_numel(shape)
        .ok_or_else(|| CoreError::layout(key, format!("shape {shape:?} overflows u64 elements")))?;
    let mut covered = 0u64;
    for (c, r) in chunks.iter().enumerate() {
        r.check_bounds(shape)
            .map_err(|why| CoreError::layout(key, format!("chunk {c}: {why}")))?;
        covered = r
            .numel()
            .and_then(|n| covered.checked_add(n))
            .ok_or_else(|| CoreError::layout(key, "chunk sizes overflow u64"))?;
    }
    let planner = TensorPlanner::new(shape, chunks);
    for (i, p) in planner.pieces.iter().enumerate() {
        let mut clash = None;
        planner.index.query(&p.offsets, &p.sizes, |j| {
            if j != i && clash.is_none() {
                clash = Some(j);
            }
        });
        if let Some(j) = clash {
            let (a, b) = (planner.piece_chunk[i], planner.piece_chunk[j]);
            return Err(CoreError::layout(
                key,
                format!(
                    "chunks {a} ({:?}) and {b} ({:?}) overlap",
                    chunks[a], chunks[b]
                ),
            ));
        }
    }
    if covered != total {
        return Err(CoreError::layout(
            key,
            format!(
                "chunks cover {covered} of {total} elements; {} element(s) are missing",
                total - covered
            ),
        ));
    }
    Ok(())
}

/// A non-empty overlap of saved box `saved` and wanted box `wanted` of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlap {
    pub saved: usize,
    pub wanted: usize,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// Every non-empty overlap between `saved` and `wanted` boxes `(offsets, sizes)` of an `ndim`-d
/// tensor, wanted box by wanted box and saved boxes ascending. Uses the band index, so regular
/// layouts (1-D or 2-D grids of thousands of boxes) cost `O((S + W) log S + hits)`.
pub fn box_overlaps(
    ndim: usize,
    saved: &[(Vec<u64>, Vec<u64>)],
    wanted: &[(Vec<u64>, Vec<u64>)],
) -> Result<Vec<Overlap>> {
    if ndim > MAX_NDIM {
        return Err(CoreError::InvalidArgument(format!(
            "{ndim}-d boxes: at most {MAX_NDIM} dimensions are supported"
        )));
    }
    for (side, boxes) in [("saved", saved), ("wanted", wanted)] {
        for (i, (o, s)) in boxes.iter().enumerate() {
            let fits = o.len() == ndim
                && s.len() == ndim
                && o.iter().zip(s).all(|(o, s)| o.checked_add(*s).is_some());
            if !fits {
                return Err(CoreError::InvalidArgument(format!(
                    "{side} box {i} ({o:?}+{s:?}) is not a {ndim}-d box"
                )));
            }
        }
    }
    let index = BoxIndex::new(
        ndim,
        saved.iter().map(|(o, s)| (o.as_slice(), s.as_slice())),
    );
    let mut out = Vec::new();
    for (w, (wo, ws)) in wanted.iter().enumerate() {
        let mut hits = Vec::new();
        index.query(wo, ws, |i| hits.push(i));
        hits.sort_unstable();
        for s in hits {
            let (so, ss) = &saved[s];
            if let Some((offsets, sizes)) = intersect_boxes(so, ss, wo, ws) {
                out.push(Overlap {
                    saved: s,
                    wanted: w,
                    offsets,
                    sizes,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: every pair, intersected directly.
    fn all_pairs(saved: &[(Vec<u64>, Vec<u64>)], wanted: &[(Vec<u64>, Vec<u64>)]) -> Vec<Overlap> {
        let mut out = Vec::new();
        for (w, (wo, ws)) in wanted.iter().enumerate() {
            for (s, (so, ss)) in saved.iter().enumerate() {
                if let Some((offsets, sizes)) = intersect_boxes(so, ss, wo, ws) {
                    out.push(Overlap {
                        saved: s,
                        wanted: w,
                        offsets,
                        sizes,
                    });
                }
            }
        }
        out
    }

    #[test]
    fn box_overlaps_match_all_pairs_on_grids() {
        let grid = |rows: u64, cols: u64, h: u64, w: u64| {
            let mut b = Vec::new();
            for i in 0..rows {
                for j in 0..cols {
                    let (r0, c0) = ((i * h).min(13), (j * w).min(11));
                    let (r1, c1) = (((i + 1) * h).min(13), ((j + 1) * w).min(11));
                    b.push((vec![r0, c0], vec![r1 - r0, c1 - c0]));
                }
            }
            b
        };
        let saved = grid(4, 3, 4, 4);
        for wanted in [grid(2, 5, 7, 3), grid(13, 1, 1, 11), grid(1, 1, 13, 11)] {
            assert_eq!(
                box_overlaps(2, &saved, &wanted).unwrap(),
                all_pairs(&saved, &wanted)
            );
        }
    }

    #[test]
    fn box_overlaps_scalar_and_bad_boxes() {
        let one = vec![(vec![], vec![])];
        assert_eq!(box_overlaps(0, &one, &one).unwrap().len(), 1);
        let bad = vec![(vec![u64::MAX], vec![2])];
        assert!(box_overlaps(1, &bad, &bad).is_err());
        assert!(box_overlaps(2, &one, &one).is_err());
        // Too many dims for the index (one nesting level per dim) is refused, not recursed into.
        let deep = vec![(vec![0u64; 30_000], vec![1u64; 30_000])];
        assert!(box_overlaps(30_000, &deep, &deep).is_err());
        assert!(check_coverage("t", &[1; 30_000], &[]).is_err());
    }
}
