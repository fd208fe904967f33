//! Token sampling in llama.cpp's order: logit biases (and tokens held back) → penalties
//! (repetition, then frequency and presence) → top-k → top-p → min-p → temperature → a draw from a seeded, deterministic generator.

/// How to pick the next token from logits.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or below) means greedy argmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; `1.0` keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; `0` keeps all.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens; `1.0` is off.
    pub repeat_penalty: f32,
    /// How many of the last tokens the penalties look at; `0` is off.
    pub repeat_last_n: usize,
    /// Subtracted from a recent token's logit once per time it occurs in the window
    /// (OpenAI's `frequency_penalty`); `0` is off.
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token in the window (OpenAI's
    /// `presence_penalty`); `0` is off.
    pub presence_penalty: f32,
    /// Seed of the random generator.
    pub seed: u64,
    /// Added to the logits of the listed tokens before anything else (OpenAI's
    /// `logit_bias`): sorted by id, one entry per id. `-inf` bans the token: it is never
    /// drawn unless every token is banned.
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens banned from the first [`SamplingParams::min_tokens`] draws (the
    /// end-of-generation tokens, for vLLM's `min_tokens`), sorted.
    pub held_back: Vec<u32>,
    /// How many draws `held_back` is banned from.
    pub min_tokens: usize,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
            held_back: Vec::new(),
            min_tokens: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

pub use tether_compute::rng::SplitMix64;

/// Picks tokens from logits; holds the random state between calls.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Reused between calls: `(token, logit)` candidates.
    candidates: Vec<(u32, f32)>,
    /// Reused between calls: each candidate's `exp(logit - max)`.
    mass: Vec<f64>,
    /// Reused between calls: every logit with the biases added.
    biased: Vec<f32>,
    /// Tokens drawn so far (for `min_tokens`).
    drawn: usize,
}

impl Sampler {
    /// A sampler with `params`, its generator seeded by `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = SplitMix64::new(params.seed);
        Self {
            params,
            rng,
            candidates: Vec::new(),
            mass: Vec::new(),
            biased: Vec::new(),
            drawn: 0,
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether every choice from now on is the arg-max of the raw logits ([`greedy`]):
    /// temperature 0, no penalty, no bias and no token held back. Such a sampler needs no
    /// more state, so the arg-max may be taken where the logits are (a worker) instead.
    /// Once true it stays true (a token is held back only for the first draws).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
            && !penalizes(&self.params)
            && self.params.logit_bias.is_empty()
            && !self.holding_back()
    }

    /// Whether the next draw bans [`SamplingParams::held_back`].
    fn holding_back(&self) -> bool {
        self.drawn < self.params.min_tokens && !self.params.held_back.is_empty()
    }

    /// The next token given `logits` (one per vocabulary entry) and the tokens so far.
    /// Non-finite logits are never chosen unless every logit is non-finite (then token 0).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.is_greedy() {
            // Greedy without penalties: one pass over the logits, no candidate list (on a
            // 128k vocabulary the list cost more host time per token than a decode kernel).
            return greedy(logits);
        }
        let shifts = !self.params.logit_bias.is_empty() || self.holding_back();
        let logits = if shifts {
            // Indexing a copy by id costs one pass; a search per candidate would cost more.
            self.biased.clear();
            self.biased.extend_from_slice(logits);
            for &(id, bias) in &self.params.logit_bias {
                if let Some(l) = self.biased.get_mut(id as usize) {
                    *l = shifted(*l, bias);
                }
            }
            if self.holding_back() {
                for &id in &self.params.held_back {
                    if let Some(l) = self.biased.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            &self.biased[..]
        } else {
            logits
        };
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (i as u32, l)),
        );
        if shifts {
            drop_banned(&mut self.candidates);
        }
        self.drawn += 1;
        penalize(&mut self.candidates, &self.params, history);
        self.choose()
    }

    /// The number of most likely candidates (by [`top_candidates`]' order) the next
    /// choice after `history` depends on, when that is fewer than the whole vocabulary: 1
    /// for a greedy sampler, `top_k` for one that keeps the top k. Penalties that only
    /// lower logits (a repeat penalty of at least 1, frequency and presence penalties of
    /// at least 0) touch the `w` distinct tokens of their window, so the k best after them
    /// are among the `k + w` best before: at least k of those are not penalized, and they
    /// still come before any token outside them. Negative biases and held-back tokens
    /// count the same way; a positive bias may lift a token from anywhere, so it needs
    /// every logit. `None`: it needs every logit.
    pub fn candidates_needed(&self, history: &[u32]) -> Option<usize> {
        let p = &self.params;
        if self.is_greedy() {
            return Some(1);
        }
        let keep = if p.temperature <= 0.0 {
            1
        } else if p.top_k > 0 {
            p.top_k
        } else {
            return None;
        };
        // A NaN bias also asks for every logit.
        if p.logit_bias.iter().any(|&(_, b)| b > 0.0 || b.is_nan()) {
            return None;
        }
        let mut lowered = p.logit_bias.len();
        if self.holding_back() {
            lowered += p.held_back.len();
        }
        if !penalizes(p) {
            return Some(keep + lowered);
        }
        // A penalty that raises logits may lift any token; NaN is none to reason about.
        let lowers =
            p.repeat_penalty >= 1.0 && p.frequency_penalty >= 0.0 && p.presence_penalty >= 0.0;
        lowers.then(|| keep + lowered + window(p, history).len())
    }

    /// [`Sampler::sample`] given only the most likely candidates, as [`top_candidates`]
    /// gives them for at least [`Sampler::candidates_needed`] of the same `history` (the
    /// same choice, and the generator advances the same way).
    pub fn sample_top(&mut self, candidates: &[(u32, f32)], history: &[u32]) -> u32 {
        if self.is_greedy() {
            return candidates.first().map_or(0, |c| c.0);
        }
        self.candidates.clear();
        self.candidates.extend_from_slice(candidates);
        let holding_back = self.holding_back();
        if holding_back || !self.params.logit_bias.is_empty() {
            let p = &self.params;
            for cand in self.candidates.iter_mut() {
                if let Ok(at) = p.logit_bias.binary_search_by_key(&cand.0, |&(t, _)| t) {
                    cand.1 = shifted(cand.1, p.logit_bias[at].1);
                }
                if holding_back && p.held_back.binary_search(&cand.0).is_ok() {
                    cand.1 = f32::NEG_INFINITY;
                }
            }
            drop_banned(&mut self.candidates);
        }
        self.drawn += 1;
        penalize(&mut self.candidates, &self.params, history);
        self.choose()
    }

    /// The rest of the chain (top-k, top-p, min-p, temperature, the draw) over
    /// `self.candidates`, which hold every non-NaN logit after the penalty, or the top ones.
    fn choose(&mut self) -> u32 {
        let p = &self.params;
        let c = &mut self.candidates;
        if p.temperature <= 0.0 {
            return c.iter().min_by(|a, b| by_logit(a, b)).map_or(0, |t| t.0);
        }
        if p.top_k == 0 {
            return self.choose_from_all();
        }
        if p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        let Some(&(best, max)) = c.first() else {
            return 0;
        };
        if !max.is_finite() {
            return best;
        }
        let sum = self.weigh(max);
        self.cut_and_draw(best, max, sum)
    }

    /// [`Sampler::choose`] without top-k, over every logit: the softmax's sum runs over
    /// the candidates in the order they came (by id), so no sort is needed for it; only
    /// what min-p keeps is sorted, and of that only as far as top-p's cut (a 128k sort
    /// took ~8 ms a token). With no cut at all the draw walks the candidates by id, as
    /// llama.cpp's does when no sampler before it sorted them.
    fn choose_from_all(&mut self) -> u32 {
        let Some(&(best, max)) = self.candidates.iter().min_by(|a, b| by_logit(a, b)) else {
            return 0;
        };
        if !max.is_finite() {
            return best;
        }
        let sum = self.weigh(max);
        let (p, c) = (&self.params, &mut self.candidates);
        // The kept ones are a prefix of the sorted list (probabilities rise with the
        // logit), so dropping the rest first changes nothing; the best always stays.
        let floor = min_p_floor(p, sum);
        let mut order: Vec<((u32, f32), f64)> = c
            .iter()
            .copied()
            .zip(self.mass.iter().copied())
            .filter(|&(cand, m)| p.min_p <= 0.0 || m / sum >= floor || cand.0 == best)
            .collect();
        if p.top_p < 1.0 {
            let keep = sort_to_top_p(&mut order, p.top_p, sum);
            order.truncate(keep);
        } else if p.min_p > 0.0 {
            order.sort_unstable_by(|a, b| by_logit(&a.0, &b.0));
        }
        c.clear();
        self.mass.clear();
        for (cand, m) in order {
            c.push(cand);
            self.mass.push(m);
        }
        self.cut_and_draw(best, max, sum)
    }

    /// Fills `self.mass` with each candidate's `exp(logit - max)`, in the candidates'
    /// order, and returns their sum (the softmax's denominator).
    fn weigh(&mut self, max: f32) -> f64 {
        self.mass.clear();
        self.mass
            .extend(self.candidates.iter().map(|t| f64::from(t.1 - max).exp()));
        self.mass.iter().sum()
    }

    /// Top-p, then min-p, over `self.candidates` sorted best first (`self.mass` their
    /// `exp(logit - max)`, `sum` the softmax's sum), then the draw at the temperature.
    fn cut_and_draw(&mut self, best: u32, max: f32, sum: f64) -> u32 {
        let p = &self.params;
        let c = &mut self.candidates;
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, m) in self.mass.iter().enumerate() {
                acc += m / sum;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = min_p_floor(p, sum);
            let kept = self.mass.iter().take_while(|&&m| m / sum >= floor).count();
            keep = keep.min(kept.max(1));
        }
        c.truncate(keep);
        let t = f64::from(p.temperature);
        let weights: Vec<f64> = c.iter().map(|x| (f64::from(x.1 - max) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.next_f64() * total;
        for (cand, w) in c.iter().zip(&weights) {
            if r < *w {
                return cand.0;
            }
            r -= w;
        }
        c.last().map_or(best, |t| t.0)
    }
}

