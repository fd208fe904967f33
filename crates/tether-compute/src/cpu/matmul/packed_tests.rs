//! Packed Q4_0 weights against the file's layout: the bytes round-trip, and the packed
//! kernels of every level this CPU has give the bits of the same level's prefill panels.

use super::*;
use crate::cpu::test_util::{Rng, random_f32, random_weights};

/// Row counts with and without rows past the last whole group.
const ROWS: [usize; 4] = [8, 13, 40, 67];

#[test]
fn packing_keeps_every_row() {
    let mut rng = Rng::new(41);
    for rows in ROWS {
        let cols = 96;
        let row_bytes = cols / 32 * 18;
        let w = random_weights(&mut rng, GgmlType::Q4_0, rows * cols);
        let mut p = w.clone();
        pack_q4_0(&mut p, row_bytes);
        assert_eq!(p.len(), w.len());
        if rows >= 8 {
            assert_ne!(p, w, "{rows} rows: nothing was packed");
        }
        let mut row = vec![0u8; row_bytes];
        for r in 0..rows {
            unpack_row(&p, row_bytes, r, &mut row);
            assert_eq!(
                row,
                w[r * row_bytes..(r + 1) * row_bytes],
                "row {r} of {rows}"
            );
        }
    }
}

/// The packed kernels read the prefill panels' blocks and run their integer and float
/// steps, so from eight tokens on (where the unpacked path takes the panels) they must
/// give the same bits at every level; decode stays within float rounding of the portable
/// kernels. A level this CPU lacks is reported as not run.
#[test]
fn packed_kernels_match_the_panels_of_every_level() {
    if !CpuIsa::Avx2.is_available() {
        eprintln!("not run: this CPU lacks AVX2, FMA or F16C");
        return;
    }
    let mut rng = Rng::new(42);
    for isa in [CpuIsa::Avx2, CpuIsa::AvxVnni, CpuIsa::Avx512Vnni] {
        if !isa.is_available() {
            eprintln!("not run: kernel level {isa} (this CPU lacks it)");
            continue;
        }
        for rows in ROWS {
            for (cols, n_tokens) in [(96, 1), (512, 3), (96, 8), (512, 13)] {
                let row_bytes = cols / 32 * 18;
                let s = Shape {
                    rows,
                    cols,
                    n_tokens,
                };
                let w = random_weights(&mut rng, GgmlType::Q4_0, rows * cols);
                let x = random_f32(&mut rng, n_tokens * cols, 1.0);
                let mut p = w.clone();
                pack_q4_0(&mut p, row_bytes);
                let mut got = vec![f32::NAN; rows * n_tokens];
                let ran = matmul_packed(isa, &p, s, &x, &mut got);
                assert_eq!(ran, isa);
                let mut want = vec![f32::NAN; rows * n_tokens];
                matmul(isa, GgmlType::Q4_0, &w, s, &x, &mut want);
                let what = format!("{isa} rows={rows} cols={cols} tokens={n_tokens}");
                let whole = rows / 8 * 8;
                for t in 0..n_tokens {
                    for r in 0..rows {
                        let (g, e) = (got[t * rows + r], want[t * rows + r]);
                        if n_tokens >= 8 && r < whole {
                            assert_eq!(g.to_bits(), e.to_bits(), "{what}: row {r} token {t}");
                        } else {
                            assert!(
                                (g - e).abs() <= 1e-5 * e.abs().max(1.0),
                                "{what}: {g} vs {e}"
                            );
                        }
                    }
                }
                // Only the first rows of a larger packed matrix.
                let mut part = vec![f32::NAN; (rows - 3) * n_tokens];
                matmul_packed(
                    isa,
                    &p,
                    Shape {
                        rows: rows - 3,
                        ..s
                    },
                    &x,
                    &mut part,
                );
                for t in 0..n_tokens {
                    for r in 0..rows - 3 {
                        let (g, e) = (part[t * (rows - 3) + r], got[t * rows + r]);
                        assert!((g - e).abs() <= 1e-5 * e.abs().max(1.0), "{what} r={r}");
                    }
                }
            }
        }
    }
}

/// The VNNI packed kernel's source on plain AVX2 (see `vnni::emulated`) against AVX2's.
#[test]
fn packed_vnni_logic_gives_the_same_bits_as_avx2() {
    let Some(cpu) = crate::cpu::simd::Avx2::detect() else {
        eprintln!("not run: this CPU lacks AVX2, FMA or F16C");
        return;
    };
    let mut rng = Rng::new(43);
    let (rows, cols, n_tokens) = (67, 512, 5);
    let row_bytes = cols / 32 * 18;
    let mut w = random_weights(&mut rng, GgmlType::Q4_0, rows * cols);
    pack_q4_0(&mut w, row_bytes);
    let x = random_f32(&mut rng, n_tokens * cols, 1.0);
    let s = Shape {
        rows,
        cols,
        n_tokens,
    };
    let mut want = vec![f32::NAN; rows * n_tokens];
    packed::matmul(&packed::Avx2Packed(cpu), &w, s, &x, &mut want);
    let mut got = vec![f32::NAN; rows * n_tokens];
    packed::matmul(&vnni::emulated::Q4_0Packed(cpu), &w, s, &x, &mut got);
    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), e.to_bits(), "output {i}: {g} vs {e}");
    }
}
