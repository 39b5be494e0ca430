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
