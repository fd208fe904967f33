//! Kernel sources (CUDA C in the repo's `kernels/`), compiled by NVRTC for the device's
//! compute capability and cached on disk as PTX.
//!
//! The cache key is a hash of the source, the architecture and the NVRTC version, so a
//! changed kernel, another GPU or another NVRTC never picks up a stale entry. A missing,
//! unreadable or corrupt entry is recompiled; failing to write the cache is not an error.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use super::ptx_cache::{fnv1a, store};
use crate::backend::Result;
use crate::cuda::device::driver_err;
use crate::error::ComputeError;

/// Text prepended to every kernel file (NVRTC gets no include path).
const COMMON: &str = include_str!("../../../../kernels/common.cuh");

/// One kernel file: its name (for messages and cache files), source and entry points.
struct KernelFile {
    name: &'static str,
    source: &'static str,
    entries: &'static [&'static str],
    /// Whether every entry begins with `PDL_ENTRY` (or waits before touching memory that
    /// other kernels use), so it may be launched as a programmatic dependent launch.
    dependent_launch: bool,
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

const FILES: &[KernelFile] = &[
    KernelFile {
        name: "matvec",
        source: include_str!("../../../../kernels/matvec.cu"),
        dependent_launch: true,
        entries: MATVEC_ENTRIES,
    },
    KernelFile {
        name: "matvec_more",
        source: include_str!("../../../../kernels/matvec_more.cu"),
        dependent_launch: true,
        entries: MATVEC_MORE_ENTRIES,
    },
    KernelFile {
        name: "matvec_packed",
        source: include_str!("../../../../kernels/matvec_packed.cu"),
        dependent_launch: true,
        entries: MATVEC_PACKED_ENTRIES,
    },
    KernelFile {
        name: "matvec_mma",
        source: include_str!("../../../../kernels/matvec_mma.cu"),
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
        source: include_str!("../../../../kernels/matvec_kquant.cu"),
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
        source: include_str!("../../../../kernels/elementwise.cu"),
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
        source: include_str!("../../../../kernels/moe.cu"),
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
        source: include_str!("../../../../kernels/select.cu"),
        dependent_launch: true,
        entries: &["top_rows", "score_rows"],
    },
    KernelFile {
        name: "attention",
        source: include_str!("../../../../kernels/attention.cu"),
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
        source: include_str!("../../../../kernels/attention_prefill.cu"),
        dependent_launch: true,
        entries: &[
            "attention_prefill_64",
            "attention_prefill_96",
            "attention_prefill_128",
        ],
    },
    KernelFile {
        name: "attention_flash",
        source: include_str!("../../../../kernels/attention_flash.cu"),
        dependent_launch: true,
        entries: super::attention_flash::ENTRIES,
    },
    KernelFile {
        name: "mmq",
        source: include_str!("../../../../kernels/mmq.cu"),
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
        ],
    },
    KernelFile {
        name: "gemm",
        source: include_str!("../../../../kernels/gemm.cu"),
        dependent_launch: false,
        entries: &[
            "gemm_dequant_f16",
            "gemm_x_f16",
            "gemm_f16",
            "gemm_f16_wide",
            "gemm_reduce",
        ],
    },
];

/// A loaded kernel entry point and whether it may be launched as a programmatic
/// dependent launch.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub(crate) function: CudaFunction,
    pub(crate) dependent_launch: bool,
}

/// Every kernel entry point, loaded into the backend's context.
pub(crate) struct Kernels {
    functions: HashMap<&'static str, Kernel>,
}

impl Kernels {
    /// Compiles (or reads from the disk cache) and loads every kernel file for compute
    /// capability `cc` (`(9, 0)` for an H100), caching compiled files in `dir`.
    pub(crate) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32), dir: Option<&Path>) -> Result<Self> {
        let nvrtc = nvrtc_version()?;
        // Each file compiles on its own thread: NVRTC takes seconds to minutes a file, and a
        // machine's first start (an empty cache) would otherwise pay them one after another.
        let compiled: Vec<Result<(String, bool)>> = std::thread::scope(|scope| {
            let jobs: Vec<_> = FILES
                .iter()
                .map(|file| scope.spawn(move || module_ptx(file, cc, nvrtc, dir, true)))
                .collect();
            jobs.into_iter()
                .map(|job| {
                    job.join().unwrap_or_else(|_| {
                        Err(ComputeError::Device(
                            "a kernel compile thread panicked".to_string(),
                        ))
                    })
                })
                .collect()
        });
        let mut functions = HashMap::new();
        for (file, compiled) in FILES.iter().zip(compiled) {
            let load_err = |e| {
                driver_err(
                    &format!(
                        "loading kernel module {} (PTX from NVRTC {}.{}) for sm_{}{}; \
                         the driver may be older than NVRTC",
                        file.name, nvrtc.0, nvrtc.1, cc.0, cc.1
                    ),
                    e,
                )
            };
            let (ptx, cached) = compiled?;
            let module = match ctx.load_module(Ptx::from_src(ptx)) {
                Ok(m) => m,
                // A cache entry the driver rejects is treated like a corrupt one.
                Err(_) if cached => {
                    let (ptx, _) = module_ptx(file, cc, nvrtc, dir, false)?;
                    ctx.load_module(Ptx::from_src(ptx)).map_err(load_err)?
                }
                Err(e) => return Err(load_err(e)),
            };
            for &entry in file.entries {
                let f = module.load_function(entry).map_err(|e| {
                    driver_err(&format!("finding kernel {entry} in {}", file.name), e)
                })?;
                let kernel = Kernel {
                    function: f,
                    dependent_launch: file.dependent_launch,
                };
                functions.insert(entry, kernel);
            }
        }
        Ok(Self { functions })
    }

    /// The entry point `name` (one of the names listed in `FILES`).
    pub(crate) fn get(&self, name: &str) -> Result<&Kernel> {
        self.functions.get(name).ok_or_else(|| {
            ComputeError::Device(format!("kernel {name} was not loaded; this is a bug"))
        })
    }
}

