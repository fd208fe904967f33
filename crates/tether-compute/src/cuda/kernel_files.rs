//! The kernel files (CUDA C in the repo's `kernels/`) and the entry points each defines:
//! what [`super::compile`] compiles and loads.

/// The kernel sources, by file: what NVRTC compiles, and where the launch constants the
/// Rust side needs are read from ([`define`]), so the two sides cannot disagree.
pub(super) mod source {
    /// Text prepended to every kernel file (NVRTC gets no include path).
    pub(in crate::cuda) const COMMON: &str = include_str!("../../../../kernels/common.cuh");
    pub(in crate::cuda) const MATVEC: &str = include_str!("../../../../kernels/matvec.cu");
    pub(in crate::cuda) const MATVEC_MORE: &str =
        include_str!("../../../../kernels/matvec_more.cu");
    pub(in crate::cuda) const MATVEC_PACKED: &str =
        include_str!("../../../../kernels/matvec_packed.cu");
    pub(in crate::cuda) const MATVEC_MMA: &str = include_str!("../../../../kernels/matvec_mma.cu");
    pub(in crate::cuda) const MATVEC_KQUANT: &str =
        include_str!("../../../../kernels/matvec_kquant.cu");
    pub(in crate::cuda) const ELEMENTWISE: &str =
        include_str!("../../../../kernels/elementwise.cu");
    pub(in crate::cuda) const MOE: &str = include_str!("../../../../kernels/moe.cu");
    pub(in crate::cuda) const SELECT: &str = include_str!("../../../../kernels/select.cu");
    pub(in crate::cuda) const ATTENTION: &str = include_str!("../../../../kernels/attention.cu");
    pub(in crate::cuda) const ATTENTION_PREFILL: &str =
        include_str!("../../../../kernels/attention_prefill.cu");
    pub(in crate::cuda) const ATTENTION_FLASH: &str =
        include_str!("../../../../kernels/attention_flash.cu");
    pub(in crate::cuda) const MMQ: &str = include_str!("../../../../kernels/mmq.cu");
    pub(in crate::cuda) const GEMM: &str = include_str!("../../../../kernels/gemm.cu");
    /// gemm.cu with the MoE products on its tile kernel after it (kernels/moe_gemm.cu):
    /// one module, so the MoE entries reuse the tile code without a second copy of it.
    pub(in crate::cuda) const GEMM_WITH_MOE: &str = concat!(
        include_str!("../../../../kernels/gemm.cu"),
        include_str!("../../../../kernels/moe_gemm.cu")
    );
}

/// The value of `#define name <integer>` at the start of a line of `source`, evaluated when
/// the crate compiles: a constant that must equal one of the kernels' is read from the
/// kernel's source instead of copied, and a missing or non-literal definition fails the
/// build.
pub(super) const fn define(source: &str, name: &str) -> usize {
    const PREFIX: &[u8] = b"#define ";
    let (s, n) = (source.as_bytes(), name.as_bytes());
    let mut line = 0;
    while line < s.len() {
        if starts_with_at(s, line, PREFIX) && starts_with_at(s, line + PREFIX.len(), n) {
            let mut i = line + PREFIX.len() + n.len();
            if i < s.len() && (s[i] == b' ' || s[i] == b'\t') {
                while i < s.len() && (s[i] == b' ' || s[i] == b'\t') {
                    i += 1;
                }
                let (mut value, digits_from) = (0usize, i);
                while i < s.len() && s[i].is_ascii_digit() {
                    value = value * 10 + (s[i] - b'0') as usize;
                    i += 1;
                }
                assert!(i > digits_from, "the #define is not an integer literal");
                return value;
            }
        }
        while line < s.len() && s[line] != b'\n' {
            line += 1;
        }
        line += 1;
    }
    panic!("no such #define in the kernel source")
}

