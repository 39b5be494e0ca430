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
    /// Each ended stream's register, once run (with `sum`).
    pub fn regs(&self) -> &[u32] {
        &self.regs
    }
    /// [`Copies::regs`], the destinations released.
    pub fn into_regs(self) -> Vec<u32> {
        self.regs
    }

    /// Runs the copies out of `src`.
    ///
    /// # Safety
    /// `src` must be readable for [`Copies::reach`] bytes, and [`available`] true.
    pub(crate) unsafe fn run(&mut self, src: *const u8) {
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn run_sse42(c: &mut Copies<'_>, src: *const u8) {
    use std::arch::x86_64::_mm_sfence;
    let streams = c.ends.len();
    let mut next = 0usize; // the next stream to give a lane
    let mut lanes: [Option<Lane>; 3] = [None; 3];
    loop {
        // Each lane to a segment with bytes left: the next of its stream, or the next stream.
        for lane in lanes.iter_mut() {
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
                        if next == streams {
                            break;
                        }
                        let start = if next == 0 { 0 } else { c.ends[next - 1] };
                        *lane = Some(Lane {
                            stream: next,
                            seg: start,
                            end: c.ends[next],
                            done: 0,
                            reg: 0,
                        });
                        next += 1;
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
        match lanes {
            [Some(ref mut a), Some(ref mut b), Some(ref mut d)] if c.sum => {
                let (pa, pb, pd) = (at(a), at(b), at(d));
                let n = pa.2.min(pb.2).min(pd.2);
                let regs = three(
                    [(pa.0, pa.1), (pb.0, pb.1), (pd.0, pd.1)],
                    n,
                    [a.reg, b.reg, d.reg],
                );
                (a.reg, b.reg, d.reg) = (regs[0], regs[1], regs[2]);
                a.done += n;
                b.done += n;
                d.done += n;
            }
            _ => {
                let Some(l) = lanes.iter_mut().flatten().next() else {
                    break;
                };
                let (s, d, n) = at(l);
                l.reg = one(s, d, n, l.reg, c.sum);
                l.done += n;
            }
        }
    }
    // Non-temporal stores are ordered by nothing else: fence them before anyone reads the bytes.
    _mm_sfence();
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

/// [`one`] for three streams at once, `n` bytes each, summed: their chains interleaved.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn three(s: [(*const u8, *mut u8); 3], n: usize, regs: [u32; 3]) -> [u32; 3] {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_stream_si64};
    let mut r = regs.map(u64::from);
    let words = n / 8;
    for i in 0..words {
        for k in 0..3 {
            let (src, dst) = s[k];
            let w = (src.add(8 * i) as *const u64).read_unaligned();
            if !dst.is_null() {
                _mm_stream_si64(dst.add(8 * i) as *mut i64, w as i64);
            }
            r[k] = _mm_crc32_u64(r[k], w);
        }
    }
    let tail = 8 * words;
    std::array::from_fn(|k| {
        let (src, dst) = s[k];
        let d = if dst.is_null() { dst } else { dst.add(tail) };
        one(src.add(tail), d, n - tail, r[k] as u32, true)
    })
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
            let regs = c.regs().to_vec();
            drop(c);
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
}
