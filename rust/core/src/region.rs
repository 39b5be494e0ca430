//! Regions of a global tensor: n-d boxes and flat ranges of the canonical (row-major) order.
//!
//! Everything is reduced to [`Piece`]s: a half-open box of the global tensor plus the affine map
//! from a global coordinate to an element offset in some local storage. Intersections, coverage
//! checks and copy plans all work on pieces, so boxes and flat ranges mix freely.

use serde::{Deserialize, Serialize};

/// Where a chunk (saved or wanted) lies in its global tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Region {
    /// Half-open box `offsets[i] .. offsets[i] + sizes[i]`, stored row-major in its own shape.
    Box { offsets: Vec<u64>, sizes: Vec<u64> },
    /// Elements `start .. start + len` of the row-major order of the global shape, stored in order.
    Flat { start: u64, len: u64 },
}

/// Most dimensions a tensor may have (numpy's limit, and torch's for reductions over dims).
/// Decoding refuses manifests with more, so per-dimension work stays small and bounded.
pub const MAX_NDIM: usize = 64;

/// Product of `dims`, or `None` on overflow.
pub fn checked_numel(dims: &[u64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Row-major strides (in elements) of `shape`. The caller has checked `numel` does not overflow.
pub fn row_major_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

impl Region {
    /// Number of elements, or `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        match self {
            Region::Box { sizes, .. } => checked_numel(sizes),
            Region::Flat { len, .. } => Some(*len),
        }
    }

    /// Checks that the region lies inside a tensor of `shape`; returns why not.
    pub fn check_bounds(&self, shape: &[u64]) -> Result<(), String> {
        let total = checked_numel(shape).ok_or("global shape overflows u64 elements")?;
        match self {
            Region::Box { offsets, sizes } => {
                if offsets.len() != shape.len() || sizes.len() != shape.len() {
                    return Err(format!(
                        "box has {} offsets and {} sizes for a {}-d tensor",
                        offsets.len(),
                        sizes.len(),
                        shape.len()
                    ));
                }
                for (d, ((&o, &s), &n)) in offsets.iter().zip(sizes).zip(shape).enumerate() {
                    match o.checked_add(s) {
                        Some(end) if end <= n => {}
                        _ => {
                            return Err(format!(
                                "box {offsets:?}+{sizes:?} exceeds dim {d} of size {n}"
                            ))
                        }
                    }
                }
                Ok(())
            }
            Region::Flat { start, len } => match start.checked_add(*len) {
                Some(end) if end <= total => Ok(()),
                _ => Err(format!(
                    "flat range {start}+{len} exceeds the tensor's {total} elements"
                )),
            },
        }
    }

    /// Splits the region into pieces whose local map is this region's own storage order.
    /// The region must have passed [`Region::check_bounds`] for `shape`.
    pub fn pieces(&self, shape: &[u64]) -> Vec<Piece> {
        match self {
            Region::Box { offsets, sizes } => {
                if sizes.contains(&0) {
                    return Vec::new();
                }
                vec![Piece {
                    offsets: offsets.clone(),
                    sizes: sizes.clone(),
                    local_start: 0,
                    strides: row_major_strides(sizes),
                }]
            }
            Region::Flat { start, len } => {
                if *len == 0 {
                    // Also spares the strides of a zero-element shape, which may overflow.
                    return Vec::new();
                }
                let global = row_major_strides(shape);
                flat_boxes(shape, *start, start + len)
                    .into_iter()
                    .map(|(offsets, sizes)| {
                        let canon: u64 = offsets.iter().zip(&global).map(|(o, s)| o * s).sum();
                        Piece {
                            offsets,
                            sizes,
                            local_start: canon - start,
                            strides: global.clone(),
                        }
                    })
                    .collect()
            }
        }
    }
}

/// A box of the global tensor and the affine map `global coordinate -> local element offset`:
/// `local(g) = local_start + sum((g[i] - offsets[i]) * strides[i])`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub local_start: u64,
    pub strides: Vec<u64>,
}

impl Piece {
    pub fn numel(&self) -> u64 {
        self.sizes.iter().product()
    }

    /// Local element offset of global coordinate `g` (which must lie in the box).
    pub fn local_offset(&self, g: &[u64]) -> u64 {
        self.local_start
            + g.iter()
                .zip(&self.offsets)
                .zip(&self.strides)
                .map(|((g, o), s)| (g - o) * s)
                .sum::<u64>()
    }

