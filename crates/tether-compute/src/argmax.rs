//! The arg-max and the top candidates of a row of logits, as the sampler defines them. They
//! live here so that a backend computing them on its device and the host sampler agree on
//! every tie and NaN.

/// The highest non-NaN logit's id (the lowest id among equals; `total_cmp` order, so +inf
/// wins and +0 beats -0), or 0 when every logit is NaN: what the candidate list gives.
/// Built to vectorize: a comparison loop carrying the best (id, logit) ran at ~2.6 ns a
/// logit, 0.3-0.4 ms a token on a 128k vocabulary; sixteen running maxima, then a search
/// for the first equal value in blocks of 64, take ~11 us.
pub fn greedy(logits: &[f32]) -> u32 {
    // `l > m` is false for NaN, so NaN never becomes a maximum.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    // The first logit with exactly these bits (blocks that hold none are skipped whole).
    let first = |want: f32| {
        logits.chunks(64).enumerate().find_map(|(b, chunk)| {
            let hit = chunk.iter().fold(false, |hit, &l| hit | (l == want));
            if !hit {
                return None;
            }
            let at = chunk.iter().position(|&l| l.to_bits() == want.to_bits())?;
            Some(b * 64 + at)
        })
    };
    let at = if max == 0.0 {
        first(0.0).or_else(|| first(-0.0))
    } else {
        first(max)
    };
    // None: every logit is NaN (or there are none); -inf alone is still found above.
    at.map_or(0, |i| i as u32)
}

/// The `k` most likely non-NaN `(id, logit)` pairs of `logits` in `out`, in the sampler's
/// order (highest first, `total_cmp`, ties to the lower id); fewer when fewer are not NaN.
/// A worker sends these instead of every logit when the sampler needs no more
/// (the sampler's `candidates_needed`). One pass: blocks of 64 whose largest value is below
/// the k-th kept one are skipped after a vectorized maximum.
pub fn top_candidates(logits: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if k == 0 {
        return;
    }
    for (b, chunk) in logits.chunks(64).enumerate() {
        if out.len() == k {
            let mut lanes = [f32::NEG_INFINITY; 16];
            for part in chunk.chunks(16) {
                for (m, &l) in lanes.iter_mut().zip(part) {
                    *m = if l > *m { l } else { *m };
                }
            }
            let max = lanes
                .iter()
                .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
            // Equal values still go through the exact comparison (+0 against -0).
            if max < out[k - 1].1 {
                continue;
            }
        }
        for (i, &l) in chunk.iter().enumerate() {
            if l.is_nan() {
                continue;
            }
            let cand = ((b * 64 + i) as u32, l);
            if out.len() == k {
                if by_logit(&cand, &out[k - 1]) != std::cmp::Ordering::Less {
                    continue;
                }
                out.pop();
            }
            let at = out.partition_point(|c| by_logit(c, &cand) == std::cmp::Ordering::Less);
            out.insert(at, cand);
        }
    }
}

/// Highest logit first, ties broken by the lower id so results are reproducible (the
/// candidates' order in [`Sampler`]).
pub fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The log-sum-exp of `logits` over its non-NaN values: a logit `l` of the row has the
/// log-probability `l - logsumexp` under the row's softmax at temperature 1. `-inf` when
/// no value is above `-inf` (or none is not NaN), `+inf` when one is `+inf`. Summed in f64
/// after subtracting the maximum, so no term overflows.
pub fn logsumexp(logits: &[f32]) -> f32 {
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (f64::from(l) - f64::from(max)).exp())
        .sum();
    (f64::from(max) + sum.ln()) as f32
}

/// `(logsumexp, logits[target])` of a row, the target's value NaN when there is none: what
/// [`crate::Backend::score_rows`] returns a row.
pub fn score_row(logits: &[f32], target: Option<u32>) -> (f32, f32) {
    let picked = target
        .and_then(|t| logits.get(t as usize).copied())
        .unwrap_or(f32::NAN);
    (logsumexp(logits), picked)
}
