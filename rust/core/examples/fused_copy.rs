//! The fused copy alone (`core::fused`), one thread: GB/s of copying `MiB` out of one buffer in
//! 64 KiB stripes with their CRC-32C folded in (as a warm local load copies a piece out of a
//! mapping of the page cache, `io::copy_mapped`), with the destination `rel` bytes into its 4 KiB
//! cycle against a page-aligned source, against `memcpy` and `memcpy` then the CRC of the same
//! bytes. Before the lanes' stores were kept apart in the 4 KiB cycle (a68a574), a destination
//! 0 / 64 / 128 / 2,048 bytes into a page copied at 1.49 / 0.56 / 3.13 / 6.50 GB/s on this
//! project's build machine, 9.2-9.8 after; 64 bytes is where the allocator puts a large tensor's
//! data.
//!
//! Then pieces, each a stream, into one run of the destination. While the lanes took streams in
//! turn (each piece three from the lane's last), 1,456-byte pieces of one run of the source
//! copied at 4.7 GB/s and 5,824-byte ones at 6.5; since each lane copies its own third of the
//! streams in order, at 8.8-9.1 and 9.7-9.9 (same session). Pieces a quarter of every row apart
//! copied at 4.1 either way, bound by their loads (summing them alone: 5 GB/s; a `memcpy` of
//! each piece, its stores reading their lines first: 5.8); since each lane asks for its next
//! pieces ahead, at 4.4-4.8 where they copied at 3.1-3.5 in the same minutes (6 runs each,
//! alternating, on a busier machine: contiguous pieces 6.8-7.2 either way).
//!
//! cargo run --release --example fused_copy -- [MiB] [reps]

mod common;
use common::best;

use olmo_chunks_core::checksum::crc32c;
use olmo_chunks_core::fused::{available, Copies};

const STRIPE: usize = 64 << 10;

/// `buf[off..off + n]` where `buf.as_ptr() + off` is `rel` bytes into a 4 KiB page.
fn at(buf: &mut [u8], rel: usize, n: usize) -> &mut [u8] {
    let off = (4096 - buf.as_ptr() as usize % 4096) % 4096 + rel;
    &mut buf[off..off + n]
}

/// The fused copy of `dst.len() / piece` pieces of `piece` bytes, `stride` apart in `src`, back
/// to back into `dst`, each a stream; their registers.
fn fused(src: &[u8], dst: &mut [u8], piece: usize, stride: usize) -> Vec<u32> {
    let mut c = Copies::new(true);
    for (r, d) in dst.chunks_mut(piece).enumerate() {
        assert!(r * stride + d.len() <= src.len());
        c.copy((r * stride) as u64, d);
        c.end_stream();
    }
    // SAFETY: every piece lies inside `src` (asserted above); `available` was checked.
    unsafe { c.run(src.as_ptr()) };
    c.into_regs()
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let n = args.first().copied().unwrap_or(128) << 20;
    let reps = args.get(1).copied().unwrap_or(5);
    assert!(available(), "no fused copy on this CPU");
    let mut src_buf = vec![0u8; n + 4096];
    let src = at(&mut src_buf, 0, n);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 + i / 4093) as u8;
    }
    let src: &[u8] = src;
    let mut dst_buf = vec![0u8; n + 8192];
    let gbps = |s: f64| n as f64 / s / 1e9;
    println!("{} MiB in 64 KiB stripes, one thread", n >> 20);
    for rel in [0, 64, 128, 2048] {
        let t = best(reps, || {
            fused(src, at(&mut dst_buf, rel, n), STRIPE, STRIPE)
        });
        assert!(at(&mut dst_buf, rel, n) == src);
        println!(
            "fused, destination {rel:4} B into a page  {:.2} GB/s",
            gbps(t)
        );
    }
    // Pieces, each a stream of its own (a split block's pieces, or rows of a whole check), back
    // to back in the destination: a quarter of a 5,824-byte row from a `Shard(0)` -> `Shard(1)`
    // load of the bench's 2 GiB state, then the same pieces back to back in the source too, and
    // whole rows.
    for (piece, stride) in [(1456, 5824), (1456, 1456), (5824, 5824)] {
        let rows = n / stride;
        let t = best(reps, || {
            fused(src, at(&mut dst_buf, 64, rows * piece), piece, stride)
        });
        println!(
            "fused, {piece:4} B pieces {stride:4} B apart   {:.2} GB/s",
            (rows * piece) as f64 / t / 1e9
        );
    }
    let t_copy = best(reps, || at(&mut dst_buf, 64, n).copy_from_slice(src));
    let t_both = best(reps, || {
        let dst = at(&mut dst_buf, 64, n);
        dst.copy_from_slice(src);
        dst.chunks(STRIPE).map(crc32c).fold(0, u32::wrapping_add)
    });
    println!(
        "memcpy                              {:.2} GB/s",
        gbps(t_copy)
    );
    println!(
        "memcpy, then the CRC of each stripe {:.2} GB/s",
        gbps(t_both)
    );
}
