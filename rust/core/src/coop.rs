//! Cooperative loads: every saved block a job needs is read from storage by exactly one rank, and
//! the bytes each other rank needs are handed over through the job's collectives.
//!
//! Each rank plans its byte copies as for a direct load ([`crate::plan_copies`]) and states, per
//! saved block, the span of it that it needs ([`needs`]). One rank turns every rank's needs into a
//! [`ReadPlan`] per rank ([`plan`]): each block gets one reader among the ranks that need it (the one
//! with the fewest bytes to read so far), readers read whole blocks (so checksums are verified where
//! the bytes come from storage), and the blocks are cut into rounds in which no rank sends and
//! receives more than a budget of bytes (what it must stage). A round is: read, the reader's own
//! bytes straight into its destinations and what goes to each peer packed ([`read_round`]), one
//! all-to-all of the packed bytes, then the copies into destinations from the bytes received
//! ([`fill_round`]). Bytes move in one order that both sides derive from the plan: block by block,
//! peers in rank order.

use std::collections::BTreeMap;

use crate::checksum;
use crate::codec::Codec;
use crate::error::{CoreError, Result};
use crate::io::{carve, overlap_in_buffer, read_from, run_parallel, ByteCopy};
use crate::manifest::Manifest;
use crate::storage::Storage;

/// The bytes of block `block` of a saved chunk that one rank needs (`span` lies inside the block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Need {
    pub block: u64,
    pub span: Span,
}

/// Bytes of saved chunk `chunk`: `count` pieces of `len` bytes, piece `i` at `lo + i * stride`
/// (a column of a row-major block is one span). A plain range has `count` 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span {
    pub chunk: u64,
    pub lo: u64,
    pub len: u64,
    pub stride: u64,
    pub count: u64,
}

impl Span {
    pub fn plain(chunk: u64, lo: u64, hi: u64) -> Span {
        Span {
            chunk,
            lo,
            len: hi - lo,
            stride: hi - lo,
            count: 1,
        }
    }
    /// Bytes the span holds.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }
    /// The pieces `(lo, hi)`, in order.
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map(|i| {
            let a = self.lo + i * self.stride;
            (a, a + self.len)
        })
    }
    /// Whether the span is well formed and inside bytes `start..end` of its chunk.
    fn within(&self, start: u64, end: u64) -> bool {
        let last = (self.count.checked_sub(1))
            .and_then(|k| k.checked_mul(self.stride))
            .and_then(|x| x.checked_add(self.lo))
            .and_then(|x| x.checked_add(self.len));
        self.len > 0
            && (self.count == 1 || self.stride >= self.len)
            && self.lo >= start
            && last.is_some_and(|e| e <= end)
    }
}

/// One rank's part of one round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// Blocks this rank reads (whole blocks, adjacent ones merged), in order.
    pub reads: Vec<Span>,
    /// `(peer, spans)` this rank sends, peers ascending, each peer's spans in block order.
    pub sends: Vec<(u32, Vec<Span>)>,
    /// `(peer, spans)` this rank receives, in the same order.
    pub recvs: Vec<(u32, Vec<Span>)>,
}

impl Round {
    pub fn read_len(&self) -> u64 {
        self.reads.iter().map(Span::bytes).sum()
    }
}

fn total(peers: &[(u32, Vec<Span>)]) -> u64 {
    peers.iter().flat_map(|p| &p.1).map(Span::bytes).sum()
}

/// One rank's plan: its rounds, and where each round starts in the job's block order (every rank
/// takes part in every round, with nothing to do in some).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadPlan {
    pub world: u32,
    pub starts: Vec<(u64, u64)>,
    pub rounds: Vec<Round>,
}

/// Length of block `block` of chunk `chunk`.
fn block_len(m: &Manifest, chunk: u64, block: u64) -> u64 {
    let len = m.chunks[chunk as usize].len;
    (len - block * m.block_size).min(m.block_size)
}

/// The bytes of each block that `copies` read, in block order: per block, the disjoint runs
/// they cover, runs of one length at one distance folded into one strided span. One sort of the
/// copies' pieces (already in order as `plan_copies` makes them) and one pass.
pub fn needs(m: &Manifest, copies: &[ByteCopy]) -> Vec<Need> {
    let bs = m.block_size;
    let mut pieces: Vec<(u64, u64, u64, u64)> = Vec::with_capacity(copies.len());
    for c in copies.iter().filter(|c| c.len > 0) {
        let (a, b) = (c.src, c.src + c.len);
        for block in a / bs..b.div_ceil(bs) {
            pieces.push((
                c.chunk as u64,
                block,
                a.max(block * bs),
                b.min((block + 1) * bs),
            ));
        }
    }
    pieces.sort();
    let mut out = Vec::new();
    let mut fold = Fold::default();
    for (chunk, block, a, b) in pieces {
        match &mut fold.run {
            Some((key, run)) if *key == (chunk, block) && a <= run.1 => run.1 = run.1.max(b),
            _ => {
                fold.end_run(&mut out, (chunk, block));
                fold.run = Some(((chunk, block), (a, b)));
            }
        }
    }
    fold.end_run(&mut out, (u64::MAX, u64::MAX));
    out
}

