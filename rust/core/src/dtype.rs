//! Element types by their stable names (the torch names without the `torch.` prefix).

/// Bytes per element of a dtype name, or `None` if the name is unknown.
pub fn itemsize(name: &str) -> Option<u64> {
    Some(match name {
        "bool" | "uint8" | "int8" | "float8_e4m3fn" | "float8_e5m2" | "float8_e4m3fnuz"
        | "float8_e5m2fnuz" => 1,
        "int16" | "uint16" | "float16" | "bfloat16" => 2,
        "int32" | "uint32" | "float32" => 4,
        "int64" | "uint64" | "float64" | "complex64" => 8,
        "complex128" => 16,
        _ => return None,
    })
}
