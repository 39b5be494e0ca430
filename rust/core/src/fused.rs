//! Copying bytes out of a mapping of the page cache at memory speed, their checksums folded in.
//!
//! A load from a warm page cache is a copy from memory to memory, and two things make the
//! obvious copies (`pread`, or `memcpy` out of a mapping, then a CRC over the destination) slower
//! than the memory allows: a store to a line that is not in the cache first reads the line (a
//! read for ownership: a third of the traffic of a copy into fresh memory), and a checksum in a
//! second pass reads the bytes again. Here each 8-byte word is loaded once, folded into a CRC-32C
//! chain from the register it was loaded into (so the checksum covers exactly the bytes stored,
//! whatever happens to the source after), and stored with a non-temporal store (`MOVNTI`: no read
//! for ownership, the line goes to memory whole). Three streams go in lockstep so that three
//! chains of the CRC-32C instruction (latency 3, throughput 1) overlap. On this project's build
//! machine (2 cores), 128 MiB out of a mapping: 11-13 ms against 20-22 ms for a `pread` of it (and
//! a `pread` followed by the CRC of each window: 20-25 ms); with four processes at once, 26-28 ms
//! each against 30-46 ms.
//!
//! The lanes' stores are kept apart in the 4 KiB cycle of addresses: where two lanes store within
//! 128 bytes of each other there (three 64 KiB stripes of one piece always do), the copy ran at
//! 0.6-3 GB/s instead of 9-10 (`examples/fused_copy.rs`, a destination 0-128 bytes into a page;
//! 6.5 GB/s at 2,048), and a tensor's data, 64 bytes into a page as the allocator places it, was
//! copied 8 times slower than one elsewhere. A lane that would store too near another first runs
//! alone to where it stores well apart; lockstep keeps the distances (stripes are whole pages).
//!
//! Each lane copies its own third of the streams, in order (`thirds`): while lanes took streams
//! in turn, each lane's next piece lay three pieces on, every piece restarted the CPU's
//! prefetching, and pieces of 1,456 bytes copied at 4.7 GB/s instead of 9 (`fused_copy`). Where
//! a lane's next segment does not continue its last in the source (a quarter of every row), the
//! CPU cannot know where it goes: as a lane copies bytes of a segment it asks for the same bytes
//! of the segment two on in its run, in the first 4 KiB of such segments (`ahead`): 3.4 -> 4.8
//! GB/s there.
//!
//! A stream is a run of segments, each a destination to fill or bytes only summed (the part of a
//! block a reader checks but does not keep); its register is `checksum::update(0, its bytes)`.
//! Where the CPU lacks the CRC-32C instruction (or is not x86-64) there is no such copy:
//! [`available`] says so and callers read instead.

use std::marker::PhantomData;

/// One stretch of a stream: `len` bytes from `off` (from the start of the source), copied to
/// `dst`, or only summed where `dst` is null.
struct Seg {
    off: u64,
    len: usize,
    dst: *mut u8,
}

/// Copies to run out of one source (`run`), in streams, each stream's register kept.
pub struct Copies<'a> {
    segs: Vec<Seg>,
    /// Stream `i` is `segs[ends[i - 1]..ends[i]]` (from 0 for the first).
    ends: Vec<usize>,
    regs: Vec<u32>,
    sum: bool,
    /// Where the source must reach: the end of the last byte any segment takes.
    reach: u64,
    _dsts: PhantomData<&'a mut [u8]>,
}