/// [`needs`]'s pass: the merged run being extended and the span the runs before it fold into,
/// each with its `(chunk, block)`.
#[derive(Default)]
struct Fold {
    run: Option<((u64, u64), (u64, u64))>,
    span: Option<(u64, Span)>,
}

impl Fold {
    /// Folds the current run into the span (or starts a new span), before a run of `next`.
    fn end_run(&mut self, out: &mut Vec<Need>, next: (u64, u64)) {
        if let Some(((chunk, block), (a, b))) = self.run.take() {
            match &mut self.span {
                Some((sb, s))
                    if *sb == block
                        && s.chunk == chunk
                        && s.len == b - a
                        && (s.count == 1 || a == s.lo + s.count * s.stride) =>
                {
                    if s.count == 1 {
                        s.stride = a - s.lo; // > len: merged runs are apart
                    }
                    s.count += 1;
                }
                _ => {
                    if let Some((block, span)) = self.span.take() {
                        out.push(Need { block, span });
                    }
                    self.span = Some((block, Span::plain(chunk, a, b)));
                }
            }
        }
        if self.span.is_some_and(|(b, s)| (s.chunk, b) != next) {
            let (block, span) = self.span.take().unwrap();
            out.push(Need { block, span });
        }
    }
}

/// Whether any block is needed by more than one rank (reading once then saves storage reads).
pub fn shared(needs: &[Vec<Need>]) -> bool {
    let mut first = std::collections::HashMap::new();
    needs.iter().enumerate().any(|(r, list)| {
        list.iter()
            .any(|n| *first.entry((n.span.chunk, n.block)).or_insert(r) != r)
    })
}

/// What a load's time is predicted from ([`predict`]), all measured on the job's machines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Bytes per second one rank reads from the checkpoint's storage (checksums verified, into
    /// place), with the other ranks reading too.
    pub storage: f64,
    /// Bytes per second one rank sends and receives in an all-to-all of the group.
    pub exchange: f64,
    /// Seconds a round costs besides its bytes: its collectives' latency.
    pub round: f64,
    /// Bytes per second one rank packs for its peers and copies into place from what it received,
    /// in fresh buffers (their first touch included), with the other ranks doing the same: the
    /// memory work only reading once does.
    pub copy: f64,
}

/// Predicted seconds of one load, read directly and read once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub direct: f64,
    pub once: f64,
}

/// Per rank, the bytes a direct load reads: every block it needs, whole (so its checksum is
/// verified), but only its own bytes of a block it trusts (`checks[r].trusted`, from
/// [`delegate_checks`]). `needs` must be valid for `m` (as [`plan`] checks).
pub fn direct_bytes(m: &Manifest, needs: &[Vec<Need>], checks: &[Checks]) -> Vec<u64> {
    needs
        .iter()
        .enumerate()
        .map(|(r, list)| {
            let trusts = |b: &(u64, u64)| {
                checks
                    .get(r)
                    .is_some_and(|c| c.trusted.binary_search(b).is_ok())
            };
            let mut blocks: BTreeMap<(u64, u64), u64> = BTreeMap::new();
            for n in list {
                *blocks.entry((n.span.chunk, n.block)).or_default() += n.span.bytes();
            }
            blocks
                .iter()
                .map(|(b, &own)| {
                    let whole = block_len(m, b.0, b.1);
                    if trusts(b) {
                        own.min(whole)
                    } else {
                        whole
                    }
                })
                .sum()
        })
        .collect()
}

/// Who checks each block of a direct load on each host ([`delegate_checks`]), per rank: the blocks
/// `(chunk, block)`, sorted, that it reads without checking them whole (`trusted`), and among them
/// those it checks in part (`split`): its share of the block's checksum, from its own bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    pub trusted: Vec<(u64, u64)>,
    pub split: Vec<(u64, u64)>,
}

