//! Cooperative loads: every saved block a job needs is read from storage by exactly one rank, and
//! the bytes each other rank needs are handed over through the job's collectives.
//!
//! Each rank plans its byte copies as for a direct load ([`crate::plan_copies`]) and states, per
//! saved block, the span of it that it needs ([`needs`]). One rank turns every rank's needs into a
//! [`ReadPlan`] per rank ([`plan`]): each block gets one reader among the ranks that need it (the one
//! with the fewest bytes to read so far), readers read whole blocks (so checksums are verified where
//! the bytes come from storage), and the blocks are cut into rounds in which no rank reads, sends
//! and receives more than a budget of bytes. A round is: read (and pack what goes to each peer),
//! one all-to-all of the packed bytes, then the copies into destinations from the bytes read and
//! received ([`fill_round`]). Bytes move in one order that both sides derive from the plan: block
//! by block, peers in rank order.

use std::collections::BTreeMap;

use crate::error::{CoreError, Result};
use crate::io::{carve, read_from, run_parallel, ByteCopy};
use crate::manifest::Manifest;
use crate::storage::Storage;

/// The bytes `lo..hi` of block `block` of saved chunk `chunk` that one rank needs (byte offsets
/// in the chunk; the span lies inside the block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Need {
    pub chunk: u64,
    pub block: u64,
    pub lo: u64,
    pub hi: u64,
}

/// Bytes `lo..hi` of saved chunk `chunk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span {
    pub chunk: u64,
    pub lo: u64,
    pub hi: u64,
}

impl Span {
    fn len(&self) -> u64 {
        self.hi - self.lo
    }
}

/// One rank's part of one round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// Blocks this rank reads (whole blocks, adjacent ones merged), into its read buffer in order.
    pub reads: Vec<Span>,
    /// `(peer, spans)` this rank sends, peers ascending, each peer's spans in block order.
    pub sends: Vec<(u32, Vec<Span>)>,
    /// `(peer, spans)` this rank receives, in the same order.
    pub recvs: Vec<(u32, Vec<Span>)>,
}

impl Round {
    pub fn read_len(&self) -> u64 {
        self.reads.iter().map(Span::len).sum()
    }
}

/// One rank's plan: its rounds, and where each round starts in the job's block order (every rank
/// takes part in every round, with nothing to do in some).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadPlan {
    pub world: u32,
    pub starts: Vec<(u64, u64)>,
    pub rounds: Vec<Round>,
}

/// `(rank, lo, hi)`: a rank needing bytes `lo..hi` of a block.
type Needer = (u32, u64, u64);

/// Length of block `block` of chunk `chunk`.
fn block_len(m: &Manifest, chunk: u64, block: u64) -> u64 {
    let len = m.chunks[chunk as usize].len;
    (len - block * m.block_size).min(m.block_size)
}

/// The block spans `copies` read, merged per block, in block order.
pub fn needs(m: &Manifest, copies: &[ByteCopy]) -> Vec<Need> {
    let bs = m.block_size;
    let mut spans: BTreeMap<(u64, u64), (u64, u64)> = BTreeMap::new();
    for c in copies.iter().filter(|c| c.len > 0) {
        let (a, b) = (c.src, c.src + c.len);
        for block in a / bs..b.div_ceil(bs) {
            let (lo, hi) = (a.max(block * bs), b.min((block + 1) * bs));
            let e = spans.entry((c.chunk as u64, block)).or_insert((lo, hi));
            *e = (e.0.min(lo), e.1.max(hi));
        }
    }
    spans
        .into_iter()
        .map(|((chunk, block), (lo, hi))| Need {
            chunk,
            block,
            lo,
            hi,
        })
        .collect()
}

/// Whether any block is needed by more than one rank (reading once then saves storage reads).
pub fn shared(needs: &[Vec<Need>]) -> bool {
    let mut seen = std::collections::HashSet::new();
    needs
        .iter()
        .any(|rank| rank.iter().any(|n| !seen.insert((n.chunk, n.block))))
}

