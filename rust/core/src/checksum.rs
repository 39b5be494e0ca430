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

/// What the CRC-32C of `n` bytes adds to their unconditioned register: `crc32c(d) ==
/// update(0, d) ^ zeros_constant(d.len())`.
pub fn zeros_constant(n: u64) -> u32 {
    !shift(!0, n)
}

/// One reader's fold of its pieces of a block of `len` bytes: fed in order of their offsets
/// (a byte fed twice, by overlapping pieces, counts once), then `finish`ed into its share.
#[derive(Clone, Debug)]
pub struct Parts {
    reg: u32,
    pos: u64,
    len: u64,
    // the last gap shifted over and its operator: rows of one stride repeat it
    gap: (u64, u32),
}

impl Parts {
    pub fn new(len: u64) -> Self {
        Parts {
            reg: 0,
            pos: 0,
            len,
            gap: (0, 1 << 31),
        }
    }
    fn skip(&mut self, n: u64) {
        if n == 0 || self.reg == 0 {
            return;
        }
        if self.gap.0 != n {
            self.gap = (n, zeros_op(n));
        }
        self.reg = mul_mod(self.gap.1, self.reg);
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
        self.skip(self.len - self.pos.min(self.len));
        self.reg
    }
}
