//! The sampler's tests: draws against oracles, and the top candidates against every logit.

use super::*;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        seed: 7,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_takes_the_argmax_and_skips_nan() {
    let mut s = Sampler::new(params(0.0));
    assert_eq!(s.sample(&[0.1, 3.0, f32::NAN, 2.9], &[]), 1);
    assert_eq!(s.sample(&[f32::NAN, -1.0], &[]), 1);
}

#[test]
fn greedy_fast_path_matches_the_candidate_list() {
    // A penalty over an empty window changes nothing but takes the candidate list.
    let mut listed = params(0.0);
    listed.repeat_penalty = 1.5;
    listed.repeat_last_n = 8;
    let (mut fast, mut slow) = (Sampler::new(params(0.0)), Sampler::new(listed));
    let mut zeros = vec![-0.0f32; 200];
    zeros[150] = 0.0;
    let mut tail = vec![1.0f32; 33];
    tail[32] = 4.0;
    let cases: [&[f32]; 10] = [
        &tail,
        &[1.0, 7.0, 7.0, -2.0],
        &[f32::NAN, f32::NAN],
        &[-0.0, 0.0, -0.0],
        &[f32::NEG_INFINITY, -1e30, f32::INFINITY, f32::INFINITY],
        &[],
        &[2.0, f32::NAN, 2.0],
        &[-f32::NAN, f32::NEG_INFINITY],
        &[-3.0; 70],
        &zeros,
    ];
    for logits in cases {
        assert_eq!(
            fast.sample(logits, &[]),
            slow.sample(logits, &[]),
            "{logits:?}"
        );
    }
    let mut x = 0x2545_f491_u32;
    let logits: Vec<f32> = (0..5000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 97) as f32 / 7.0
        })
        .collect();
    assert_eq!(fast.sample(&logits, &[]), slow.sample(&logits, &[]));
    assert_eq!(
        fast.sample(&[1.0, 7.0, 7.0], &[]),
        1,
        "ties go to the lower id"
    );
}

#[test]
fn penalty_can_change_the_greedy_choice() {
    let mut p = params(0.0);
    p.repeat_penalty = 2.0;
    p.repeat_last_n = 4;
    let mut s = Sampler::new(p);
    assert_eq!(s.sample(&[3.0, 2.0], &[0]), 1);
    assert_eq!(
        s.sample(&[3.0, 2.0], &[5, 6, 7, 8, 0, 9, 9, 9, 9]),
        0,
        "token 0 left the window"
    );
    assert_eq!(
        s.sample(&[-1.0, -1.5], &[0]),
        1,
        "negative logits are multiplied"
    );
}

#[test]
fn frequency_and_presence_penalties_subtract_after_the_repeat_penalty() {
    let mut p = params(0.0);
    p.repeat_last_n = 8;
    p.repeat_penalty = 2.0;
    p.frequency_penalty = 0.5;
    p.presence_penalty = 0.25;
    let mut s = Sampler::new(p);
    // Token 0: 4.0 / 2 - 3 * 0.5 - 0.25 = 0.25; token 1 (unseen) stays at 0.3.
    assert_eq!(s.sample(&[4.0, 0.3], &[0, 0, 0]), 1);
    // Token 0 twice: 4.0 / 2 - 2 * 0.5 - 0.25 = 0.75 beats 0.3.
    assert_eq!(s.sample(&[4.0, 0.3], &[0, 0]), 0);
    // Negative logits: -0.1 * 2 - 0.5 - 0.25 = -0.95 loses to -0.9.
    assert_eq!(s.sample(&[-0.1, -0.9], &[0]), 1);
    // Only the window counts: three old 0s are outside the last 8 tokens.
    assert_eq!(
        s.sample(&[4.0, 0.3], &[0, 0, 0, 5, 5, 5, 5, 5, 5, 5, 0, 0]),
        0
    );
}

#[test]
fn same_seed_same_draws_and_frequencies_follow_softmax() {
    let logits = [1.0f32, 0.0, 2.0];
    let mut a = Sampler::new(params(1.0));
    let mut b = Sampler::new(params(1.0));
    let mut counts = [0usize; 3];
    let n = 30_000;
    for _ in 0..n {
        let x = a.sample(&logits, &[]);
        assert_eq!(x, b.sample(&logits, &[]));
        counts[x as usize] += 1;
    }
    let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
    for (i, &l) in logits.iter().enumerate() {
        let want = f64::from(l).exp() / z;
        let got = counts[i] as f64 / n as f64;
        assert!((got - want).abs() < 0.015, "token {i}: {got} vs {want}");
    }
}