/// Plans a cooperative load of `m` for ranks whose needs are `needs` (one list per rank), in
/// rounds where no rank reads, sends and receives more than `budget` bytes together (a single
/// block over the budget makes a round of its own).
pub fn plan(m: &Manifest, needs: &[Vec<Need>], budget: u64) -> Result<Vec<ReadPlan>> {
    let world = needs.len();
    // (chunk, block) -> the ranks needing it, with their spans
    let mut units: BTreeMap<(u64, u64), Vec<Needer>> = BTreeMap::new();
    for (r, list) in needs.iter().enumerate() {
        for n in list {
            let ok = (n.chunk as usize) < m.chunks.len()
                && n.block < m.chunks[n.chunk as usize].len.div_ceil(m.block_size)
                && n.lo < n.hi
                && n.lo >= n.block * m.block_size
                && n.hi <= n.block * m.block_size + block_len(m, n.chunk, n.block);
            if !ok {
                return Err(CoreError::InvalidArgument(format!(
                    "rank {r} needs {n:?}, which is not a span of one saved block"
                )));
            }
            units
                .entry((n.chunk, n.block))
                .or_default()
                .push((r as u32, n.lo, n.hi));
        }
    }
    let mut plans: Vec<ReadPlan> = (0..world)
        .map(|_| ReadPlan {
            world: world as u32,
            ..Default::default()
        })
        .collect();
    let mut load = vec![0u64; world];
    let mut cost = vec![0u64; world];
    let mut open = false;
    for ((chunk, block), mut who) in units {
        who.sort_unstable();
        let len = block_len(m, chunk, block);
        let reader = who
            .iter()
            .map(|w| w.0)
            .min_by_key(|&r| (load[r as usize], r))
            .expect("a unit has a needer");
        let sent: u64 = who
            .iter()
            .filter(|w| w.0 != reader)
            .map(|w| w.2 - w.1)
            .sum();
        let over = |cost: &[u64]| {
            cost[reader as usize] + len + sent > budget
                || who
                    .iter()
                    .any(|w| w.0 != reader && cost[w.0 as usize] + (w.2 - w.1) > budget)
        };
        if !open || over(&cost) {
            for p in &mut plans {
                p.starts.push((chunk, block));
                p.rounds.push(Round::default());
            }
            cost.iter_mut().for_each(|c| *c = 0);
            open = true;
        }
        load[reader as usize] += len;
        cost[reader as usize] += len + sent;
        let lo = block * m.block_size;
        push_span(
            &mut plans[reader as usize].rounds.last_mut().unwrap().reads,
            Span {
                chunk,
                lo,
                hi: lo + len,
            },
        );
        for &(r, lo, hi) in who.iter().filter(|w| w.0 != reader) {
            cost[r as usize] += hi - lo;
            let span = Span { chunk, lo, hi };
            push_peer(
                &mut plans[reader as usize].rounds.last_mut().unwrap().sends,
                r,
                span,
            );
            push_peer(
                &mut plans[r as usize].rounds.last_mut().unwrap().recvs,
                reader,
                span,
            );
        }
    }
    for p in &mut plans {
        for round in &mut p.rounds {
            round.sends.sort_by_key(|s| s.0);
            round.recvs.sort_by_key(|s| s.0);
        }
    }
    Ok(plans)
}

fn push_span(spans: &mut Vec<Span>, s: Span) {
    match spans.last_mut() {
        Some(last) if last.chunk == s.chunk && last.hi == s.lo => last.hi = s.hi,
        _ => spans.push(s),
    }
}

fn push_peer(peers: &mut Vec<(u32, Vec<Span>)>, peer: u32, s: Span) {
    match peers.iter_mut().find(|p| p.0 == peer) {
        Some(p) => push_span(&mut p.1, s),
        None => peers.push((peer, vec![s])),
    }
}

/// Reads round `round`'s blocks into `read_buf` (verifying checksums when `verify`) and packs the
/// bytes each peer needs from them into `send_buf`, peers in order.
pub fn read_round(
    storage: &dyn Storage,
    m: &Manifest,
    round: &Round,
    read_buf: &mut [u8],
    send_buf: &mut [u8],
    verify: bool,
    workers: usize,
) -> Result<()> {
    let mut copies = Vec::with_capacity(round.reads.len());
    let mut at = 0;
    for s in &round.reads {
        copies.push(ByteCopy {
            chunk: s.chunk as usize,
            src: s.lo,
            dst: 0,
            dst_off: at,
            len: s.len(),
        });
        at += s.len();
    }
    check_len("read", at, read_buf.len())?;
    read_from(storage, m, copies, vec![&mut *read_buf], verify, workers)?;
    let sends: Vec<Span> = round
        .sends
        .iter()
        .flat_map(|p| p.1.iter().copied())
        .collect();
    let segments = segments(&round.reads, read_buf);
    let packed = copies_into(&sends, 0);
    check_len("send", packed.iter().map(|c| c.len).sum(), send_buf.len())?;
    copy_from(&segments, &packed, vec![send_buf], workers)?;
    Ok(())
}

