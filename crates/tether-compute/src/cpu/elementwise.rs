//! Normalisation, activation, residual and rotary kernels on f32 slices. Sizes were checked
//! by the caller; these only compute.

use rayon::prelude::*;

use crate::backend::RopeParams;
use crate::rope::{pair_angle, yarn_ramp};

/// Elements per parallel task for the element-wise ops (small inputs stay on one thread).
const PAR_CHUNK: usize = 1 << 14;

/// `out[t] = x[t] / sqrt(mean(x[t]²) + eps) · weight` for rows of `dim`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], dim: usize, eps: f32, out: &mut [f32]) {
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(o, xr)| {
            // Sum in f64: rows reach 8192 elements and f32 would lose low bits here.
            let ss: f64 = xr.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
            let inv = (1.0 / (ss / dim as f64 + f64::from(eps)).sqrt()) as f32;
            for ((o, v), w) in o.iter_mut().zip(xr).zip(weight) {
                *o = v * inv * w;
            }
        });
}

/// `out[i] = silu(gate[i]) · up[i]` with `silu(x) = x / (1 + e^-x)`.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
}

/// GELU with the tanh approximation: `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `out[i] = gelu_tanh(gate[i]) · up[i]`.
pub(crate) fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = gelu_tanh(*g) * u;
            }
        });
}

/// `x[i] *= factor`.
pub(crate) fn scale(x: &mut [f32], factor: f32) {
    x.par_chunks_mut(PAR_CHUNK)
        .for_each(|x| x.iter_mut().for_each(|v| *v *= factor));
}

/// `x[i] = cap · tanh(x[i] / cap)`.
pub(crate) fn softcap(x: &mut [f32], cap: f32) {
    x.par_chunks_mut(PAR_CHUNK)
        .for_each(|x| x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()));
}

/// `x[i] += y[i]`.
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(PAR_CHUNK)
        .zip(y.par_chunks(PAR_CHUNK))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(a, b)| *a += b));
}

/// `x[t][i] += bias[i]` for rows of `bias.len()`.
pub(crate) fn add_bias(x: &mut [f32], bias: &[f32]) {
    x.par_chunks_mut(bias.len())
        .for_each(|row| row.iter_mut().zip(bias).for_each(|(a, b)| *a += b));
}

