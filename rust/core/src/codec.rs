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

/// [`shuffle`] for a width known at compile time: 16 elements at a time through SIMD registers
/// where there are some, one element at a time for the rest.
fn shuffle_w<const W: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / W;
    let (body, tail) = dst.split_at_mut(n * W);
    if n > 0 {
        let mut it = body.chunks_exact_mut(n);
        let mut planes: [&mut [u8]; W] = std::array::from_fn(|_| it.next().unwrap());
        let done = simd::shuffle_tiles::<W>(src, &mut planes);
        for (i, elem) in src.chunks_exact(W).enumerate().skip(done) {
            for j in 0..W {
                planes[j][i] = elem[j];
            }
        }
    }
    tail.copy_from_slice(&src[n * W..]);
}

/// [`unshuffle`] for a width known at compile time, as [`shuffle_w`].
fn unshuffle_w<const W: usize>(src: &[u8], dst: &mut [u8]) {
    let n = src.len() / W;
    let planes: [&[u8]; W] = std::array::from_fn(|j| &src[j * n..(j + 1) * n]);
    let done = simd::unshuffle_tiles::<W>(&planes, &mut dst[..n * W]);
    for (i, out) in dst[..n * W].chunks_exact_mut(W).enumerate().skip(done) {
        for j in 0..W {
            out[j] = planes[j][i];
        }
    }
    dst[n * W..].copy_from_slice(&src[n * W..]);
}

/// The byte-plane transpose 16 elements (`W` 16-byte registers) at a time. A width of 2^k is k
/// perfect shuffles of the tile's bytes: split each pair of registers into its even and its odd
/// bytes (packing), and for the way back interleave them again (unpacking). SSE2 is part of
/// x86-64; elsewhere the callers' scalar loops do all of it.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    const LANES: usize = 16;

    /// Moves the first whole tiles of `src` (`W`-byte elements) into `planes`; how many elements
    /// it moved.
    pub fn shuffle_tiles<const W: usize>(src: &[u8], planes: &mut [&mut [u8]; W]) -> usize {
        let tiles = planes[0].len() / LANES;
        // SAFETY: SSE2 is always there on x86-64.
        let mask = unsafe { _mm_set1_epi16(0x00FF) };
        for t in 0..tiles {
            // SAFETY: tile `t` covers src[t*16*W .. (t+1)*16*W] and planes[j][t*16 .. t*16+16],
            // all within bounds (the plane length is the element count); unaligned loads and
            // stores; SSE2 is always there on x86-64.
            unsafe {
                let at = src.as_ptr().add(t * LANES * W);
                let mut v: [__m128i; W] =
                    std::array::from_fn(|r| _mm_loadu_si128(at.add(r * LANES).cast()));
                for _ in 0..W.trailing_zeros() {
                    v = std::array::from_fn(|r| {
                        let (k, odd) = (r % (W / 2), r >= W / 2);
                        let (a, b) = (v[2 * k], v[2 * k + 1]);
                        if odd {
                            _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8))
                        } else {
                            _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask))
                        }
                    });
                }
                for (plane, r) in planes.iter_mut().zip(v) {
                    _mm_storeu_si128(plane.as_mut_ptr().add(t * LANES).cast(), r);
                }
            }
        }
        tiles * LANES
    }

    /// The inverse of [`shuffle_tiles`]: the first whole tiles of `planes` into `dst`.
    pub fn unshuffle_tiles<const W: usize>(planes: &[&[u8]; W], dst: &mut [u8]) -> usize {
        let tiles = planes[0].len() / LANES;
        for t in 0..tiles {
            // SAFETY: as in shuffle_tiles, with the roles of source and destination swapped.
            unsafe {
                let mut v: [__m128i; W] = std::array::from_fn(|j| {
                    _mm_loadu_si128(planes[j].as_ptr().add(t * LANES).cast())
                });
                for _ in 0..W.trailing_zeros() {
                    v = std::array::from_fn(|r| {
                        let (e, o) = (v[r / 2], v[W / 2 + r / 2]);
                        if r % 2 == 0 {
                            _mm_unpacklo_epi8(e, o)
                        } else {
                            _mm_unpackhi_epi8(e, o)
                        }
                    });
                }
                let at = dst.as_mut_ptr().add(t * LANES * W);
                for (r, x) in v.into_iter().enumerate() {
                    _mm_storeu_si128(at.add(r * LANES).cast(), x);
                }
            }
        }
        tiles * LANES
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub fn shuffle_tiles<const W: usize>(_: &[u8], _: &mut [&mut [u8]; W]) -> usize {
        0
    }
    pub fn unshuffle_tiles<const W: usize>(_: &[&[u8]; W], _: &mut [u8]) -> usize {
        0
    }
}