    /// One past the largest local element offset the piece touches.
    /// `None` if it overflows u64 (absurd strides from a caller).
    pub fn local_extent(&self) -> Option<u64> {
        if self.sizes.contains(&0) {
            return Some(self.local_start);
        }
        self.sizes
            .iter()
            .zip(&self.strides)
            .try_fold(self.local_start, |acc, (n, s)| {
                acc.checked_add((n - 1).checked_mul(*s)?)
            })?
            .checked_add(1)
    }
}

/// The intersection of two half-open boxes, or `None` if it is empty.
pub fn intersect_boxes(
    a_off: &[u64],
    a_size: &[u64],
    b_off: &[u64],
    b_size: &[u64],
) -> Option<(Vec<u64>, Vec<u64>)> {
    let mut off = Vec::with_capacity(a_off.len());
    let mut size = Vec::with_capacity(a_off.len());
    for i in 0..a_off.len() {
        let lo = a_off[i].max(b_off[i]);
        let hi = (a_off[i] + a_size[i]).min(b_off[i] + b_size[i]);
        if hi <= lo {
            return None;
        }
        off.push(lo);
        size.push(hi - lo);
    }
    Some((off, size))
}

/// Decomposes the flat range `[start, end)` of the row-major order of `shape` into at most
/// `2 * ndim - 1` disjoint boxes, in canonical order. Iterative, so any `ndim` is safe.
///
/// The range descends through the leading dims while it stays inside one index; at the first dim
/// where it spans several, it is a suffix of index `a` (slabs from the deepest dim up), the whole
/// indices `a+1..b` (or `a..b`), and a prefix of index `b` (slabs from the shallowest dim down).
pub fn flat_boxes(shape: &[u64], start: u64, end: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let n = shape.len();
    let mut out = Vec::new();
    if start >= end {
        return out;
    }
    // inner[d]: elements per index of dim d.
    let mut inner = vec![1u64; n];
    for d in (0..n.saturating_sub(1)).rev() {
        inner[d] = inner[d + 1] * shape[d + 1];
    }
    // The box of indices `lo..hi` of dim `prefix.len()` under the fixed leading indices `prefix`.
    let slab = |prefix: &[u64], lo: u64, hi: u64| {
        let d = prefix.len();
        let mut off = prefix.to_vec();
        off.push(lo);
        off.resize(n, 0);
        let mut size = vec![1u64; d];
        size.push(hi - lo);
        size.extend_from_slice(&shape[d + 1..]);
        (off, size)
    };
    let mut prefix = Vec::with_capacity(n);
    let (mut s, mut e) = (start, end);
    let (a, b) = loop {
        let Some(&w) = inner.get(prefix.len()) else {
            // Inside one element.
            out.push((prefix, vec![1u64; n]));
            return out;
        };
        let (a, b) = (s / w, e / w);
        if a != b {
            break (a, b);
        }
        prefix.push(a);
        (s, e) = (s % w, e % w);
    };
    let w = inner[prefix.len()];
    let mut full_start = a;
    if s % w != 0 {
        // Suffix `[s % w, w)` of index `a`.
        let mut p = prefix.clone();
        p.push(a);
        let mut rest = s % w;
        let mut slabs = Vec::new();
        loop {
            let (k, w) = (p.len(), inner[p.len()]);
            let (i, r) = (rest / w, rest % w);
            if r == 0 {
                slabs.push(slab(&p, i, shape[k]));
                break;
            }
            if i + 1 < shape[k] {
                slabs.push(slab(&p, i + 1, shape[k]));
            }
            p.push(i);
            rest = r;
        }
        out.extend(slabs.into_iter().rev());
        full_start = a + 1;
    }
    if b > full_start {
        out.push(slab(&prefix, full_start, b));
    }
    if e % w != 0 {
        // Prefix `[0, e % w)` of index `b`.
        let mut p = prefix;
        p.push(b);
        let mut rest = e % w;
        loop {
            let w = inner[p.len()];
            let (i, r) = (rest / w, rest % w);
            if i > 0 {
                out.push(slab(&p, 0, i));
            }
            if r == 0 {
                break;
            }
            p.push(i);
            rest = r;
        }
    }
    out
}

