//! The cuda backend's knobs, read from the environment in one place and handed to
//! [`super::CudaBackend::with_tuning`]: nothing under `cuda/` reads the environment itself,
//! so a binary decides them once and a test can set them without touching the process's
//! environment.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::cache_dir::cache_root_from;

/// Knobs that choose which kernels run and where compiled kernels are kept; none changes
/// what a result means. [`CudaTuning::default`] is what an empty environment gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaTuning {
    /// Programmatic dependent launches on compute capability 9.0 and later: each kernel's
    /// blocks start while the one before finishes (`TETHER_PDL=0` turns them off).
    pub dependent_launches: bool,
    /// Prefill attention on the tensor-core flash kernels where the device can run them
    /// (`TETHER_FLASH_ATTENTION=0` turns them off).
    pub flash_attention: bool,
    /// Tokens from which matrix-vector products use tensor cores, instead of the measured
    /// default (`TETHER_MMA_MIN_TOKENS`, > 0).
    pub mma_min_tokens: Option<usize>,
    /// Tokens from which products take the GEMM, instead of the measured defaults
    /// (`TETHER_GEMM_MIN_TOKENS`; raised to 9, the smallest batch the GEMM is tested at).
    pub gemm_min_tokens: Option<usize>,
    /// Batches of 9-32 tokens (by weight type) to this many take the products from the
    /// quantized blocks (mmq.rs), instead of the measured default, 64 (`TETHER_MMQ=N`; 0 turns them off).
    pub mmq_max_tokens: Option<usize>,
    /// The GEMM decodes the weight types it can read in its own tiles, skipping the f16
    /// workspace (`TETHER_GEMM_FUSED=0` turns that off).
    pub fused_gemm: bool,
    /// Tokens from which mixture-of-experts prefill takes the GEMM's tile kernels, instead
    /// of the measured default (`TETHER_MOE_TILE_MIN_TOKENS`; raised to 9, so decode batches
    /// keep their kernels).
    pub moe_tile_min_tokens: Option<usize>,
    /// Blocks per multiprocessor the 8-bit products split K until they fill, instead of
    /// the measured default (`TETHER_MMQ_BLOCKS`, > 0).
    pub mmq_blocks_per_sm: Option<usize>,
    /// Where compiled kernels are cached on disk: `kernels` under the cache root
    /// ([`crate::cache_dir`]); `None` compiles every time.
    pub kernel_cache: Option<PathBuf>,
    /// A folder whose `NAME.cu` and `common.cuh` replace the built-in kernel sources of
    /// the same names (`TETHER_KERNEL_SOURCES`): kernel variants can be compared on a GPU
    /// machine without building the binary again. Entry points must keep their names.
    pub kernel_sources: Option<PathBuf>,
}

/// The smallest batch the GEMM is tested from, as it was first used.
const GEMM_TESTED_FROM: usize = 9;

impl Default for CudaTuning {
    fn default() -> Self {
        Self::from_vars(|_| None)
    }
}