#[test]
fn top_k_top_p_and_min_p_restrict_the_candidates() {
    let logits = [5.0f32, 4.9, 0.0, -3.0];
    let mut p = params(1.0);
    p.top_k = 2;
    let mut s = Sampler::new(p.clone());
    assert!((0..500).all(|_| s.sample(&logits, &[]) < 2));
    p.top_k = 0;
    p.top_p = 0.5;
    let mut s = Sampler::new(p.clone());
    assert!(
        (0..500).all(|_| s.sample(&logits, &[]) == 0),
        "first token alone passes 0.5"
    );
    p.top_p = 1.0;
    p.min_p = 0.5;
    let mut s = Sampler::new(p);
    let mut seen = [false; 4];
    (0..2000).for_each(|_| seen[s.sample(&logits, &[]) as usize] = true);
    assert_eq!(seen, [true, true, false, false]);
}

#[test]
fn low_temperature_concentrates_on_the_best() {
    let logits = [1.0f32, 1.5, 0.5];
    let mut s = Sampler::new(params(0.05));
    assert!((0..200).all(|_| s.sample(&logits, &[]) == 1));
}

#[test]
fn splitmix_is_deterministic_and_spread() {
    let mut a = SplitMix64::new(1);
    let first: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
    let mut b = SplitMix64::new(1);
    assert_eq!(first, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
    let mean: f64 = (0..10_000).map(|_| a.next_f64()).sum::<f64>() / 10_000.0;
    assert!((mean - 0.5).abs() < 0.02);
}

/// Logits with ties, NaN, both zeros and both infinities among random values.
fn awkward_logits(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| match rng.next_u64() % 40 {
            0 => f32::NAN,
            1 => 0.0,
            2 => -0.0,
            3 => f32::INFINITY,
            4 => f32::NEG_INFINITY,
            // Few distinct values: many ties.
            5..=20 => (rng.next_u64() % 8) as f32 * 0.5,
            _ => (rng.next_f64() * 20.0 - 10.0) as f32,
        })
        .collect()
}

#[test]
fn top_candidates_are_the_head_of_the_sorted_candidate_list() {
    let mut rng = SplitMix64::new(7);
    let mut out = Vec::new();
    for n in [0usize, 1, 5, 63, 64, 65, 1000, 5000] {
        let logits = awkward_logits(&mut rng, n);
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        all.sort_by(by_logit);
        for k in [1usize, 2, 40, 300, 6000] {
            top_candidates(&logits, k, &mut out);
            let want = &all[..k.min(all.len())];
            assert_eq!(out.len(), want.len(), "n={n} k={k}");
            for (a, b) in out.iter().zip(want) {
                assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()), "n={n} k={k}");
            }
        }
    }
    top_candidates(&[1.0, 2.0], 0, &mut out);
    assert!(out.is_empty());
}

/// The chain without top-k as written out: every candidate sorted, the softmax's sum
/// taken in id order, top-p, min-p, the draw (by id when nothing was cut).
fn every_logit_oracle(p: &SamplingParams, logits: &[f32], rng: &mut SplitMix64) -> u32 {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let sum: f64 = match c.iter().min_by(|a, b| by_logit(a, b)) {
        Some(&(best, max)) if !max.is_finite() => return best,
        Some(&(_, max)) => c.iter().map(|t| f64::from(t.1 - max).exp()).sum(),
        None => return 0,
    };
    c.sort_by(by_logit);
    let max = c[0].1;
    let probs: Vec<f64> = c.iter().map(|t| f64::from(t.1 - max).exp() / sum).collect();
    let mut keep = c.len();
    let mut acc = 0.0;
    for (i, q) in probs.iter().enumerate() {
        acc += q;
        if p.top_p < 1.0 && acc >= f64::from(p.top_p) {
            keep = i + 1;
            break;
        }
    }
    if p.min_p > 0.0 {
        let floor = f64::from(p.min_p) * probs[0];
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    if p.top_p >= 1.0 && p.min_p <= 0.0 {
        // Nothing cut: the draw walks the candidates by id.
        c.sort_by_key(|t| t.0);
    }
    let t = f64::from(p.temperature);
    let weights: Vec<f64> = c[..keep]
        .iter()
        .map(|x| (f64::from(x.1 - max) / t).exp())
        .collect();
    let mut r = rng.next_f64() * weights.iter().sum::<f64>();
    for (cand, w) in c.iter().zip(&weights) {
        if r < *w {
            return cand.0;
        }
        r -= w;
    }
    c[keep - 1].0
}

#[test]
fn without_top_k_the_draw_follows_the_chain_over_every_logit() {
    // Sorting only what min-p keeps, as far as top-p's cut, must draw what sorting
    // everything draws; top-p alone cuts at 0.5 to 0.999 of the mass.
    let chains = [
        (0.95, 0.05),
        (0.5, 0.0),
        (0.9, 0.0),
        (0.999, 0.0),
        (1.0, 0.2),
        (1.0, 0.0),
        (0.9, 2.0),
    ];
    let mut rng = SplitMix64::new(8);
    for (top_p, min_p) in chains {
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p,
            min_p,
            seed: 4,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params.clone());
        let mut oracle = SplitMix64::new(params.seed);
        for step in 0..200 {
            let mut logits = awkward_logits(&mut rng, 3000);
            if step % 2 == 0 {
                // Without infinities, so the softmax is not decided by them alone.
                logits
                    .iter_mut()
                    .filter(|l| l.is_infinite())
                    .for_each(|l| *l = 1.0);
            }
            assert_eq!(
                sampler.sample(&logits, &[]),
                every_logit_oracle(&params, &logits, &mut oracle),
                "{params:?} step {step}"
            );
        }
    }
}