/// Who checks each block of a direct load on each host. Where the ranks that need a block hold
/// every byte of it once between them (each a quarter of every row, say), the block is split:
/// each folds the checksum of its own bytes as it copies them (`checksum::Parts`), and the XOR of
/// their shares is checked in the load's last step ([`split_sum`]); this needs no shared page
/// cache, so it spans hosts. Otherwise one of the ranks of each host that need the block checks
/// it: one that needs it whole if there is such a rank, else the one with the fewest bytes to
/// check so far (or the previous block's checker, while within a read unit of that), which then
/// reads it whole; the others copy only their own bytes of it. Either way a block is pulled
/// through memory once on a host, not once per rank. `hosts[r]` (one per rank) names rank `r`'s
/// host: ranks that read through one page cache (one kernel), so that the bytes a rank copies are
/// the ones its peer checked. `needs` must be valid for `m` (as [`plan`] checks).
pub fn delegate_checks(m: &Manifest, needs: &[Vec<Need>], hosts: &[u64]) -> Vec<Checks> {
    // (chunk, block) -> (rank, bytes it needs, its spans), ranks ascending
    type Needers = Vec<(usize, u64, Vec<Span>)>;
    let mut by_block: BTreeMap<(u64, u64), Needers> = BTreeMap::new();
    for (r, list) in needs.iter().enumerate() {
        for n in list {
            let v = by_block.entry((n.span.chunk, n.block)).or_default();
            match v.last_mut() {
                Some(last) if last.0 == r => {
                    last.1 += n.span.bytes();
                    last.2.push(n.span);
                }
                _ => v.push((r, n.span.bytes(), vec![n.span])),
            }
        }
    }
    let mut load = vec![0u64; needs.len()];
    let mut out = vec![Checks::default(); needs.len()];
    // (chunk, host) -> (block, rank): the last checker, kept on for the next block while its load
    // stays within a read unit of the least: runs of blocks, not one block per rank in turn,
    // so that each rank reads (and maps) long stretches.
    let mut last: BTreeMap<(u64, u64), (u64, usize)> = BTreeMap::new();
    for ((chunk, block), ranks) in by_block {
        let whole = block_len(m, chunk, block);
        if ranks.len() > 1
            && m.chunks[chunk as usize].codec == Codec::Raw
            && ranks.iter().map(|r| r.1).sum::<u64>() == whole
            && disjoint(ranks.iter().flat_map(|r| &r.2))
        {
            for (r, own, _) in ranks {
                out[r].trusted.push((chunk, block));
                out[r].split.push((chunk, block));
                load[r] += own;
            }
            continue;
        }
        let mut on_host: BTreeMap<u64, Needers> = BTreeMap::new();
        for r in ranks {
            on_host.entry(hosts[r.0]).or_default().push(r);
        }
        for (host, ranks) in on_host {
            if ranks.len() == 1 {
                load[ranks[0].0] += whole;
                continue;
            }
            let any_whole = ranks.iter().any(|&(_, n, _)| n >= whole);
            let can = |&&(_, n, _): &&(usize, u64, Vec<Span>)| !any_whole || n >= whole;
            let least = ranks
                .iter()
                .filter(can)
                .min_by_key(|r| (load[r.0], r.0))
                .unwrap()
                .0;
            let checker = match last.get(&(chunk, host)) {
                Some(&(b, r))
                    if b + 1 == block
                        && ranks.iter().filter(can).any(|q| q.0 == r)
                        && load[r] <= load[least] + crate::io::MAX_UNIT =>
                {
                    r
                }
                _ => least,
            };
            last.insert((chunk, host), (block, checker));
            for (r, _, _) in ranks.iter().filter(|q| q.0 != checker) {
                out[*r].trusted.push((chunk, block));
            }
            load[checker] += whole;
        }
    }
    out
}

/// Whether no two of `spans` (of one block) share a byte, decided from their strides (at most 32
/// spans, and those of two strides only where one is a single piece; else `false`, which only
/// costs the block its split check).
fn disjoint<'a>(spans: impl Iterator<Item = &'a Span>) -> bool {
    let spans: Vec<&Span> = spans.take(33).collect();
    if spans.len() > 32 {
        return false;
    }
    // Pieces `a.lo + i * stride` (i < a.count) and `b.lo + j * stride` (j < b.count) meet iff
    // some d = i - j, in -(b.count - 1)..=a.count - 1, has -a.len < a.lo - b.lo + d * stride < b.len.
    let meet = |a: &Span, b: &Span, stride: u64| {
        let (s, x) = (stride as i128, a.lo as i128 - b.lo as i128);
        let lo = (-(a.len as i128) - x).div_euclid(s) + 1;
        let hi = (b.len as i128 - x - 1).div_euclid(s);
        lo.max(1 - b.count as i128) <= hi.min(a.count as i128 - 1)
    };
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            let overlap = if a.count == 1 {
                meet(a, b, b.stride)
            } else if b.count == 1 || a.stride == b.stride {
                meet(a, b, a.stride)
            } else {
                true
            };
            if overlap {
                return false;
            }
        }
    }
    true
}