impl<'a> Copies<'a> {
    /// Copies whose registers are wanted (`sum`), or plain copies.
    pub fn new(sum: bool) -> Self {
        Copies {
            segs: Vec::new(),
            ends: Vec::new(),
            regs: Vec::new(),
            sum,
            reach: 0,
            _dsts: PhantomData,
        }
    }
    /// Appends to the current stream: source bytes `off..off + dst.len()` into `dst`.
    pub fn copy(&mut self, off: u64, dst: &'a mut [u8]) {
        self.push(off, dst.len(), dst.as_mut_ptr());
    }
    /// Appends to the current stream: source bytes `off..off + len`, summed, not copied.
    pub fn skip(&mut self, off: u64, len: usize) {
        self.push(off, len, std::ptr::null_mut());
    }
    fn push(&mut self, off: u64, len: usize, dst: *mut u8) {
        if len > 0 {
            self.reach = self.reach.max(off + len as u64);
            self.segs.push(Seg { off, len, dst });
        }
    }
    /// Ends the current stream (an empty one has register 0).
    pub fn end_stream(&mut self) {
        self.ends.push(self.segs.len());
    }
    /// The source bytes these copies reach.
    pub fn reach(&self) -> u64 {
        self.reach
    }
    /// Bytes the copies take from the source (copied or summed).
    pub fn bytes(&self) -> u64 {
        self.segs.iter().map(|s| s.len as u64).sum()
    }
    /// Each ended stream's register, once run (with `sum`); the destinations released.
    pub fn into_regs(self) -> Vec<u32> {
        self.regs
    }

    /// Runs the copies out of `src`.
    ///
    /// # Safety
    /// `src` must be readable for [`Copies::reach`] bytes, and [`available`] true.
    pub unsafe fn run(&mut self, src: *const u8) {
        if self.segs.len() > self.ends.last().copied().unwrap_or(0) {
            self.end_stream();
        }
        self.regs = vec![0; if self.sum { self.ends.len() } else { 0 }];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as this function's contract; `available` checked the instruction.
        unsafe {
            run_sse42(self, src)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = src;
    }
}

/// Whether this machine has the copy (x86-64 with the CRC-32C instruction).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where one of the three lanes stands: in segment `seg` of stream `stream`, `done` bytes in.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Lane {
    stream: usize,
    seg: usize,
    end: usize,
    done: usize,
    reg: u32,
}

/// How many segments ahead of its own a lane asks for its source.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 2;
/// How much of a segment that does not continue the one before it in the source is asked for
/// ahead (from there on the CPU's own prefetching has caught the run).
#[cfg(target_arch = "x86_64")]
const START: usize = 4096;

