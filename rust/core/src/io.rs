//! Parallel positional I/O: writing chunks with block checksums, and reading byte ranges of saved
//! chunks straight into destination memory, verifying checksums on the way. Compressed chunks
//! (`codec`) are read block by block through scratch memory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::checksum::{self, Crc32c};
use crate::codec::{self, Codec, Encoded};
use crate::coop::Checks;
use crate::error::{CoreError, Result};
use crate::fused::Copies;
use crate::manifest::{block_count, Chunk, FileEntry, Manifest, MAX_BLOCK_SIZE};
use crate::storage::{LocalFs, Mapped, Object, ReadMerge, Storage};

/// Data offsets inside a file are multiples of this.
pub const ALIGN: u64 = 64;
/// Largest unit of work one worker reads or writes at a time (rounded to whole blocks).
pub const MAX_UNIT: u64 = 8 << 20;

/// Worker threads to use when the caller does not say: `OLMO_CHUNKS_THREADS`, else the core count
/// clamped to 4..=32 (I/O waits as well as copies, so a few more threads than cores help).
pub fn default_workers() -> usize {
    if let Some(n) = std::env::var("OLMO_CHUNKS_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return usize::max(n, 1);
    }
    std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(4, 32)
}

/// Runs `job` on each item of `work` from `workers` scoped threads; the first error stops the
/// rest. Where no more threads can be started (a limit on threads or memory), fewer do the work,
/// down to the caller's thread alone.
pub(crate) fn run_parallel<T: Send>(
    work: Vec<T>,
    workers: usize,
    job: impl Fn(T) -> Result<()> + Sync,
) -> Result<()> {
    let workers = workers.clamp(1, work.len().max(1));
    let queue = Mutex::new(work.into_iter());
    let failed = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    let work = || {
        while !failed.load(Ordering::Relaxed) {
            let Some(item) = queue.lock().unwrap().next() else {
                break;
            };
            if let Err(e) = job(item) {
                failed.store(true, Ordering::Relaxed);
                first_error.lock().unwrap().get_or_insert(e);
            }
        }
    };
    std::thread::scope(|s| {
        let started = (0..workers)
            .take_while(|_| std::thread::Builder::new().spawn_scoped(s, work).is_ok())
            .count();
        if started == 0 {
            work();
        }
    });
    match first_error.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One chunk to write: its bytes and the data file (index into the file list) it goes to.
pub struct WriteItem<'a> {
    pub file: usize,
    pub data: &'a [u8],
}

/// Where a written chunk landed, with its block checksums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub file: u32,
    pub offset: u64,
    /// Raw bytes of the chunk.
    pub len: u64,
    pub checksums: Vec<u32>,
    pub codec: Codec,
    /// Stored length of each block when compressed; empty when raw.
    pub block_lens: Vec<u32>,
}

/// [`write_chunks_to`] a local directory.
pub fn write_chunks(
    dir: &Path,
    rel_paths: &[String],
    items: &[WriteItem<'_>],
    block_size: u64,
    workers: usize,
) -> Result<(Vec<Written>, Vec<FileEntry>)> {
    write_chunks_to(&LocalFs::new(dir), rel_paths, items, block_size, workers)
}

/// Writes `items` into the data objects `rel_paths` of `storage` (created fresh) with `workers`
/// threads, makes them durable, and returns where each item went.
pub fn write_chunks_to(
    storage: &dyn Storage,
    rel_paths: &[String],
    items: &[WriteItem<'_>],
    block_size: u64,
    workers: usize,
) -> Result<(Vec<Written>, Vec<FileEntry>)> {
    write_chunks_with(storage, rel_paths, items, block_size, workers, None)
}

/// [`write_chunks_to`], compressing every chunk with zstd at `zstd_level` when given (see
/// [`codec`]). Compression runs first, into memory, so that every chunk's stored size, and so its
/// place in the file, is known before anything is written.
pub fn write_chunks_with(
    storage: &dyn Storage,
    rel_paths: &[String],
    items: &[WriteItem<'_>],
    block_size: u64,
    workers: usize,
    zstd_level: Option<i32>,
) -> Result<(Vec<Written>, Vec<FileEntry>)> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        return Err(CoreError::InvalidArgument(format!(
            "write_chunks: block size {block_size} is not in 1..={MAX_BLOCK_SIZE}"
        )));
    }
    if items.iter().any(|it| it.file >= rel_paths.len()) {
        return Err(CoreError::InvalidArgument(
            "write_chunks: file index out of range".into(),
        ));
    }
    if let Some(level) = zstd_level.filter(|l| !codec::level_range().contains(l)) {
        return Err(CoreError::InvalidArgument(format!(
            "zstd level {level} is not in {:?}",
            codec::level_range()
        )));
    }
    let unit = MAX_UNIT.next_multiple_of(block_size);
    let mut work = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let len = it.data.len() as u64;
        let mut s = 0;
        while s < len {
            work.push((i, s, (s + unit).min(len)));
            s += unit;
        }
    }
    let mut codecs = vec![Codec::Raw; items.len()];
    let mut encoded: Vec<Option<Encoded>> = work.iter().map(|_| None).collect();
    if let Some(level) = zstd_level {
        let first = |i: usize| &items[i].data[..items[i].data.len().min(block_size as usize)];
        let shuffles = Mutex::new(vec![0u8; items.len()]);
        run_parallel((0..items.len()).collect(), workers, |i| {
            let w = codec::choose_shuffle(first(i), level);
            shuffles.lock().unwrap()[i] = w;
            Ok(())
        })?;
        let shuffles = shuffles.into_inner().unwrap();
        let done = Mutex::new(std::mem::take(&mut encoded));
        run_parallel((0..work.len()).collect(), workers, |u| {
            let (i, s, e) = work[u];
            let data = &items[i].data[s as usize..e as usize];
            let enc = codec::encode_blocks(data, block_size, shuffles[i], level);
            done.lock().unwrap()[u] = Some(enc);
            Ok(())
        })?;
        encoded = done.into_inner().unwrap();
        codecs = shuffles
            .into_iter()
            .map(|shuffle| Codec::Zstd { shuffle })
            .collect();
    }
    // Stored length of each work unit, then where each chunk and unit lands.
    let unit_lens: Vec<u64> = work
        .iter()
        .zip(&encoded)
        .map(|(&(_, s, e), enc)| enc.as_ref().map_or(e - s, |x| x.bytes.len() as u64))
        .collect();
    let mut stored = vec![0u64; items.len()];
    for (&(i, _, _), n) in work.iter().zip(&unit_lens) {
        stored[i] += n;
    }
    let mut sizes = vec![0u64; rel_paths.len()];
    let mut written = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let offset = sizes[it.file].next_multiple_of(ALIGN);
        let len = it.data.len() as u64;
        sizes[it.file] = offset + stored[i];
        written.push(Written {
            file: it.file as u32,
            offset,
            len,
            checksums: vec![0; block_count(len, block_size) as usize],
            codec: codecs[i],
            block_lens: Vec::new(),
        });
    }
    let mut unit_pos = Vec::with_capacity(work.len());
    let mut next = vec![0u64; items.len()];
    for (&(i, _, _), n) in work.iter().zip(&unit_lens) {
        unit_pos.push(written[i].offset + next[i]);
        next[i] += n;
    }
    let files = rel_paths
        .iter()
        .zip(&sizes)
        .map(|(rel, &size)| storage.create(rel, size))
        .collect::<Result<Vec<_>>>()?;
    let mut ends = vec![0u64; rel_paths.len()];
    for (w, n) in written.iter().zip(&stored) {
        let f = w.file as usize;
        files[f]
            .pad(ends[f], w.offset - ends[f])
            .map_err(|e| CoreError::io(storage.name(&rel_paths[f]), e))?;
        ends[f] = w.offset + n;
    }
    let crcs = Mutex::new(Vec::new());
    run_parallel((0..work.len()).collect(), workers, |u| {
        let (i, s, e) = work[u];
        let w = &written[i];
        let data = match &encoded[u] {
            Some(enc) => &enc.bytes[..],
            None => &items[i].data[s as usize..e as usize],
        };
        files[w.file as usize]
            .write_all_at(data, unit_pos[u])
            .map_err(|err| CoreError::io(storage.name(&rel_paths[w.file as usize]), err))?;
        if encoded[u].is_none() {
            let mut local: Vec<(usize, usize, u32)> = Vec::new();
            for (k, block) in data.chunks(block_size as usize).enumerate() {
                local.push((i, (s / block_size) as usize + k, checksum::crc32c(block)));
            }
            crcs.lock().unwrap().extend(local);
        }
        Ok(())
    })?;
    for (i, b, c) in crcs.into_inner().unwrap() {
        written[i].checksums[b] = c;
    }
    // Units are in chunk order: their blocks' lengths and checksums concatenate.
    for (u, enc) in encoded.into_iter().enumerate() {
        if let Some(enc) = enc {
            let (i, s, _) = work[u];
            let b = (s / block_size) as usize;
            let w = &mut written[i];
            w.checksums[b..b + enc.checksums.len()].copy_from_slice(&enc.checksums);
            w.block_lens.extend(enc.block_lens);
        }
    }
    let synced: Vec<(&Box<dyn Object>, &String)> = files.iter().zip(rel_paths).collect();
    run_parallel(synced, workers, |(f, rel)| {
        f.sync().map_err(|e| CoreError::io(storage.name(rel), e))
    })?;
    storage.persist(&rel_paths.iter().map(String::as_str).collect::<Vec<_>>())?;
    let entries = rel_paths
        .iter()
        .zip(sizes)
        .map(|(p, size)| FileEntry {
            path: p.clone(),
            size,
        })
        .collect();
    Ok((written, entries))
}

