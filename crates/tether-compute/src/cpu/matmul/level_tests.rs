//! The kernel levels against each other: which level runs, and that every level the
//! running CPU has gives the same bits. A level this CPU lacks is reported as not run, so
//! the same tests, run on a CPU with AVX-512 VNNI or AVX-VNNI, cover those kernels.

use super::*;
use crate::CpuBackend;
use crate::cpu::test_util::{Rng, random_f32, random_weights};

/// The levels above AVX2 this CPU has; prints the ones it lacks, which these tests then
/// did not run.
fn vnni_levels() -> Vec<CpuIsa> {
    let (have, lack): (Vec<_>, Vec<_>) = [CpuIsa::AvxVnni, CpuIsa::Avx512Vnni]
        .into_iter()
        .partition(|l| l.is_available());
    for l in lack {
        eprintln!("not run: kernel level {l} (this CPU lacks it)");
    }
    have
}

/// Types with kernels at some SIMD level, and one (Q3_K) with portable kernels only.
const TYPES: [GgmlType; 9] = [
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q5_0,
    GgmlType::Q5K,
    GgmlType::F16,
    GgmlType::F32,
    GgmlType::Q3K,
];

/// Types with VNNI kernels (and integer portable ones).
const VNNI_TYPES: [GgmlType; 4] = [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K];

/// Rows that leave a partial tile of four and a partial panel of eight; token counts on
/// both sides of the panel threshold, with short token groups.
const SIZES: [(usize, usize); 6] = [(1, 1), (13, 1), (67, 3), (130, 9), (37, 13), (8, 64)];

fn cols_for(ty: GgmlType) -> [usize; 2] {
    match ty.block_elems() {
        256 => [256, 768],
        _ => [96, 512],
    }
}

/// `matmul` at `isa` on random data; returns the output and the level that ran.
fn run_at(isa: CpuIsa, ty: GgmlType, w: &[u8], s: Shape, x: &[f32]) -> (Vec<f32>, CpuIsa) {
    let mut out = vec![f32::NAN; s.rows * s.n_tokens];
    let ran = matmul(isa, ty, w, s, x, &mut out);
    (out, ran)
}

/// Forcing a level runs that level's kernels where it has them and the next level's
/// otherwise; never a higher one.
#[test]
fn forcing_a_level_runs_that_level() {
    let mut rng = Rng::new(31);
    for isa in CpuIsa::ALL {
        if !isa.is_available() {
            eprintln!("not run: kernel level {isa} (this CPU lacks it)");
            continue;
        }
        // The level a backend forced to `isa` holds is the one its ops pass down.
        assert_eq!(CpuBackend::with_isa(Some(1), isa).unwrap().isa(), isa);
        for ty in TYPES {
            let s = Shape {
                rows: 9,
                cols: cols_for(ty)[0],
                n_tokens: 2,
            };
            let w = random_weights(&mut rng, ty, s.rows * s.cols);
            let x = random_f32(&mut rng, s.n_tokens * s.cols, 1.0);
            let (_, ran) = run_at(isa, ty, &w, s, &x);
            assert_eq!(ran, level_for(isa, ty), "{ty} at {isa}");
            let vnni = VNNI_TYPES.contains(&ty);
            let want = match isa {
                CpuIsa::Scalar => CpuIsa::Scalar,
                CpuIsa::AvxVnni | CpuIsa::Avx512Vnni if vnni => isa,
                _ if ty == GgmlType::Q3K => CpuIsa::Scalar,
                _ => CpuIsa::Avx2,
            };
            assert_eq!(ran, want, "{ty} at {isa}");
        }
    }
}

/// Random weights and activations for each type of `types`, column count and size of
/// [`SIZES`]; the weights of odd row counts have their quants at the extremes (see
/// [`saturate_quants`]), where the AVX2 kernels' i16 steps come closest to overflowing.
fn cases(seed: u64, types: &[GgmlType]) -> Vec<(GgmlType, Shape, Vec<u8>, Vec<f32>)> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for &ty in types {
        for cols in cols_for(ty) {
            for (rows, n_tokens) in SIZES {
                let s = Shape {
                    rows,
                    cols,
                    n_tokens,
                };
                let mut w = random_weights(&mut rng, ty, rows * cols);
                if rows % 2 == 1 {
                    saturate_quants(ty, &mut w, rng.next_u64());
                }
                let x = random_f32(&mut rng, n_tokens * cols, 1.0);
                out.push((ty, s, w, x));
            }
        }
    }
    out
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, e)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            e.to_bits(),
            "{what}, output {i}: {g} vs avx2 {e}"
        );
    }
}