/// What a lane in segment `seg`, `done` bytes in, about to copy `n`, asks for ahead: the same
/// bytes of the segment `AHEAD` on in its run (up to `stop`), where that segment does not
/// continue the one before it in the source and within its first `START` bytes (else 0 bytes).
#[cfg(target_arch = "x86_64")]
fn ahead(segs: &[Seg], seg: usize, stop: usize, done: usize, n: usize) -> (u64, usize) {
    let f = seg + AHEAD;
    if f >= stop || done >= START {
        return (0, 0);
    }
    let (p, s) = (&segs[f - 1], &segs[f]);
    if p.off + p.len as u64 == s.off {
        return (0, 0);
    }
    let ask = n.min(START - done).min(s.len.saturating_sub(done));
    (s.off + done as u64, ask)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn run_sse42(c: &mut Copies<'_>, src: *const u8) {
    use std::arch::x86_64::_mm_sfence;
    let streams = c.ends.len();
    // Each lane its own third of the streams (see the module's doc).
    let starts = |i: usize| if i == 0 { 0 } else { c.ends[i - 1] };
    let bytes = (0..streams).map(|i| c.segs[starts(i)..c.ends[i]].iter().map(|s| s.len).sum());
    let cuts = thirds(bytes);
    let mut next = [0, cuts[0], cuts[1]]; // each lane's next stream
    let limit = [cuts[0], cuts[1], streams];
    let stop = limit.map(starts); // where each lane's run of segments ends
    let mut lanes: [Option<Lane>; 3] = [None; 3];
    loop {
        // Each lane to a segment with bytes left: the next of its stream, or the next stream.
        for (i, lane) in lanes.iter_mut().enumerate() {
            let (next, limit) = (&mut next[i], limit[i]);
            loop {
                match lane {
                    Some(l) if l.seg < l.end && l.done < c.segs[l.seg].len => break,
                    Some(l) if l.seg + 1 < l.end => (l.seg, l.done) = (l.seg + 1, 0),
                    _ => {
                        if let Some(l) = lane.take() {
                            if c.sum {
                                c.regs[l.stream] = l.reg;
                            }
                        }
                        if *next == limit {
                            break;
                        }
                        *lane = Some(Lane {
                            stream: *next,
                            seg: starts(*next),
                            end: c.ends[*next],
                            done: 0,
                            reg: 0,
                        });
                        *next += 1;
                    }
                }
            }
        }
        let at = |l: &Lane| {
            let s = &c.segs[l.seg];
            let dst = if s.dst.is_null() {
                s.dst
            } else {
                s.dst.add(l.done)
            };
            (src.add(s.off as usize + l.done), dst, s.len - l.done)
        };
        if let [Some(a), Some(b), Some(d)] = &mut lanes {
            if c.sum {
                let (pa, pb, pd) = (at(a), at(b), at(d));
                // A lane whose stores fall near another's in the 4 KiB cycle of addresses first
                // runs alone to where they fall apart; lockstep then keeps the distances.
                let stores = [pa.1, pb.1, pd.1].map(|p| (!p.is_null()).then_some(p as usize));
                if let Some((k, x)) = (1..3).find_map(|k| Some((k, apart(&stores, k)?))) {
                    let (l, (s, d, left)) = if k == 1 { (b, pb) } else { (d, pd) };
                    let n = x.min(left);
                    l.reg = one(s, d, n, l.reg, true);
                    l.done += n;
                    continue;
                }
                let n = pa.2.min(pb.2).min(pd.2);
                let pf = [(&*a, 0), (&*b, 1), (&*d, 2)].map(|(l, k)| {
                    let (at, ask) = ahead(&c.segs, l.seg, stop[k], l.done, n);
                    (src.add(at as usize), ask)
                });
                let regs = three(
                    [(pa.0, pa.1), (pb.0, pb.1), (pd.0, pd.1)],
                    n,
                    [a.reg, b.reg, d.reg],
                    pf,
                );
                (a.reg, b.reg, d.reg) = (regs[0], regs[1], regs[2]);
                a.done += n;
                b.done += n;
                d.done += n;
                continue;
            }
        }
        let Some(l) = lanes.iter_mut().flatten().next() else {
            break;
        };
        let (s, d, n) = at(l);
        l.reg = one(s, d, n, l.reg, c.sum);
        l.done += n;
    }
    // Non-temporal stores are ordered by nothing else: fence them before anyone reads the bytes.
    _mm_sfence();
}

/// Where the second and third lanes' runs of streams start, given each stream's bytes: the
/// streams cut into three runs of about equal bytes (a run starts with the first stream that
/// starts at or past its third of the bytes), so that each lane copies its own stretch of the
/// source and the destination in order.
#[cfg(target_arch = "x86_64")]
fn thirds(bytes: impl Iterator<Item = usize> + Clone) -> [usize; 2] {
    let total: usize = bytes.clone().sum();
    let mut cuts = [0; 2];
    let mut before = 0; // the bytes of the streams before stream `i`
    for (i, n) in bytes.chain([0]).enumerate() {
        for (k, cut) in cuts.iter_mut().enumerate() {
            if 3 * before < total * (k + 1) {
                *cut = i + 1;
            }
        }
        before += n;
    }
    cuts
}

/// Stores of lanes that fall within this many bytes of each other in the 4 KiB cycle of
/// addresses make a lockstep copy up to 30 times slower (measured on this project's build
/// machine: 0.4 GB/s at 64 bytes, 6 GB/s at 128, 11-12 GB/s from 192 on; where the loads fall
/// hardly matters); `APART` is where a lane is moved to.
const NEAR: usize = 256;
const APART: usize = 512;

/// How far (a multiple of 64 bytes) lane `k`, storing next at `stores[k]`, must run alone for its
/// stores to fall `APART` from the other lanes' (`None` for a lane that only sums); `None` where
/// they fall `NEAR` or farther already.
#[cfg(target_arch = "x86_64")]
fn apart(stores: &[Option<usize>; 3], k: usize) -> Option<usize> {
    let at = stores[k]?;
    let gap = |a: usize, b: usize| {
        let d = a.wrapping_sub(b) % 4096;
        d.min(4096 - d)
    };
    let others = || (0..3).filter(move |&j| j != k).filter_map(|j| stores[j]);
    if others().all(|o| gap(at, o) >= NEAR) {
        return None;
    }
    (1..64)
        .map(|i| 64 * i)
        .find(|&x| others().all(|o| gap(at + x, o) >= APART))
}

/// Copies (where `dst` is not null) and sums `n` bytes of one stream.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn one(src: *const u8, dst: *mut u8, n: usize, reg: u32, sum: bool) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8, _mm_stream_si64};
    let mut r = reg as u64;
    let words = n / 8;
    for i in 0..words {
        let w = (src.add(8 * i) as *const u64).read_unaligned();
        if !dst.is_null() {
            _mm_stream_si64(dst.add(8 * i) as *mut i64, w as i64);
        }
        if sum {
            r = _mm_crc32_u64(r, w);
        }
    }
    let mut r = r as u32;
    for i in 8 * words..n {
        let b = *src.add(i);
        if !dst.is_null() {
            *dst.add(i) = b;
        }
        r = _mm_crc32_u8(r, b);
    }
    r
}

