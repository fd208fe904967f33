//! The ggml tensor element types that GGUF files name, with their block geometry.
//!
//! Ids and block sizes follow the GGUF specification (ggml's `ggml_type` numbering).

use std::fmt;

/// A tensor element type as stored in GGUF (`ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ4NL,
    IQ4XS,
    BF16,
}

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 17] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::BF16,
    ];

    /// Every type model files store weights in: all but Q8_1 and Q8_K, the intermediate
    /// formats of ggml's dot products.
    pub const WEIGHTS: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
    ];

    /// The type for a GGUF type id, or `None` for ids this crate does not handle
    /// (removed Q4_2/Q4_3, the lattice i-quants IQ1..IQ3, integer types).
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    /// Elements in one block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::IQ4NL => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K
            | GgmlType::IQ4XS => QK_K,
        }
    }

    /// Bytes in one block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::Q8K => 292,
            GgmlType::IQ4NL => 18,
            GgmlType::IQ4XS => 136,
        }
    }

    /// Bytes for `elems` elements, or `None` when `elems` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let per = self.block_elems() as u64;
        if !elems.is_multiple_of(per) {
            return None;
        }
        (elems / per).checked_mul(self.block_bytes() as u64)
    }

    /// Whether the type is a block-quantized format (not a plain float).
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// The lower-case name llama.cpp prints (`q4_0`, `q6_k`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q8_1 => "q8_1",
            GgmlType::Q2K => "q2_k",
            GgmlType::Q3K => "q3_k",
            GgmlType::Q4K => "q4_k",
            GgmlType::Q5K => "q5_k",
            GgmlType::Q6K => "q6_k",
            GgmlType::Q8K => "q8_k",
            GgmlType::IQ4NL => "iq4_nl",
            GgmlType::IQ4XS => "iq4_xs",
            GgmlType::BF16 => "bf16",
        }
    }

    /// The type with this lower-case name (as accepted on command lines).
    pub fn from_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        Self::ALL.into_iter().find(|t| t.name() == lower)
    }
}

/// ggml's name for a type id that [`GgmlType::from_id`] rejects, so errors can say which
/// format a file uses (`iq2_xxs`, `tq1_0`); `unknown type` for ids ggml never assigned.
pub fn unsupported_type_name(id: u32) -> &'static str {
    match id {
        4 => "q4_2 (removed from ggml)",
        5 => "q4_3 (removed from ggml)",
        16 => "iq2_xxs",
        17 => "iq2_xs",
        18 => "iq3_xxs",
        19 => "iq1_s",
        21 => "iq3_s",
        22 => "iq2_s",
        24 => "i8",
        25 => "i16",
        26 => "i32",
        27 => "i64",
        28 => "f64",
        29 => "iq1_m",
        31..=33 => "q4_0_4_4/q4_0_4_8/q4_0_8_8 (removed from ggml)",
        34 => "tq1_0",
        35 => "tq2_0",
        36..=38 => "iq4_nl_4_4/iq4_nl_4_8/iq4_nl_8_8 (removed from ggml)",
        39 => "mxfp4",
        40 => "nvfp4",
        41 => "q1_0",
        _ => "unknown type",
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_rejected() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
        // IQ2_XXS, IQ3_S: lattice i-quants this crate does not decode.
        assert_eq!(GgmlType::from_id(16), None);
        assert_eq!(GgmlType::from_id(21), None);
        assert_eq!(GgmlType::from_id(20), Some(GgmlType::IQ4NL));
        assert_eq!(GgmlType::from_id(23), Some(GgmlType::IQ4XS));
    }

    #[test]
    fn sizes_need_whole_blocks() {
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
        assert_eq!(GgmlType::Q6K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::IQ4NL.bytes_for(64), Some(36));
        assert_eq!(GgmlType::IQ4XS.bytes_for(512), Some(272));
        assert_eq!(GgmlType::IQ4XS.bytes_for(32), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