/// Copy `len` bytes from byte `src` of saved chunk `chunk` (a manifest chunk index) to byte
/// `dst_off` of destination buffer `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteCopy {
    pub chunk: usize,
    pub src: u64,
    pub dst: usize,
    pub dst_off: u64,
    pub len: u64,
}

/// How a block is checked on a read: whole here (`Check`), by another rank of this host
/// (`Trusted`), or in part here, this rank folding its share of the checksum from its own bytes
/// (`Split`; `coop::delegate_checks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trust {
    Check,
    Trusted,
    Split,
}

/// A block-aligned byte range of one chunk and the destination slices it fills. Its blocks are
/// all checked alike (`trust`).
struct Unit<'a> {
    chunk: usize,
    start: u64,
    end: u64,
    trust: Trust,
    /// (offset inside the unit, destination bytes)
    parts: Vec<(u64, &'a mut [u8])>,
}

/// Fails with `Truncated` if chunk `c` does not fit in its data file of `size` bytes.
fn check_extent(m: &Manifest, c: usize, path: &Path, size: u64) -> Result<()> {
    let ch = &m.chunks[c];
    let needed = ch.offset + m.stored_len(ch);
    if needed <= size {
        return Ok(());
    }
    let (key, chunk) = chunk_name(m, c);
    Err(CoreError::Truncated {
        path: path.to_path_buf(),
        key,
        chunk,
        needed,
        size,
    })
}

/// Names the tensor and chunk-in-tensor of manifest chunk `c`, for errors.
pub(crate) fn chunk_name(m: &Manifest, c: usize) -> (String, usize) {
    let t = m.chunk_start.partition_point(|&s| s <= c) - 1;
    (m.tensors[t].key.clone(), c - m.chunk_start[t])
}

/// Carves each copy its own disjoint slice of its destination (`copies[i].dst` indexes `dests`).
/// Fails if a copy lies outside its destination or, with `overlap(earlier, later)`'s error, if two
/// copies' destination ranges overlap.
pub(crate) fn carve<'a>(
    copies: &[ByteCopy],
    dests: Vec<&'a mut [u8]>,
    overlap: impl Fn(&ByteCopy, &ByteCopy) -> CoreError,
) -> Result<Vec<&'a mut [u8]>> {
    // By destination (a counting sort, keeping the copies' order within each), then by offset in
    // it where that order is not already the offsets' (the copies of one destination mostly come in
    // its order; the destinations do not come in theirs).
    let outside = |c: &ByteCopy| {
        CoreError::InvalidArgument(format!("copy {c:?} lies outside its destination"))
    };
    let mut at = vec![0usize; dests.len() + 1];
    for c in copies {
        if c.dst >= dests.len() {
            return Err(outside(c));
        }
        at[c.dst + 1] += 1;
    }
    for d in 0..dests.len() {
        at[d + 1] += at[d];
    }
    let mut order = vec![0usize; copies.len()];
    for (i, c) in copies.iter().enumerate() {
        order[at[c.dst]] = i;
        at[c.dst] += 1;
    }
    // `at[d]` is now where destination `d`'s copies end (and `d + 1`'s begin).
    let mut start = 0;
    for &end in &at[..dests.len()] {
        let same = &mut order[start..end];
        if !same.is_sorted_by_key(|&i| copies[i].dst_off) {
            same.sort_unstable_by_key(|&i| copies[i].dst_off);
        }
        start = end;
    }
    let mut slices: Vec<Option<&mut [u8]>> = (0..copies.len()).map(|_| None).collect();
    let mut rest: Vec<Option<(u64, &mut [u8])>> = dests.into_iter().map(|d| Some((0, d))).collect();
    let mut last = vec![0usize; rest.len()]; // each destination's copy carved last
    for &i in &order {
        let c = copies[i];
        let (cursor, buf) = rest[c.dst].take().unwrap();
        if c.dst_off < cursor {
            return Err(overlap(&copies[last[c.dst]], &c));
        }
        last[c.dst] = i;
        let end = c
            .dst_off
            .checked_add(c.len)
            .filter(|&e| e - cursor <= buf.len() as u64);
        if end.is_none() {
            return Err(outside(&c));
        }
        let (_, tail) = buf.split_at_mut((c.dst_off - cursor) as usize);
        let (mine, tail) = tail.split_at_mut(c.len as usize);
        slices[i] = Some(mine);
        rest[c.dst] = Some((c.dst_off + c.len, tail));
    }
    Ok(slices.into_iter().map(Option::unwrap).collect())
}