/// What the shares of the blocks split in a load (`blocks`, each once) XOR to when every byte is
/// as saved: each block's CRC-32C with its length's constant (`checksum::zeros_constant`). Each
/// rank's shares XOR into one word per load ([`share_sum`]), so the last step checks them with one
/// word per rank; [`check_shares`] finds the block where they do not add up.
pub fn split_sum(m: &Manifest, blocks: &[(u64, u64)]) -> u32 {
    blocks.iter().fold(0, |x, &(c, b)| {
        let ch = &m.chunks[c as usize];
        x ^ m.chunk_checksums(ch)[b as usize] ^ checksum::zeros_constant(block_len(m, c, b))
    })
}

/// The XOR of one rank's shares `(chunk, block, share)`.
pub fn share_sum(shares: &[(u64, u64, u32)]) -> u32 {
    shares.iter().fold(0, |x, s| x ^ s.2)
}

/// Checks split blocks from the shares of the ranks that split them (all of them, any order):
/// each block's shares XOR to its checksum ([`split_sum`]), else `ChecksumMismatch` for the first
/// that does not (`name` names a data file of `m` for the error).
pub fn check_shares(
    m: &Manifest,
    shares: &[(u64, u64, u32)],
    name: &dyn Fn(&str) -> std::path::PathBuf,
) -> Result<()> {
    let mut by_block: BTreeMap<(u64, u64), u32> = BTreeMap::new();
    for &(c, b, share) in shares {
        *by_block.entry((c, b)).or_default() ^= share;
    }
    for ((c, b), x) in by_block {
        let inside =
            |ch: &&crate::manifest::Chunk| b.checked_mul(m.block_size).is_some_and(|s| s < ch.len);
        let ch = m.chunks.get(c as usize).filter(inside);
        let Some(ch) = ch else {
            return Err(CoreError::InvalidArgument(format!(
                "a share of block {b} of chunk {c}: no such block in the checkpoint"
            )));
        };
        let found = x ^ checksum::zeros_constant(block_len(m, c, b));
        let expected = m.chunk_checksums(ch)[b as usize];
        if found != expected {
            let (key, chunk) = crate::io::chunk_name(m, c as usize);
            let start = ch.offset + b * m.block_size;
            return Err(CoreError::ChecksumMismatch {
                path: name(&m.files[ch.file as usize].path),
                key,
                chunk,
                start,
                end: start + block_len(m, c, b),
                expected,
                found,
            });
        }
    }
    Ok(())
}

/// The cost model of the two read strategies. Ranks work in parallel and the slowest one sets the
/// pace. Reading directly, rank `r` reads `direct[r]` bytes: `max_r direct[r] / storage`. Reading
/// once, the first round is read, then each round's exchange (its slowest exchanger, the larger of
/// what a rank sends and receives, plus the round's fixed cost) overlaps the next round's reads
/// (its slowest reader): `R(0) + sum_k max(X(k) + round, R(k + 1))`, with
/// `R(k) = max_r read[r][k] / storage` (0 past the last round) and
/// `X(k) = max_r max(sent, received)[r][k] / exchange + max_r (sent + received)[r][k] / copy`
/// (the bytes packed for peers and copied into place from what came back).
pub fn predict(direct: &[u64], plans: &[ReadPlan], rates: &Rates) -> Prediction {
    let per_s = |bytes: u64, rate: f64| if bytes == 0 { 0.0 } else { bytes as f64 / rate };
    let slowest = direct.iter().copied().max().unwrap_or(0);
    let rounds = plans.first().map_or(0, |p| p.rounds.len());
    let slowest_of = |f: &dyn Fn(&Round) -> u64, k: usize| {
        plans.iter().map(|p| f(&p.rounds[k])).max().unwrap_or(0)
    };
    let read = |k: usize| {
        if k < rounds {
            per_s(slowest_of(&|r| r.read_len(), k), rates.storage)
        } else {
            0.0
        }
    };
    let moved = |k: usize| {
        per_s(
            slowest_of(&|r| total(&r.sends).max(total(&r.recvs)), k),
            rates.exchange,
        ) + per_s(
            slowest_of(&|r| total(&r.sends) + total(&r.recvs), k),
            rates.copy,
        )
    };
    // Round k+1 is read while round k is exchanged (olmo_chunks.fill pipelines them).
    let once = if rounds == 0 {
        0.0
    } else {
        read(0)
            + (0..rounds)
                .map(|k| (moved(k) + rates.round).max(read(k + 1)))
                .sum::<f64>()
    };
    Prediction {
        direct: per_s(slowest, rates.storage),
        once,
    }
}

