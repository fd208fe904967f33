//! Logit biases and held-back tokens: over every logit and over the top candidates alike.

use super::*;

fn with_bias(temperature: f32, logit_bias: Vec<(u32, f32)>) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 11,
        logit_bias,
        ..SamplingParams::default()
    }
}

#[test]
fn a_bias_moves_the_greedy_choice_and_a_ban_is_never_drawn() {
    let logits = [0.5, 4.0, 3.5, -2.0, 1.0];
    let mut favored = Sampler::new(with_bias(0.0, vec![(3, 100.0)]));
    assert!(
        !favored.is_greedy(),
        "a biased sampler cannot use the raw arg-max"
    );
    assert_eq!(favored.sample(&logits, &[]), 3);
    let mut banned = Sampler::new(with_bias(0.0, vec![(1, f32::NEG_INFINITY)]));
    assert_eq!(banned.sample(&logits, &[]), 2);
    // Hot sampling over every token: the banned one never comes out, even when its logit
    // is +inf (where adding -inf would give NaN).
    let hot = [1.0, f32::INFINITY, 1.0, 1.0];
    let mut s = Sampler::new(with_bias(5.0, vec![(1, f32::NEG_INFINITY), (2, -3.0)]));
    let mut seen = [0usize; 4];
    for _ in 0..2000 {
        seen[s.sample(&hot, &[]) as usize] += 1;
    }
    assert_eq!(seen[1], 0, "{seen:?}");
    assert!(seen[0] > 0 && seen[2] > 0 && seen[3] > 0, "{seen:?}");
    assert!(seen[2] < seen[0], "a negative bias lowers: {seen:?}");
}

#[test]
fn held_back_tokens_are_banned_for_the_first_draws_only() {
    let logits = [0.0, 1.0, 9.0, 2.0];
    let mut s = Sampler::new(SamplingParams {
        held_back: vec![2],
        min_tokens: 3,
        ..SamplingParams::greedy()
    });
    for draw in 0..3 {
        assert!(!s.is_greedy(), "draw {draw} holds back");
        assert_eq!(s.candidates_needed(&[]), Some(2));
        assert_eq!(s.sample(&logits, &[]), 3, "draw {draw}");
    }
    assert!(s.is_greedy(), "greedy again once min_tokens are drawn");
    assert_eq!(s.sample(&logits, &[]), 2);
    let mut top = Sampler::new(SamplingParams {
        held_back: vec![2],
        min_tokens: 1,
        ..SamplingParams::greedy()
    });
    assert_eq!(top.sample_top(&[(2, 9.0), (3, 2.0)], &[]), 3);
    assert_eq!(top.sample_top(&[(2, 9.0), (3, 2.0)], &[]), 2);
}

#[test]
fn only_lowering_biases_may_use_the_top_candidates() {
    let raise = Sampler::new(with_bias(0.8, vec![(5, -1.0), (9, 0.5)]));
    assert_eq!(
        raise.candidates_needed(&[]),
        None,
        "a raised token may come from anywhere"
    );
    let nan = Sampler::new(with_bias(0.0, vec![(5, f32::NAN)]));
    assert_eq!(nan.candidates_needed(&[]), None);
    let lower = Sampler::new(SamplingParams {
        top_k: 40,
        ..with_bias(0.8, vec![(5, -1.0), (9, f32::NEG_INFINITY)])
    });
    assert_eq!(lower.candidates_needed(&[]), Some(42));
}

#[test]
fn biased_draws_from_the_top_candidates_equal_draws_from_every_logit() {
    let mut rng = SplitMix64::new(21);
    let mut sorted = Vec::new();
    let mut top = Vec::new();
    for (temperature, top_k, repeat_penalty) in [(0.0, 0, 1.0), (0.9, 40, 1.0), (1.3, 5, 1.2)] {
        let mut history: Vec<u32> = Vec::new();
        for step in 0..200 {
            let logits: Vec<f32> = (0..3000).map(|_| rng.next_f64() as f32 * 8.0).collect();
            // Ban or lower some of this step's best tokens, so the biases reach the head.
            top_candidates(&logits, 12, &mut sorted);
            let mut logit_bias: Vec<(u32, f32)> = sorted
                .iter()
                .step_by(2)
                .enumerate()
                .map(|(i, c)| (c.0, if i % 2 == 0 { f32::NEG_INFINITY } else { -1.5 }))
                .collect();
            logit_bias.sort_unstable_by_key(|b| b.0);
            let params = SamplingParams {
                top_k,
                repeat_penalty,
                repeat_last_n: 16,
                seed: step,
                held_back: vec![sorted[1].0.min(sorted[3].0), sorted[1].0.max(sorted[3].0)],
                min_tokens: 1,
                ..with_bias(temperature, logit_bias)
            };
            let mut full = Sampler::new(params.clone());
            let mut part = Sampler::new(params.clone());
            let k = part.candidates_needed(&history).expect("lowering only");
            top_candidates(&logits, k, &mut top);
            let chosen = full.sample(&logits, &history);
            assert_eq!(part.sample_top(&top, &history), chosen, "{params:?}");
            assert!(
                params
                    .logit_bias
                    .iter()
                    .all(|b| b.0 != chosen || b.1.is_finite()),
                "a banned token came out at step {step}"
            );
            assert!(!params.held_back.contains(&chosen), "step {step}");
            history.push(chosen);
        }
    }
}