/// Executes the `copies` (of the whole load) that fall in this round, from the bytes this rank
/// read (`read_buf`) and received (`recv_buf`, peers in order). Returns the bytes copied.
pub fn fill_round(
    round: &Round,
    read_buf: &[u8],
    recv_buf: &[u8],
    copies: &[ByteCopy],
    dests: Vec<&mut [u8]>,
    workers: usize,
) -> Result<u64> {
    check_len("read", round.read_len(), read_buf.len())?;
    let recvs: Vec<Span> = round
        .recvs
        .iter()
        .flat_map(|p| p.1.iter().copied())
        .collect();
    check_len("receive", recvs.iter().map(Span::len).sum(), recv_buf.len())?;
    let mut segs = segments(&round.reads, read_buf);
    segs.extend(segments(&recvs, recv_buf));
    segs.sort_unstable_by_key(|s| (s.0.chunk, s.0.lo));
    copy_from(&segs, copies, dests, workers)
}

fn check_len(what: &str, want: u64, have: usize) -> Result<()> {
    if want == have as u64 {
        return Ok(());
    }
    Err(CoreError::InvalidArgument(format!(
        "{what} buffer of {have} bytes given for {want}"
    )))
}

/// `spans` laid out back to back in `buf`.
fn segments<'a>(spans: &[Span], buf: &'a [u8]) -> Vec<(Span, &'a [u8])> {
    let mut at = 0usize;
    spans
        .iter()
        .map(|s| {
            let n = s.len() as usize;
            at += n;
            (*s, &buf[at - n..at])
        })
        .collect()
}

/// Copies of `spans`, back to back into buffer `dst`.
fn copies_into(spans: &[Span], dst: usize) -> Vec<ByteCopy> {
    let mut at = 0;
    spans
        .iter()
        .map(|s| {
            at += s.len();
            ByteCopy {
                chunk: s.chunk as usize,
                src: s.lo,
                dst,
                dst_off: at - s.len(),
                len: s.len(),
            }
        })
        .collect()
}

/// Executes the parts of `copies` that the in-memory chunk bytes `segs` (sorted, disjoint) hold.
/// Returns the bytes copied.
fn copy_from(
    segs: &[(Span, &[u8])],
    copies: &[ByteCopy],
    dests: Vec<&mut [u8]>,
    workers: usize,
) -> Result<u64> {
    let key = |s: &(Span, &[u8])| (s.0.chunk, s.0.lo);
    if segs
        .windows(2)
        .any(|w| key(&w[0]) > key(&w[1]) || (w[0].0.chunk == w[1].0.chunk && w[0].0.hi > w[1].0.lo))
    {
        return Err(CoreError::InvalidArgument("overlapping segments".into()));
    }
    // The parts of each copy that segments hold: (copy, segment, bytes to skip in the copy).
    let mut parts: Vec<ByteCopy> = Vec::new();
    for c in copies.iter().filter(|c| c.len > 0) {
        let (a, b) = (c.src, c.src + c.len);
        let chunk = c.chunk as u64;
        let mut i = segs.partition_point(|s| (s.0.chunk, s.0.hi) <= (chunk, a));
        while let Some((s, _)) = segs.get(i) {
            if s.chunk != chunk || s.lo >= b {
                break;
            }
            let (lo, hi) = (a.max(s.lo), b.min(s.hi));
            parts.push(ByteCopy {
                chunk: i,
                src: lo - s.lo,
                dst: c.dst,
                dst_off: c.dst_off + (lo - a),
                len: hi - lo,
            });
            i += 1;
        }
    }
    let total = parts.iter().map(|p| p.len).sum();
    let slices = carve(&parts, dests)?;
    let work: Vec<(ByteCopy, &mut [u8])> = parts.into_iter().zip(slices).collect();
    let per = work.len().div_ceil(workers.max(1) * 4).max(1);
    let mut batches: Vec<Vec<(ByteCopy, &mut [u8])>> = Vec::new();
    let mut it = work.into_iter().peekable();
    while it.peek().is_some() {
        batches.push(it.by_ref().take(per).collect());
    }
    run_parallel(batches, workers, |batch| {
        for (p, dst) in batch {
            let seg = segs[p.chunk].1;
            dst.copy_from_slice(&seg[p.src as usize..(p.src + p.len) as usize]);
        }
        Ok(())
    })?;
    Ok(total)
}

// -- wire form: the plans and needs travel between ranks as little-endian u64 words -------------