/// Plans a cooperative load of `m` for ranks whose needs are `needs` (one list per rank), in
/// rounds where no rank sends and receives more than `budget` bytes together (a single block
/// over the budget makes a round of its own; what a reader keeps goes straight into place).
pub fn plan(m: &Manifest, needs: &[Vec<Need>], budget: u64) -> Result<Vec<ReadPlan>> {
    let world = needs.len();
    // (chunk, block) -> the ranks needing it, with their spans
    let mut units: BTreeMap<(u64, u64), Vec<(u32, Span)>> = BTreeMap::new();
    for (r, list) in needs.iter().enumerate() {
        for n in list {
            let chunk = n.span.chunk;
            let ok = (chunk as usize) < m.chunks.len()
                && n.block < m.chunks[chunk as usize].len.div_ceil(m.block_size)
                && n.span.within(
                    n.block * m.block_size,
                    n.block * m.block_size + block_len(m, chunk, n.block),
                );
            if !ok {
                return Err(CoreError::InvalidArgument(format!(
                    "rank {r} needs {n:?}, which is not a span of one saved block"
                )));
            }
            units
                .entry((chunk, n.block))
                .or_default()
                .push((r as u32, n.span));
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
    let mut last: Option<(u64, u64, u32)> = None; // the unit just planned and its reader
    for ((chunk, block), mut who) in units {
        who.sort_unstable();
        let len = block_len(m, chunk, block);
        let least = who
            .iter()
            .map(|w| w.0)
            .min_by_key(|&r| (load[r as usize], r))
            .expect("a unit has a needer");
        // The reader of the unit before keeps reading while it is within a run of the least
        // loaded: readers read runs, not every other block (which would split their reads, and an
        // object store's requests, at every block).
        let reader = match last {
            Some((c, b, r))
                if continues(m, (c, b), (chunk, block))
                    && who.iter().any(|w| w.0 == r)
                    && load[r as usize] < load[least as usize] + READ_RUN =>
            {
                r
            }
            _ => least,
        };
        last = Some((chunk, block, reader));
        // Bytes each other needer receives (`who` is sorted by rank).
        let mut takes: Vec<(u32, u64)> = Vec::new();
        for (r, span) in who.iter().filter(|w| w.0 != reader) {
            match takes.last_mut() {
                Some(t) if t.0 == *r => t.1 += span.bytes(),
                _ => takes.push((*r, span.bytes())),
            }
        }
        let sent: u64 = takes.iter().map(|t| t.1).sum();
        // Only what moves between ranks is staged: a reader's own bytes go straight into place.
        let over = |cost: &[u64]| {
            cost[reader as usize] + sent > budget
                || takes.iter().any(|&(r, n)| cost[r as usize] + n > budget)
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
        cost[reader as usize] += sent;
        for &(r, n) in &takes {
            cost[r as usize] += n;
        }
        let lo = block * m.block_size;
        push_span(
            &mut plans[reader as usize].rounds.last_mut().unwrap().reads,
            Span::plain(chunk, lo, lo + len),
        );
        for &(r, span) in who.iter().filter(|w| w.0 != reader) {
            let sends = &mut plans[reader as usize].rounds.last_mut().unwrap().sends;
            push_peer(sends, r, span);
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

/// How far (bytes) a reader may run ahead of the least loaded needer while it reads on through
/// adjacent blocks: one I/O unit.
const READ_RUN: u64 = crate::io::MAX_UNIT;

/// True if block `b` follows block `a` in its data file: the next block of one chunk, or the
/// first of the chunk after in the same file.
fn continues(m: &Manifest, a: (u64, u64), b: (u64, u64)) -> bool {
    let file = |c: u64| m.chunks.get(c as usize).map(|c| c.file);
    (b.0 == a.0 && b.1 == a.1 + 1)
        || (b.0 == a.0 + 1
            && b.1 == 0
            && a.1 + 1 == m.chunks[a.0 as usize].len.div_ceil(m.block_size)
            && file(a.0) == file(b.0))
}

/// Appends `s`, extending the last span instead when both are plain and `s` continues it.
fn push_span(spans: &mut Vec<Span>, s: Span) {
    match spans.last_mut() {
        Some(last)
            if last.chunk == s.chunk
                && last.count == 1
                && s.count == 1
                && last.lo + last.len == s.lo =>
        {
            last.len += s.len;
            last.stride = last.len;
        }
        _ => spans.push(s),
    }
}

fn push_peer(peers: &mut Vec<(u32, Vec<Span>)>, peer: u32, s: Span) {
    match peers.iter_mut().find(|p| p.0 == peer) {
        Some(p) => push_span(&mut p.1, s),
        None => peers.push((peer, vec![s])),
    }
}

/// Reads round `k`'s blocks (`round`) and puts their bytes where they go, in one pass: the parts
/// of this rank's own copies of the round (`copies`, one round's item of
/// [`ReadPlan::copies_by_round`]) that lie in the blocks it reads go straight into `dests`, and
/// what its peers need is packed into `send_buf`. Bytes wanted in several places (a block every
/// rank needs) are read into one of them and copied from there into the others, so that the
/// reads stay few and large. Returns the seconds the reads took (not those copies) and the bytes
/// copied into `dests`.
#[allow(clippy::too_many_arguments)]
pub fn read_round<'a>(
    storage: &dyn Storage,
    m: &Manifest,
    round: &Round,
    copies: &[ByteCopy],
    send_buf: &'a mut [u8],
    mut dests: Vec<&'a mut [u8]>,
    verify: bool,
    workers: usize,
) -> Result<(f64, u64)> {
    check_len("send", total(&round.sends), send_buf.len())?;
    let reads = pieces(&round.reads);
    let mut all: Vec<ByteCopy> = copies
        .iter()
        .filter(|c| c.len > 0 && holds(&reads, c))
        .copied()
        .collect();
    let copied = all.iter().map(|c| c.len).sum();
    all.extend(copies_into(
        &pieces(round.sends.iter().flat_map(|p| &p.1)),
        dests.len(),
    ));
    dests.push(send_buf);
    let (first, again) = split_repeats(all);
    if !again.is_empty() {
        // Every destination range in bounds and apart: what makes the copies below sound.
        let every: Vec<ByteCopy> = first.iter().chain(&again).copied().collect();
        carve(
            &every,
            dests.iter_mut().map(|d| &mut **d).collect(),
            overlap_in_buffer,
        )?;
    }
    // Where the repeated bytes are copied from (kept only when there are some).
    let landed = if again.is_empty() {
        Vec::new()
    } else {
        first.clone()
    };
    let t0 = std::time::Instant::now();
    read_from(
        storage,
        m,
        first,
        dests.iter_mut().map(|d| &mut **d).collect(),
        verify,
        workers,
    )?;
    let seconds = t0.elapsed().as_secs_f64();
    for c in &again {
        let (a, b) = (c.src, c.src + c.len);
        let mut i = landed.partition_point(|f| (f.chunk, f.src + f.len) <= (c.chunk, a));
        while let Some(f) = landed.get(i).filter(|f| f.chunk == c.chunk && f.src < b) {
            let (x, y) = (a.max(f.src), b.min(f.src + f.len));
            let from = (f.dst, (f.dst_off + x - f.src) as usize);
            copy_between(
                &mut dests,
                from,
                (c.dst, (c.dst_off + x - a) as usize),
                (y - x) as usize,
            );
            i += 1;
        }
    }
    Ok((seconds, copied))
}

/// `copies` split into those whose source bytes no earlier one has (sorted by source, apart:
/// what is read) and the rest (to be copied from where the first landed). At one source the
/// earlier in `copies` comes first.
fn split_repeats(mut copies: Vec<ByteCopy>) -> (Vec<ByteCopy>, Vec<ByteCopy>) {
    copies.sort_by_key(|c| (c.chunk, c.src)); // stable: a rank's own copies before its sends
    let (mut first, mut again) = (Vec::with_capacity(copies.len()), Vec::new());
    let mut end: Option<(usize, u64)> = None; // how far the chunk's bytes are read so far
    for c in copies {
        let seen = match end {
            Some((chunk, e)) if chunk == c.chunk => e.saturating_sub(c.src).min(c.len),
            _ => 0,
        };
        if seen > 0 {
            again.push(ByteCopy { len: seen, ..c });
        }
        if seen < c.len {
            first.push(ByteCopy {
                src: c.src + seen,
                dst_off: c.dst_off + seen,
                len: c.len - seen,
                ..c
            });
            end = Some((c.chunk, c.src + c.len));
        }
    }
    (first, again)
}

/// Copies `n` bytes from `(buffer, offset)` `from` to `to` among `dests` (ranges apart).
fn copy_between(dests: &mut [&mut [u8]], from: (usize, usize), to: (usize, usize), n: usize) {
    let ((s, so), (d, dof)) = (from, to);
    match s.cmp(&d) {
        std::cmp::Ordering::Equal => dests[d].copy_within(so..so + n, dof),
        std::cmp::Ordering::Less => {
            let (lo, hi) = dests.split_at_mut(d);
            hi[0][dof..dof + n].copy_from_slice(&lo[s][so..so + n]);
        }
        std::cmp::Ordering::Greater => {
            let (lo, hi) = dests.split_at_mut(s);
            lo[d][dof..dof + n].copy_from_slice(&hi[0][so..so + n]);
        }
    }
}

/// Whether the sorted, disjoint `pieces` hold all of copy `c`'s source bytes.
fn holds(pieces: &[(u64, u64, u64)], c: &ByteCopy) -> bool {
    let (chunk, a, b) = (c.chunk as u64, c.src, c.src + c.len);
    let i = pieces.partition_point(|p| (p.0, p.2) <= (chunk, a));
    pieces
        .get(i)
        .is_some_and(|&(pc, lo, hi)| pc == chunk && lo <= a && b <= hi)
}

/// Executes the `copies` (of one round, as [`read_round`] takes them) that come from the bytes
/// this rank received (`recv_buf`, peers in order); [`read_round`] did the others. Returns the
/// bytes copied.
pub fn fill_round(
    round: &Round,
    recv_buf: &[u8],
    copies: &[ByteCopy],
    dests: Vec<&mut [u8]>,
    workers: usize,
) -> Result<u64> {
    check_len("receive", total(&round.recvs), recv_buf.len())?;
    let mut segs = segments(&pieces(round.recvs.iter().flat_map(|p| &p.1)), recv_buf);
    segs.sort_unstable_by_key(|s| (s.0, s.1)); // peers in order, each in block order
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

/// The plain pieces `(chunk, lo, hi)` of `spans`, in order.
fn pieces<'a>(spans: impl IntoIterator<Item = &'a Span>) -> Vec<(u64, u64, u64)> {
    spans
        .into_iter()
        .flat_map(|s| s.pieces().map(|(a, b)| (s.chunk, a, b)))
        .collect()
}

/// Chunk bytes `lo..hi` held in memory.
type Segment<'a> = (u64, u64, u64, &'a [u8]);

/// `pieces` laid out back to back in `buf`.
fn segments<'a>(pieces: &[(u64, u64, u64)], buf: &'a [u8]) -> Vec<Segment<'a>> {
    let mut at = 0usize;
    pieces
        .iter()
        .map(|&(chunk, lo, hi)| {
            let n = (hi - lo) as usize;
            at += n;
            (chunk, lo, hi, &buf[at - n..at])
        })
        .collect()
}

/// Copies of `pieces`, back to back into buffer `dst`.
fn copies_into(pieces: &[(u64, u64, u64)], dst: usize) -> Vec<ByteCopy> {
    let mut at = 0;
    pieces
        .iter()
        .map(|&(chunk, lo, hi)| {
            at += hi - lo;
            ByteCopy {
                chunk: chunk as usize,
                src: lo,
                dst,
                dst_off: at - (hi - lo),
                len: hi - lo,
            }
        })
        .collect()
}

/// Executes the parts of `copies` that the in-memory chunk bytes `segs` (sorted, disjoint) hold.
/// Returns the bytes copied.
fn copy_from(
    segs: &[Segment<'_>],
    copies: &[ByteCopy],
    dests: Vec<&mut [u8]>,
    workers: usize,
) -> Result<u64> {
    if segs
        .windows(2)
        .any(|w| (w[0].0, w[0].1) > (w[1].0, w[1].1) || (w[0].0 == w[1].0 && w[0].2 > w[1].1))
    {
        return Err(CoreError::InvalidArgument("overlapping segments".into()));
    }
    // The parts of each copy that segments hold (`chunk` naming the segment, `src` inside it).
    let mut parts: Vec<ByteCopy> = Vec::new();
    for c in copies.iter().filter(|c| c.len > 0) {
        let (a, b) = (c.src, c.src + c.len);
        let chunk = c.chunk as u64;
        let mut i = segs.partition_point(|s| (s.0, s.2) <= (chunk, a));
        while let Some(&(sc, lo, hi, _)) = segs.get(i) {
            if sc != chunk || lo >= b {
                break;
            }
            let (x, y) = (a.max(lo), b.min(hi));
            parts.push(ByteCopy {
                chunk: i,
                src: x - lo,
                dst: c.dst,
                dst_off: c.dst_off + (x - a),
                len: y - x,
            });
            i += 1;
        }
    }
    let copied = parts.iter().map(|p| p.len).sum();
    let slices = carve(&parts, dests, overlap_in_buffer)?;
    let work: Vec<(ByteCopy, &mut [u8])> = parts.into_iter().zip(slices).collect();
    let per = work.len().div_ceil(workers.max(1) * 4).max(1);
    let mut batches: Vec<Vec<(ByteCopy, &mut [u8])>> = Vec::new();
    let mut it = work.into_iter().peekable();
    while it.peek().is_some() {
        batches.push(it.by_ref().take(per).collect());
    }
    run_parallel(batches, workers, |batch| {
        for (p, dst) in batch {
            let seg = segs[p.chunk].3;
            dst.copy_from_slice(&seg[p.src as usize..(p.src + p.len) as usize]);
        }
        Ok(())
    })?;
    Ok(copied)
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
        Ok(Span {
            chunk: self.next()?,
            lo: self.next()?,
            len: self.next()?,
            stride: self.next()?,
            count: self.next()?,
        })
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
    let mut w = Vec::with_capacity(6 * needs.len());
    for n in needs {
        w.push(n.block);
        push_words(&mut w, &n.span);
    }
    to_bytes(&w)
}

pub fn decode_needs(bytes: &[u8]) -> Result<Vec<Need>> {
    let w = words(bytes)?;
    let mut c = Words(w.iter());
    let mut out = Vec::with_capacity(w.len() / 6);
    while c.0.len() > 0 {
        let block = c.next()?;
        out.push(Need {
            block,
            span: c.span()?,
        });
    }
    Ok(out)
}

/// The wire form of one rank's [`Checks`]: runs of consecutive blocks of a chunk, `(chunk, first
/// block, count, split)` each (`split` 1 for blocks checked in part, else 0).
pub fn encode_checks(checks: &Checks) -> Vec<u8> {
    let mut w: Vec<u64> = Vec::new();
    for &(chunk, block) in &checks.trusted {
        let split = checks.split.binary_search(&(chunk, block)).is_ok() as u64;
        match w
            .len()
            .checked_sub(4)
            .map(|i| (w[i], w[i + 1], w[i + 2], w[i + 3]))
        {
            Some((c, first, n, s)) if c == chunk && first + n == block && s == split => {
                let i = w.len() - 2;
                w[i] += 1
            }
            _ => w.extend([chunk, block, 1, split]),
        }
    }
    to_bytes(&w)
}

/// [`encode_checks`] read back: sorted blocks, each of a chunk of `m` (else `InvalidArgument`).
pub fn decode_checks(m: &Manifest, bytes: &[u8]) -> Result<Checks> {
    let w = words(bytes)?;
    if !w.len().is_multiple_of(4) {
        return Err(CoreError::InvalidArgument(
            "a list of trusted blocks is not made of (chunk, block, count, split) runs".into(),
        ));
    }
    let mut out = Checks::default();
    for run in w.chunks_exact(4) {
        let (chunk, first, n, split) = (run[0], run[1], run[2], run[3]);
        let blocks = m
            .chunks
            .get(chunk as usize)
            .map_or(0, |c| c.len.div_ceil(m.block_size));
        if first.checked_add(n).is_none_or(|e| e > blocks) || split > 1 {
            return Err(CoreError::InvalidArgument(format!(
                "trusted blocks {first}+{n} of chunk {chunk}: no such blocks in the checkpoint"
            )));
        }
        out.trusted.extend((first..first + n).map(|b| (chunk, b)));
        if split == 1 {
            out.split.extend((first..first + n).map(|b| (chunk, b)));
        }
    }
    for list in [&mut out.trusted, &mut out.split] {
        list.sort_unstable();
        list.dedup();
    }
    Ok(out)
}

/// The wire form of one rank's shares `(chunk, block, share)`.
pub fn encode_shares(shares: &[(u64, u64, u32)]) -> Vec<u8> {
    let w: Vec<u64> = shares
        .iter()
        .flat_map(|&(c, b, x)| [c, b, x as u64])
        .collect();
    to_bytes(&w)
}

/// [`encode_shares`] read back (`InvalidArgument` if not made of triples of a 32-bit share).
pub fn decode_shares(bytes: &[u8]) -> Result<Vec<(u64, u64, u32)>> {
    let w = words(bytes)?;
    let bad = || {
        CoreError::InvalidArgument(
            "a list of block shares is not made of (chunk, block, share)".into(),
        )
    };
    if !w.len().is_multiple_of(3) {
        return Err(bad());
    }
    w.chunks_exact(3)
        .map(|t| Ok((t[0], t[1], u32::try_from(t[2]).map_err(|_| bad())?)))
        .collect()
}

fn push_words(w: &mut Vec<u64>, s: &Span) {
    w.extend([s.chunk, s.lo, s.len, s.stride, s.count]);
}

impl ReadPlan {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![self.world as u64, self.rounds.len() as u64];
        let spans = |w: &mut Vec<u64>, s: &[Span]| {
            w.push(s.len() as u64);
            s.iter().for_each(|s| push_words(w, s));
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

    /// Fails unless every span of the plan is well formed and inside its chunk of `m`.
    pub fn check(&self, m: &Manifest) -> Result<()> {
        let rounds = self.rounds.iter();
        let mut spans = rounds.flat_map(|r| {
            r.reads
                .iter()
                .chain(r.sends.iter().chain(&r.recvs).flat_map(|p| &p.1))
        });
        match spans.find(|s| {
            m.chunks
                .get(s.chunk as usize)
                .is_none_or(|c| !s.within(0, c.len))
        }) {
            Some(s) => Err(CoreError::InvalidArgument(format!(
                "a read plan names {s:?}, outside the checkpoint's chunks"
            ))),
            None => Ok(()),
        }
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
