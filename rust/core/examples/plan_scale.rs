//! Planning at scale without data: a manifest of `ranks` x `tensors` chunks (Shard(0) rows) is
//! encoded, decoded, and one rank's load is planned for a different layout.
//!
//! cargo run --release --example plan_scale -- 4096 500

use std::path::Path;
use std::time::Instant;

use olmo_chunks_core::{plan_runs, Chunk, FileEntry, Manifest, Piece, Region, Target, TensorEntry};
use serde_json::value::RawValue;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let (ranks, tensors) = (
        args.first().copied().unwrap_or(4096),
        args.get(1).copied().unwrap_or(500),
    );
    let (rows_per, cols) = (4u64, 64u64);
    let rows = ranks * rows_per;
    let mut m = Manifest {
        save_id: "x".into(),
        block_size: 1 << 20,
        files: (0..ranks)
            .map(|r| FileEntry {
                path: format!("data/x/rank-{r:05}.bin"),
                size: 1 << 40,
            })
            .collect(),
        tensors: Vec::new(),
        chunk_start: vec![0],
        chunks: Vec::new(),
        checksums: vec![0; 1],
        block_lens: vec![1024; 1],
        entries: RawValue::from_string("{}".into()).unwrap(),
        info: RawValue::from_string("{}".into()).unwrap(),
    };
    for t in 0..tensors {
        for r in 0..ranks {
            m.chunks.push(Chunk {
                region: Region::Box {
                    offsets: vec![r * rows_per, 0],
                    sizes: vec![rows_per, cols],
                },
                file: r as u32,
                offset: t * 1024,
                len: rows_per * cols * 4,
                crc_index: 0,
                codec: Default::default(),
            });
        }
        m.chunk_start.push(m.chunks.len());
        m.tensors.push(TensorEntry {
            key: format!("layers.{t}.w"),
            dtype: "float32".into(),
            shape: vec![rows, cols],
            role: "main_weight".into(),
            order: "row-major".into(),
            chunks: ranks as usize,
        });
    }
    let t0 = Instant::now();
    let bytes = m.encode();
    let t1 = Instant::now();
    let m = Manifest::decode(&bytes, Path::new("scale")).unwrap();
    let t2 = Instant::now();
    println!(
        "{} chunks, manifest {:.1} MB: encode {:.0} ms, decode {:.0} ms",
        m.chunks.len(),
        bytes.len() as f64 / 1e6,
        (t1 - t0).as_secs_f64() * 1e3,
        (t2 - t1).as_secs_f64() * 1e3
    );
    // One rank of a 2-D grid (ranks/64 x 64 over rows x cols would be too thin; use 64 x 2).
    let (grid_r, grid_c) = (64u64, 2u64);
    let (tr, tc) = (rows / grid_r, cols / grid_c);
    let targets: Vec<Target> = (0..tensors as usize)
        .map(|t| Target {
            tensor: t,
            pieces: vec![Piece {
                offsets: vec![5 * tr, tc],
                sizes: vec![tr, tc],
                local_start: 0,
                strides: vec![tc, 1],
            }],
            dest: t,
            dest_len: u64::MAX,
        })
        .collect();
    let t3 = Instant::now();
    let runs = plan_runs(&m, &targets).unwrap();
    let t4 = Instant::now();
    println!(
        "plan one rank of a {grid_r}x{grid_c} grid over {tensors} tensors: {:.1} ms, {} runs",
        (t4 - t3).as_secs_f64() * 1e3,
        runs.len()
    );
}