#[test]
fn sampling_from_the_top_candidates_equals_sampling_from_every_logit() {
    // Same seeds, 300 steps each: the worker's top candidates give the same tokens as
    // the full logits, for every sampler that says it needs no more than them, with
    // penalized windows of tokens drawn from the ones most likely to be chosen.
    let penalized = |repeat_penalty, repeat_last_n, temperature, top_k| SamplingParams {
        repeat_penalty,
        repeat_last_n,
        temperature,
        top_k,
        seed: 5,
        ..SamplingParams::default()
    };
    let chains = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.7,
            top_k: 5,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.3,
            top_k: 200,
            top_p: 0.5,
            min_p: 0.2,
            seed: 9,
            ..SamplingParams::default()
        },
        SamplingParams::greedy(),
        penalized(1.1, 64, 0.8, 40),
        penalized(3.0, 16, 1.5, 3),
        penalized(f32::INFINITY, 8, 0.8, 10),
        penalized(1.3, 32, 0.0, 40),
        SamplingParams {
            frequency_penalty: 0.7,
            presence_penalty: 0.4,
            ..penalized(1.0, 64, 0.8, 40)
        },
        SamplingParams {
            frequency_penalty: 2.0,
            ..penalized(1.2, 24, 1.3, 5)
        },
        SamplingParams {
            presence_penalty: 1.5,
            ..penalized(1.0, 16, 0.0, 40)
        },
    ];
    let mut rng = SplitMix64::new(3);
    let mut top = Vec::new();
    let mut sorted = Vec::new();
    for params in chains {
        let mut full = Sampler::new(params.clone());
        let mut part = Sampler::new(params.clone());
        let mut history: Vec<u32> = Vec::new();
        let penalty = !Sampler::new(params.clone()).is_greedy() && params.repeat_last_n > 0;
        for step in 0..300 {
            let mut logits = awkward_logits(&mut rng, 3000);
            if penalty {
                // Infinities fill the head of the list and no penalty moves them.
                logits
                    .iter_mut()
                    .filter(|l| l.is_infinite())
                    .for_each(|l| *l = 9.5);
            }
            // The window holds some of this step's best tokens, so the penalty moves
            // the head of the list, and some others.
            top_candidates(&logits, 60, &mut sorted);
            for _ in 0..4 {
                let pick = (rng.next_u64() % 70) as usize;
                history.push(sorted.get(pick).map_or(pick as u32 * 37, |c| c.0));
            }
            let k = part
                .candidates_needed(&history)
                .expect("needs only the top candidates");
            // A worker may send more candidates than this sampler needs.
            top_candidates(&logits, k + step % 3, &mut top);
            let chosen = full.sample(&logits, &history);
            assert_eq!(
                part.sample_top(&top, &history),
                chosen,
                "{params:?} step {step}"
            );
            history.push(chosen);
        }
    }
    let history = [1, 2, 2, 3];
    let window = Sampler::new(penalized(1.1, 3, 0.8, 40));
    assert_eq!(
        window.candidates_needed(&history),
        Some(42),
        "{{2, 3}} in the window"
    );
    let boost = Sampler::new(penalized(0.9, 64, 0.8, 40));
    assert_eq!(
        boost.candidates_needed(&history),
        None,
        "a boost raises logits"
    );
    let nan = Sampler::new(penalized(f32::NAN, 64, 0.8, 40));
    assert_eq!(nan.candidates_needed(&history), None);
    for (frequency_penalty, presence_penalty) in [(-0.5, 0.0), (0.0, -0.1), (f32::NAN, 0.0)] {
        let raising = Sampler::new(SamplingParams {
            frequency_penalty,
            presence_penalty,
            ..penalized(1.0, 64, 0.8, 40)
        });
        assert_eq!(
            raising.candidates_needed(&history),
            None,
            "frequency {frequency_penalty}, presence {presence_penalty}"
        );
    }
    let presence = Sampler::new(SamplingParams {
        presence_penalty: 0.5,
        ..penalized(1.0, 3, 0.8, 40)
    });
    assert_eq!(presence.candidates_needed(&history), Some(42));
    let every = Sampler::new(SamplingParams {
        top_k: 0,
        ..SamplingParams::default()
    });
    assert_eq!(every.candidates_needed(&history), None);
}