/// Appends one block as stored to `out`: the zstd frame of (shuffled) `raw` if it is shorter,
/// else `raw`; returns its stored length.
fn encode_block(
    raw: &[u8],
    shuffle_width: u8,
    level: i32,
    tmp: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> usize {
    let input = if shuffle_width == 0 {
        raw
    } else {
        shuffle(raw, shuffle_width as usize, tmp);
        &tmp[..]
    };
    COMPRESSOR.with(|cell| {
        let (ctx, frame) = &mut *cell.borrow_mut();
        frame.clear();
        frame.reserve(zstd::zstd_safe::compress_bound(input.len()));
        let stored = match compressor(ctx, level).and_then(|c| c.compress_to_buffer(input, frame)) {
            Ok(n) if n < raw.len() => &frame[..n],
            _ => raw,
        };
        out.extend_from_slice(stored);
        stored.len()
    })
}

type Compressor = Option<(i32, zstd::bulk::Compressor<'static>)>;

thread_local! {
    /// Each I/O worker's zstd contexts, reused for every block it handles (a context costs
    /// allocations and table setup per use otherwise), and its buffer for compressed frames.
    static COMPRESSOR: std::cell::RefCell<(Compressor, Vec<u8>)> =
        const { std::cell::RefCell::new((None, Vec::new())) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compressor(
    ctx: &mut Compressor,
    level: i32,
) -> std::io::Result<&mut zstd::bulk::Compressor<'static>> {
    if ctx.as_ref().is_none_or(|(l, _)| *l != level) {
        *ctx = Some((level, zstd::bulk::Compressor::new(level)?));
    }
    Ok(&mut ctx.as_mut().unwrap().1)
}

/// Bytes of a chunk's first block [`choose_shuffle`] compresses with each width: enough for the
/// exponent bytes' statistics, a few percent of a default block.
const SHUFFLE_SAMPLE: usize = 64 << 10;

/// The shuffle width among [`SHUFFLES`] that stores the start of `first_block` (a chunk's)
/// smallest.
pub fn choose_shuffle(first_block: &[u8], level: i32) -> u8 {
    let sample = &first_block[..first_block.len().min(SHUFFLE_SAMPLE)];
    let (mut tmp, mut out) = (Vec::new(), Vec::new());
    SHUFFLES
        .iter()
        .copied()
        .filter(|&w| sample.len() >= 2 * w as usize)
        .min_by_key(|&w| {
            out.clear();
            encode_block(sample, w, level, &mut tmp, &mut out)
        })
        .unwrap_or(0)
}

/// Compresses `data` (whole blocks of a chunk, but for its last) block by block with zstd at
/// `level`, shuffled by `shuffle` first.
pub fn encode_blocks(data: &[u8], block_size: u64, shuffle: u8, level: i32) -> Encoded {
    let n = block_count(data.len() as u64, block_size) as usize;
    let mut e = Encoded {
        bytes: Vec::with_capacity(data.len()), // no block is stored longer than it is
        block_lens: Vec::with_capacity(n),
        checksums: Vec::with_capacity(n),
    };
    let mut tmp = Vec::new();
    for raw in data.chunks(block_size as usize) {
        let at = e.bytes.len();
        let n = encode_block(raw, shuffle, level, &mut tmp, &mut e.bytes);
        e.block_lens.push(n as u32);
        e.checksums.push(crate::checksum::crc32c(&e.bytes[at..]));
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
            src in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1000),
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
