//! Shared helpers for the core's integration tests: a seeded RNG, random layouts (exact
//! partitions of a tensor into boxes and flat ranges), random strided targets, brute-force
//! element enumeration, and building real manifests from chunk bytes.

#![allow(dead_code)]

use std::path::Path;

use olmo_chunks_core::manifest::block_count;
use olmo_chunks_core::{
    write_chunks, Chunk, FileEntry, Manifest, Piece, Region, SaveOptions, SaveTxn, TensorEntry,
    WriteItem,
};

/// splitmix64: small, seedable, good enough to drive layout generation from a proptest seed.
pub struct Seeded(u64);

impl Seeded {
    pub fn new(seed: u64) -> Self {
        Seeded(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Row-major strides, computed here independently of the crate.
pub fn canon_strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

pub fn canon_index(strides: &[u64], g: &[u64]) -> u64 {
    g.iter().zip(strides).map(|(a, b)| a * b).sum()
}

/// Calls `f` with every coordinate of the box in row-major order (once for a 0-d box).
pub fn for_each_coord(offsets: &[u64], sizes: &[u64], mut f: impl FnMut(&[u64])) {
    if sizes.contains(&0) {
        return;
    }
    let mut g = offsets.to_vec();
    loop {
        f(&g);
        let mut d = g.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            g[d] += 1;
            if g[d] < offsets[d] + sizes[d] {
                break;
            }
            g[d] = offsets[d];
        }
    }
}

/// Canonical indices of a (valid) region's elements in its own storage order, by brute force.
pub fn region_elements(shape: &[u64], r: &Region) -> Vec<u64> {
    match r {
        Region::Box { offsets, sizes } => {
            let strides = canon_strides(shape);
            let mut out = Vec::new();
            for_each_coord(offsets, sizes, |g| out.push(canon_index(&strides, g)));
            out
        }
        Region::Flat { start, len } => (*start..start + len).collect(),
    }
}

/// Brute-force coverage oracle: true iff every region lies inside `shape` and every element is
/// covered exactly once.
pub fn oracle_exact_cover(shape: &[u64], regions: &[Region]) -> bool {
    let total = numel(shape);
    let mut count = vec![0u32; total as usize];
    let strides = canon_strides(shape);
    for r in regions {
        match r {
            Region::Box { offsets, sizes } => {
                if offsets.len() != shape.len() || sizes.len() != shape.len() {
                    return false;
                }
                for d in 0..shape.len() {
                    if offsets[d]
                        .checked_add(sizes[d])
                        .is_none_or(|e| e > shape[d])
                    {
                        return false;
                    }
                }
                for_each_coord(offsets, sizes, |g| {
                    count[canon_index(&strides, g) as usize] += 1
                });
            }
            Region::Flat { start, len } => {
                if start.checked_add(*len).is_none_or(|e| e > total) {
                    return false;
                }
                for i in *start..start + len {
                    count[i as usize] += 1;
                }
            }
        }
    }
    count.iter().all(|&c| c == 1)
}

/// Splits `0..n` into consecutive intervals; with `allow_empty`, sometimes empty ones too.
fn split_interval(rng: &mut Seeded, n: u64, allow_empty: bool) -> Vec<(u64, u64)> {
    let mut cuts: Vec<u64> = (1..n).filter(|_| rng.chance(35)).collect();
    if allow_empty && rng.chance(10) {
        cuts.push(rng.range(0, n));
    }
    cuts.push(0);
    cuts.push(n);
    cuts.sort_unstable();
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}

/// A grid: independent random splits per dimension, every combination a box.
pub fn grid_partition(rng: &mut Seeded, shape: &[u64]) -> Vec<Region> {
    let per_dim: Vec<Vec<(u64, u64)>> = shape
        .iter()
        .map(|&n| split_interval(rng, n, true))
        .collect();
    let mut out = vec![(Vec::new(), Vec::new())];
    for ivs in &per_dim {
        let mut next = Vec::new();
        for (o, s) in &out {
            for &(a, b) in ivs {
                let (mut o2, mut s2): (Vec<u64>, Vec<u64>) = (o.clone(), s.clone());
                o2.push(a);
                s2.push(b - a);
                next.push((o2, s2));
            }
        }
        out = next;
    }
    out.into_iter()
        .map(|(offsets, sizes)| Region::Box { offsets, sizes })
        .collect()
}

/// Random guillotine cuts of the box `(offsets, sizes)`: not a grid in general.
pub fn guillotine_boxes(
    rng: &mut Seeded,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    cuts: usize,
) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut boxes = vec![(offsets, sizes)];
    for _ in 0..cuts {
        let b = rng.below(boxes.len() as u64) as usize;
        let dims: Vec<usize> = (0..boxes[b].1.len())
            .filter(|&d| boxes[b].1[d] >= 2)
            .collect();
        if dims.is_empty() {
            continue;
        }
        let d = *rng.pick(&dims);
        let (o, s) = boxes[b].clone();
        let at = rng.range(1, s[d] - 1);
        let (mut o2, mut s2) = (o.clone(), s.clone());
        boxes[b].1[d] = at;
        o2[d] = o[d] + at;
        s2[d] = s[d] - at;
        boxes.push((o2, s2));
    }
    rng.shuffle(&mut boxes);
    boxes
}

pub fn guillotine_partition(rng: &mut Seeded, shape: &[u64]) -> Vec<Region> {
    let cuts = rng.range(0, 12) as usize;
    guillotine_boxes(rng, vec![0; shape.len()], shape.to_vec(), cuts)
        .into_iter()
        .map(|(offsets, sizes)| Region::Box { offsets, sizes })
        .collect()
}

/// Consecutive flat ranges covering `start..end` of the canonical order.
pub fn flat_partition(rng: &mut Seeded, start: u64, end: u64) -> Vec<Region> {
    split_interval(rng, end - start, true)
        .into_iter()
        .map(|(a, b)| Region::Flat {
            start: start + a,
            len: b - a,
        })
        .collect()
}

/// Slabs along dim 0, each partitioned its own way: one flat range, flat ranges, a guillotine of
/// boxes, or a grid. Mixes boxes and flat ranges in one tensor.
pub fn mixed_partition(rng: &mut Seeded, shape: &[u64]) -> Vec<Region> {
    if shape.is_empty() {
        return if rng.chance(50) {
            vec![Region::Flat { start: 0, len: 1 }]
        } else {
            vec![Region::Box {
                offsets: vec![],
                sizes: vec![],
            }]
        };
    }
    let inner = numel(&shape[1..]);
    let mut out = Vec::new();
    for (a, b) in split_interval(rng, shape[0], false) {
        let mut off = vec![0; shape.len()];
        off[0] = a;
        let mut size = shape.to_vec();
        size[0] = b - a;
        match rng.below(4) {
            0 => out.push(Region::Flat {
                start: a * inner,
                len: (b - a) * inner,
            }),
            1 => out.extend(flat_partition(rng, a * inner, b * inner)),
            2 => {
                let cuts = rng.range(0, 6) as usize;
                out.extend(
                    guillotine_boxes(rng, off, size, cuts)
                        .into_iter()
                        .map(|(offsets, sizes)| Region::Box { offsets, sizes }),
                )
            }
            _ => {
                for r in grid_partition(rng, &size) {
                    if let Region::Box { offsets, sizes } = r {
                        let offsets = offsets.iter().zip(&off).map(|(x, y)| x + y).collect();
                        out.push(Region::Box { offsets, sizes });
                    }
                }
            }
        }
    }
    rng.shuffle(&mut out);
    out
}

/// A random exact partition of `shape` of any of the kinds above.
pub fn random_partition(rng: &mut Seeded, shape: &[u64]) -> Vec<Region> {
    match rng.below(4) {
        0 => grid_partition(rng, shape),
        1 => guillotine_partition(rng, shape),
        2 => flat_partition(rng, 0, numel(shape)),
        _ => mixed_partition(rng, shape),
    }
}

/// A piece for the box `(offsets, sizes)` with a random injective local layout starting at
/// `local_start`: dims in random order (transposes), optional gaps (padding) between rows.
/// Returns the piece and one past its largest local offset.
pub fn strided_piece(
    rng: &mut Seeded,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    local_start: u64,
) -> (Piece, u64) {
    let n = sizes.len();
    let mut order: Vec<usize> = (0..n).collect();
    if rng.chance(50) {
        rng.shuffle(&mut order);
    }
    let mut strides = vec![0u64; n];
    let mut cur = if rng.chance(20) { 2 } else { 1 };
    for &d in order.iter().rev() {
        strides[d] = cur;
        let pad = if rng.chance(30) { rng.range(1, 3) } else { 0 };
        cur = cur * sizes[d].max(1) + pad;
    }
    let extent = if sizes.contains(&0) {
        local_start
    } else {
        local_start
            + sizes
                .iter()
                .zip(&strides)
                .map(|(s, t)| (s - 1) * t)
                .sum::<u64>()
            + 1
    };
    let piece = Piece {
        offsets,
        sizes,
        local_start,
        strides,
    };
    (piece, extent)
}

/// A random box inside `shape`; mostly non-empty, sometimes empty.
pub fn random_box(rng: &mut Seeded, shape: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let mut o = Vec::new();
    let mut s = Vec::new();
    let nonempty = rng.chance(80);
    for &n in shape {
        let (a, b) = if nonempty && n > 0 {
            let a = rng.range(0, n - 1);
            (a, rng.range(a + 1, n))
        } else {
            let a = rng.range(0, n);
            (a, rng.range(a, n))
        };
        o.push(a);
        s.push(b - a);
    }
    (o, s)
}

/// What a loading rank wants of a tensor: pieces with their local maps, and the destination size
/// in elements (with slack) that holds them.
pub struct WantedTarget {
    pub pieces: Vec<Piece>,
    pub dest_elems: u64,
}

/// A random target: one strided box, a flat range, or several disjoint boxes packed one after
/// another (with gaps) into one buffer.
pub fn random_target(rng: &mut Seeded, shape: &[u64]) -> WantedTarget {
    let base = if rng.chance(30) { rng.range(1, 5) } else { 0 };
    let (pieces, extent) = match rng.below(3) {
        0 => {
            let (o, s) = random_box(rng, shape);
            let (p, e) = strided_piece(rng, o, s, base);
            (vec![p], e)
        }
        1 => {
            let total = numel(shape);
            let a = rng.range(0, total.saturating_sub(1));
            let b = rng.range(a, total);
            let mut pieces = Region::Flat {
                start: a,
                len: b - a,
            }
            .pieces(shape);
            for p in &mut pieces {
                p.local_start += base;
            }
            (pieces, base + b - a)
        }
        _ => {
            let mut at = base;
            let mut pieces = Vec::new();
            for r in random_partition(rng, shape) {
                if !rng.chance(50) {
                    continue;
                }
                // Only boxes here: a flat range's pieces share one local map already.
                let boxes = match r {
                    Region::Box { offsets, sizes } => vec![(offsets, sizes)],
                    Region::Flat { start, len } => {
                        olmo_chunks_core::region::flat_boxes(shape, start, start + len)
                    }
                };
                for (o, s) in boxes {
                    let (p, e) = strided_piece(rng, o, s, at);
                    at = e + if rng.chance(30) { 2 } else { 0 };
                    pieces.push(p);
                }
            }
            (pieces, at)
        }
    };
    let slack = if rng.chance(30) { rng.range(1, 4) } else { 0 };
    WantedTarget {
        pieces,
        dest_elems: extent + slack,
    }
}

/// For each local element offset of `pieces`, the canonical index it must receive, computed by
/// brute force from the affine maps. Panics if two elements share a local offset.
pub fn expected_locals(shape: &[u64], pieces: &[Piece]) -> Vec<(u64, u64)> {
    let strides = canon_strides(shape);
    let mut out = Vec::new();
    for p in pieces {
        for_each_coord(&p.offsets, &p.sizes, |g| {
            let local = p.local_start
                + g.iter()
                    .zip(&p.offsets)
                    .zip(&p.strides)
                    .map(|((g, o), s)| (g - o) * s)
                    .sum::<u64>();
            out.push((local, canon_index(&strides, g)));
        });
    }
    let mut locals: Vec<u64> = out.iter().map(|x| x.0).collect();
    locals.sort_unstable();
    let n = locals.len();
    locals.dedup();
    assert_eq!(
        n,
        locals.len(),
        "generator bug: a target maps two elements to one place"
    );
    out
}

/// A JSON value of whatever type the manifest uses for `entries` / `info`: an empty object.
pub fn empty_object<T: serde::de::DeserializeOwned>() -> T {
    serde_json::from_str("{}").unwrap()
}

/// One tensor to save: its metadata and chunk regions.
#[derive(Clone, Debug)]
pub struct SavedTensor {
    pub key: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub regions: Vec<Region>,
}

/// Little-endian bytes of a chunk whose element `i` holds `value(canonical index)` truncated to
/// the item size; distinct tensors get distinct salts so mixing them up shows.
pub fn chunk_bytes(t: &SavedTensor, r: &Region, item: u64, salt: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for e in region_elements(&t.shape, r) {
        let v = (e.wrapping_mul(0x9e37_79b9) ^ salt).to_le_bytes();
        out.extend((0..item as usize).map(|k| v[k % 8] ^ (k / 8) as u8));
    }
    out
}

/// Builds a manifest from where chunks landed; checksums in chunk order.
pub fn assemble_manifest(
    tensors: &[SavedTensor],
    placed: Vec<(u32, u64, u64, Vec<u32>)>,
    files: Vec<FileEntry>,
    block_size: u64,
) -> Manifest {
    let mut chunk_start = Vec::new();
    let mut chunks = Vec::new();
    let mut checksums = Vec::new();
    let mut block_lens = Vec::new();
    let mut it = placed.into_iter();
    for t in tensors {
        chunk_start.push(chunks.len());
        for r in &t.regions {
            let (file, offset, len, crcs) = it.next().unwrap();
            assert_eq!(crcs.len() as u64, block_count(len, block_size));
            chunks.push(Chunk {
                region: r.clone(),
                file,
                offset,
                len,
                crc_index: checksums.len() as u64,
                codec: Default::default(),
            });
            let raw = |k: u64| (len - k * block_size).min(block_size) as u32;
            block_lens.extend((0..crcs.len() as u64).map(raw));
            checksums.extend(crcs);
        }
    }
    chunk_start.push(chunks.len());
    Manifest {
        save_id: "test-save".into(),
        block_size,
        files,
        tensors: tensors
            .iter()
            .map(|t| TensorEntry {
                key: t.key.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                role: "param".into(),
                order: "row-major".into(),
                chunks: t.regions.len(),
            })
            .collect(),
        chunk_start,
        chunks,
        checksums,
        block_lens,
        entries: empty_object(),
        info: empty_object(),
    }
}

/// The bytes of every chunk of `tensors`, in manifest chunk order.
pub fn tensor_chunk_data(tensors: &[SavedTensor]) -> Vec<Vec<u8>> {
    let mut data = Vec::new();
    for (ti, t) in tensors.iter().enumerate() {
        let item = olmo_chunks_core::dtype::itemsize(&t.dtype).unwrap();
        for r in &t.regions {
            data.push(chunk_bytes(t, r, item, ti as u64 * 0x1_0000_0001));
        }
    }
    data
}

/// Writes `data` (one entry per chunk of `tensors`, in order; round-robin over `nfiles` data
/// files) into `dir` and commits a manifest.
pub fn save_bytes(
    dir: &Path,
    tensors: &[SavedTensor],
    data: &[Vec<u8>],
    nfiles: usize,
    block_size: u64,
    workers: usize,
) {
    let opts = SaveOptions {
        overwrite: true,
        lease_timeout: std::time::Duration::from_secs(60),
    };
    let mut txn = SaveTxn::begin(dir, opts).unwrap();
    let m = write_save(&txn, dir, tensors, data, nfiles, block_size, workers);
    txn.commit(&m).unwrap();
}

/// The data of [`save_bytes`] written under `txn`: returns the manifest to commit.
pub fn write_save(
    txn: &SaveTxn,
    dir: &Path,
    tensors: &[SavedTensor],
    data: &[Vec<u8>],
    nfiles: usize,
    block_size: u64,
    workers: usize,
) -> Manifest {
    let prefix = txn.data_prefix();
    let paths: Vec<String> = (0..nfiles)
        .map(|i| format!("{prefix}/rank-{i:05}.bin"))
        .collect();
    let items: Vec<WriteItem<'_>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| WriteItem {
            file: i % nfiles,
            data: d,
        })
        .collect();
    let (written, files) = write_chunks(dir, &paths, &items, block_size, workers).unwrap();
    let placed = written
        .into_iter()
        .map(|w| (w.file, w.offset, w.len, w.checksums))
        .collect();
    let mut m = assemble_manifest(tensors, placed, files, block_size);
    m.save_id = txn.save_id().to_string();
    m
}

