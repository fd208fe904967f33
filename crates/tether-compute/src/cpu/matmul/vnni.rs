//! VNNI kernels: `vpdpbusd` adds the products of four u8 × i8 byte pairs into each i32
//! lane in one instruction, where AVX2 needs `maddubs`, `madd` and an add (or sums of
//! `maddubs` in i16), and `vpdpwssd` does `madd` plus the add. The same source is built
//! twice by [`vnni_kernels`]: with the AVX-512 VL encoding (`avx512vnni`) and with the VEX
//! one (`avxvnni`), since a `#[target_feature]` function only inlines intrinsics its own
//! features cover.
//!
//! The vectors are 256 bits, not 512: the panels and four-row tiles of the AVX2 kernels are
//! reused as they are (packed and decoded by the AVX2 code, which inlines here), and Zen 4
//! runs a 512-bit operation as two 256-bit halves anyway, so the gain is in the
//! instructions VNNI fuses, not in width.
//!
//! Every kernel here produces the same i32 lanes as its AVX2 twin and then runs the same
//! float operations in the same order, so results are identical bit for bit across levels.

use std::arch::x86_64::*;

use super::avx2::{
    dot_q8_blocks, dot4_blocks, f16_at, fold4_i32, load_q8, prefetch_ahead, q4_0_offset, scales4,
    unfold4, unpack_q4_0_unsigned, unpack_q8_0,
};
use super::avx2_kquant::{
    Q6K_SCALE_PICK, dot_q4k_body, dot_q6k_body, high2, load_bsums, load32, load32_i8, prefetch,
};
use super::avx2_panel::{
    PANEL_ROWS, PanelFormat, broadcast4, finish, panel_dot_body, panel_dot_subs,
};
use super::packed::{PackedKernel, packed_dot_body, prefetch_ahead, unpack_block};
use super::scalar::unpack_q4k_scales;
use super::{RowKernel, Shape, avx2_panel, avx2_panel_q4k as q4k, avx2_panel_q6k as q6k, run};
use crate::cpu::q8::{BlockQ8, BlockQ8K, quantize_row_q8, quantize_row_q8k};
use crate::cpu::simd::hsum_ps;
use tether_gguf::GgmlType;

/// A [`RowKernel`] named `$name` holding `$Token`: activations by `$quantize`, one row by
/// the closure body, and (when given) four rows at once by `$dot4`.
macro_rules! row_kernel {
    ($Token:ty, $name:ident, $Act:ty, $block:expr, $quantize:ident, $(
        $dot4:ident,)? |$w:ident, $xs:ident| $dot:expr) => {
        /// Weights of the type in the name against 8-bit activations.
        pub(crate) struct $name(pub $Token);

        impl RowKernel for $name {
            type Act = $Act;
            const ACT_BLOCK: usize = $block;

            fn prepare(&self, x: &[f32], out: &mut [$Act]) {
                $quantize(Some(self.0.avx2()), x, out);
            }

            fn dot<const N: usize>(&self, $w: &[u8], $xs: [&[$Act]; N]) -> [f32; N] {
                $dot
            }

            $(
                fn dot4<const N: usize>(&self, w: [&[u8]; 4], xs: [&[$Act]; N]) -> [[f32; N]; 4] {
                    // SAFETY: `self.0` proves the CPU has the enabled features.
                    unsafe { $dot4(w, xs) }
                }
            )?
        }
    };
}

/// A [`PanelFormat`] named `$name` holding `$Token`: activations by `$quantize`, panels
/// packed by the AVX2 `$pack` and multiplied by `$dot`.
macro_rules! panel_format {
    ($Token:ty, $name:ident, $Act:ty, $block:expr, $quantize:ident, $pack:path, $dot:ident) => {
        /// Weights of the type in the name on the panel path (prefill).
        pub(crate) struct $name(pub $Token);

        impl PanelFormat for $name {
            type Act = $Act;
            const ACT_BLOCK: usize = $block;

            fn prepare(&self, x: &[f32], out: &mut [$Act]) {
                $quantize(Some(self.0.avx2()), x, out);
            }

            fn pack(&self, w: &[u8], bytes: usize, rows: usize, r0: usize, p: &mut Vec<__m256i>) {
                // SAFETY: `self.0` proves the CPU has AVX2, FMA and F16C.
                unsafe { $pack(w, bytes, rows, r0, p) }
            }

            fn dot<const N: usize>(&self, p: &[__m256i], xs: [&[$Act]; N]) -> [__m256; N] {
                // SAFETY: `self.0` proves the CPU has the enabled features.
                unsafe { $dot(p, xs) }
            }
        }
    };
}

