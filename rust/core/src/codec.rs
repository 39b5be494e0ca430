//! Chunk compression (format version 2). Each checksum block of a chunk is compressed on its own,
//! as one plain zstd frame, so a reader that needs part of a chunk reads and decompresses only the
//! blocks it overlaps. Before compressing, a chunk's bytes may be byte-shuffled (byte `j` of every
//! element together: the exponent bytes of floats end up side by side), when that makes its first
//! block smaller. A block that does not shrink is stored raw; a stored block's length says which.

use crate::manifest::block_count;

/// How a chunk's blocks are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Codec {
    /// The chunk's bytes as they are, `block_size` bytes a block.
    #[default]
    Raw,
    /// Each block a zstd frame of its bytes, byte-shuffled by `shuffle`-byte elements first when
    /// `shuffle` is not 0; a block whose stored length equals its raw length is stored raw.
    Zstd { shuffle: u8 },
}

/// Shuffle widths a writer tries (0: none) and a reader accepts.
pub const SHUFFLES: [u8; 4] = [0, 2, 4, 8];

/// zstd levels a writer accepts.
pub fn level_range() -> std::ops::RangeInclusive<i32> {
    zstd::compression_level_range()
}

/// Blocks as stored: their bytes back to back, each one's stored length and crc32c.
pub struct Encoded {
    pub bytes: Vec<u8>,
    pub block_lens: Vec<u32>,
    pub checksums: Vec<u32>,
}

/// Byte `j` of element `i` goes to `j * n + i` (`n` whole elements; a tail shorter than an element
/// is kept as it is).
fn shuffle(src: &[u8], width: usize, dst: &mut Vec<u8>) {
    dst.clear();
    dst.resize(src.len(), 0);
    match width {
        2 => shuffle_w::<2>(src, dst),
        4 => shuffle_w::<4>(src, dst),
        8 => shuffle_w::<8>(src, dst),
        _ => unreachable!("shuffle width {width}"),
    }
}

fn unshuffle(src: &[u8], width: usize, dst: &mut [u8]) {
    match width {
        2 => unshuffle_w::<2>(src, dst),
        4 => unshuffle_w::<4>(src, dst),
        8 => unshuffle_w::<8>(src, dst),
        _ => unreachable!("shuffle width {width}"),
    }
}

/// [`shuffle`] for a width known at compile time: one pass over the elements, writing `W` plane
/// streams.
fn shuffle_w<const W: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / W;
    let (body, tail) = dst.split_at_mut(n * W);
    if n > 0 {
        let mut it = body.chunks_exact_mut(n);
        let planes: [&mut [u8]; W] = std::array::from_fn(|_| it.next().unwrap());
        for (i, elem) in src.chunks_exact(W).enumerate() {
            for j in 0..W {
                planes[j][i] = elem[j];
            }
        }
    }
    tail.copy_from_slice(&src[n * W..]);
}

/// [`unshuffle`] for a width known at compile time: one pass over the elements, reading `W` plane
/// streams.
fn unshuffle_w<const W: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / W;
    let planes: [&[u8]; W] = std::array::from_fn(|j| &src[j * n..(j + 1) * n]);
    for (i, out) in dst[..n * W].chunks_exact_mut(W).enumerate() {
        for j in 0..W {
            out[j] = planes[j][i];
        }
    }
    dst[n * W..].copy_from_slice(&src[n * W..]);
}

/// One block as stored: the zstd frame of (shuffled) `raw` if it is shorter, else `raw`.
fn encode_block(raw: &[u8], shuffle_width: u8, level: i32, tmp: &mut Vec<u8>) -> Vec<u8> {
    let input = if shuffle_width == 0 {
        raw
    } else {
        shuffle(raw, shuffle_width as usize, tmp);
        &tmp[..]
    };
    match compress(input, level) {
        Ok(frame) if frame.len() < raw.len() => frame,
        _ => raw.to_vec(),
    }
}

thread_local! {
    /// Each I/O worker's zstd contexts, reused for every block it handles (a context costs
    /// allocations and table setup per use otherwise).
    static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compress(input: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|(l, _)| *l != level) {
            *slot = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        slot.as_mut().unwrap().1.compress(input)
    })
}