/// `carve`'s error for overlapping copies that came from anywhere.
pub(crate) fn overlap_in_buffer(_: &ByteCopy, c: &ByteCopy) -> CoreError {
    CoreError::InvalidArgument(format!("destination ranges overlap in buffer {}", c.dst))
}

/// Executes `copies` from the checkpoint in `dir` into `dests`, reading every needed block of
/// every chunk once, in parallel, straight into the destination where a whole unit lands in one
/// place, and verifying block checksums when `verify` is set. Destination ranges must not overlap.
pub fn read_into(
    dir: &Path,
    m: &Manifest,
    copies: Vec<ByteCopy>,
    dests: Vec<&mut [u8]>,
    verify: bool,
    workers: usize,
) -> Result<()> {
    read_from(&LocalFs::new(dir), m, copies, dests, verify, workers)
}

/// [`read_into`] from any storage.
pub fn read_from(
    storage: &dyn Storage,
    m: &Manifest,
    copies: Vec<ByteCopy>,
    dests: Vec<&mut [u8]>,
    verify: bool,
    workers: usize,
) -> Result<()> {
    read_from_trusting(
        storage,
        m,
        copies,
        dests,
        verify,
        &Checks::default(),
        workers,
    )
    .map(|_| ())
}

/// [`read_from`], but blocks `(chunk, block)` of `checks.trusted` are not checked whole: another
/// rank on this host reads each of them whole and checks it, or (`checks.split`) the ranks that
/// need it each fold a share of its checksum from their own bytes (`coop::delegate_checks`). This rank then copies only its pieces of them, out of a mapping
/// where the storage has one, and returns its shares `(chunk, block, share)` of the split blocks,
/// sorted (`coop::check_shares` checks them).
pub fn read_from_trusting(
    storage: &dyn Storage,
    m: &Manifest,
    mut copies: Vec<ByteCopy>,
    dests: Vec<&mut [u8]>,
    verify: bool,
    checks: &Checks,
    workers: usize,
) -> Result<Vec<(u64, u64, u32)>> {
    let trust = |chunk: usize, block: u64| {
        let b = (chunk as u64, block);
        if checks.split.binary_search(&b).is_ok() {
            Trust::Split
        } else if checks.trusted.binary_search(&b).is_ok() {
            Trust::Trusted
        } else {
            Trust::Check
        }
    };
    copies.retain(|c| c.len > 0);
    for c in &copies {
        let chunk = m
            .chunks
            .get(c.chunk)
            .ok_or_else(|| CoreError::InvalidArgument(format!("chunk {} out of range", c.chunk)))?;
        let dest_len = dests.get(c.dst).map(|d| d.len() as u64);
        let fits =
            |off: u64, cap: Option<u64>| off.checked_add(c.len).is_some_and(|e| Some(e) <= cap);
        if !fits(c.src, Some(chunk.len)) || !fits(c.dst_off, dest_len) {
            return Err(CoreError::InvalidArgument(format!(
                "copy {c:?} lies outside its chunk or destination"
            )));
        }
    }
    // Two chunks of one tensor landing on the same bytes: the targets of a tensor never overlap
    // (they are parts of its destination), so its saved chunks do, which a committed manifest's
    // never do (its chunks' sizes add up to the tensor's, so one of its elements is missing too).
    let overlap = |a: &ByteCopy, b: &ByteCopy| {
        let ((key, ca), (other, cb)) = (chunk_name(m, a.chunk), chunk_name(m, b.chunk));
        if key == other && ca != cb {
            CoreError::layout(
                &key,
                format!("saved chunks {ca} and {cb} overlap (a corrupt manifest)"),
            )
        } else {
            overlap_in_buffer(a, b)
        }
    };
    let slices = carve(&copies, dests, overlap)?
        .into_iter()
        .map(Some)
        .collect();
    // Open and size-check every data file that is needed.
    let mut files: Vec<Option<(Box<dyn Object>, PathBuf)>> =
        (0..m.files.len()).map(|_| None).collect();
    for c in &copies {
        let ch = &m.chunks[c.chunk];
        let slot = &mut files[ch.file as usize];
        if slot.is_none() {
            *slot = Some(open_data_file(storage, m, ch.file)?);
        }
        let (f, path) = slot.as_ref().unwrap();
        check_extent(m, c.chunk, path, f.size())?;
    }
    let units = make_units(m, &copies, slices, &trust);
    let requests = merge_units(m, units, storage.read_merge());
    let shares = Mutex::new(Vec::new());
    // Reads a unit; returns whether its bytes went through `fold` on the way.
    let read_unit = |u: &mut Unit<'_>, fold: &mut Option<UnitShares>| -> Result<bool> {
        let ch = &m.chunks[u.chunk];
        let (f, path) = files[ch.file as usize].as_ref().unwrap();
        let verify = verify && u.trust == Trust::Check;
        let parts = &mut u.parts;
        if ch.codec != Codec::Raw {
            return with_scratch(|raw| {
                decode_range(m, u.chunk, &**f, path, u.start, u.end, verify, raw)?;
                for (off, dst) in parts.iter_mut() {
                    let n = dst.len();
                    dst.copy_from_slice(&raw[*off as usize..*off as usize + n]);
                }
                Ok(false)
            });
        }
        let io_err = |e| read_error(m, u.chunk, path, ch.offset + u.end, f.size(), e);
        let read = |buf: &mut [u8]| {
            f.read_exact_at(&mut [buf], ch.offset + u.start)
                .map_err(io_err)
        };
        let read_vectored =
            |segs: &mut [&mut [u8]]| f.read_exact_at(segs, ch.offset + u.start).map_err(io_err);
        let check = |segs: &[&[u8]]| {
            if verify {
                check_blocks(m, u.chunk, ch, u.start, segs, path)
            } else {
                Ok(())
            }
        };
        let disjoint = parts
            .windows(2)
            .all(|w| w[0].0 + w[0].1.len() as u64 <= w[1].0);
        if disjoint {
            if let Some(map) = f.mapped(ch.offset + u.start, u.end - u.start) {
                let blocks = (m, u.chunk, path.as_path());
                return copy_mapped(
                    blocks,
                    &map,
                    (u.start, u.end),
                    parts,
                    verify,
                    fold.as_mut(),
                    io_err,
                );
            }
        }
        with_scratch(|scratch| {
            let len = (u.end - u.start) as usize;
            if !disjoint {
                // Two targets want the same bytes: read once, copy to each.
                scratch.resize(len, 0);
                read(scratch)?;
                check(&[&scratch[..]])?;
                for (off, dst) in parts.iter_mut() {
                    let n = dst.len();
                    dst.copy_from_slice(&scratch[*off as usize..*off as usize + n]);
                }
                return Ok(false);
            }
            if let Some(w) = f.window() {
                let mut check =
                    verify.then(|| BlockCheck::new(m, u.chunk, ch, u.start, u.end, path));
                let mut seen = |b: &[u8]| {
                    if let Some(c) = check.as_mut() {
                        c.feed(b)
                    }
                };
                let at = ch.offset + u.start;
                read_windows(&**f, at, len, parts, w, scratch, &mut seen).map_err(io_err)?;
                return check.map_or(Ok(()), BlockCheck::finish).map(|_| false);
            }
            // One vectored read straight into the destinations; bytes no target wants land in
            // scratch (they are read anyway, for the block checksums).
            let wanted: usize = parts.iter().map(|p| p.1.len()).sum();
            scratch.resize(len - wanted, 0);
            let mut spare: &mut [u8] = &mut scratch[..];
            let mut segs: Vec<&mut [u8]> = Vec::with_capacity(2 * parts.len() + 1);
            let mut pos = 0usize;
            for (off, dst) in parts.iter_mut() {
                let off = *off as usize;
                if off > pos {
                    let (gap, rest) = std::mem::take(&mut spare).split_at_mut(off - pos);
                    segs.push(gap);
                    spare = rest;
                }
                pos = off + dst.len();
                segs.push(&mut **dst);
            }
            if len > pos {
                segs.push(spare);
            }
            if !verify {
                return read_vectored(&mut segs).map(|_| false);
            }
            // Each stretch checked as soon as it lands, while it is in the cache.
            let mut check = BlockCheck::new(m, u.chunk, ch, u.start, u.end, path);
            f.read_exact_at_seen(&mut segs, ch.offset + u.start, &mut |b| check.feed(b))
                .map_err(io_err)?;
            check.finish().map(|_| false)
        })
    };
    let job = |mut u: Unit<'_>| -> Result<()> {
        u.parts.sort_unstable_by_key(|p| p.0);
        let mut fold = (u.trust == Trust::Split)
            .then(|| UnitShares::new(u.chunk as u64, m.block_size, m.chunks[u.chunk].len, u.start));
        let fed = read_unit(&mut u, &mut fold)?;
        if let Some(mut fold) = fold {
            if !fed {
                fold.feed_parts(&u.parts);
            }
            shares.lock().unwrap().extend(fold.finish());
        }
        Ok(())
    };
    // Units merged into one request: one read of the object's bytes from the first unit's start
    // to the last one's end, the parts straight into place, the rest (unneeded bytes inside the
    // units, gaps between them) into scratch; each unit's blocks checked as they land.
    let merged = |mut units: Vec<Unit<'_>>| -> Result<()> {
        let spans: Vec<(usize, u64, u64)> =
            units.iter().map(|u| (u.chunk, u.start, u.end)).collect();
        let at = |&(c, s, e): &(usize, u64, u64)| (m.chunks[c].offset + s, m.chunks[c].offset + e);
        let (begin, end) = (at(&spans[0]).0, at(&spans[spans.len() - 1]).1);
        let last = spans[spans.len() - 1].0;
        let (f, path) = files[m.chunks[spans[0].0].file as usize].as_ref().unwrap();
        let err = |e| read_error(m, last, path, end, f.size(), e);
        let wanted: u64 = units
            .iter()
            .flat_map(|u| &u.parts)
            .map(|p| p.1.len() as u64)
            .sum();
        // Its own scratch, freed after: the pool keeps buffers of one unit at most.
        let mut scratch = vec![0u8; (end - begin - wanted) as usize];
        let mut spare: &mut [u8] = &mut scratch[..];
        let mut segs: Vec<&mut [u8]> = Vec::new();
        let mut owner: Vec<Option<usize>> = Vec::new(); // the unit each segment belongs to
        let mut pos = begin;
        for (i, u) in units.iter_mut().enumerate() {
            let (base, _) = at(&spans[i]);
            if base > pos {
                segs.push(split_off(&mut spare, base - pos));
                owner.push(None);
            }
            let mut done = 0u64;
            for (off, dst) in u.parts.iter_mut() {
                if *off > done {
                    segs.push(split_off(&mut spare, *off - done));
                    owner.push(Some(i));
                }
                done = *off + dst.len() as u64;
                segs.push(&mut **dst);
                owner.push(Some(i));
            }
            if u.end - u.start > done {
                segs.push(split_off(&mut spare, u.end - u.start - done));
                owner.push(Some(i));
            }
            pos = base + (u.end - u.start);
        }
        if !verify {
            return f.read_exact_at(&mut segs, begin).map_err(err);
        }
        let lens: Vec<usize> = segs.iter().map(|s| s.len()).collect();
        let mut checks: Vec<BlockCheck<'_>> = spans
            .iter()
            .map(|&(c, s, e)| BlockCheck::new(m, c, &m.chunks[c], s, e, path))
            .collect();
        let (mut seg, mut left) = (0usize, lens[0]);
        f.read_exact_at_seen(&mut segs, begin, &mut |mut b: &[u8]| {
            while !b.is_empty() {
                while left == 0 {
                    seg += 1;
                    left = lens[seg];
                }
                let n = b.len().min(left);
                if let Some(i) = owner[seg] {
                    checks[i].feed(&b[..n]);
                }
                left -= n;
                b = &b[n..];
            }
        })
        .map_err(err)?;
        checks.into_iter().try_for_each(BlockCheck::finish)
    };
    run_parallel(requests, workers, |mut units: Vec<Unit<'_>>| {
        if units.len() == 1 {
            job(units.pop().unwrap())
        } else {
            merged(units)
        }
    })?;
    let mut shares = shares.into_inner().unwrap();
    shares.sort_unstable();
    Ok(shares)
}