/// The kernels of one VNNI encoding: `$features` to compile them with, `$Token` proving
/// them, `$dpbusd` and `$dpwssd` the two intrinsics in that encoding.
macro_rules! vnni_kernels {
    ($features:literal, $Token:ty, $dpbusd:ident, $dpwssd:ident) => {
        use super::*;

        /// `out[t][r] = Σ_c w[r][c] · x[t][c]` for the types `level_for` gives this level;
        /// any other type goes to the AVX2 kernels.
        pub(crate) fn matmul(
            t: $Token,
            ty: GgmlType,
            w: &[u8],
            s: Shape,
            x: &[f32],
            out: &mut [f32],
        ) {
            let panels = s.n_tokens >= avx2_panel::MIN_TOKENS;
            match ty {
                GgmlType::Q4_0 if panels => avx2_panel::matmul(&Q4_0Panels(t), w, s, x, out),
                GgmlType::Q4_0 => run(&Q4_0Kernel(t), w, s, x, out),
                GgmlType::Q8_0 => run(&Q8_0Kernel(t), w, s, x, out),
                GgmlType::Q4K if panels => avx2_panel::matmul(&Q4KPanels(t), w, s, x, out),
                GgmlType::Q4K => run(&Q4KKernel(t), w, s, x, out),
                GgmlType::Q6K if panels => avx2_panel::matmul(&Q6KPanels(t), w, s, x, out),
                GgmlType::Q6K => run(&Q6KKernel(t), w, s, x, out),
                _ => super::super::avx2_matmul(t.avx2(), ty, w, s, x, out),
            }
        }

        /// [`dot4_blocks`]'s integer step for unsigned Q4_0 nibbles.
        #[inline]
        #[target_feature(enable = $features)]
        fn rows_sum_q4_0(q: &[__m256i; 4], y: &BlockQ8) -> __m256i {
            let yv = load_q8(y);
            let z = _mm256_setzero_si256();
            let p = [
                $dpbusd(z, q[0], yv),
                $dpbusd(z, q[1], yv),
                $dpbusd(z, q[2], yv),
                $dpbusd(z, q[3], yv),
            ];
            _mm256_sub_epi32(fold4_i32(p), q4_0_offset(y))
        }

        /// [`dot4_blocks`]'s integer step for signed Q8_0 quants (`|q| · sign(y, q)`).
        #[inline]
        #[target_feature(enable = $features)]
        fn rows_sum_q8_0(q: &[__m256i; 4], y: &BlockQ8) -> __m256i {
            let yv = load_q8(y);
            let z = _mm256_setzero_si256();
            let row =
                |k: usize| $dpbusd(z, _mm256_sign_epi8(q[k], q[k]), _mm256_sign_epi8(yv, q[k]));
            fold4_i32([row(0), row(1), row(2), row(3)])
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn dot4_q4_0<const N: usize>(w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
            dot4_blocks!(w, xs, 18, unpack_q4_0_unsigned, rows_sum_q4_0)
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn dot4_q8_0<const N: usize>(w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
            dot4_blocks!(w, xs, 34, unpack_q8_0, rows_sum_q8_0)
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn dot_q4k<const N: usize>(w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
            dot_q4k_body!(w, xs, $dpwssd)
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn dot_q6k<const N: usize>(w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
            dot_q6k_body!(w, xs, $dpwssd)
        }

        /// Each row's `Σ q·y` over one packed Q4_0 block, in two chains of `vpdpbusd` so
        /// consecutive ones do not wait on each other.
        #[inline]
        #[target_feature(enable = $features)]
        fn block_sum_q4_0(pb: &[__m256i], y: &BlockQ8) -> __m256i {
            let p = |acc: __m256i, k: usize| $dpbusd(acc, pb[k], broadcast4(&y.qs, 4 * k));
            let z = _mm256_setzero_si256();
            let even = p(p(p(p(z, 0), 2), 4), 6);
            let odd = p(p(p(p(z, 1), 3), 5), 7);
            _mm256_add_epi32(even, odd)
        }

        /// The sums of 32 quants (`v`, one row per lane) against activations `at..at + 32`
        /// of `y`: elements `0..16` in the first, `16..32` in the second, each one
        /// `vpdpbusd` chain.
        #[inline]
        #[target_feature(enable = $features)]
        fn half_sums(v: &[__m256i; 8], y: &BlockQ8K, at: usize) -> (__m256i, __m256i) {
            let p = |acc: __m256i, k: usize| $dpbusd(acc, v[k], broadcast4(&y.qs, at + 4 * k));
            let z = _mm256_setzero_si256();
            (p(p(p(p(z, 0), 1), 2), 3), p(p(p(p(z, 4), 5), 6), 7))
        }

        /// Adds sub-block `s`'s `scale_s · Σ q·y` of one packed Q4_K super-block (quants
        /// `v`) to `sums`. Each 16-element half sums to at most 16 · 15 · 127 < 2^15, so the
        /// two halves go into the i16 halves of each lane and one `vpdpwssd` applies the
        /// panel's scale pair.
        #[inline]
        #[target_feature(enable = $features)]
        fn sub_sums_q4k(
            pb: &[__m256i],
            v: &[__m256i; 8],
            s: usize,
            y: &BlockQ8K,
            sums: __m256i,
        ) -> __m256i {
            let (lo, hi) = half_sums(v, y, 32 * s);
            let halves = _mm256_blend_epi16::<0b1010_1010>(lo, _mm256_slli_epi32::<16>(hi));
            $dpwssd(sums, halves, pb[q4k::SCALES_AT + s])
        }

        /// Adds chunk `c`'s `scale · Σ q·y` of one packed Q6_K super-block (quants `v`) to
        /// `sums`. A 16-element sub-block sums to up to 16 · 63 · 127, past i16, so its
        /// scale is taken back to i32 (the panel keeps it in both i16 halves) for a
        /// multiply.
        #[inline]
        #[target_feature(enable = $features)]
        fn sub_sums_q6k(
            pb: &[__m256i],
            v: &[__m256i; 8],
            c: usize,
            y: &BlockQ8K,
            sums: __m256i,
        ) -> __m256i {
            let (lo, hi) = half_sums(v, y, 32 * c);
            let sc_lo = _mm256_srai_epi32::<16>(pb[q6k::SCALES_AT + 2 * c]);
            let sc_hi = _mm256_srai_epi32::<16>(pb[q6k::SCALES_AT + 2 * c + 1]);
            let scaled =
                _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo), _mm256_mullo_epi32(hi, sc_hi));
            _mm256_add_epi32(sums, scaled)
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn panel_dot_q4_0<const N: usize>(p: &[__m256i], xs: [&[BlockQ8]; N]) -> [__m256; N] {
            panel_dot_body!(
                p,
                xs,
                avx2_panel::PACKED_BLOCK,
                block_sum_q4_0,
                avx2_panel::finish
            )
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn packed_dot_q4_0<const N: usize>(g: &[u8], xs: [&[BlockQ8]; N]) -> [__m256; N] {
            packed_dot_body!(g, xs, block_sum_q4_0)
        }

        /// Q4_0 weights packed by `finish_weight`.
        pub(crate) struct Q4_0Packed(pub $Token);

        impl PackedKernel for Q4_0Packed {
            fn avx2(&self) -> crate::cpu::simd::Avx2 {
                self.0.avx2()
            }

            fn dot8<const N: usize>(&self, g: &[u8], xs: [&[BlockQ8]; N]) -> [__m256; N] {
                // SAFETY: `self.0` proves the CPU has the enabled features.
                unsafe { packed_dot_q4_0(g, xs) }
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn panel_dot_q4k<const N: usize>(p: &[__m256i], xs: [&[BlockQ8K]; N]) -> [__m256; N] {
            panel_dot_subs!(
                p,
                xs,
                q4k::PACKED_BLOCK,
                q4k::SUBS,
                sub_sums_q4k,
                q4k::finish
            )
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn panel_dot_q6k<const N: usize>(p: &[__m256i], xs: [&[BlockQ8K]; N]) -> [__m256; N] {
            panel_dot_subs!(
                p,
                xs,
                q6k::PACKED_BLOCK,
                q6k::CHUNKS,
                sub_sums_q6k,
                q6k::finish
            )
        }

        row_kernel!(
            $Token,
            Q4_0Kernel,
            BlockQ8,
            32,
            quantize_row_q8,
            dot4_q4_0,
            |w, xs| {
                // Rows past the last tile of four: the AVX2 kernel (the same sums).
                // SAFETY: the token proves the CPU has the enabled features.
                unsafe { dot_q8_blocks::<N, false>(w, xs) }
            }
        );
        row_kernel!(
            $Token,
            Q8_0Kernel,
            BlockQ8,
            32,
            quantize_row_q8,
            dot4_q8_0,
            |w, xs| {
                // SAFETY: the token proves the CPU has the enabled features.
                unsafe { dot_q8_blocks::<N, true>(w, xs) }
            }
        );
        row_kernel!(
            $Token,
            Q4KKernel,
            BlockQ8K,
            256,
            quantize_row_q8k,
            |w, xs| {
                // SAFETY: the token proves the CPU has the enabled features.
                unsafe { dot_q4k(w, xs) }
            }
        );
        row_kernel!(
            $Token,
            Q6KKernel,
            BlockQ8K,
            256,
            quantize_row_q8k,
            |w, xs| {
                // SAFETY: the token proves the CPU has the enabled features.
                unsafe { dot_q6k(w, xs) }
            }
        );
        panel_format!(
            $Token,
            Q4_0Panels,
            BlockQ8,
            32,
            quantize_row_q8,
            avx2_panel::pack,
            panel_dot_q4_0
        );
        panel_format!(
            $Token,
            Q4KPanels,
            BlockQ8K,
            256,
            quantize_row_q8k,
            q4k::pack,
            panel_dot_q4k
        );
        panel_format!(
            $Token,
            Q6KPanels,
            BlockQ8K,
            256,
            quantize_row_q8k,
            q6k::pack,
            panel_dot_q6k
        );
    };
}

/// The AVX-512 VL encoding (Zen 4, Intel since Ice Lake server).
pub(crate) mod avx512 {
    use crate::cpu::simd::Avx512Vnni;
    vnni_kernels!(
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        Avx512Vnni,
        _mm256_dpbusd_epi32,
        _mm256_dpwssd_epi32
    );
}

/// The VEX encoding (`avxvnni`: Intel since Alder Lake, Zen 5).
pub(crate) mod avx {
    use crate::cpu::simd::AvxVnni;
    vnni_kernels!(
        "avx2,fma,f16c,avxvnni",
        AvxVnni,
        _mm256_dpbusd_avx_epi32,
        _mm256_dpwssd_avx_epi32
    );
}

/// The same kernels on plain AVX2, with `vpdpbusd` and `vpdpwssd` spelled as the
/// instructions they fuse, so CPUs without VNNI still test the logic around them (the
/// chains, the halves, the scale steps) bit for bit against AVX2. `maddubs` saturates
/// where `vpdpbusd` does not, but no kernel here feeds it pairs that reach 2^15.
#[cfg(test)]
pub(crate) mod emulated {
    use crate::cpu::simd::Avx2;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(u, s);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
    }

    vnni_kernels!("avx2,fma,f16c", Avx2, dpbusd, dpwssd);
}