/// [`tensor_chunk_data`] with every byte xored by `salt` (a save told apart from another).
pub fn salted_chunk_data(tensors: &[SavedTensor], salt: u8) -> Vec<Vec<u8>> {
    tensor_chunk_data(tensors)
        .into_iter()
        .map(|c| c.into_iter().map(|b| b ^ salt).collect())
        .collect()
}

/// Writes chunk `i` of `tensors` (`data[i]`) into `storage` under `txn`, one data file per chunk
/// written one after another, as a rank rolls its files at a byte budget (`SaveSession`: how
/// import-dcp and import-hf write); returns the manifest to commit.
pub fn write_rolled(
    storage: &dyn olmo_chunks_core::Storage,
    txn: &SaveTxn,
    tensors: &[SavedTensor],
    data: &[Vec<u8>],
    block_size: u64,
) -> Manifest {
    let (mut placed, mut files) = (Vec::new(), Vec::new());
    for (part, d) in data.iter().enumerate() {
        let rel = olmo_chunks_core::txn::data_file_name(txn.save_id(), 0, part);
        let item = WriteItem { file: 0, data: d };
        let (w, f) =
            olmo_chunks_core::write_chunks_to(storage, &[rel], &[item], block_size, 2).unwrap();
        placed.push((
            files.len() as u32,
            w[0].offset,
            w[0].len,
            w[0].checksums.clone(),
        ));
        files.extend(f);
    }
    let mut m = assemble_manifest(tensors, placed, files, block_size);
    m.save_id = txn.save_id().to_string();
    m
}

/// Saves `tensors` with their canonical chunk bytes; returns those bytes in chunk order.
pub fn save(
    dir: &Path,
    tensors: &[SavedTensor],
    nfiles: usize,
    block_size: u64,
    workers: usize,
) -> Vec<Vec<u8>> {
    let data = tensor_chunk_data(tensors);
    save_bytes(dir, tensors, &data, nfiles, block_size, workers);
    data
}

/// A manifest that passes validation without any data files: chunks packed into one file,
/// checksums zero. For planning tests.
pub fn in_memory_manifest(tensors: &[SavedTensor], block_size: u64) -> Manifest {
    let mut placed = Vec::new();
    let mut at = 0u64;
    for t in tensors {
        let item = olmo_chunks_core::dtype::itemsize(&t.dtype).unwrap();
        for r in &t.regions {
            let len = r.numel().unwrap() * item;
            placed.push((
                0u32,
                at,
                len,
                vec![0u32; block_count(len, block_size) as usize],
            ));
            at = (at + len).next_multiple_of(64);
        }
    }
    let files = vec![FileEntry {
        path: "data/all.bin".into(),
        size: at,
    }];
    assemble_manifest(tensors, placed, files, block_size)
}