/// The shares of the blocks of a split unit (chunk bytes from `start`), fed its parts in order of
/// their offsets (bytes fed twice count once), block by block.
struct UnitShares {
    chunk: u64,
    bs: u64,
    clen: u64,
    start: u64,
    pos: u64,
    // the block being folded, if any, and its fold (reused block to block: it keeps its tables)
    cur: Option<u64>,
    fold: checksum::Parts,
    out: Vec<(u64, u64, u32)>,
}

impl UnitShares {
    fn new(chunk: u64, bs: u64, clen: u64, start: u64) -> Self {
        UnitShares {
            chunk,
            bs,
            clen,
            start,
            pos: start,
            cur: None,
            fold: checksum::Parts::new(0),
            out: Vec::new(),
        }
    }
    /// Parts `(offset from the unit's start, bytes)`, in order of their offsets: three at a time
    /// through `checksum::regs3` where they are short and follow one another inside one block,
    /// else one by one.
    fn feed_parts(&mut self, parts: &[(u64, &mut [u8])]) {
        let mut i = 0;
        while i < parts.len() {
            if let Some(three) = parts.get(i..i + 3).filter(|p| self.apart(p)) {
                let regs = checksum::regs3([&*three[0].1, &*three[1].1, &*three[2].1]);
                let b = (self.start + three[0].0) / self.bs;
                let base = b * self.bs - self.start;
                let fold = self.block(b);
                for ((off, dst), reg) in three.iter().zip(regs) {
                    fold.feed_reg(off - base, dst.len() as u64, reg);
                }
                self.pos = self.start + three[2].0 + three[2].1.len() as u64;
                i += 3;
            } else {
                self.feed(parts[i].0, parts[i].1);
                i += 1;
            }
        }
    }
    /// A stretch of `len` bytes at `off` from the unit's start, inside one block and at or after
    /// everything fed so far, by its register from 0 (`checksum::update(0, bytes)`).
    fn feed_reg(&mut self, off: u64, len: u64, reg: u32) {
        let at = self.start + off;
        let (b, bs) = (at / self.bs, self.bs);
        self.block(b).feed_reg(at - b * bs, len, reg);
        self.pos = at + len;
    }
    /// Whether `parts` are short but not empty, each starting at or after the end of the one
    /// before (the first at or after everything fed so far), and all inside one block.
    fn apart(&self, parts: &[(u64, &mut [u8])]) -> bool {
        let mut end = self.pos;
        for (off, dst) in parts {
            let at = self.start + off;
            if dst.is_empty() || dst.len() > checksum::SHORT || at < end {
                return false;
            }
            end = at + dst.len() as u64;
        }
        (self.start + parts[0].0) / self.bs == (end - 1) / self.bs
    }
    /// The fold of block `b`, after those of the blocks before it.
    fn block(&mut self, b: u64) -> &mut checksum::Parts {
        if self.cur != Some(b) {
            let (lo, hi) = (b * self.bs, ((b + 1) * self.bs).min(self.clen));
            self.flush(hi - lo);
            self.cur = Some(b);
        }
        &mut self.fold
    }
    /// Bytes `data` at `off` from the unit's start.
    fn feed(&mut self, off: u64, mut data: &[u8]) {
        let mut at = self.start + off;
        let end = at + data.len() as u64;
        if end <= self.pos {
            return;
        }
        if at < self.pos {
            data = &data[(self.pos - at) as usize..];
            at = self.pos;
        }
        while !data.is_empty() {
            let b = at / self.bs;
            let (lo, hi) = (b * self.bs, ((b + 1) * self.bs).min(self.clen));
            let n = data.len().min((hi - at) as usize);
            self.block(b).feed(at - lo, &data[..n]);
            at += n as u64;
            data = &data[n..];
        }
        self.pos = end;
    }
    /// Ends the block being folded, if any, and starts a fold of `len` bytes.
    fn flush(&mut self, len: u64) {
        let share = self.fold.restart(len);
        if let Some(b) = self.cur.take() {
            self.out.push((self.chunk, b, share));
        }
    }
    fn finish(mut self) -> Vec<(u64, u64, u32)> {
        self.flush(0);
        self.out
    }
}