/// The shuffle width among [`SHUFFLES`] that stores `first_block` (a chunk's) smallest.
pub fn choose_shuffle(first_block: &[u8], level: i32) -> u8 {
    let mut tmp = Vec::new();
    SHUFFLES
        .iter()
        .copied()
        .filter(|&w| first_block.len() >= 2 * w as usize)
        .min_by_key(|&w| encode_block(first_block, w, level, &mut tmp).len())
        .unwrap_or(0)
}

/// Compresses `data` (whole blocks of a chunk, but for its last) block by block with zstd at
/// `level`, shuffled by `shuffle` first.
pub fn encode_blocks(data: &[u8], block_size: u64, shuffle: u8, level: i32) -> Encoded {
    let n = block_count(data.len() as u64, block_size) as usize;
    let mut e = Encoded {
        bytes: Vec::new(),
        block_lens: Vec::with_capacity(n),
        checksums: Vec::with_capacity(n),
    };
    let mut tmp = Vec::new();
    for raw in data.chunks(block_size as usize) {
        let stored = encode_block(raw, shuffle, level, &mut tmp);
        e.block_lens.push(stored.len() as u32);
        e.checksums.push(crate::checksum::crc32c(&stored));
        e.bytes.extend_from_slice(&stored);
    }
    e
}

/// Decodes one stored block into `out` (exactly the block's raw length). The error says what is
/// wrong: a frame that is not zstd, or that decompresses to another length.
pub fn decode_block(
    stored: &[u8],
    codec: Codec,
    out: &mut [u8],
    tmp: &mut Vec<u8>,
) -> Result<(), String> {
    if stored.len() == out.len() {
        out.copy_from_slice(stored); // raw, or a zstd block that did not shrink
        return Ok(());
    }
    let Codec::Zstd { shuffle } = codec else {
        return Err(format!(
            "raw block of {} bytes, expected {}",
            stored.len(),
            out.len()
        ));
    };
    let dst: &mut [u8] = if shuffle == 0 {
        out
    } else {
        tmp.resize(out.len(), 0);
        &mut tmp[..]
    };
    let n = decompress_exact(stored, dst)?;
    if n != dst.len() {
        return Err(format!(
            "zstd block decompresses to {n} bytes, expected {}",
            dst.len()
        ));
    }
    if shuffle != 0 {
        unshuffle(tmp, shuffle as usize, out);
    }
    Ok(())
}