/// The smallest `exp(logit - max) / sum` min-p keeps: `min_p` times the best one's.
fn min_p_floor(p: &SamplingParams, sum: f64) -> f64 {
    f64::from(p.min_p) * (1.0 / sum)
}

/// Sorts `order` (candidates with their `exp(logit - max)`) best first as far as top-p's
/// cut, a growing chunk at a time, and returns how many it keeps: the same cut, by the
/// same sums, as sorting everything, in time that follows the cut rather than the
/// vocabulary.
fn sort_to_top_p(order: &mut [((u32, f32), f64)], top_p: f32, sum: f64) -> usize {
    let by = |a: &((u32, f32), f64), b: &((u32, f32), f64)| by_logit(&a.0, &b.0);
    let (mut done, mut acc, mut chunk) = (0, 0.0f64, 64usize);
    while done < order.len() {
        let end = (done + chunk).min(order.len());
        if end < order.len() {
            order[done..].select_nth_unstable_by(end - done - 1, by);
        }
        order[done..end].sort_unstable_by(by);
        for (i, x) in order[done..end].iter().enumerate() {
            acc += x.1 / sum;
            if acc >= f64::from(top_p) {
                return done + i + 1;
            }
        }
        done = end;
        chunk = chunk.saturating_mul(4);
    }
    order.len()
}