/// The error of a failed read of chunk `c` in data file `path` (of `size` bytes): `Truncated` if
/// the file ends before byte `needed`.
fn read_error(
    m: &Manifest,
    c: usize,
    path: &Path,
    needed: u64,
    size: u64,
    e: std::io::Error,
) -> CoreError {
    if e.kind() != std::io::ErrorKind::UnexpectedEof {
        return CoreError::io(path, e);
    }
    let (key, chunk) = chunk_name(m, c);
    CoreError::Truncated {
        path: path.to_path_buf(),
        key,
        chunk,
        needed,
        size,
    }
}

/// The longest stretch of a mapped copy's stream ([`copy_mapped`]): a checked block goes through
/// in several streams, so that three chains of the CRC run at once, and the shifts that join
/// their registers are of one length (a table, built once: `checksum::Parts`).
const STRIPE: u64 = 64 << 10;

/// Copies a raw unit (chunk bytes `start..end`, its `parts` apart) out of a resident mapping of
/// its data file: every byte loaded once, its checksum folded in as it is copied (`fused`). With
/// `verify` every byte of the unit's blocks is summed and each block checked (bytes no part wants
/// summed, not copied); with a `fold` (a split unit) each part's bytes are summed into it.
/// Returns whether `fold` was fed. The first argument is the manifest, the unit's chunk and its
/// data file's name (for errors).
fn copy_mapped(
    (m, c, path): (&Manifest, usize, &Path),
    map: &Mapped<'_>,
    (start, end): (u64, u64),
    parts: &mut [(u64, &mut [u8])],
    verify: bool,
    fold: Option<&mut UnitShares>,
    io_err: impl Fn(std::io::Error) -> CoreError,
) -> Result<bool> {
    let (bs, len) = (m.block_size, end - start);
    let mut copies = Copies::new(verify || fold.is_some());
    let mut stretches: Vec<(u64, u64)> = Vec::new(); // each stream's (offset in the unit, length)
    let mut parts = parts.iter_mut().map(|(o, d)| (*o, &mut **d));
    if verify {
        // Every block whole, in stripes; the parts' bytes copied, the rest summed only.
        let mut cur = parts.next();
        for lo in (0..len).step_by(bs as usize) {
            let hi = (lo + bs).min(len);
            for s in (lo..hi).step_by(STRIPE as usize) {
                let e = (s + STRIPE).min(hi);
                let mut pos = s;
                while pos < e {
                    match cur.take() {
                        Some((o, dst)) if o <= pos => {
                            let n = (e - pos).min(dst.len() as u64);
                            let (head, tail) = dst.split_at_mut(n as usize);
                            copies.copy(pos, head);
                            pos += n;
                            cur = if tail.is_empty() {
                                parts.next()
                            } else {
                                Some((pos, tail))
                            };
                        }
                        next => {
                            let to = next.as_ref().map_or(e, |(o, _)| (*o).min(e));
                            copies.skip(pos, (to - pos) as usize);
                            (pos, cur) = (to, next);
                        }
                    }
                }
                copies.end_stream();
                stretches.push((s, e - s));
            }
        }
    } else {
        // Each part in stretches inside one block.
        for (mut pos, mut rest) in parts {
            while !rest.is_empty() {
                let n = ((pos / bs + 1) * bs - pos)
                    .min(STRIPE)
                    .min(rest.len() as u64);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n as usize);
                copies.copy(pos, head);
                copies.end_stream();
                stretches.push((pos, n));
                (pos, rest) = (pos + n, tail);
            }
        }
    }
    map.copy(&mut copies).map_err(io_err)?;
    let regs = copies.into_regs();
    if let Some(fold) = fold {
        for (&(at, n), reg) in stretches.iter().zip(regs) {
            fold.feed_reg(at, n, reg);
        }
        return Ok(true);
    }
    if verify {
        let (ch, first) = (&m.chunks[c], start / bs);
        let crcs = m.chunk_checksums(ch);
        let mut block = checksum::Parts::new(0);
        let mut i = 0;
        for (b, lo) in (0..len).step_by(bs as usize).enumerate() {
            let blen = (lo + bs).min(len) - lo;
            block.restart(blen);
            while let Some(&(at, n)) = stretches.get(i).filter(|s| s.0 < lo + blen) {
                block.feed_reg(at - lo, n, regs[i]);
                i += 1;
            }
            let found = block.restart(0) ^ checksum::zeros_constant(blen);
            let k = first as usize + b;
            if found != crcs[k] {
                return Err(mismatch((m, c, path), k, blen, found));
            }
        }
    }
    Ok(false)
}

