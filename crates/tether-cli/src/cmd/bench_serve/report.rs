//! What one `bench --serve` run measured, summed up: aggregate generated tokens/s, time to
//! first token and inter-token latency percentiles, errors, and the same per round (a
//! client's n-th request, or a conversation's n-th turn).

use super::client::Timing;
use serde_json::{Value, json};
use std::time::Duration;

/// One request's outcome, with its round.
pub(crate) struct Outcome {
    pub(crate) round: usize,
    pub(crate) result: Result<Timing, String>,
}

/// The outcomes of one run and its wall time.
pub(crate) struct Measured {
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) wall: Duration,
}

/// The figures of one run.
#[derive(Debug, PartialEq)]
pub(crate) struct Summary {
    pub(crate) requests: usize,
    pub(crate) errors: usize,
    pub(crate) first_error: Option<String>,
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
    pub(crate) wall_seconds: f64,
    pub(crate) tokens_per_second: f64,
    pub(crate) ttft_ms: Percentiles,
    pub(crate) itl_ms: Percentiles,
    pub(crate) rounds: Vec<Round>,
}

/// The 50th and 99th percentiles (nearest rank) of some milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
}

/// Figures of one round over every client.
#[derive(Debug, PartialEq)]
pub(crate) struct Round {
    pub(crate) index: usize,
    pub(crate) requests: usize,
    pub(crate) mean_prompt_tokens: f64,
    pub(crate) ttft_ms: Percentiles,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentiles; zeros for no samples.
pub(crate) fn percentiles(mut samples: Vec<f64>) -> Percentiles {
    if samples.is_empty() {
        return Percentiles::default();
    }
    samples.sort_by(f64::total_cmp);
    let at =
        |q: f64| samples[((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1];
    Percentiles {
        p50: at(0.50),
        p99: at(0.99),
    }
}

impl Summary {
    /// Sums up `measured`.
    pub(crate) fn of(measured: &Measured) -> Summary {
        let ok: Vec<(usize, &Timing)> = measured
            .outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok().map(|t| (o.round, t)))
            .collect();
        let first_error = measured
            .outcomes
            .iter()
            .find_map(|o| o.result.as_ref().err().cloned());
        let completion_tokens = ok.iter().map(|(_, t)| t.completion_tokens).sum::<usize>();
        let wall_seconds = measured.wall.as_secs_f64();
        let rounds = measured
            .outcomes
            .iter()
            .map(|o| o.round)
            .max()
            .map_or(0, |r| r + 1);
        let rounds = (0..rounds)
            .filter_map(|index| {
                let of: Vec<&Timing> = ok
                    .iter()
                    .filter(|(r, _)| *r == index)
                    .map(|(_, t)| *t)
                    .collect();
                (!of.is_empty()).then(|| Round {
                    index,
                    requests: of.len(),
                    mean_prompt_tokens: of.iter().map(|t| t.prompt_tokens as f64).sum::<f64>()
                        / of.len() as f64,
                    ttft_ms: percentiles(of.iter().map(|t| ms(t.ttft)).collect()),
                })
            })
            .collect();
        Summary {
            requests: measured.outcomes.len(),
            errors: measured.outcomes.len() - ok.len(),
            first_error,
            prompt_tokens: ok.iter().map(|(_, t)| t.prompt_tokens).sum(),
            completion_tokens,
            wall_seconds,
            tokens_per_second: completion_tokens as f64 / wall_seconds.max(1e-9),
            ttft_ms: percentiles(ok.iter().map(|(_, t)| ms(t.ttft)).collect()),
            itl_ms: percentiles(
                ok.iter()
                    .flat_map(|(_, t)| t.gaps.iter().map(|g| ms(*g)))
                    .collect(),
            ),
            rounds,
        }
    }

    /// The summary as one JSON object, with `context` (what was measured) merged in.
    pub(crate) fn json(&self, mut context: Value) -> Value {
        let p = |p: Percentiles| json!({"p50": p.p50, "p99": p.p99});
        let body = json!({
            "requests": self.requests,
            "errors": self.errors,
            "first_error": self.first_error,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
            "ttft_ms": p(self.ttft_ms),
            "itl_ms": p(self.itl_ms),
            "rounds": self.rounds.iter().map(|r| json!({
                "round": r.index, "requests": r.requests,
                "mean_prompt_tokens": r.mean_prompt_tokens, "ttft_ms": p(r.ttft_ms),
            })).collect::<Vec<_>>(),
        });
        if let (Some(c), Value::Object(b)) = (context.as_object_mut(), body) {
            c.extend(b);
        }
        context
    }

    /// The summary as markdown tables; `round_name` heads the per-round rows.
    pub(crate) fn print(&self, label: &str, round_name: &str) {
        println!(
            "| run | requests | errors | prompt tok | gen tok | wall s | gen t/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        println!(
            "| {label} | {} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} |",
            self.requests,
            self.errors,
            self.prompt_tokens,
            self.completion_tokens,
            self.wall_seconds,
            self.tokens_per_second,
            self.ttft_ms.p50,
            self.ttft_ms.p99,
            self.itl_ms.p50,
            self.itl_ms.p99,
        );
        println!();
        println!("| {round_name} | requests | mean prompt tok | TTFT p50 ms | TTFT p99 ms |");
        println!("|---:|---:|---:|---:|---:|");
        for r in &self.rounds {
            println!(
                "| {} | {} | {:.0} | {:.1} | {:.1} |",
                r.index + 1,
                r.requests,
                r.mean_prompt_tokens,
                r.ttft_ms.p50,
                r.ttft_ms.p99
            );
        }
        if let Some(e) = &self.first_error {
            println!("\nfirst error: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(ttft_ms: u64, gaps_ms: &[u64], prompt: usize, generated: usize) -> Timing {
        Timing {
            ttft: Duration::from_millis(ttft_ms),
            gaps: gaps_ms.iter().map(|g| Duration::from_millis(*g)).collect(),
            prompt_tokens: prompt,
            completion_tokens: generated,
            text: String::new(),
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p99), (50.0, 99.0));
        let p = percentiles(vec![3.0, 1.0]);
        assert_eq!((p.p50, p.p99), (1.0, 3.0));
        assert_eq!(percentiles(Vec::new()), Percentiles::default());
    }

    #[test]
    fn summary_counts_tokens_errors_and_rounds() {
        let measured = Measured {
            outcomes: vec![
                Outcome {
                    round: 0,
                    result: Ok(timing(100, &[10, 20], 40, 3)),
                },
                Outcome {
                    round: 1,
                    result: Ok(timing(10, &[30], 60, 2)),
                },
                Outcome {
                    round: 1,
                    result: Err("HTTP 429".into()),
                },
            ],
            wall: Duration::from_secs(2),
        };
        let s = Summary::of(&measured);
        assert_eq!((s.requests, s.errors), (3, 1));
        assert_eq!(s.first_error.as_deref(), Some("HTTP 429"));
        assert_eq!((s.prompt_tokens, s.completion_tokens), (100, 5));
        assert!((s.tokens_per_second - 2.5).abs() < 1e-9);
        assert_eq!((s.ttft_ms.p50, s.ttft_ms.p99), (10.0, 100.0));
        assert_eq!((s.itl_ms.p50, s.itl_ms.p99), (20.0, 30.0));
        assert_eq!(s.rounds.len(), 2);
        assert_eq!(
            (s.rounds[1].requests, s.rounds[1].mean_prompt_tokens),
            (1, 60.0)
        );
        let j = s.json(json!({"clients": 2}));
        assert_eq!(
            (j["clients"].as_u64(), j["errors"].as_u64()),
            (Some(2), Some(1))
        );
        assert_eq!(j["rounds"][0]["ttft_ms"]["p50"].as_f64(), Some(100.0));
    }
}