/// Every VNNI level this CPU has against AVX2, through the dispatcher, on decode (row
/// tiles of four and their tails) and prefill (panels of eight) shapes: the integer sums
/// and the float steps after them are the same, so the outputs must be equal to the bit.
/// AVX2 itself stays within float rounding of the portable kernels on the extreme quants.
#[test]
fn vnni_levels_give_the_same_bits_as_avx2() {
    if !CpuIsa::Avx2.is_available() {
        eprintln!("not run: this CPU lacks AVX2, FMA or F16C");
        return;
    }
    let levels = vnni_levels();
    for (ty, s, w, x) in cases(32, &TYPES) {
        let (want, _) = run_at(CpuIsa::Avx2, ty, &w, s, &x);
        if VNNI_TYPES.contains(&ty) {
            // The same 8-bit activations in the portable integer kernels.
            let (scalar, _) = run_at(CpuIsa::Scalar, ty, &w, s, &x);
            let scale = scalar.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (a, b) in want.iter().zip(&scalar) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "{ty}: avx2 {a} vs scalar {b}"
                );
            }
        }
        for &isa in &levels {
            let (got, _) = run_at(isa, ty, &w, s, &x);
            let (rows, cols, n_tokens) = (s.rows, s.cols, s.n_tokens);
            let what = format!("{ty} at {isa}, rows={rows} cols={cols} tokens={n_tokens}");
            assert_same_bits(&got, &want, &what);
        }
    }
}

/// Sets the quant bytes of every block of `w` to the extremes (`0x00`, `0xFF`, `0x80` and
/// `0x7F` patterns), leaving each block's f16 scale fields as they were.
fn saturate_quants(ty: GgmlType, w: &mut [u8], seed: u64) {
    let patterns = [0x00u8, 0xFF, 0x80, 0x7F];
    // Byte ranges of each block that hold quants (scale fields excluded).
    let quants: &[(usize, usize)] = match ty {
        GgmlType::Q4_0 => &[(2, 18)],
        GgmlType::Q8_0 => &[(2, 34)],
        // Q4_K: 12 bytes of 6-bit scales and mins (all 63 at 0xFF), then the nibbles.
        GgmlType::Q4K => &[(4, 144)],
        // Q6_K: nibbles, high bits, then the i8 scales (0x80 is -128).
        GgmlType::Q6K => &[(0, 208)],
        _ => &[],
    };
    let block = ty.block_bytes();
    for (b, blk) in w.chunks_exact_mut(block).enumerate() {
        for &(from, to) in quants {
            let pick = (seed as usize).wrapping_add(b) % patterns.len();
            for (i, byte) in blk[from..to].iter_mut().enumerate() {
                *byte = patterns[(pick + i / 7) % patterns.len()];
            }
        }
    }
}

/// The VNNI kernels' source built on AVX2 with the fused instructions spelled out (see
/// `vnni::emulated`) against the AVX2 kernels, bit for bit: checks everything around
/// `vpdpbusd`/`vpdpwssd` on any AVX2 CPU, including ones without VNNI.
#[cfg(target_arch = "x86_64")]
#[test]
fn vnni_kernel_logic_gives_the_same_bits_as_avx2() {
    let Some(cpu) = crate::cpu::simd::Avx2::detect() else {
        eprintln!("not run: this CPU lacks AVX2, FMA or F16C");
        return;
    };
    for (ty, s, w, x) in cases(34, &VNNI_TYPES) {
        let (want, _) = run_at(CpuIsa::Avx2, ty, &w, s, &x);
        let mut got = vec![f32::NAN; s.rows * s.n_tokens];
        vnni::emulated::matmul(cpu, ty, &w, s, &x, &mut got);
        let (rows, cols, n_tokens) = (s.rows, s.cols, s.n_tokens);
        assert_same_bits(
            &got,
            &want,
            &format!("{ty} rows={rows} cols={cols} tokens={n_tokens}"),
        );
    }
}