/// Decompresses `frame`, exactly one zstd frame that declares its content size, into `dst`; the
/// bytes it produced. A frame declaring more than `dst` holds is refused before decompressing.
fn decompress_exact(frame: &[u8], dst: &mut [u8]) -> Result<usize, String> {
    use zstd::zstd_safe;
    let bad = |what: &str| format!("not a valid zstd frame ({what})");
    match zstd_safe::find_frame_compressed_size(frame) {
        Ok(n) if n == frame.len() => {}
        Ok(n) => return Err(format!("{} bytes follow the zstd frame", frame.len() - n)),
        Err(code) => return Err(bad(zstd_safe::get_error_name(code))),
    }
    match zstd_safe::get_frame_content_size(frame) {
        Ok(Some(n)) if n <= dst.len() as u64 => {}
        Ok(Some(n)) => {
            return Err(format!(
                "zstd block decompresses to {n} bytes, expected {}",
                dst.len()
            ))
        }
        _ => return Err(bad("no content size")),
    }
    DECOMPRESSOR
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = Some(zstd::bulk::Decompressor::new()?);
            }
            slot.as_mut().unwrap().decompress_to_buffer(frame, dst)
        })
        .map_err(|e| bad(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(n: usize) -> Vec<u8> {
        // Trained-like weights: small values of similar magnitude, so the exponent bytes repeat.
        (0..n)
            .flat_map(|i| ((i as f32 * 0.618).sin() * 0.02).to_le_bytes())
            .collect()
    }

    fn encode(data: &[u8], bs: u64, level: i32) -> (Codec, Encoded) {
        let shuffle = choose_shuffle(&data[..data.len().min(bs as usize)], level);
        (
            Codec::Zstd { shuffle },
            encode_blocks(data, bs, shuffle, level),
        )
    }

    fn decode_all((codec, e): &(Codec, Encoded), raw_len: usize, bs: usize) -> Vec<u8> {
        let mut out = vec![0u8; raw_len];
        let (mut pos, mut tmp) = (0usize, Vec::new());
        for (k, &len) in e.block_lens.iter().enumerate() {
            let end = ((k + 1) * bs).min(raw_len);
            let stored = &e.bytes[pos..pos + len as usize];
            assert_eq!(crate::checksum::crc32c(stored), e.checksums[k]);
            decode_block(stored, *codec, &mut out[k * bs..end], &mut tmp).unwrap();
            pos += len as usize;
        }
        assert_eq!(pos, e.bytes.len());
        out
    }

    #[test]
    fn round_trips_and_shuffles_floats() {
        let data = floats(10_000);
        let e = encode(&data, 4096, 3);
        assert_eq!(e.0, Codec::Zstd { shuffle: 4 });
        let e1 = &e.1;
        // Random low mantissa bits stay: the sign and exponent bytes are what shrinks.
        assert!(e1.bytes.len() < data.len() * 9 / 10, "{}", e1.bytes.len());
        assert_eq!(decode_all(&e, data.len(), 4096), data);
    }

    #[test]
    fn incompressible_blocks_are_stored_raw() {
        let mut x = 0x9E3779B97F4A7C15u64;
        let data: Vec<u8> = (0..5000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let e = encode(&data, 1024, 3);
        assert_eq!(e.1.block_lens, vec![1024, 1024, 1024, 1024, 904]);
        assert_eq!(e.1.bytes, data);
        assert_eq!(decode_all(&e, data.len(), 1024), data);
    }

    #[test]
    fn shuffle_inverts_with_a_tail() {
        let src: Vec<u8> = (0..23).collect();
        let mut s = Vec::new();
        shuffle(&src, 4, &mut s);
        assert_eq!(&s[..6], &[0, 4, 8, 12, 16, 1]);
        assert_eq!(&s[20..], &[20, 21, 22]);
        let mut back = vec![0; 23];
        unshuffle(&s, 4, &mut back);
        assert_eq!(back, src);
    }

    proptest::proptest! {
        /// Against the definition, for every width and length (tails included).
        #[test]
        fn shuffle_is_the_byte_plane_transpose(
            src in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            width in proptest::sample::select(vec![2usize, 4, 8]),
        ) {
            let n = src.len() / width;
            let mut s = Vec::new();
            shuffle(&src, width, &mut s);
            proptest::prop_assert_eq!(s.len(), src.len());
            for i in 0..n {
                for j in 0..width {
                    proptest::prop_assert_eq!(s[j * n + i], src[i * width + j]);
                }
            }
            proptest::prop_assert_eq!(&s[n * width..], &src[n * width..]);
            let mut back = vec![0xA5; src.len()];
            unshuffle(&s, width, &mut back);
            proptest::prop_assert_eq!(back, src);
        }
    }

    #[test]
    fn bad_frames_are_errors() {
        let data = floats(2048);
        let (codec, e) = encode(&data, 8192, 3);
        let (mut tmp, mut out) = (Vec::new(), vec![0u8; 8192]);
        // Wrong length: the frame of a shorter block, asked for a longer one, and vice versa.
        let (_, short) = encode(&data[..4096], 8192, 3);
        let err = decode_block(&short.bytes, codec, &mut out, &mut tmp).unwrap_err();
        assert!(
            err.contains("decompresses to 4096 bytes, expected 8192"),
            "{err}"
        );
        let err = decode_block(&e.bytes, codec, &mut out[..4096], &mut tmp).unwrap_err();
        assert!(
            err.contains("decompresses to 8192 bytes, expected 4096"),
            "{err}"
        );
        // Garbage, a truncated frame, and trailing bytes.
        let err = decode_block(&[7u8; 100], codec, &mut out, &mut tmp).unwrap_err();
        assert!(err.contains("not a valid zstd frame"), "{err}");
        let n = e.bytes.len();
        let err = decode_block(&e.bytes[..n - 5], codec, &mut out, &mut tmp).unwrap_err();
        assert!(err.contains("not a valid zstd frame"), "{err}");
        let mut extra = e.bytes.clone();
        extra.extend_from_slice(&[0, 0]);
        let err = decode_block(&extra, codec, &mut out, &mut tmp).unwrap_err();
        assert!(err.contains("follow the zstd frame"), "{err}");
    }
}