/// `logit` with `bias` added; a bias of `-inf` bans the token whatever its logit (`+inf`
/// plus `-inf` would be NaN).
fn shifted(logit: f32, bias: f32) -> f32 {
    if bias == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        logit + bias
    }
}

/// Removes banned (`-inf`) candidates, unless every one is: a banned token then carries no
/// weight in the draw, but a rounding walk past the end could still land on it.
fn drop_banned(candidates: &mut Vec<(u32, f32)>) {
    if candidates.iter().any(|c| c.1 != f32::NEG_INFINITY) {
        candidates.retain(|c| c.1 != f32::NEG_INFINITY);
    }
}

/// Whether `p` has a penalty that changes anything.
fn penalizes(p: &SamplingParams) -> bool {
    let any = p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    any && p.repeat_last_n > 0
}

/// The distinct tokens of the penalties' window (the last `repeat_last_n` of `history`),
/// sorted, each with how often it occurs there.
fn window(p: &SamplingParams, history: &[u32]) -> Vec<(u32, u32)> {
    let mut seen = history[history.len().saturating_sub(p.repeat_last_n)..].to_vec();
    seen.sort_unstable();
    let mut counted: Vec<(u32, u32)> = Vec::with_capacity(seen.len());
    for t in seen {
        match counted.last_mut() {
            Some((last, n)) if *last == t => *n += 1,
            _ => counted.push((t, 1)),
        }
    }
    counted
}

/// Applies the penalties to the candidates whose token is in the window, as llama.cpp
/// does: the positive logits are divided (the others multiplied) by the repeat penalty,
/// then the frequency penalty times the token's count and the presence penalty are
/// subtracted.
fn penalize(candidates: &mut [(u32, f32)], p: &SamplingParams, history: &[u32]) {
    if !penalizes(p) {
        return;
    }
    let seen = window(p, history);
    for cand in candidates.iter_mut() {
        let Ok(at) = seen.binary_search_by_key(&cand.0, |&(t, _)| t) else {
            continue;
        };
        let count = seen[at].1 as f32;
        let repeated = if cand.1 > 0.0 {
            cand.1 / p.repeat_penalty
        } else {
            cand.1 * p.repeat_penalty
        };
        cand.1 = repeated - count * p.frequency_penalty - p.presence_penalty;
    }
}

use tether_compute::argmax::by_logit;
pub use tether_compute::argmax::{greedy, logsumexp, top_candidates};

#[cfg(test)]
#[path = "sampling_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "sampling_bias_tests.rs"]
mod bias_tests;