/// [`one`] for three streams at once, `n` bytes each, summed: their chains interleaved. Stream
/// `k` asks for the first `pf[k].1` bytes at `pf[k].0` ahead, a line for each line it copies.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn three(
    s: [(*const u8, *mut u8); 3],
    n: usize,
    regs: [u32; 3],
    pf: [(*const u8, usize); 3],
) -> [u32; 3] {
    let words = n / 8;
    let r = regs.map(u64::from);
    // One loop per set of lanes that store (a lane whose destination is null only sums), so that
    // the loop tests nothing per word.
    let r = match s.map(|(_, d)| !d.is_null()) {
        [true, true, true] => words3::<true, true, true>(s, words, r, pf),
        [true, true, false] => words3::<true, true, false>(s, words, r, pf),
        [true, false, true] => words3::<true, false, true>(s, words, r, pf),
        [true, false, false] => words3::<true, false, false>(s, words, r, pf),
        [false, true, true] => words3::<false, true, true>(s, words, r, pf),
        [false, true, false] => words3::<false, true, false>(s, words, r, pf),
        [false, false, true] => words3::<false, false, true>(s, words, r, pf),
        [false, false, false] => words3::<false, false, false>(s, words, r, pf),
    };
    let tail = 8 * words;
    std::array::from_fn(|k| {
        let (src, dst) = s[k];
        let d = if dst.is_null() { dst } else { dst.add(tail) };
        one(src.add(tail), d, n - tail, r[k] as u32, true)
    })
}