/// Rotates each head of each token row of `x` (`[tokens][n_heads][head_dim]`) by its
/// position: pair `i` turns by `pos · freq_scale · base^(-2i/n_rot) / freq_factors[i]`, or
/// by YaRN's blend ([`crate::rope`]).
/// Elements past `n_rot` stay as they are.
pub(crate) fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[u32],
    p: &RopeParams,
    freq_factors: Option<&[f32]>,
) {
    let half = p.n_rot / 2;
    let ramp = yarn_ramp(p);
    x.par_chunks_mut(n_heads * head_dim)
        .zip(positions.par_iter())
        .for_each_init(Vec::new, |table: &mut Vec<(f32, f32)>, (row, &pos)| {
            table.clear();
            for i in 0..half {
                let factor = freq_factors.map_or(1.0, |f| f64::from(f[i]));
                let (theta, mscale) = pair_angle(p, ramp, i, pos, factor);
                table.push(((theta.cos() * mscale) as f32, (theta.sin() * mscale) as f32));
            }
            for head in row.chunks_exact_mut(head_dim) {
                for (i, &(c, s)) in table.iter().enumerate() {
                    let (a, b) = if p.neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_util::{Rng, random_f32, relative_error};

    #[test]
    fn rms_norm_matches_f64() {
        let mut rng = Rng::new(21);
        let (n, dim) = (5, 96);
        let x = random_f32(&mut rng, n * dim, 3.0);
        let w = random_f32(&mut rng, dim, 1.5);
        let mut out = vec![0.0; n * dim];
        rms_norm(&x, &w, dim, 1e-5, &mut out);
        let mut want = vec![0.0f64; n * dim];
        for t in 0..n {
            let r = &x[t * dim..(t + 1) * dim];
            let ms = r.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / dim as f64;
            for i in 0..dim {
                want[t * dim + i] = f64::from(r[i]) / (ms + 1e-5).sqrt() * f64::from(w[i]);
            }
        }
        assert!(relative_error(&out, &want) < 1e-6);
    }

    #[test]
    fn swiglu_add_and_bias_match_f64() {
        let mut rng = Rng::new(22);
        let n = 40_000; // spans several parallel chunks
        let g = random_f32(&mut rng, n, 8.0);
        let u = random_f32(&mut rng, n, 2.0);
        let mut out = vec![0.0; n];
        swiglu(&g, &u, &mut out);
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| f64::from(*g) / (1.0 + (-f64::from(*g)).exp()) * f64::from(*u))
            .collect();
        assert!(relative_error(&out, &want) < 1e-6);

        let mut x = g.clone();
        add(&mut x, &u);
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(a, b)| f64::from(*a) + f64::from(*b))
            .collect();
        assert!(relative_error(&x, &want) < 1e-7);

        let bias = random_f32(&mut rng, 100, 1.0);
        let mut x = g[..400].to_vec();
        add_bias(&mut x, &bias);
        for (i, v) in x.iter().enumerate() {
            assert_eq!(*v, g[i] + bias[i % 100]);
        }
    }

    #[test]
    fn geglu_scale_and_softcap_match_f64() {
        let mut rng = Rng::new(24);
        let n = 40_000;
        let g = random_f32(&mut rng, n, 6.0);
        let u = random_f32(&mut rng, n, 2.0);
        let mut out = vec![0.0; n];
        geglu(&g, &u, &mut out);
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| gelu(f64::from(*g)) * f64::from(*u))
            .collect();
        assert!(relative_error(&out, &want) < 1e-6);
        // gelu(-x) = gelu(x) - x: negative inputs give small negative values, not zero.
        assert!(gelu_tanh(-1.0) < -0.15 && gelu_tanh(-1.0) > -0.16);

        let mut x = g.clone();
        scale(&mut x, 3.5);
        let want: Vec<f64> = g.iter().map(|v| f64::from(*v) * 3.5).collect();
        assert!(relative_error(&x, &want) < 1e-7);

        let mut x = g.clone();
        softcap(&mut x, 2.0);
        let want: Vec<f64> = g
            .iter()
            .map(|v| 2.0 * (f64::from(*v) / 2.0).tanh())
            .collect();
        assert!(relative_error(&x, &want) < 1e-6);
        assert!(x.iter().all(|v| v.abs() <= 2.0));
    }

    fn rope_reference(
        x: &[f32],
        heads: usize,
        hd: usize,
        pos: &[u32],
        p: &RopeParams,
        ff: Option<&[f32]>,
    ) -> Vec<f64> {
        let mut out: Vec<f64> = x.iter().map(|v| f64::from(*v)).collect();
        for (t, &ps) in pos.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * hd;
                for i in 0..p.n_rot / 2 {
                    let theta = f64::from(ps) * f64::from(p.freq_scale)
                        / f64::from(p.freq_base).powf(2.0 * i as f64 / p.n_rot as f64)
                        / ff.map_or(1.0, |f| f64::from(f[i]));
                    let (a, b) = if p.neox {
                        (i, i + p.n_rot / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (out[base + a], out[base + b]);
                    out[base + a] = x0 * theta.cos() - x1 * theta.sin();
                    out[base + b] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        out
    }

    #[test]
    fn rope_matches_f64_in_both_styles_with_partial_rotation_and_factors() {
        let mut rng = Rng::new(23);
        let (n, heads, hd) = (4, 3, 16);
        let x = random_f32(&mut rng, n * heads * hd, 1.0);
        let pos = [0u32, 1, 17, 5000];
        let ff: Vec<f32> = (0..6).map(|i| 1.0 + i as f32).collect();
        for neox in [false, true] {
            for (n_rot, factors) in [(16, None), (12, Some(&ff[..]))] {
                let p = RopeParams {
                    n_rot,
                    freq_base: 10000.0,
                    freq_scale: 0.5,
                    neox,
                    yarn: None,
                };
                let mut got = x.clone();
                rope(&mut got, heads, hd, &pos, &p, factors);
                let want = rope_reference(&x, heads, hd, &pos, &p, factors);
                assert!(
                    relative_error(&got, &want) < 1e-6,
                    "neox={neox} n_rot={n_rot}"
                );
                // Position 0 is the identity; dims past n_rot are untouched.
                assert_eq!(&got[..heads * hd], &x[..heads * hd]);
                if n_rot < hd {
                    assert_eq!(got[heads * hd + hd - 1], x[heads * hd + hd - 1]);
                }
            }
        }
    }
}
