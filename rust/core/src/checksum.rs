//! CRC-32C (Castagnoli), the checksum of every stored block, at memory speed: crc-fast's
//! carry-less-multiply folding (VPCLMULQDQ with AVX-512, PCLMULQDQ, or ARM PMULL, chosen at run
//! time), several times the throughput of one `crc32` instruction stream. The values are the
//! standard CRC-32C (the `crc32c` crate's; a property test compares them).

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// A CRC-32C fed in pieces.
#[derive(Clone)]
pub struct Crc32c(Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }
    /// The CRC-32C of everything fed since the last `take`, and a fresh start.
    pub fn take(&mut self) -> u32 {
        self.0.finalize_reset() as u32
    }
}

// -- checking a block from the pieces several readers hold ----------------------------------------
//
// CRC-32C without its conditioning (the register starting at 0, no final inversion) is linear
// over GF(2): the register after a message is the XOR of the registers after each piece of it with
// the rest zeroed, and zeros before a piece leave a register of 0 at 0. So readers that between
// them hold every byte of a block once can each fold their own pieces (`Parts`) and the XOR of
// what they fold, with the block length's constant (`zeros_constant`), is the block's CRC-32C.

/// The reflected CRC-32C polynomial.
const POLY: u32 = 0x82F6_3B78;

/// `a * b` modulo the polynomial (reflected: bit 31 is x^0).
fn mul_mod(a: u32, mut b: u32) -> u32 {
    let (mut m, mut p) = (1u32 << 31, 0u32);
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                return p;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
}

/// x^(8n) modulo the polynomial: what `n` zero bytes multiply a register by.
fn zeros_op(n: u64) -> u32 {
    // x^(2^k) for k = 0..64, by squaring
    static POWERS: std::sync::OnceLock<[u32; 64]> = std::sync::OnceLock::new();
    let powers = POWERS.get_or_init(|| {
        let mut t = [0u32; 64];
        t[0] = 1 << 30; // x^1
        for k in 1..64 {
            t[k] = mul_mod(t[k - 1], t[k - 1]);
        }
        t
    });
    let (mut p, mut n, mut k) = (1u32 << 31, n, 3usize);
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod(powers[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// The register `reg` after `n` zero bytes.
pub fn shift(reg: u32, n: u64) -> u32 {
    if reg == 0 || n == 0 {
        return reg;
    }
    mul_mod(zeros_op(n), reg)
}

/// The register `reg` after `data`.
pub fn update(reg: u32, data: &[u8]) -> u32 {
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, reg as u64);
    d.update(data);
    d.get_state() as u32
}

/// Pieces up to this long are folded three at a time ([`regs3`]): below it the CRC-32C
/// instruction, three chains interleaved, beats the folding CRC's per-call cost (on this build's
/// machine, 32 against 47 ns for a 736-byte piece; about even at 1,472 bytes).
pub const SHORT: usize = 1024;

/// The registers after each of three pieces, from 0 (`update(0, piece)` each). Short pieces (a
/// quarter of a row) cost a folding CRC more per byte than long ones; where the CPU has the
/// CRC-32C instruction, three pieces go through it interleaved, one word of each in turn, so the
/// three chains overlap.
pub fn regs3(pieces: [&[u8]; 3]) -> [u32; 3] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the instruction is there (checked above).
            return unsafe { regs3_sse42(pieces) };
        }
    }
    pieces.map(|p| update(0, p))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn regs3_sse42(pieces: [&[u8]; 3]) -> [u32; 3] {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let words = pieces.iter().map(|p| p.len() / 8).min().unwrap();
    let mut regs = [0u64; 3];
    let word = |p: &[u8], i: usize| u64::from_le_bytes(p[8 * i..8 * i + 8].try_into().unwrap());
    for i in 0..words {
        for k in 0..3 {
            regs[k] = _mm_crc32_u64(regs[k], word(pieces[k], i));
        }
    }
    let mut out = [0u32; 3];
    for k in 0..3 {
        let rest = &pieces[k][8 * words..];
        let mut chunks = rest.chunks_exact(8);
        let mut r = regs[k];
        for w in chunks.by_ref() {
            r = _mm_crc32_u64(r, u64::from_le_bytes(w.try_into().unwrap()));
        }
        let mut r = r as u32;
        for &b in chunks.remainder() {
            r = _mm_crc32_u8(r, b);
        }
        out[k] = r;
    }
    out
}

