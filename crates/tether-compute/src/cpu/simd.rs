//! CPU feature detection shared by the cpu backend's SIMD paths.

/// Proof that the CPU supports AVX2, FMA and F16C. Only [`Avx2::detect`] creates one, so a
/// function holding it may call `#[target_feature(enable = "avx2,fma,f16c")]` code.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token when the running CPU has AVX2, FMA and F16C (never on other architectures).
    pub(crate) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let ok = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            ok.then_some(Self(()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }
}

impl Avx2 {
    /// Itself, so code generic over the levels' tokens can ask any of them for AVX2.
    #[cfg(test)]
    pub(crate) fn avx2(self) -> Avx2 {
        self
    }
}

/// Proof that the CPU has AVX-512 F, BW and VL with VNNI, besides everything [`Avx2`]
/// proves: `#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]`
/// code may run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512Vnni(());

impl Avx512Vnni {
    /// The token when the running CPU has every feature named above.
    pub(crate) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let ok = Avx2::detect().is_some()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            ok.then_some(Self(()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }
}

impl Avx512Vnni {
    /// The AVX2 token this one implies.
    pub(crate) fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

/// Proof that the CPU has the VEX-encoded 256-bit VNNI (`avxvnni`) besides everything
/// [`Avx2`] proves.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AvxVnni(());

impl AvxVnni {
    /// The token when the running CPU has AVX2, FMA, F16C and AVX-VNNI.
    pub(crate) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let ok = Avx2::detect().is_some() && is_x86_feature_detected!("avxvnni");
            ok.then_some(Self(()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }
}

impl AvxVnni {
    /// The AVX2 token this one implies.
    pub(crate) fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

/// Sum of the eight lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_ps(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