fn words(bytes: &[u8]) -> Result<Vec<u64>> {
    if !bytes.len().is_multiple_of(8) {
        return Err(CoreError::InvalidArgument(
            "a read plan's length is not a multiple of 8".into(),
        ));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        .collect())
}

fn to_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A cursor over words that fails cleanly when they run out.
struct Words<'a>(std::slice::Iter<'a, u64>);

impl Words<'_> {
    fn next(&mut self) -> Result<u64> {
        self.0
            .next()
            .copied()
            .ok_or_else(|| CoreError::InvalidArgument("a read plan ends early".into()))
    }
    fn span(&mut self) -> Result<Span> {
        let (chunk, lo, hi) = (self.next()?, self.next()?, self.next()?);
        if lo >= hi {
            return Err(CoreError::InvalidArgument(
                "an empty span in a read plan".into(),
            ));
        }
        Ok(Span { chunk, lo, hi })
    }
    fn spans(&mut self) -> Result<Vec<Span>> {
        let n = self.next()?;
        (0..n).map(|_| self.span()).collect()
    }
    fn peers(&mut self, world: u32) -> Result<Vec<(u32, Vec<Span>)>> {
        let n = self.next()?;
        (0..n)
            .map(|_| {
                let peer = self.next()?;
                if peer >= world as u64 {
                    return Err(CoreError::InvalidArgument(
                        "a read plan names no such rank".into(),
                    ));
                }
                Ok((peer as u32, self.spans()?))
            })
            .collect()
    }
}

pub fn encode_needs(needs: &[Need]) -> Vec<u8> {
    let w: Vec<u64> = needs
        .iter()
        .flat_map(|n| [n.chunk, n.block, n.lo, n.hi])
        .collect();
    to_bytes(&w)
}

pub fn decode_needs(bytes: &[u8]) -> Result<Vec<Need>> {
    let w = words(bytes)?;
    if !w.len().is_multiple_of(4) {
        return Err(CoreError::InvalidArgument("malformed needs".into()));
    }
    Ok(w.chunks_exact(4)
        .map(|n| Need {
            chunk: n[0],
            block: n[1],
            lo: n[2],
            hi: n[3],
        })
        .collect())
}

impl ReadPlan {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![self.world as u64, self.rounds.len() as u64];
        let spans = |w: &mut Vec<u64>, s: &[Span]| {
            w.push(s.len() as u64);
            s.iter().for_each(|s| w.extend([s.chunk, s.lo, s.hi]));
        };
        for (start, r) in self.starts.iter().zip(&self.rounds) {
            w.extend([start.0, start.1]);
            spans(&mut w, &r.reads);
            for peers in [&r.sends, &r.recvs] {
                w.push(peers.len() as u64);
                for (p, s) in peers {
                    w.push(*p as u64);
                    spans(&mut w, s);
                }
            }
        }
        to_bytes(&w)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let w = words(bytes)?;
        let mut c = Words(w.iter());
        let world = u32::try_from(c.next()?).map_err(|_| {
            CoreError::InvalidArgument("a read plan's world size is too large".into())
        })?;
        let n = c.next()?;
        let mut plan = ReadPlan {
            world,
            ..Default::default()
        };
        for _ in 0..n {
            plan.starts.push((c.next()?, c.next()?));
            let reads = c.spans()?;
            let sends = c.peers(world)?;
            let recvs = c.peers(world)?;
            plan.rounds.push(Round {
                reads,
                sends,
                recvs,
            });
        }
        if c.0.next().is_some() {
            return Err(CoreError::InvalidArgument(
                "a read plan has trailing words".into(),
            ));
        }
        Ok(plan)
    }

    /// `copies` split at block boundaries and bucketed by the round holding their block.
    pub fn copies_by_round(&self, m: &Manifest, copies: &[ByteCopy]) -> Vec<Vec<ByteCopy>> {
        let bs = m.block_size;
        let mut out = vec![Vec::new(); self.rounds.len()];
        for c in copies.iter().filter(|c| c.len > 0) {
            let (a, b) = (c.src, c.src + c.len);
            for block in a / bs..b.div_ceil(bs) {
                let (lo, hi) = (a.max(block * bs), b.min((block + 1) * bs));
                let key = (c.chunk as u64, block);
                let k = self.starts.partition_point(|s| *s <= key);
                if k > 0 {
                    out[k - 1].push(ByteCopy {
                        src: lo,
                        dst_off: c.dst_off + (lo - a),
                        len: hi - lo,
                        ..*c
                    });
                }
            }
        }
        out
    }
}