/// Reads bytes `at..at + len` of `f` in windows of `w` bytes, each handed to `seen` as it lands:
/// straight into the destination where one part (`(offset in the range, destination)`, disjoint,
/// in order) takes a whole window; otherwise into the first `w` bytes of `scratch`, the same ones
/// for every window, and copied from there into the parts. Bytes a rank reads only for the
/// checksums (the other half of a row) then stay in the CPU's cache, and the checksum runs over
/// whole windows, not over each small piece.
fn read_windows(
    f: &dyn Object,
    at: u64,
    len: usize,
    parts: &mut [(u64, &mut [u8])],
    w: usize,
    scratch: &mut Vec<u8>,
    seen: &mut dyn FnMut(&[u8]),
) -> std::io::Result<()> {
    scratch.resize(w.min(len), 0);
    let mut next = parts
        .iter_mut()
        .map(|(off, dst)| (*off as usize, &mut **dst));
    let mut cur = next.next(); // the part being filled, from its offset on
    let mut start = 0usize;
    while start < len {
        let end = (start + w).min(len);
        match cur.take() {
            Some((off, dst)) if off == start && dst.len() >= end - start => {
                let (head, tail) = dst.split_at_mut(end - start);
                f.read_exact_at(&mut [&mut *head], at + start as u64)?;
                seen(head);
                cur = if tail.is_empty() {
                    next.next()
                } else {
                    Some((end, tail))
                };
            }
            mut part => {
                let window = &mut scratch[..end - start];
                f.read_exact_at(&mut [&mut *window], at + start as u64)?;
                seen(window);
                while let Some((off, dst)) = part.take_if(|p| p.0 < end) {
                    let n = dst.len().min(end - off);
                    let (head, tail) = dst.split_at_mut(n);
                    head.copy_from_slice(&window[off - start..off - start + n]);
                    part = if tail.is_empty() {
                        next.next()
                    } else {
                        Some((off + n, tail))
                    };
                }
                cur = part;
            }
        }
        start = end;
    }
    Ok(())
}

/// The first `n` bytes of `spare`, which keeps the rest.
fn split_off<'s>(spare: &mut &'s mut [u8], n: u64) -> &'s mut [u8] {
    let (head, rest) = std::mem::take(spare).split_at_mut(n as usize);
    *spare = rest;
    head
}

/// Groups `units` into the requests that read them: alone, or, where `merge` allows, with the
/// units that follow closely in the same data file (raw ones whose parts do not overlap: those
/// are read straight into place).
fn merge_units<'a>(m: &Manifest, mut units: Vec<Unit<'a>>, merge: ReadMerge) -> Vec<Vec<Unit<'a>>> {
    if merge.max == 0 {
        return units.into_iter().map(|u| vec![u]).collect();
    }
    let at = |u: &Unit<'_>| {
        let ch = &m.chunks[u.chunk];
        (ch.file, ch.offset + u.start, ch.offset + u.end)
    };
    units.sort_unstable_by_key(|u| (at(u).0, at(u).1));
    let mut out: Vec<Vec<Unit<'a>>> = Vec::new();
    let mut open: Option<(u32, u64, u64)> = None; // file, start and end of the request taking more
    for mut u in units {
        u.parts.sort_unstable_by_key(|p| p.0);
        let ok = m.chunks[u.chunk].codec == Codec::Raw
            && u.trust != Trust::Split
            && u.parts
                .windows(2)
                .all(|w| w[0].0 + w[0].1.len() as u64 <= w[1].0);
        let (f, s, e) = at(&u);
        match open.as_mut() {
            Some((of, os, oe))
                if ok && *of == f && s >= *oe && s - *oe <= merge.gap && e - *os <= merge.max =>
            {
                *oe = e;
                out.last_mut().unwrap().push(u);
            }
            _ => {
                open = ok.then_some((f, s, e));
                out.push(vec![u]);
            }
        }
    }
    out
}

/// Scratch buffers kept across calls: worker threads live for one call only, and fresh pages cost
/// a kernel zero-fill on first touch. At most one buffer per worker of the widest call is kept,
/// each at most one unit. `try_lock` never waits, so a child forked while a load runs in another
/// thread (whose lock then stays held) allocates its own buffers instead of hanging.
static SCRATCH: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn with_scratch<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    let mut buf = SCRATCH
        .try_lock()
        .ok()
        .and_then(|mut pool| pool.pop())
        .unwrap_or_default();
    let out = f(&mut buf);
    if let Ok(mut pool) = SCRATCH.try_lock() {
        pool.push(buf);
    }
    out
}

/// Checks the block checksums of chunk bytes `start..` held, in order, by `segs`.
fn check_blocks(
    m: &Manifest,
    c: usize,
    ch: &Chunk,
    start: u64,
    segs: &[&[u8]],
    path: &Path,
) -> Result<()> {
    let total: u64 = segs.iter().map(|s| s.len() as u64).sum();
    let mut check = BlockCheck::new(m, c, ch, start, start + total, path);
    segs.iter().for_each(|s| check.feed(s));
    check.finish()
}

/// The block checksums of chunk bytes `start..end`, fed in order as they arrive: whole blocks,
/// but at the chunk's end. The first mismatch is kept; `finish` says whether there was one.
struct BlockCheck<'a> {
    m: &'a Manifest,
    c: usize,
    path: &'a Path,
    crcs: &'a [u32],
    block: usize,
    filled: usize,
    crc: Crc32c,
    left: u64,
    failure: Option<CoreError>,
}