/// What the CRC-32C of `n` bytes adds to their unconditioned register: `crc32c(d) ==
/// update(0, d) ^ zeros_constant(d.len())`.
pub fn zeros_constant(n: u64) -> u32 {
    !shift(!0, n)
}

/// `reg -> shift(reg, n)` for one `n`, as four byte tables (the map is linear: the XOR of its
/// images of each byte of `reg`).
struct ZerosTable([[u32; 256]; 4]);

impl ZerosTable {
    fn new(n: u64) -> Box<Self> {
        let op = zeros_op(n);
        let mut t = Box::new(ZerosTable([[0; 256]; 4]));
        for (k, table) in t.0.iter_mut().enumerate() {
            for bit in 0..8 {
                let v = mul_mod(op, 1u32 << (8 * k + bit));
                let step = 1usize << bit;
                for b in 0..step {
                    table[b | step] = table[b] ^ v;
                }
            }
        }
        t
    }
    fn apply(&self, reg: u32) -> u32 {
        let b = reg.to_le_bytes();
        self.0[0][b[0] as usize]
            ^ self.0[1][b[1] as usize]
            ^ self.0[2][b[2] as usize]
            ^ self.0[3][b[3] as usize]
    }
}

/// One reader's fold of its pieces of a block of `len` bytes: fed in order of their offsets
/// (a byte fed twice, by overlapping pieces, counts once), then `finish`ed into its share.
pub struct Parts {
    reg: u32,
    pos: u64,
    len: u64,
    // the last gap shifted over and its table: pieces of one stride repeat it
    gap: Option<(u64, Box<ZerosTable>)>,
    // the gap before that, shifted over once (a table pays from the second use)
    seen: u64,
}

impl Parts {
    pub fn new(len: u64) -> Self {
        Parts {
            reg: 0,
            pos: 0,
            len,
            gap: None,
            seen: u64::MAX,
        }
    }
    fn skip(&mut self, n: u64) {
        if n == 0 || self.reg == 0 {
            return;
        }
        match &self.gap {
            Some((g, t)) if *g == n => self.reg = t.apply(self.reg),
            _ if self.seen == n => {
                let t = ZerosTable::new(n);
                self.reg = t.apply(self.reg);
                self.gap = Some((n, t));
            }
            _ => {
                self.seen = n;
                self.reg = shift(self.reg, n);
            }
        }
    }
    /// A piece of `len` bytes at offset `at` of the block, at or after the end of the last one,
    /// by its register from 0 (`update(0, piece)`, from [`regs3`]).
    pub fn feed_reg(&mut self, at: u64, len: u64, reg: u32) {
        self.skip(at + len - self.pos);
        self.reg ^= reg;
        self.pos = at + len;
    }
    /// Bytes `data` at offset `at` of the block (`at + data.len() <= len`).
    pub fn feed(&mut self, at: u64, mut data: &[u8]) {
        let end = at + data.len() as u64;
        if end <= self.pos {
            return;
        }
        if at < self.pos {
            data = &data[(self.pos - at) as usize..];
        } else {
            self.skip(at - self.pos);
        }
        self.reg = update(self.reg, data);
        self.pos = end;
    }
    /// This reader's share: its register with zeros to the block's end.
    pub fn finish(mut self) -> u32 {
        self.restart(0)
    }
    /// This reader's share, as `finish`, and a fresh fold of the next block, of `len` bytes, that
    /// keeps the gap tables (pieces of one stride repeat their gap block after block).
    pub fn restart(&mut self, len: u64) -> u32 {
        self.skip(self.len - self.pos.min(self.len));
        let share = self.reg;
        (self.reg, self.pos, self.len) = (0, 0, len);
        share
    }
}
