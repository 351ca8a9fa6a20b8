//! Element types, described as DLPack does (type code, bits, lanes).

/// DLPack type codes (`DLDataTypeCode`). Declaration order is the DLPack code (`kDLInt` = 0, ...,
/// pinned code by code in this file's tests): only append.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Int,
    UInt,
    Float,
    OpaqueHandle,
    Bfloat,
    Complex,
    Bool,
    Float8E3m4,
    Float8E4m3,
    Float8E4m3b11fnuz,
    Float8E4m3fn,
    Float8E4m3fnuz,
    Float8E5m2,
    Float8E5m2fnuz,
    Float8E8m0fnu,
    Float6E2m3fn,
    Float6E3m2fn,
    Float4E2m1fn,
}

impl Code {
    const ALL: [Code; 18] = [
        Code::Int,
        Code::UInt,
        Code::Float,
        Code::OpaqueHandle,
        Code::Bfloat,
        Code::Complex,
        Code::Bool,
        Code::Float8E3m4,
        Code::Float8E4m3,
        Code::Float8E4m3b11fnuz,
        Code::Float8E4m3fn,
        Code::Float8E4m3fnuz,
        Code::Float8E5m2,
        Code::Float8E5m2fnuz,
        Code::Float8E8m0fnu,
        Code::Float6E2m3fn,
        Code::Float6E3m2fn,
        Code::Float4E2m1fn,
    ];
}

/// An element type: DLPack's `DLDataType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

impl DType {
    pub const fn new(code: Code, bits: u8) -> DType {
        DType {
            code: code as u8,
            bits,
            lanes: 1,
        }
    }

    pub const F32: DType = DType::new(Code::Float, 32);
    pub const F16: DType = DType::new(Code::Float, 16);
    pub const BF16: DType = DType::new(Code::Bfloat, 16);
    /// PyTorch's `float8_e4m3fn` (FP8 dispatch output).
    pub const F8E4M3FN: DType = DType::new(Code::Float8E4m3fn, 8);
    pub const I32: DType = DType::new(Code::Int, 32);
    pub const I64: DType = DType::new(Code::Int, 64);

    pub fn code(self) -> Option<Code> {
        Code::ALL.iter().copied().find(|c| *c as u8 == self.code)
    }

    /// PyTorch's name (`torch.bfloat16`, `torch.float8_e4m3fn`, ...), or a DLPack description
    /// for types PyTorch has no name for.
    pub fn torch_name(self) -> String {
        let name = match (self.code(), self.bits, self.lanes) {
            (Some(Code::Int), 8, 1) => "int8",
            (Some(Code::Int), 16, 1) => "int16",
            (Some(Code::Int), 32, 1) => "int32",
            (Some(Code::Int), 64, 1) => "int64",
            (Some(Code::UInt), 8, 1) => "uint8",
            (Some(Code::UInt), 16, 1) => "uint16",
            (Some(Code::UInt), 32, 1) => "uint32",
            (Some(Code::UInt), 64, 1) => "uint64",
            (Some(Code::Float), 16, 1) => "float16",
            (Some(Code::Float), 32, 1) => "float32",
            (Some(Code::Float), 64, 1) => "float64",
            (Some(Code::Bfloat), 16, 1) => "bfloat16",
            (Some(Code::Complex), 64, 1) => "complex64",
            (Some(Code::Complex), 128, 1) => "complex128",
            (Some(Code::Bool), 8, 1) => "bool",
            (Some(Code::Float8E4m3fn), 8, 1) => "float8_e4m3fn",
            (Some(Code::Float8E4m3fnuz), 8, 1) => "float8_e4m3fnuz",
            (Some(Code::Float8E5m2), 8, 1) => "float8_e5m2",
            (Some(Code::Float8E5m2fnuz), 8, 1) => "float8_e5m2fnuz",
            (Some(Code::Float8E8m0fnu), 8, 1) => "float8_e8m0fnu",
            (Some(Code::Float4E2m1fn), 8, 1) => "float4_e2m1fn_x2",
            _ => {
                return format!(
                    "dlpack(code={}, bits={}, lanes={})",
                    self.code, self.bits, self.lanes
                )
            }
        };
        format!("torch.{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_dlpacks() {
        let dlpack = [
            (Code::Int, 0),               // kDLInt
            (Code::UInt, 1),              // kDLUInt
            (Code::Float, 2),             // kDLFloat
            (Code::OpaqueHandle, 3),      // kDLOpaqueHandle
            (Code::Bfloat, 4),            // kDLBfloat
            (Code::Complex, 5),           // kDLComplex
            (Code::Bool, 6),              // kDLBool
            (Code::Float8E3m4, 7),        // kDLFloat8_e3m4
            (Code::Float8E4m3, 8),        // kDLFloat8_e4m3
            (Code::Float8E4m3b11fnuz, 9), // kDLFloat8_e4m3b11fnuz
            (Code::Float8E4m3fn, 10),     // kDLFloat8_e4m3fn
            (Code::Float8E4m3fnuz, 11),   // kDLFloat8_e4m3fnuz
            (Code::Float8E5m2, 12),       // kDLFloat8_e5m2
            (Code::Float8E5m2fnuz, 13),   // kDLFloat8_e5m2fnuz
            (Code::Float8E8m0fnu, 14),    // kDLFloat8_e8m0fnu
            (Code::Float6E2m3fn, 15),     // kDLFloat6_e2m3fn
            (Code::Float6E3m2fn, 16),     // kDLFloat6_e3m2fn
            (Code::Float4E2m1fn, 17),     // kDLFloat4_e2m1fn
        ];
        for (code, n) in dlpack {
            assert_eq!(code as u8, n, "{code:?}");
        }
        assert_eq!(Code::ALL, dlpack.map(|(code, _)| code));
    }
}