/// Whether `s[at..]` begins with `prefix`.
const fn starts_with_at(s: &[u8], at: usize, prefix: &[u8]) -> bool {
    if at + prefix.len() > s.len() {
        return false;
    }
    let mut k = 0;
    while k < prefix.len() {
        if s[at + k] != prefix[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// One kernel file: its name (for messages and cache files), source and entry points.
pub(super) struct KernelFile {
    pub(super) name: &'static str,
    pub(super) source: &'static str,
    pub(super) entries: &'static [&'static str],
    /// Whether every entry begins with `PDL_ENTRY` (or waits before touching memory that
    /// other kernels use), so it may be launched as a programmatic dependent launch.
    pub(super) dependent_launch: bool,
}

const MATVEC_ENTRIES: &[&str] = &[
    "matvec_f32_1",
    "matvec_f32_2",
    "matvec_f32_4",
    "matvec_f32_8",
    "matvec_f16_1",
    "matvec_f16_2",
    "matvec_f16_4",
    "matvec_f16_8",
    "matvec_bf16_1",
    "matvec_bf16_2",
    "matvec_bf16_4",
    "matvec_bf16_8",
    "matvec_q4_0_1",
    "matvec_q4_0_2",
    "matvec_q4_0_4",
    "matvec_q4_0_8",
    "matvec_q8_0_1",
    "matvec_q8_0_2",
    "matvec_q8_0_4",
    "matvec_q8_0_8",
    "matvec_q4_k_1",
    "matvec_q4_k_2",
    "matvec_q4_k_4",
    "matvec_q4_k_8",
    "matvec_q5_k_1",
    "matvec_q5_k_2",
    "matvec_q5_k_4",
    "matvec_q5_k_8",
    "matvec_q6_k_1",
    "matvec_q6_k_2",
    "matvec_q6_k_4",
    "matvec_q6_k_8",
    "quantize_q8",
    "matvecq_q4_0_1",
    "matvecq_q4_0_2",
    "matvecq_q4_0_4",
    "matvecq_q4_0_8",
    "matvecq3_q4_0_1",
    "matvecq3_q4_0_2",
    "matvecq3_q4_0_4",
    "matvecq3_q4_0_8",
    "matvecq_swiglu_q4_0_1",
    "matvecq_swiglu_q4_0_2",
    "matvecq_swiglu_q4_0_4",
    "matvecq_swiglu_q4_0_8",
];

/// The f32-activation products of the less common weight types (kernels/matvec_more.cu).
const MATVEC_MORE_ENTRIES: &[&str] = &[
    "matvec_q4_1_1",
    "matvec_q4_1_2",
    "matvec_q4_1_4",
    "matvec_q4_1_8",
    "matvec_q5_0_1",
    "matvec_q5_0_2",
    "matvec_q5_0_4",
    "matvec_q5_0_8",
    "matvec_q5_1_1",
    "matvec_q5_1_2",
    "matvec_q5_1_4",
    "matvec_q5_1_8",
    "matvec_q8_1_1",
    "matvec_q8_1_2",
    "matvec_q8_1_4",
    "matvec_q8_1_8",
    "matvec_q2_k_1",
    "matvec_q2_k_2",
    "matvec_q2_k_4",
    "matvec_q2_k_8",
    "matvec_q3_k_1",
    "matvec_q3_k_2",
    "matvec_q3_k_4",
    "matvec_q3_k_8",
    "matvec_q8_k_1",
    "matvec_q8_k_2",
    "matvec_q8_k_4",
    "matvec_q8_k_8",
    "matvec_iq4_nl_1",
    "matvec_iq4_nl_2",
    "matvec_iq4_nl_4",
    "matvec_iq4_nl_8",
    "matvec_iq4_xs_1",
    "matvec_iq4_xs_2",
    "matvec_iq4_xs_4",
    "matvec_iq4_xs_8",
];

const MATVEC_PACKED_ENTRIES: &[&str] = &[
    "matvecp_q4_0_1",
    "matvecp3_q4_0_1",
    "matvecp_swiglu_q4_0_1",
    "matvecp_q4_0_2",
    "matvecp3_q4_0_2",
    "matvecp_swiglu_q4_0_2",
    "matvecp_q4_0_4",
    "matvecp3_q4_0_4",
    "matvecp_swiglu_q4_0_4",
    "matvecp_q4_0_8",
    "matvecp3_q4_0_8",
    "matvecp_swiglu_q4_0_8",
    "matvecp_q8_0_1",
    "matvecp3_q8_0_1",
    "matvecp_swiglu_q8_0_1",
    "matvecp_q8_0_2",
    "matvecp3_q8_0_2",
    "matvecp_swiglu_q8_0_2",
    "matvecp_q8_0_4",
    "matvecp3_q8_0_4",
    "matvecp_swiglu_q8_0_4",
    "matvecp_q8_0_8",
    "matvecp3_q8_0_8",
    "matvecp_swiglu_q8_0_8",
    "pack_q4_0",
    "pack_q8_0",
    "moep_swiglu_q4_0_1",
    "moep_down_q4_0_1",
    "moep_swiglu_q4_0_8",
    "moep_down_q4_0_8",
    "moep_swiglu_q8_0_1",
    "moep_down_q8_0_1",
    "moep_swiglu_q8_0_8",
    "moep_down_q8_0_8",
];

pub(super) const FILES: &[KernelFile] = &[
    KernelFile {
        name: "matvec",
        source: source::MATVEC,
        dependent_launch: true,
        entries: MATVEC_ENTRIES,
    },
    KernelFile {
        name: "matvec_more",
        source: source::MATVEC_MORE,
        dependent_launch: true,
        entries: MATVEC_MORE_ENTRIES,
    },
    KernelFile {
        name: "matvec_packed",
        source: source::MATVEC_PACKED,
        dependent_launch: true,
        entries: MATVEC_PACKED_ENTRIES,
    },
    KernelFile {
        name: "matvec_mma",
        source: source::MATVEC_MMA,
        dependent_launch: true,
        entries: &[
            "matvec_mma_q4_0_8",
            "matvec_mma_q4_0_16",
            "matvec_mma_q4_0_32",
            "matvec_mma_q8_0_8",
            "matvec_mma_q8_0_16",
            "matvec_mma_q8_0_32",
            "moemma_swiglu_q4_k_32",
            "moemma_down_q4_k_32",
        ],
    },
    KernelFile {
        name: "matvec_kquant",
        source: source::MATVEC_KQUANT,
        dependent_launch: true,
        entries: &[
            "matveck_q4_k_1",
            "matveck3_q4_k_1",
            "matveck_swiglu_q4_k_1",
            "matveck_q4_k_2",
            "matveck3_q4_k_2",
            "matveck_swiglu_q4_k_2",
            "matveck_q4_k_4",
            "matveck3_q4_k_4",
            "matveck_swiglu_q4_k_4",
            "matveck_q4_k_8",
            "matveck3_q4_k_8",
            "matveck_swiglu_q4_k_8",
            "matveck_q5_k_1",
            "matveck3_q5_k_1",
            "matveck_swiglu_q5_k_1",
            "matveck_q5_k_2",
            "matveck3_q5_k_2",
            "matveck_swiglu_q5_k_2",
            "matveck_q5_k_4",
            "matveck3_q5_k_4",
            "matveck_swiglu_q5_k_4",
            "matveck_q5_k_8",
            "matveck3_q5_k_8",
            "matveck_swiglu_q5_k_8",
            "matveck_q6_k_1",
            "matveck3_q6_k_1",
            "matveck_swiglu_q6_k_1",
            "matveck_q6_k_2",
            "matveck3_q6_k_2",
            "matveck_swiglu_q6_k_2",
            "matveck_q6_k_4",
            "matveck3_q6_k_4",
            "matveck_swiglu_q6_k_4",
            "matveck_q6_k_8",
            "matveck3_q6_k_8",
            "matveck_swiglu_q6_k_8",
            "matveck_iq4_xs_1",
            "matveck3_iq4_xs_1",
            "matveck_swiglu_iq4_xs_1",
            "matveck_iq4_xs_2",
            "matveck3_iq4_xs_2",
            "matveck_swiglu_iq4_xs_2",
            "matveck_iq4_xs_4",
            "matveck3_iq4_xs_4",
            "matveck_swiglu_iq4_xs_4",
            "matveck_iq4_xs_8",
            "matveck3_iq4_xs_8",
            "matveck_swiglu_iq4_xs_8",
            "matveck_q3_k_1",
            "matveck3_q3_k_1",
            "matveck_swiglu_q3_k_1",
            "matveck_q3_k_2",
            "matveck3_q3_k_2",
            "matveck_swiglu_q3_k_2",
            "matveck_q3_k_4",
            "matveck3_q3_k_4",
            "matveck_swiglu_q3_k_4",
            "matveck_q3_k_8",
            "matveck3_q3_k_8",
            "matveck_swiglu_q3_k_8",
            "matveck3_q4_k_q6_k_1",
            "matveck3_q4_k_q6_k_2",
            "matveck3_q4_k_q6_k_4",
            "matveck3_q4_k_q6_k_8",
            "matveck3_q5_k_q6_k_1",
            "matveck3_q5_k_q6_k_2",
            "matveck3_q5_k_q6_k_4",
            "matveck3_q5_k_q6_k_8",
            "matveck3_q3_k_q4_k_1",
            "matveck3_q3_k_q4_k_2",
            "matveck3_q3_k_q4_k_4",
            "matveck3_q3_k_q4_k_8",
            "matveck3_q3_k_q5_k_1",
            "matveck3_q3_k_q5_k_2",
            "matveck3_q3_k_q5_k_4",
            "matveck3_q3_k_q5_k_8",
            "matveck3_iq4_xs_q5_k_1",
            "matveck3_iq4_xs_q5_k_2",
            "matveck3_iq4_xs_q5_k_4",
            "matveck3_iq4_xs_q5_k_8",
            "pack_q3_k",
            "pack_iq4_xs",
            "pack_q6_k",
            "moek_swiglu_q4_k_1",
            "moek_down_q4_k_1",
            "moek_swiglu_q4_k_8",
            "moek_down_q4_k_8",
            "moek_swiglu_q5_k_1",
            "moek_down_q5_k_1",
            "moek_swiglu_q5_k_8",
            "moek_down_q5_k_8",
            "moek_swiglu_q6_k_1",
            "moek_down_q6_k_1",
            "moek_swiglu_q6_k_8",
            "moek_down_q6_k_8",
            "moek_swiglu_iq4_xs_1",
            "moek_down_iq4_xs_1",
            "moek_swiglu_iq4_xs_8",
            "moek_down_iq4_xs_8",
            "moek_swiglu_q3_k_1",
            "moek_down_q3_k_1",
            "moek_swiglu_q3_k_8",
            "moek_down_q3_k_8",
            "moek_swiglu_q6_k_gguf_1",
            "moek_down_q6_k_gguf_1",
            "moek_swiglu_q6_k_gguf_8",
            "moek_down_q6_k_gguf_8",
        ],
    },
    KernelFile {
        name: "elementwise",
        source: source::ELEMENTWISE,
        dependent_launch: true,
        entries: &[
            "rms_norm",
            "rms_norm_q8",
            "swiglu",
            "geglu",
            "scale",
            "softcap",
            "add",
            "add_bias",
            "rope",
            "rope_store_f16",
            "get_rows",
            "argmax_rows",
            "copy_in",
        ],
    },
    KernelFile {
        name: "moe",
        source: source::MOE,
        dependent_launch: true,
        entries: &[
            "moe_route",
            "moe_gate_up",
            "moe_down",
            "moe_sum",
            "moe_group",
            "moe_gather_q8",
        ],
    },
    KernelFile {
        name: "select",
        source: source::SELECT,
        dependent_launch: true,
        entries: &["top_rows", "score_rows"],
    },
    KernelFile {
        name: "attention",
        source: source::ATTENTION,
        dependent_launch: true,
        entries: &[
            "kv_store_f16",
            "kv_store_quant",
            "attention",
            "attention_f16v",
            "attention_merge",
            "attention_merge_q8",
        ],
    },
    KernelFile {
        name: "attention_prefill",
        source: source::ATTENTION_PREFILL,
        dependent_launch: true,
        entries: &[
            "attention_prefill_64",
            "attention_prefill_96",
            "attention_prefill_128",
        ],
    },
    KernelFile {
        name: "attention_flash",
        source: source::ATTENTION_FLASH,
        dependent_launch: true,
        entries: super::attention_flash::ENTRIES,
    },
    KernelFile {
        name: "mmq",
        source: source::MMQ,
        dependent_launch: false,
        entries: &[
            "mmq_q4_0",
            "mmq_q4_0p",
            "mmq_q8_0",
            "mmq_q8_0p",
            "mmq_q4_k",
            "mmq_q5_k",
            "mmq_q6_k",
            "mmq_q6_kp",
            "mmq_iq4_xs",
            "mmq_iq4_xsp",
            "mmq_tokens_f16",
        ],
    },
    KernelFile {
        name: "gemm",
        source: source::GEMM_WITH_MOE,
        dependent_launch: true,
        entries: &[
            "gemm_dequant_f16",
            "gemm_x_f16",
            "gemm_f16",
            "gemm_f16_wide",
            "gemm_reduce",
            "gemm_reduce3",
            "gemm_reduce_gated",
            "gemmq_q4_0p",
            "gemmq_q8_0p",
            "gemmq_q4_k",
            "gemmq_q5_k",
            "gemmq_q6_kp",
            "gemmq_iq4_xsp",
            "gemmq_q4_0p_n32",
            "gemmq_q4_0p_n64",
            "gemmq_q8_0p_n32",
            "gemmq_q8_0p_n64",
            "gemmq_q4_k_n32",
            "gemmq_q4_k_n64",
            "gemmq_q5_k_n32",
            "gemmq_q5_k_n64",
            "gemmq_q6_kp_n32",
            "gemmq_q6_kp_n64",
            "gemmq_iq4_xsp_n32",
            "gemmq_iq4_xsp_n64",
            "moe_gather_f16",
            "moe_act_f16",
            "moeg_swiglu_q4_0p_n32",
            "moeg_down_q4_0p_n32",
            "moeg_swiglu_q4_0p_n64",
            "moeg_down_q4_0p_n64",
            "moeg_swiglu_q8_0p_n32",
            "moeg_down_q8_0p_n32",
            "moeg_swiglu_q8_0p_n64",
            "moeg_down_q8_0p_n64",
            "moeg_swiglu_q4_k_n32",
            "moeg_down_q4_k_n32",
            "moeg_swiglu_q4_k_n64",
            "moeg_down_q4_k_n64",
            "moeg_swiglu_q5_k_n32",
            "moeg_down_q5_k_n32",
            "moeg_swiglu_q5_k_n64",
            "moeg_down_q5_k_n64",
            "moeg_swiglu_q6_kp_n32",
            "moeg_down_q6_kp_n32",
            "moeg_swiglu_q6_kp_n64",
            "moeg_down_q6_kp_n64",
            "moeg_swiglu_q6_k_n32",
            "moeg_down_q6_k_n32",
            "moeg_swiglu_q6_k_n64",
            "moeg_down_q6_k_n64",
            "moeg_swiglu_iq4_xsp_n32",
            "moeg_down_iq4_xsp_n32",
            "moeg_swiglu_iq4_xsp_n64",
            "moeg_down_iq4_xsp_n64",
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_are_read_as_integer_literals_at_line_starts() {
        let src = "// #define A 1\n#define AB 7\n#define A\t 42 // why\n#define C (A * 2)\n";
        assert_eq!(define(src, "A"), 42);
        assert_eq!(define(src, "AB"), 7);
        assert!(std::panic::catch_unwind(|| define(src, "C")).is_err());
        assert!(std::panic::catch_unwind(|| define(src, "D")).is_err());
    }

    #[test]
    fn every_entry_is_defined_in_its_file() {
        for f in FILES {
            for e in f.entries {
                // MoE entries: MOE_ENTRIES(prefix, type, ...) defines both kernels and widths.
                let moe = ["moek_", "moep_"].iter().find_map(|p| {
                    let rest = e.strip_prefix(p)?;
                    let rest = rest
                        .strip_prefix("swiglu_")
                        .or(rest.strip_prefix("down_"))?;
                    let ty = rest.rsplit_once('_').map_or(rest, |(t, _)| t);
                    Some(format!("MOE_ENTRIES({}, {ty},", p.trim_end_matches('_')))
                });
                if let Some(mac) = moe {
                    assert!(f.source.contains(&mac), "{e} not found in {}", f.name);
                    continue;
                }
                // Packed entries: PK_ENTRIES_<TYPE>(nt) defines the three kernels of a type.
                let packed = ["matvecp_swiglu_", "matvecp3_", "matvecp_"]
                    .iter()
                    .find_map(|p| e.strip_prefix(p).map(|rest| (p, rest)));
                if let Some((prefix, rest)) = packed {
                    let (ty, nt) = rest.rsplit_once('_').unwrap_or((rest, ""));
                    let mac = format!("PK_ENTRIES_{}({nt})", ty.to_uppercase());
                    let body = format!("{prefix}##ty##_##nt(");
                    assert!(
                        f.source.contains(&mac) && f.source.contains(&body),
                        "{e} not found in {}",
                        f.name
                    );
                    continue;
                }
                // K-quant entries: KQ_ALL(type, ...) defines the four token widths.
                let kquant = ["matveck_swiglu_", "matveck3_", "matveck_"]
                    .iter()
                    .find_map(|p| e.strip_prefix(p));
                if let Some(rest) = kquant {
                    let ty = rest.rsplit_once('_').map_or(rest, |(t, _)| t);
                    let defined = [format!("KQ_ALL({ty},"), format!("KQ3_MIXED_ALL({ty},")]
                        .iter()
                        .any(|mac| f.source.contains(mac.as_str()));
                    assert!(defined, "{e} not found in {}", f.name);
                    continue;
                }
                // Flash-attention entries: FA_ENTRY(head, type, ...) inside FA_TYPES(head).
                if let Some(rest) = e.strip_prefix("flash_attention_") {
                    let (d, ty) = rest.split_once('_').unwrap_or((rest, ""));
                    assert!(
                        f.source.contains(&format!("FA_TYPES({d})"))
                            && f.source.contains(&format!("FA_ENTRY(d, {ty}, ")),
                        "{e} not found in {}",
                        f.name
                    );
                    continue;
                }
                // Tensor-core entries: MQ_ENTRY(type, signedness, tokens).
                if let Some(rest) = e.strip_prefix("matvec_mma_") {
                    let (ty, tokens) = rest.rsplit_once('_').unwrap_or((rest, ""));
                    let defined = f.source.lines().any(|l| {
                        l.starts_with(&format!("MQ_ENTRY({ty},"))
                            && l.ends_with(&format!(", {tokens})"))
                    });
                    assert!(defined, "{e} not found in {}", f.name);
                    continue;
                }
                // Products from the blocks: MMQ_ENTRY(name, type id), or a kernel of its
                // own (the tokens' conversion).
                if e.starts_with("mmq_") {
                    let defined = f.source.contains(&format!("MMQ_ENTRY({e}, "))
                        || f.source.contains(&format!("    {e}("));
                    assert!(defined, "{e} not found in {}", f.name);
                    continue;
                }
                // Tile kernels: GEMM_ENTRY(name, warps, type), and the narrow variants of a
                // decoding one, GEMM_NARROW(name, type).
                if e.starts_with("gemm_f16") || e.starts_with("gemmq_") {
                    let base = e.strip_suffix("_n32").or_else(|| e.strip_suffix("_n64"));
                    let defined = match base {
                        Some(b) => f.source.contains(&format!("GEMM_NARROW({b}, ")),
                        None => f.source.contains(&format!("GEMM_ENTRY({e}, ")),
                    };
                    assert!(defined, "{e} not found in {}", f.name);
                    continue;
                }
                // MoE tile entries: MOEG_ENTRIES(type, ...) defines both kernels and widths.
                if let Some(rest) = e.strip_prefix("moeg_") {
                    let rest = rest
                        .strip_prefix("swiglu_")
                        .or(rest.strip_prefix("down_"))
                        .unwrap_or(rest);
                    let ty = rest.rsplit_once('_').map_or(rest, |(t, _)| t);
                    let mac = format!("MOEG_ENTRIES({ty}, ");
                    assert!(f.source.contains(&mac), "{e} not found in {}", f.name);
                    continue;
                }
                // Matvec entries come from a macro: check the type part is instantiated.
                let fused = [
                    ("matvecq_swiglu_q4_0_", "MVQ_SWIGLU_ENTRY"),
                    ("matvecq3_q4_0_", "MVQ3_ENTRY"),
                ];
                if let Some((n, mac)) = fused
                    .iter()
                    .find_map(|(p, m)| e.strip_prefix(p).map(|n| (n, m)))
                {
                    let entry = format!("{mac}({n})");
                    assert!(f.source.contains(&entry), "{e} not found in {}", f.name);
                    continue;
                }
                let (all, stem) = match e.strip_prefix("matvecq_") {
                    Some(stem) => ("MVQ_ALL", stem),
                    None => ("MV_ALL", e.trim_start_matches("matvec_")),
                };
                let ty = stem.rsplit_once('_').map_or(stem, |(t, _)| t);
                assert!(
                    f.source.contains(&format!("{e}("))
                        || f.source.contains(&format!("{all}({ty})")),
                    "{e} not found in {}",
                    f.name
                );
            }
        }
    }
}