impl<'a> BlockCheck<'a> {
    fn new(m: &'a Manifest, c: usize, ch: &'a Chunk, start: u64, end: u64, path: &'a Path) -> Self {
        BlockCheck {
            m,
            c,
            path,
            crcs: m.chunk_checksums(ch),
            block: (start / m.block_size) as usize,
            filled: 0,
            crc: Crc32c::default(),
            left: end - start,
            failure: None,
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        let bs = self.m.block_size as usize;
        while !bytes.is_empty() && self.left > 0 {
            let n = bytes.len().min(bs - self.filled).min(self.left as usize);
            self.crc.update(&bytes[..n]);
            self.filled += n;
            self.left -= n as u64;
            bytes = &bytes[n..];
            if self.filled == bs || self.left == 0 {
                self.end_block();
            }
        }
    }

    fn end_block(&mut self) {
        let (block, crc, len) = (self.block, self.crc.take(), self.filled);
        (self.block, self.filled) = (block + 1, 0);
        if crc == self.crcs[block] || self.failure.is_some() {
            return;
        }
        self.failure = Some(mismatch(
            (self.m, self.c, self.path),
            block,
            len as u64,
            crc,
        ));
    }

    fn finish(self) -> Result<()> {
        self.failure.map_or(Ok(()), Err)
    }
}

/// The error of block `block` of chunk `c` (in data file `path`), `len` bytes, whose checksum came
/// out as `found`.
fn mismatch(
    (m, c, path): (&Manifest, usize, &Path),
    block: usize,
    len: u64,
    found: u32,
) -> CoreError {
    let (ch, (key, chunk)) = (&m.chunks[c], chunk_name(m, c));
    let start = ch.offset + block as u64 * m.block_size;
    CoreError::ChecksumMismatch {
        path: path.to_path_buf(),
        key,
        chunk,
        start,
        end: start + len,
        expected: m.chunk_checksums(ch)[block],
        found,
    }
}

/// Splits the needed bytes of every chunk into block-aligned units, cutting at the first and last
/// whole block of each copy so that the interior of a large copy is read straight into place.
fn make_units<'a>(
    m: &Manifest,
    copies: &[ByteCopy],
    mut slices: Vec<Option<&'a mut [u8]>>,
    trust: &dyn Fn(usize, u64) -> Trust,
) -> Vec<Unit<'a>> {
    let bs = m.block_size;
    let unit_max = MAX_UNIT.next_multiple_of(bs);
    // By chunk and source: the order `plan_copies` makes them in, so the sort mostly finds it.
    let mut order: Vec<usize> = (0..copies.len()).collect();
    order.sort_by_key(|&i| (copies[i].chunk, copies[i].src));
    let mut units: Vec<Unit<'a>> = Vec::new();
    let mut k = 0;
    while k < order.len() {
        let chunk = copies[order[k]].chunk;
        let clen = m.chunks[chunk].len;
        let mut j = k;
        while j < order.len() && copies[order[j]].chunk == chunk {
            j += 1;
        }
        let group = &order[k..j];
        // Needed block-aligned segments, and the cut points inside them.
        let mut cuts: Vec<u64> = Vec::new();
        let mut segs: Vec<(u64, u64)> = Vec::new();
        for &i in group {
            let c = copies[i];
            let (a, b) = (
                c.src / bs * bs,
                (c.src + c.len).next_multiple_of(bs).min(clen),
            );
            match segs.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => segs.push((a, b)),
            }
            // Only a copy holding a whole block has an interior to keep in one place.
            let (first, last) = (
                c.src.next_multiple_of(bs).min(clen),
                (c.src + c.len) / bs * bs,
            );
            if first < last {
                cuts.extend([first, last]);
            }
        }
        // And where the checking of blocks changes: a unit's blocks are checked alike.
        for &(s, e) in &segs {
            let mut prev = None;
            for block in s / bs..e.div_ceil(bs) {
                let t = trust(chunk, block);
                if prev.is_some_and(|p| p != t) {
                    cuts.push(block * bs);
                }
                prev = Some(t);
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        let first_unit = units.len();
        let mut ci = 0;
        for (s, e) in segs {
            let mut pos = s;
            while pos < e {
                while ci < cuts.len() && cuts[ci] <= pos {
                    ci += 1;
                }
                let mut end = (pos + unit_max).min(e);
                if ci < cuts.len() && cuts[ci] < end {
                    end = cuts[ci];
                }
                units.push(Unit {
                    chunk,
                    start: pos,
                    end,
                    trust: trust(chunk, pos / bs),
                    parts: Vec::new(),
                });
                pos = end;
            }
        }
        // Hand each copy's slice out to the units it overlaps, in pieces.
        let ours = &mut units[first_unit..];
        for &i in group {
            let c = copies[i];
            let mut slice = slices[i].take().unwrap();
            let mut at = c.src;
            let mut u = ours.partition_point(|u| u.end <= at);
            while !slice.is_empty() {
                let unit = &mut ours[u];
                let n = (unit.end.min(c.src + c.len) - at) as usize;
                let (head, tail) = slice.split_at_mut(n);
                unit.parts.push((at - unit.start, head));
                slice = tail;
                at += n as u64;
                u += 1;
            }
        }
        k = j;
    }
    // Read in file order (a disk's sequential reads); units are few next to copies.
    units.sort_by_key(|u| {
        let ch = &m.chunks[u.chunk];
        (ch.file, ch.offset + u.start)
    });
    units
}