/// Calls `f(src_offset, dst_offset, len)` for each maximal run of the box `(off, size)` that is
/// contiguous in both `src` and `dst` local storage, in row-major order of the box.
pub fn for_each_run(
    off: &[u64],
    size: &[u64],
    src: &Piece,
    dst: &Piece,
    mut f: impl FnMut(u64, u64, u64),
) {
    let n = off.len();
    // Merge trailing dims while both maps stay contiguous; size-1 dims never break contiguity.
    let mut run = 1u64;
    let mut outer = n;
    while outer > 0 {
        let d = outer - 1;
        if size[d] != 1 && (src.strides[d] != run || dst.strides[d] != run) {
            break;
        }
        run *= size[d];
        outer -= 1;
    }
    let src0 = src.local_offset(off);
    let dst0 = dst.local_offset(off);
    if outer == 0 {
        f(src0, dst0, run);
        return;
    }
    // Odometer over the outer dims.
    let mut idx = vec![0u64; outer];
    let (mut s, mut t) = (src0, dst0);
    loop {
        f(s, t, run);
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            s += src.strides[d];
            t += dst.strides[d];
            if idx[d] < size[d] {
                break;
            }
            s -= src.strides[d] * size[d];
            t -= dst.strides[d] * size[d];
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_boxes_cover_range_in_order() {
        let shape = [3u64, 4, 5];
        let total = 60;
        for s in 0..=total {
            for e in s..=total {
                let boxes = flat_boxes(&shape, s, e);
                assert!(boxes.len() <= 5, "{s}..{e}: {} boxes", boxes.len());
                let strides = row_major_strides(&shape);
                let mut elems = Vec::new();
                for (o, z) in &boxes {
                    for i in 0..z[0] {
                        for j in 0..z[1] {
                            for k in 0..z[2] {
                                elems.push(
                                    (o[0] + i) * strides[0] + (o[1] + j) * strides[1] + o[2] + k,
                                );
                            }
                        }
                    }
                }
                assert_eq!(elems, (s..e).collect::<Vec<_>>());
            }
        }
    }

    /// Canonical indices of the boxes' elements, in order (brute force over any ndim).
    fn box_elements(shape: &[u64], boxes: &[(Vec<u64>, Vec<u64>)]) -> Vec<u64> {
        let strides = row_major_strides(shape);
        let mut out = Vec::new();
        for (o, z) in boxes {
            assert!(!z.contains(&0), "empty box {o:?}+{z:?}");
            let mut idx = vec![0u64; z.len()];
            'coords: loop {
                out.push(
                    idx.iter()
                        .zip(o)
                        .zip(&strides)
                        .map(|((i, o), s)| (i + o) * s)
                        .sum(),
                );
                for d in (0..z.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < z[d] {
                        continue 'coords;
                    }
                    idx[d] = 0;
                }
                break;
            }
        }
        out
    }

    #[test]
    fn flat_boxes_cover_every_range_of_assorted_shapes() {
        for shape in [
            vec![5u64],
            vec![1, 1, 4],
            vec![2, 1, 3, 2],
            vec![2, 3, 1, 2, 2],
            vec![3, 1, 1],
        ] {
            let total: u64 = shape.iter().product();
            for s in 0..=total {
                for e in s..=total {
                    let boxes = flat_boxes(&shape, s, e);
                    assert!(boxes.len() < 2 * shape.len(), "{shape:?} {s}..{e}");
                    assert_eq!(box_elements(&shape, &boxes), (s..e).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn flat_boxes_of_very_many_dims_do_not_recurse() {
        // 30,000 dims: one box, computed without a stack frame per dim.
        let mut shape = vec![1u64; 30_000];
        shape[0] = 2;
        shape[29_999] = 3;
        let boxes = flat_boxes(&shape, 1, 5);
        assert_eq!(box_elements(&shape, &boxes), vec![1, 2, 3, 4]);
    }

    #[test]
    fn scalar_flat_range_is_one_empty_box() {
        assert_eq!(flat_boxes(&[], 0, 1), vec![(vec![], vec![])]);
        let p = Region::Flat { start: 0, len: 1 }.pieces(&[]);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].numel(), 1);
    }

    #[test]
    fn runs_merge_full_trailing_dims() {
        let shape = [4u64, 6];
        let src = Region::Box {
            offsets: vec![0, 0],
            sizes: vec![4, 6],
        }
        .pieces(&shape)
        .remove(0);
        let dst = src.clone();
        let mut runs = Vec::new();
        for_each_run(&[1, 0], &[2, 6], &src, &dst, |a, b, n| runs.push((a, b, n)));
        assert_eq!(runs, vec![(6, 6, 12)]);
        runs.clear();
        for_each_run(&[1, 2], &[2, 3], &src, &dst, |a, b, n| runs.push((a, b, n)));
        assert_eq!(runs, vec![(8, 8, 3), (14, 14, 3)]);
    }
}