impl CudaTuning {
    /// The knobs as the process's environment sets them.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// The knobs as `var` (an environment lookup) sets them. A count that is not a
    /// positive number is ignored, as an unset one is.
    fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let off = |name: &str| var(name).is_some_and(|v| v == "0");
        let tokens = |name: &str| {
            var(name)
                .and_then(|v| v.to_str()?.parse::<usize>().ok())
                .filter(|&n| n > 0)
        };
        let cache_root = cache_root_from(&var);
        Self {
            dependent_launches: !off("TETHER_PDL"),
            flash_attention: !off("TETHER_FLASH_ATTENTION"),
            mma_min_tokens: tokens("TETHER_MMA_MIN_TOKENS"),
            gemm_min_tokens: tokens("TETHER_GEMM_MIN_TOKENS").map(|n| n.max(GEMM_TESTED_FROM)),
            mmq_max_tokens: var("TETHER_MMQ").and_then(|v| v.to_str()?.trim().parse().ok()),
            fused_gemm: !off("TETHER_GEMM_FUSED"),
            moe_tile_min_tokens: tokens("TETHER_MOE_TILE_MIN_TOKENS")
                .map(|n| n.max(GEMM_TESTED_FROM)),
            mmq_blocks_per_sm: tokens("TETHER_MMQ_BLOCKS"),
            kernel_cache: cache_root.map(|root| root.join("kernels")),
            kernel_sources: var("TETHER_KERNEL_SOURCES")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn tuning(vars: &[(&str, &str)]) -> CudaTuning {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| ((*k).to_string(), OsString::from(v)))
            .collect();
        CudaTuning::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn an_empty_environment_turns_everything_on_with_measured_defaults() {
        let t = tuning(&[]);
        assert!(t.dependent_launches && t.flash_attention && t.fused_gemm);
        assert_eq!((t.mma_min_tokens, t.gemm_min_tokens), (None, None));
        assert_eq!((&t.kernel_cache, &t.kernel_sources), (&None, &None));
        assert_eq!(t, CudaTuning::default());
    }

    #[test]
    fn each_variable_sets_its_knob() {
        let t = tuning(&[
            ("TETHER_PDL", "0"),
            ("TETHER_FLASH_ATTENTION", "0"),
            ("TETHER_MMA_MIN_TOKENS", "3"),
            ("TETHER_GEMM_MIN_TOKENS", "65"),
            ("TETHER_CACHE", "/var/cache/t"),
            ("TETHER_KERNEL_SOURCES", "/src/kernels"),
            ("TETHER_MMQ_BLOCKS", "4"),
            ("TETHER_GEMM_FUSED", "0"),
            ("TETHER_MOE_TILE_MIN_TOKENS", "4"),
            ("HOME", "/home/x"),
        ]);
        assert!(!t.dependent_launches && !t.flash_attention && !t.fused_gemm);
        assert_eq!(t.moe_tile_min_tokens, Some(GEMM_TESTED_FROM));
        assert_eq!(t.mmq_blocks_per_sm, Some(4));
        assert_eq!((t.mma_min_tokens, t.gemm_min_tokens), (Some(3), Some(65)));
        assert_eq!(t.kernel_cache, Some(PathBuf::from("/var/cache/t/kernels")));
        assert_eq!(t.kernel_sources, Some(PathBuf::from("/src/kernels")));
    }

    #[test]
    fn bad_counts_are_ignored_and_the_gemm_starts_where_it_is_tested() {
        let t = tuning(&[
            ("TETHER_MMA_MIN_TOKENS", "0"),
            ("TETHER_GEMM_MIN_TOKENS", "2"),
            ("TETHER_PDL", "1"),
            ("HOME", "/home/x"),
        ]);
        assert!(t.dependent_launches);
        assert_eq!((t.mma_min_tokens, t.gemm_min_tokens), (None, Some(9)));
        assert_eq!(
            t.kernel_cache,
            Some(PathBuf::from("/home/x/.cache/tether/kernels"))
        );
        assert_eq!(
            tuning(&[("TETHER_MMA_MIN_TOKENS", "lots")]).mma_min_tokens,
            None
        );
    }

    #[test]
    fn tether_mmq_sets_the_largest_mmq_batch_and_zero_turns_it_off() {
        let mmq = |v| tuning(&[("TETHER_MMQ", v)]).mmq_max_tokens;
        assert_eq!(mmq("256"), Some(256));
        assert_eq!(mmq(" 64 "), Some(64));
        assert_eq!(mmq("0"), Some(0));
        assert_eq!(mmq("many"), None);
        assert_eq!(tuning(&[]).mmq_max_tokens, None);
        assert_eq!(
            tuning(&[("TETHER_MMQ_BLOCKS", "0")]).mmq_blocks_per_sm,
            None
        );
    }
}
