//! Element types in C terms for C and C++ callers' messages.
//!
//! The core names an element type as vLLM's messages do, the way PyTorch prints it
//! (`torch.float32`, [`DType::torch_name`]): the Python package shows exactly that text. C and
//! C++ callers write an element type as an `epcomm_dtype` (DLPack's type code and bits), so
//! `epcomm_last_error_message` names it so: `float32 (kDLFloat, 32 bits)`. The one place the
//! two renderings meet; the table is `DType::torch_name`'s own, so they cannot drift apart.

use std::borrow::Cow;

use crate::dtype::{Code, DType};

/// DLPack's name of a type code (`DLDataTypeCode`'s enumerator, as `dlpack.h` spells it).
fn dlpack_code_name(code: Code) -> &'static str {
    match code {
        Code::Int => "kDLInt",
        Code::UInt => "kDLUInt",
        Code::Float => "kDLFloat",
        Code::OpaqueHandle => "kDLOpaqueHandle",
        Code::Bfloat => "kDLBfloat",
        Code::Complex => "kDLComplex",
        Code::Bool => "kDLBool",
        Code::Float8E3m4 => "kDLFloat8_e3m4",
        Code::Float8E4m3 => "kDLFloat8_e4m3",
        Code::Float8E4m3b11fnuz => "kDLFloat8_e4m3b11fnuz",
        Code::Float8E4m3fn => "kDLFloat8_e4m3fn",
        Code::Float8E4m3fnuz => "kDLFloat8_e4m3fnuz",
        Code::Float8E5m2 => "kDLFloat8_e5m2",
        Code::Float8E5m2fnuz => "kDLFloat8_e5m2fnuz",
        Code::Float8E8m0fnu => "kDLFloat8_e8m0fnu",
        Code::Float6E2m3fn => "kDLFloat6_e2m3fn",
        Code::Float6E3m2fn => "kDLFloat6_e3m2fn",
        Code::Float4E2m1fn => "kDLFloat4_e2m1fn",
    }
}

/// The C name of the scalar type PyTorch calls `torch.{name}`: `float32 (kDLFloat, 32 bits)`;
/// `None` when `name` is no PyTorch dtype name.
fn c_name(name: &str) -> Option<String> {
    let torch = format!("torch.{name}");
    (0..=u8::MAX)
        .flat_map(|code| {
            [8, 16, 32, 64, 128].map(|bits| DType {
                code,
                bits,
                lanes: 1,
            })
        })
        .find(|d| d.torch_name() == torch)
        .and_then(|d| {
            let code = d.code()?;
            Some(format!(
                "{name} ({}, {} bits)",
                dlpack_code_name(code),
                d.bits
            ))
        })
}

/// `message` with every PyTorch dtype name (`torch.NAME`, NAME one of [`DType::torch_name`]'s)
/// written in C terms (`NAME (kDLCODE, BITS bits)`); any other `torch.` text (e.g.
/// `torch.distributed`) is left as it is.
pub(crate) fn with_c_dtype_names(message: &str) -> Cow<'_, str> {
    const PREFIX: &str = "torch.";
    if !message.contains(PREFIX) {
        return Cow::Borrowed(message);
    }
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(message.len() + 32);
    let mut rest = message;
    while let Some(at) = rest.find(PREFIX) {
        let after = &rest[at + PREFIX.len()..];
        let name = &after[..after.find(|c: char| !word(c)).unwrap_or(after.len())];
        let starts_word = !rest[..at].ends_with(|c: char| word(c) || c == '.');
        match c_name(name).filter(|_| starts_word) {
            Some(c) => {
                out.push_str(&rest[..at]);
                out.push_str(&c);
            }
            None => out.push_str(&rest[..at + PREFIX.len() + name.len()]),
        }
        rest = &after[name.len()..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_dtype_names_read_in_c_terms_and_other_text_stays() {
        assert_eq!(
            with_c_dtype_names(
                "tensor 'topk_ids' has dtype torch.int16; expected torch.int32 or torch.int64"
            ),
            "tensor 'topk_ids' has dtype int16 (kDLInt, 16 bits); expected int32 (kDLInt, 32 bits) or int64 (kDLInt, 64 bits)"
        );
        assert_eq!(
            with_c_dtype_names("(torch.bool, torch.float8_e5m2)."),
            "(bool (kDLBool, 8 bits), float8_e5m2 (kDLFloat8_e5m2, 8 bits))."
        );
        assert_eq!(
            with_c_dtype_names("torch.bfloat16/torch.float4_e2m1fn_x2 torch.uint8"),
            "bfloat16 (kDLBfloat, 16 bits)/float4_e2m1fn_x2 (kDLFloat4_e2m1fn, 8 bits) uint8 (kDLUInt, 8 bits)"
        );
        for same in [
            "torch.distributed and torch.compile",
            "torch.float320 torch.x9 torch. mytorch.float32 a.torch.float32",
            "dlpack(code=2, bits=32, lanes=4)",
            "",
        ] {
            assert_eq!(with_c_dtype_names(same), same);
        }
    }

    #[test]
    fn every_torch_name_has_a_c_name() {
        for code in 0..=u8::MAX {
            for bits in [8, 16, 32, 64, 128] {
                let d = DType {
                    code,
                    bits,
                    lanes: 1,
                };
                if let Some(name) = d.torch_name().strip_prefix("torch.") {
                    let c = c_name(name).unwrap_or_default();
                    assert!(c.starts_with(&format!("{name} (kDL")), "{c}");
                    assert!(c.ends_with(&format!(", {bits} bits)")), "{c}");
                }
            }
        }
    }
}
