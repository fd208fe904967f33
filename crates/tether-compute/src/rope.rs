//! Rotary-embedding angles shared by the backends: plain (with linear scaling and llama3
//! frequency factors) and YaRN's blend of interpolated and extrapolated frequencies.
//!
//! YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
//! Models"): pair `i` turns with frequency `θ_i = base^(-2i/n_rot)`, of wavelength
//! `λ_i = 2π/θ_i`. Pairs that turn many times over the original context (`L/λ_i > β_fast`)
//! keep their frequency (extrapolation); pairs that turn less than `β_slow` times are
//! divided by the scale factor `s` (interpolation); a linear ramp over the pair index blends
//! the two in between. The ramp's ends are the pair indices where `L/λ = β`:
//! `d(β) = n_rot · ln(L / (2π β)) / (2 ln base)`, floored and ceiled as HF transformers and
//! llama.cpp do. Cosine and sine are multiplied by `mscale = attn_factor · (1 + 0.1 ln s)`,
//! the paper's attention temperature applied to both q and k.

use crate::backend::RopeParams;

/// YaRN rope scaling (`rope.scaling.type = yarn`); the scale factor is `1 / freq_scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnParams {
    /// Context the model was trained at before scaling (`rope.scaling.original_context_length`).
    pub orig_ctx: u32,
    /// Rotations above which a pair is extrapolated (32 unless the file says).
    pub beta_fast: f32,
    /// Rotations below which a pair is interpolated (1 unless the file says).
    pub beta_slow: f32,
    /// Extra factor on the attention temperature (`rope.scaling.attn_factor`, 1 by default).
    pub attn_factor: f32,
}

/// What a kernel needs to apply YaRN: the ramp's ends (in pair indices) and the multiplier of
/// cosine and sine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRamp {
    /// Pairs at or below this index keep their frequency.
    pub low: f32,
    /// Pairs at or above this index are interpolated.
    pub high: f32,
    /// Multiplier of cosine and sine.
    pub mscale: f32,
}

impl YarnRamp {
    /// The kernels' arguments: `(low, high, mscale)`, or `(0, -1, 1)` for no YaRN (a `high`
    /// below zero turns the blend off).
    pub fn kernel_args(ramp: Option<YarnRamp>) -> (f32, f32, f32) {
        ramp.map_or((0.0, -1.0, 1.0), |r| (r.low, r.high, r.mscale))
    }
}

/// The YaRN ramp of `p`, when it asks for YaRN.
pub fn yarn_ramp(p: &RopeParams) -> Option<YarnRamp> {
    let y = p.yarn?;
    let n_rot = p.n_rot as f64;
    let base = f64::from(p.freq_base);
    let dim = |beta: f32| {
        n_rot * (f64::from(y.orig_ctx) / (2.0 * std::f64::consts::PI * f64::from(beta))).ln()
            / (2.0 * base.ln())
    };
    let low = dim(y.beta_fast).floor().max(0.0);
    let high = dim(y.beta_slow).ceil().min(n_rot - 1.0);
    let scale = 1.0 / f64::from(p.freq_scale);
    Some(YarnRamp {
        low: low as f32,
        high: high as f32,
        mscale: (f64::from(y.attn_factor) * (1.0 + 0.1 * scale.ln())) as f32,
    })
}

/// The angle of pair `i` at position `pos` (`factor`: its llama3 frequency factor, 1 when
/// none) and the multiplier of its cosine and sine. Angles in f64: positions reach 10^5+
/// and an f32 angle would be off by far more than the f32 result can show.
pub fn pair_angle(
    p: &RopeParams,
    ramp: Option<YarnRamp>,
    i: usize,
    pos: u32,
    factor: f64,
) -> (f64, f64) {
    let freq = f64::from(p.freq_base).powf(-2.0 * i as f64 / p.n_rot as f64);
    let extrapolated = f64::from(pos) * freq / factor;
    let interpolated = extrapolated * f64::from(p.freq_scale);
    match ramp {
        None => (interpolated, 1.0),
        Some(r) => {
            let y = (i as f64 - f64::from(r.low)) / f64::from(r.high - r.low).max(0.001);
            // 1 keeps the pair's own frequency, 0 interpolates it.
            let keep = 1.0 - y.clamp(0.0, 1.0);
            let theta = interpolated * (1.0 - keep) + extrapolated * keep;
            (theta, f64::from(r.mscale))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(yarn: Option<YarnParams>) -> RopeParams {
        RopeParams {
            n_rot: 128,
            freq_base: 1e6,
            freq_scale: 0.25,
            neox: true,
            yarn,
        }
    }

    /// Qwen3's YaRN (factor 4 over 32768 positions, head 128, base 1e6): the ramp runs over
    /// pairs 23..40 (d(32) = 23.6, d(1) = 39.7), and the temperature is 1 + 0.1 ln 4.
    #[test]
    fn yarn_ramp_of_qwen3_long_context() {
        let yarn = YarnParams {
            orig_ctx: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        };
        let p = params(Some(yarn));
        let r = yarn_ramp(&p).unwrap();
        assert_eq!((r.low, r.high), (23.0, 40.0));
        assert!((f64::from(r.mscale) - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-6);
        // Fast pairs keep their frequency, slow ones are divided by 4, the middle blends.
        let plain = params(None);
        let (fast, m) = pair_angle(&p, Some(r), 3, 1000, 1.0);
        assert_eq!(m, f64::from(r.mscale));
        let (fast_linear, _) = pair_angle(&plain, None, 3, 1000, 1.0);
        assert!((fast - 4.0 * fast_linear).abs() < 1e-9 * fast.abs());
        let (slow, _) = pair_angle(&p, Some(r), 60, 1000, 1.0);
        let (slow_linear, _) = pair_angle(&plain, None, 60, 1000, 1.0);
        assert!((slow - slow_linear).abs() < 1e-12);
        let (mid, _) = pair_angle(&p, Some(r), 31, 1000, 1.0);
        let (mid_linear, _) = pair_angle(&plain, None, 31, 1000, 1.0);
        assert!(
            mid > mid_linear * 1.5 && mid < mid_linear * 3.5,
            "{mid} {mid_linear}"
        );
        assert_eq!(yarn_ramp(&plain), None);
    }
}
