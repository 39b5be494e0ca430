//! The zstd codec alone, one thread: GB/s per core of encoding and decoding trained-like FP32
//! weights (per-row log-normal scales around 0.02, as benches/compression.py makes them) block by
//! block, and of the steps inside (shuffle, zstd, unshuffle, crc32c). No files, no workers: the
//! figure issue 21's per-core targets are about.
//!
//! cargo run --release --example codec_speed -- [MiB] [level] [reps] [shuffle width]

mod common;
use common::best;

use olmo_chunks_core::checksum::crc32c;
use olmo_chunks_core::codec::{choose_shuffle, decode_block, encode_blocks, Codec};

const BLOCK: u64 = 1 << 20;

/// `n` FP32 values in rows of 4096, each row `0.02 * exp(0.5 z)` times standard normals.
fn weights(n: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut normal =
        move || (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
    let mut out = Vec::with_capacity(n * 4);
    let mut scale = 0.0;
    for i in 0..n {
        if i % 4096 == 0 {
            scale = 0.02 * (0.5 * normal()).exp();
        }
        out.extend_from_slice(&((normal() * scale) as f32).to_le_bytes());
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().map_or(32, |a| a.parse().unwrap());
    let level: i32 = args.get(1).map_or(1, |a| a.parse().unwrap());
    let reps: usize = args.get(2).map_or(3, |a| a.parse().unwrap());
    let data = weights(mib << 18);
    let gbps = |s: f64| data.len() as f64 / s / 1e9;

    let shuffle = args.get(3).map_or_else(
        || choose_shuffle(&data[..BLOCK as usize], level),
        |a| a.parse().unwrap(),
    );
    let codec = Codec::Zstd { shuffle };
    let t_choose = best(reps, || choose_shuffle(&data[..BLOCK as usize], level));
    let t_enc = best(reps, || encode_blocks(&data, BLOCK, shuffle, level));
    let enc = encode_blocks(&data, BLOCK, shuffle, level);
    let mut out = vec![0u8; data.len()];
    let mut tmp = Vec::new();
    let t_dec = best(reps, || {
        let mut pos = 0usize;
        for (k, &len) in enc.block_lens.iter().enumerate() {
            let raw = k * BLOCK as usize..((k + 1) * BLOCK as usize).min(data.len());
            let stored = &enc.bytes[pos..pos + len as usize];
            decode_block(stored, codec, &mut out[raw], &mut tmp).unwrap();
            pos += len as usize;
        }
    });
    assert!(out == data, "round trip");
    let t_crc = best(reps, || crc32c(&enc.bytes));
    let t_copy = best(reps, || out.copy_from_slice(&data));
    println!(
        "{mib} MiB FP32 weights, zstd-{level}, shuffle {shuffle}, 1 MiB blocks, one thread: \
         stored/raw {:.3}",
        enc.bytes.len() as f64 / data.len() as f64
    );
    println!("encode (shuffle + zstd + crc32c)  {:.3} GB/s", gbps(t_enc));
    println!("decode (zstd + unshuffle)         {:.3} GB/s", gbps(t_dec));
    println!(
        "choose the shuffle (first block)  {:.1} ms per chunk",
        t_choose * 1e3
    );
    println!("crc32c of the stored bytes        {:.3} GB/s", gbps(t_crc));
    println!("memcpy of the raw bytes           {:.3} GB/s", gbps(t_copy));
}