/// Reads the stored blocks holding raw bytes `start..end` (whole blocks, but at the chunk's end)
/// of compressed chunk `c`, checks their checksums when `verify` is set, and decodes them into
/// `out`. A block that does not decode to its raw length is `CorruptData`, whether or not checked.
#[allow(clippy::too_many_arguments)]
fn decode_range(
    m: &Manifest,
    c: usize,
    f: &dyn Object,
    path: &Path,
    start: u64,
    end: u64,
    verify: bool,
    out: &mut Vec<u8>,
) -> Result<()> {
    let ch = &m.chunks[c];
    let bs = m.block_size;
    let (lens, crcs) = (m.chunk_block_lens(ch), m.chunk_checksums(ch));
    let (k0, k1) = ((start / bs) as usize, end.div_ceil(bs) as usize);
    let sum = |r: &[u32]| r.iter().map(|&n| n as u64).sum::<u64>();
    let at = ch.offset + sum(&lens[..k0]);
    let n = sum(&lens[k0..k1]);
    out.resize((end - start) as usize, 0);
    with_scratch(|stored| {
        stored.resize(n as usize, 0);
        f.read_exact_at(&mut [&mut stored[..]], at)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    let (key, chunk) = chunk_name(m, c);
                    CoreError::Truncated {
                        path: path.to_path_buf(),
                        key,
                        chunk,
                        needed: at + n,
                        size: f.size(),
                    }
                }
                _ => CoreError::io(path, e),
            })?;
        let (mut pos, mut tmp) = (0usize, Vec::new());
        for k in k0..k1 {
            let block = &stored[pos..pos + lens[k] as usize];
            let (s, e) = (at + pos as u64, at + (pos + block.len()) as u64);
            let found = checksum::crc32c(block);
            if verify && found != crcs[k] {
                let (key, chunk) = chunk_name(m, c);
                return Err(CoreError::ChecksumMismatch {
                    path: path.to_path_buf(),
                    key,
                    chunk,
                    start: s,
                    end: e,
                    expected: crcs[k],
                    found,
                });
            }
            let raw = (k as u64 * bs - start) as usize
                ..((k as u64 + 1) * bs).min(ch.len) as usize - start as usize;
            codec::decode_block(block, ch.codec, &mut out[raw], &mut tmp).map_err(|reason| {
                let (key, chunk) = chunk_name(m, c);
                CoreError::CorruptData {
                    path: path.to_path_buf(),
                    key,
                    chunk,
                    start: s,
                    end: e,
                    reason,
                }
            })?;
            pos += block.len();
        }
        Ok(())
    })
}

/// Opens data file `file` of `m`, with its name for errors.
fn open_data_file(
    storage: &dyn Storage,
    m: &Manifest,
    file: u32,
) -> Result<(Box<dyn Object>, PathBuf)> {
    let rel = &m.files[file as usize].path;
    Ok((storage.open(rel)?, storage.name(rel)))
}

/// [`verify_from`] a local directory.
pub fn verify_all(
    dir: &Path,
    m: &Manifest,
    workers: usize,
    progress: Option<&AtomicU64>,
) -> Result<u64> {
    verify_from(&LocalFs::new(dir), m, workers, progress)
}

/// Streams every chunk of the checkpoint once and checks its block checksums and file extents.
/// Returns the number of bytes verified; `progress`, when given, counts them up as units complete.
pub fn verify_from(
    storage: &dyn Storage,
    m: &Manifest,
    workers: usize,
    progress: Option<&AtomicU64>,
) -> Result<u64> {
    let files = (0..m.files.len())
        .map(|f| open_data_file(storage, m, f as u32))
        .collect::<Result<Vec<_>>>()?;
    // Check every extent against the real file sizes first: the work list below is then bounded
    // by bytes that exist, not by sizes a manifest merely claims.
    for (c, ch) in m.chunks.iter().enumerate() {
        let (f, path) = &files[ch.file as usize];
        check_extent(m, c, path, f.size())?;
    }
    let unit_max = MAX_UNIT.next_multiple_of(m.block_size);
    let mut work = Vec::new();
    for (c, ch) in m.chunks.iter().enumerate() {
        let mut s = 0;
        while s < ch.len {
            work.push((c, s, (s + unit_max).min(ch.len)));
            s += unit_max;
        }
    }
    let total = work.iter().map(|w| w.2 - w.1).sum();
    run_parallel(work, workers, |(c, s, e)| {
        let ch = &m.chunks[c];
        let (f, path) = &files[ch.file as usize];
        if ch.codec != Codec::Raw {
            with_scratch(|raw| decode_range(m, c, &**f, path, s, e, true, raw))?;
            if let Some(done) = progress {
                done.fetch_add(e - s, Ordering::Relaxed);
            }
            return Ok(());
        }
        with_scratch(|buf| {
            buf.resize((e - s) as usize, 0);
            let mut check = BlockCheck::new(m, c, ch, s, e, path);
            f.read_exact_at_seen(&mut [&mut buf[..]], ch.offset + s, &mut |b| check.feed(b))
                .map_err(|err| read_error(m, c, path, ch.offset + e, f.size(), err))?;
            check.finish()
        })?;
        if let Some(done) = progress {
            done.fetch_add(e - s, Ordering::Relaxed);
        }
        Ok(())
    })?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes in memory, each read recorded.
    struct Mem(Vec<u8>, Mutex<Vec<(u64, usize)>>);

    impl Object for Mem {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
            let mut at = offset as usize;
            for b in bufs.iter_mut() {
                let src = self.0.get(at..at + b.len());
                b.copy_from_slice(src.ok_or(std::io::ErrorKind::UnexpectedEof)?);
                at += b.len();
            }
            self.1.lock().unwrap().push((offset, at - offset as usize));
            Ok(())
        }
        fn write_all_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
            Err(std::io::ErrorKind::Unsupported.into()) // read-only: the tests only read
        }
        fn sync(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    proptest! {
        /// Against the bytes themselves: every part gets its bytes, `seen` gets the whole range
        /// in order, and each read is one window (at most `w` bytes, in order, gapless).
        #[test]
        fn read_windows_fills_parts_and_sees_every_byte(
            len in 1usize..400,
            at in 0u64..50,
            w in 1usize..70,
            cuts in proptest::collection::vec((0usize..400, any::<bool>()), 0..40),
        ) {
            let data: Vec<u8> = (0..at as usize + len).map(|i| (i * 7 + i / 256) as u8).collect();
            // Disjoint parts from sorted cut points, each kept or left as a gap.
            let mut points: Vec<usize> = cuts.iter().map(|c| c.0 % (len + 1)).collect();
            points.extend([0, len]);
            points.sort_unstable();
            points.dedup();
            let spans: Vec<(usize, usize)> = points.windows(2).zip(&cuts)
                .filter(|(_, c)| c.1).map(|(p, _)| (p[0], p[1])).collect();
            let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(a, b)| vec![0; b - a]).collect();
            let mut parts: Vec<(u64, &mut [u8])> = spans.iter().zip(bufs.iter_mut())
                .map(|(&(a, _), b)| (a as u64, &mut b[..])).collect();
            let f = Mem(data.clone(), Mutex::new(Vec::new()));
            let mut seen = Vec::new();
            let mut scratch = Vec::new();
            read_windows(&f, at, len, &mut parts, w, &mut scratch, &mut |b| seen.extend_from_slice(b))
                .unwrap();
            let range = &data[at as usize..at as usize + len];
            prop_assert_eq!(&seen[..], range);
            for (&(a, b), buf) in spans.iter().zip(&bufs) {
                prop_assert_eq!(&buf[..], &range[a..b]);
            }
            let reads = f.1.lock().unwrap().clone();
            let mut pos = at;
            for (off, n) in reads {
                prop_assert!(off == pos && n <= w && n > 0);
                pos += n as u64;
            }
            prop_assert_eq!(pos, at + len as u64);
        }
    }
}