/// The first `words` 8-byte words of [`three`], a 64-byte line of each lane a step; lane `k`
/// stores where `Sk`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
#[inline]
unsafe fn words3<const S0: bool, const S1: bool, const S2: bool>(
    s: [(*const u8, *mut u8); 3],
    words: usize,
    mut r: [u64; 3],
    pf: [(*const u8, usize); 3],
) -> [u64; 3] {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_prefetch, _mm_stream_si64, _MM_HINT_T0};
    let [(s0, d0), (s1, d1), (s2, d2)] = s;
    let step = |o: usize, r: &mut [u64; 3]| {
        let a = (s0.add(o) as *const u64).read_unaligned();
        let b = (s1.add(o) as *const u64).read_unaligned();
        let c = (s2.add(o) as *const u64).read_unaligned();
        if S0 {
            _mm_stream_si64(d0.add(o) as *mut i64, a as i64);
        }
        if S1 {
            _mm_stream_si64(d1.add(o) as *mut i64, b as i64);
        }
        if S2 {
            _mm_stream_si64(d2.add(o) as *mut i64, c as i64);
        }
        r[0] = _mm_crc32_u64(r[0], a);
        r[1] = _mm_crc32_u64(r[1], b);
        r[2] = _mm_crc32_u64(r[2], c);
    };
    let ask = |at: usize| {
        for (p, len) in pf {
            if at < len {
                _mm_prefetch(p.add(at) as *const i8, _MM_HINT_T0);
            }
        }
    };
    let lines = words / 8;
    for line in 0..lines {
        let at = 64 * line;
        ask(at);
        for w in 0..8 {
            step(at + 8 * w, &mut r);
        }
    }
    if 8 * lines < words {
        ask(64 * lines);
    }
    for w in 8 * lines..words {
        step(8 * w, &mut r);
    }
    r
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::checksum::update;
    use proptest::prelude::*;

    proptest! {
        /// Streams of copied and summed segments, against copying and summing byte by byte.
        #[test]
        fn copies_and_registers_match_a_plain_copy_and_crc(
            src in proptest::collection::vec(any::<u8>(), 1..3000),
            streams in proptest::collection::vec(
                proptest::collection::vec((any::<u16>(), 0usize..200, any::<bool>()), 0..5), 0..8),
            sum in any::<bool>(),
        ) {
            prop_assume!(available());
            // Destinations: one buffer per copied segment, at odd offsets inside it.
            let mut bufs: Vec<Vec<u8>> = Vec::new();
            let mut plan = Vec::new();
            for st in &streams {
                let mut segs = Vec::new();
                for &(off, len, copy) in st {
                    let off = off as usize % src.len();
                    let len = len.min(src.len() - off);
                    segs.push((off, len, copy.then_some(bufs.len())));
                    if copy {
                        bufs.push(vec![0xEE; len + 3]);
                    }
                }
                plan.push(segs);
            }
            let mut slots: Vec<Option<&mut [u8]>> =
                bufs.iter_mut().map(|b| { let n = b.len(); Some(&mut b[1..n - 2]) }).collect();
            let mut c = Copies::new(sum);
            for segs in &plan {
                for &(off, len, buf) in segs {
                    match buf {
                        Some(i) => c.copy(off as u64, slots[i].take().unwrap()),
                        None => c.skip(off as u64, len),
                    }
                }
                c.end_stream();
            }
            unsafe { c.run(src.as_ptr()) };
            let regs = c.into_regs();
            if sum {
                prop_assert_eq!(regs.len(), plan.len());
            }
            for (i, segs) in plan.iter().enumerate() {
                let bytes: Vec<u8> =
                    segs.iter().flat_map(|&(o, l, _)| src[o..o + l].iter().copied()).collect();
                if sum {
                    prop_assert_eq!(regs[i], update(0, &bytes));
                }
                for &(off, len, buf) in segs {
                    if let Some(b) = buf {
                        prop_assert_eq!(&bufs[b][1..1 + len], &src[off..off + len]);
                        prop_assert_eq!((bufs[b][0], bufs[b][len + 1]), (0xEE, 0xEE));
                    }
                }
            }
        }
    }

    proptest! {
        /// Each lane's run of streams starts with the first stream that starts at or past its
        /// third of the bytes.
        #[test]
        fn thirds_cut_at_the_first_stream_past_each_third(
            bytes in proptest::collection::vec(prop_oneof![Just(0usize), 0usize..100_000], 0..40),
        ) {
            let total: usize = bytes.iter().sum();
            let before = |i: usize| bytes[..i].iter().sum::<usize>();
            let want = [1, 2].map(|k| (0..=bytes.len()).find(|&i| 3 * before(i) >= k * total).unwrap());
            prop_assert_eq!(thirds(bytes.iter().copied()), want);
        }
    }

    proptest! {
        /// A lane asks for the bytes it copies, of the segment `AHEAD` on in its run, only where
        /// that segment jumps in the source, and only within its first `START` bytes.
        #[test]
        fn a_lane_asks_ahead_only_where_the_source_jumps(
            shape in proptest::collection::vec((0u64..1 << 20, 1usize..9000, any::<bool>()), 1..12),
            seg in 0usize..12,
            stop in 0usize..14,
            done in 0usize..9000,
            n in 0usize..9000,
        ) {
            let mut segs: Vec<Seg> = Vec::new();
            for &(off, len, follows) in &shape {
                let off = match segs.last() {
                    Some(p) if follows => p.off + p.len as u64,
                    _ => off,
                };
                segs.push(Seg { off, len, dst: std::ptr::null_mut() });
            }
            let stop = stop.min(segs.len());
            let (at, ask) = ahead(&segs, seg, stop, done, n);
            // Byte by byte: which of the bytes `done..done + n` of segment `seg + AHEAD` to ask for.
            let f = seg + AHEAD;
            let jumps = f < stop && segs[f - 1].off + segs[f - 1].len as u64 != segs[f].off;
            let want: Vec<u64> = (done..done + n)
                .filter(|&i| jumps && i < START && i < segs[f].len)
                .map(|i| segs[f].off + i as u64)
                .collect();
            let got: Vec<u64> = (0..ask as u64).map(|i| at + i).collect();
            prop_assert_eq!(got, want);
        }
    }

    proptest! {
        /// A lane is moved only where its stores fall near another's, and then to where they
        /// fall `APART` from all of them.
        #[test]
        fn apart_moves_a_lane_only_where_its_stores_fall_near_anothers(
            stores in proptest::array::uniform3(proptest::option::of(0usize..1 << 20)),
            k in 0usize..3,
        ) {
            let gap = |a: usize, b: usize| { let d = a.abs_diff(b) % 4096; d.min(4096 - d) };
            let others: Vec<usize> = (0..3).filter(|&j| j != k).filter_map(|j| stores[j]).collect();
            let near = stores[k].is_some_and(|at| others.iter().any(|&o| gap(at, o) < NEAR));
            match apart(&stores, k) {
                None => prop_assert!(!near),
                Some(x) => {
                    prop_assert!(near);
                    prop_assert!(x > 0 && x % 64 == 0 && x < 4096);
                    prop_assert!(others.iter().all(|&o| gap(stores[k].unwrap() + x, o) >= APART));
                }
            }
        }
    }

    /// Three streams long enough to be moved apart, whose destinations fall at one place of the
    /// 4 KiB cycle (as 64 KiB stripes of one piece do), some bytes only summed.
    #[test]
    fn streams_whose_stores_fall_together_copy_and_sum_exactly() {
        if !available() {
            return;
        }
        let stripe = 20_000usize;
        let src: Vec<u8> = (0..4 * stripe as u32 + 77)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut dst = vec![0u8; 4 * stripe + 4096];
        let base = (4096 - dst.as_ptr() as usize % 4096) % 4096 + 64;
        let mut c = Copies::new(true);
        let mut rest = &mut dst[base..];
        for k in 0..3 {
            let (mine, r) = std::mem::take(&mut rest).split_at_mut(stripe + 4096 - stripe % 4096);
            rest = r;
            c.copy((k * stripe + 5) as u64, &mut mine[..stripe]);
            c.skip(((k + 1) * stripe + 5) as u64, 77);
            c.end_stream();
        }
        unsafe { c.run(src.as_ptr()) };
        let regs = c.into_regs();
        let step = stripe + 4096 - stripe % 4096;
        for k in 0..3 {
            let from = k * stripe + 5;
            assert_eq!(
                &dst[base + k * step..base + k * step + stripe],
                &src[from..from + stripe]
            );
            let mut summed = src[from..from + stripe].to_vec();
            summed.extend_from_slice(&src[from + stripe..from + stripe + 77]);
            assert_eq!(regs[k], update(0, &summed));
        }
    }
}
