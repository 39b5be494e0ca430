//! What the examples share.

use std::hint::black_box;
use std::time::Instant;

/// The fastest of `reps` runs of `f`, in seconds.
pub fn best<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