/// NVRTC's (major, minor) version; fails clearly when libnvrtc cannot be loaded.
fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(ComputeError::Unavailable(
            "NVRTC (libnvrtc.so) was not found, and the CUDA backend compiles its kernels \
             with it: install the CUDA toolkit's NVRTC or add its lib directory to \
             LD_LIBRARY_PATH"
                .to_string(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both pointers are valid for the call.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(ComputeError::Unavailable(format!(
            "asking NVRTC for its version failed ({status:?})"
        )));
    }
    Ok((major, minor))
}

/// The name of the cache entry of `file` for this architecture and NVRTC.
fn cache_name(file: &KernelFile, cc: (i32, i32), nvrtc: (i32, i32)) -> String {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let version = format!("nvrtc{}.{}", nvrtc.0, nvrtc.1);
    let hash = fnv1a(&[
        COMMON.as_bytes(),
        file.source.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
    ]);
    format!("{}-{hash:016x}-{arch}-{version}.ptx", file.name)
}

/// A PTX text that looks whole: NVRTC's output always declares `.version` and the entries.
fn plausible_ptx(text: &str, file: &KernelFile) -> bool {
    !text.contains('\0')
        && text.contains(".version")
        && file.entries.iter().all(|e| text.contains(e))
}

/// The PTX of `file` and whether it came from the cache: from the cache when `use_cache`
/// and a valid entry exists, else compiled (and written to the cache).
fn module_ptx(
    file: &KernelFile,
    cc: (i32, i32),
    nvrtc: (i32, i32),
    dir: Option<&Path>,
    use_cache: bool,
) -> Result<(String, bool)> {
    let path = dir.map(|d| d.join(cache_name(file, cc, nvrtc)));
    if use_cache
        && let Some(text) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok())
        && plausible_ptx(&text, file)
    {
        return Ok((text, true));
    }
    let source = format!("{COMMON}\n{}", file.source);
    let opts = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
            "--std=c++17".to_string(),
        ],
        name: Some(format!("{}.cu", file.name)),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(&source, opts).map_err(|e| ComputeError::Compile {
        what: format!(
            "NVRTC {}.{} failed to compile kernels/{}.cu for sm_{}{}",
            nvrtc.0, nvrtc.1, file.name, cc.0, cc.1
        ),
        source: e,
    })?;
    let text = ptx.to_src();
    if let (Some(path), Some(dir)) = (path, dir) {
        store(dir, &path, &text);
    }
    Ok((text, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_names_change_with_arch_and_nvrtc() {
        let f = &FILES[0];
        let a = cache_name(f, (9, 0), (12, 8));
        assert_ne!(a, cache_name(f, (8, 0), (12, 8)));
        assert_ne!(a, cache_name(f, (9, 0), (13, 0)));
        assert!(a.starts_with("matvec-") && a.ends_with("-sm_90-nvrtc12.8.ptx"));
    }

    #[test]
    fn hash_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn truncated_or_foreign_ptx_is_rejected() {
        let f = &FILES[1];
        let good = format!(".version 8.0\n{}", f.entries.join("\n"));
        assert!(plausible_ptx(&good, f));
        assert!(!plausible_ptx(&good[..good.len() - 3], f));
        assert!(!plausible_ptx(&format!("{good}\0"), f));
        assert!(!plausible_ptx("garbage", f));
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
                // 8-bit products: MMQ_ENTRY(name, type id).
                if e.starts_with("mmq_") {
                    let defined = f.source.contains(&format!("MMQ_ENTRY({e}, "));
                    assert!(defined, "{e} not found in {}", f.name);
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
