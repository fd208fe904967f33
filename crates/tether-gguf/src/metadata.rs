//! GGUF metadata values.

use std::fmt;

use crate::array::MetaArray;

/// A metadata value, as typed in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7 (one byte, 0 or 1).
    Bool(bool),
    /// Type 8 (u64 length + UTF-8 bytes).
    String(String),
    /// Type 9 (element type u32 + u64 count + elements, all of one type).
    Array(MetaArray),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

/// GGUF value type ids.
pub(crate) mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;

    /// The lower-case name of type `id` (`u32`, `string`, `array`).
    pub fn name(id: u32) -> &'static str {
        match id {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            BOOL => "bool",
            STRING => "string",
            ARRAY => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
            _ => "unknown",
        }
    }
}

impl MetaValue {
    /// The GGUF value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => type_id::U8,
            MetaValue::I8(_) => type_id::I8,
            MetaValue::U16(_) => type_id::U16,
            MetaValue::I16(_) => type_id::I16,
            MetaValue::U32(_) => type_id::U32,
            MetaValue::I32(_) => type_id::I32,
            MetaValue::F32(_) => type_id::F32,
            MetaValue::Bool(_) => type_id::BOOL,
            MetaValue::String(_) => type_id::STRING,
            MetaValue::Array(_) => type_id::ARRAY,
            MetaValue::U64(_) => type_id::U64,
            MetaValue::I64(_) => type_id::I64,
            MetaValue::F64(_) => type_id::F64,
        }
    }

    /// The lower-case type name (`u32`, `string`, `array`).
    pub fn type_name(&self) -> &'static str {
        type_id::name(self.type_id())
    }

    /// Any integer value widened to `i128` (so every int type compares without loss).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An integer value that fits `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer value that fits `u32`.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_int().and_then(|v| u32::try_from(v).ok())
    }

    /// An integer value that fits `i32`.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_int().and_then(|v| i32::try_from(v).ok())
    }

    /// An `F32` or `F64` value as `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A `Bool` value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A `String` value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An `Array` value.
    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for MetaValue {
    /// Scalars as themselves, strings quoted; arrays in full (see `inspect` for abbreviation).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::U8(v) => write!(f, "{v}"),
            MetaValue::I8(v) => write!(f, "{v}"),
            MetaValue::U16(v) => write!(f, "{v}"),
            MetaValue::I16(v) => write!(f, "{v}"),
            MetaValue::U32(v) => write!(f, "{v}"),
            MetaValue::I32(v) => write!(f, "{v}"),
            MetaValue::U64(v) => write!(f, "{v}"),
            MetaValue::I64(v) => write!(f, "{v}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(items) => write!(f, "{items}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_conversions_respect_range() {
        assert_eq!(MetaValue::I32(-1).as_u64(), None);
        assert_eq!(MetaValue::I64(7).as_u32(), Some(7));
        assert_eq!(MetaValue::U64(u64::MAX).as_u32(), None);
        assert_eq!(MetaValue::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(MetaValue::U32(1 << 31).as_i32(), None);
        assert_eq!(MetaValue::F32(1.0).as_u64(), None);
        assert_eq!(MetaValue::F64(0.5).as_f32(), Some(0.5));
    }
}
