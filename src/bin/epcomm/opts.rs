//! Options of `demo` and `bench`: `--name value` or `--name=value`, plus value-less flags.

use epcomm::num::FloatKind;

/// Splits `args` into (name, value) pairs; the names in `flags` take no value (theirs is "").
pub fn pairs(args: &[String], flags: &[&str]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if flags.contains(&a.as_str()) {
            out.push((a.clone(), String::new()));
        } else if let Some((name, value)) = a.split_once('=') {
            out.push((name.to_owned(), value.to_owned()));
        } else {
            let value = it.next().ok_or(format!("{a} needs a value"))?;
            out.push((a.clone(), value.clone()));
        }
    }
    Ok(out)
}

/// A non-negative integer option.
pub fn count(name: &str, value: &str) -> Result<usize, String> {
    value
        .parse()
        .map_err(|_| format!("{name} needs a non-negative integer, got '{value}'"))
}

/// A `--dtype` value: bf16, f16 or f32 (torch's long names too).
pub fn dtype(value: &str) -> Result<FloatKind, String> {
    match value {
        "bf16" | "bfloat16" => Ok(FloatKind::Bf16),
        "f16" | "fp16" | "float16" => Ok(FloatKind::F16),
        "f32" | "fp32" | "float32" => Ok(FloatKind::F32),
        other => Err(format!("--dtype {other}: expected bf16, f16 or f32")),
    }
}
