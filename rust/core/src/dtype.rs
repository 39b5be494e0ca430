//! Element types by their stable names (the torch names without the `torch.` prefix).

/// Every element type the format stores, with its bytes per element.
pub const DTYPES: &[(&str, u64)] = &[
    ("bool", 1),
    ("uint8", 1),
    ("int8", 1),
    ("float8_e4m3fn", 1),
    ("float8_e5m2", 1),
    ("float8_e4m3fnuz", 1),
    ("float8_e5m2fnuz", 1),
    ("int16", 2),
    ("uint16", 2),
    ("float16", 2),
    ("bfloat16", 2),
    ("int32", 4),
    ("uint32", 4),
    ("float32", 4),
    ("int64", 8),
    ("uint64", 8),
    ("float64", 8),
    ("complex64", 8),
    ("complex128", 16),
];

/// Bytes per element of a dtype name, or `None` if the name is unknown.
pub fn itemsize(name: &str) -> Option<u64> {
    DTYPES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, size)| size)
}
